"""What the w8a8 kernel tests share: w8a8 by its definition, and activation rows that probe the
row quantization's edges."""

from __future__ import annotations

import torch


def w8a8_exact(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w8a8 by its definition, with the int32 sums taken in float64 (exact: |sum| < 2^53): each row of
    x quantized with one scale d = max(max|x| / 127, 1e-12), q = round(x / d); y = (sum q c * d) * s."""
    xf = x.reshape(-1, x.shape[-1]).float()
    d = (xf.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    q = torch.round(xf / d).clamp(-127, 127)
    acc = (q.double() @ codes.double().T).float()
    return (acc * d * scales).to(x.dtype).reshape(*x.shape[:-1], -1)


def edge_rows(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x (float32, [M >= 4, K]) with row 1 zero, row 2 below the 1e-12 scale floor (max|x| / 127 <
    1e-12), and, where K >= 4, row 3 at exact ties (x / d = x: ±0.5, ±1.5, 2.5), in place."""
    k = x.shape[1]
    x[1] = 0
    x[2] = torch.randn(k, generator=g) * 1e-14
    if k >= 4:
        x[3] = 0.5 * torch.arange(k) % 5 - 2.0
        x[3, 0] = 127.0
    return x


def check_batch_form(n: int, k: int, dtype: torch.dtype, seed: int, rows: tuple[int, ...], other_form) -> None:
    """w8a8_linear as dispatched against `other_form(fn)` (fn run with another form of the kernel),
    the torch path and the definition, to the bit, for x of each of `rows` rows: random codes with
    per-row scales of mixed size, x with the edge rows."""
    from pagedllm.quantization import kernels as K
    from pagedllm.quantization import native

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    codes, scales = K.quantize_int8_per_channel(w)
    wsum = codes.sum(dim=1, dtype=torch.int32)
    x = edge_rows(torch.randn(max(rows), k, generator=g) * 4, g).to(dtype)
    assert native.w8a8_rows() > max(rows)
    for m in rows:
        y = native.w8a8_small_m_linear(x[:m], codes, scales, wsum)
        assert y.dtype == dtype
        assert torch.equal(y, other_form(lambda: native.w8a8_small_m_linear(x[:m], codes, scales, wsum)))
        assert torch.equal(y, K.int8_dynamic_linear(x[:m], codes.t(), scales))
        assert torch.equal(y, w8a8_exact(x[:m], codes, scales))


def check_sums_wrap(k: int, other_form) -> None:
    """Codes and activations at ±127 over k inputs (sums past 2^31 for k > 133,143): the call as
    dispatched and under `other_form` wrap the same way (the bits, not the value, are the contract)."""
    from pagedllm.quantization import native

    n = 20
    codes = torch.full((n, k), 127, dtype=torch.int8)
    codes[1::2] = -127
    scales = torch.ones(n)
    wsum = codes.sum(dim=1, dtype=torch.int32)
    x = torch.ones(8, k)
    y = native.w8a8_small_m_linear(x, codes, scales, wsum)
    assert torch.equal(y, other_form(lambda: native.w8a8_small_m_linear(x, codes, scales, wsum)))
