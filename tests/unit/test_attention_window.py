"""A layer's own sliding window (Gemma 3's sliding layers) over a step built without one: every
backend equals dense causal attention with the window's mask."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.cpu_kernel import load_kernel
from pagedllm.attention.metadata import with_window
from pagedllm.attention.torch_backend import paged_attention
from tests.unit.test_attention import BS, CASES, D, H, KVH, NUM_BLOCKS, make_case, metadata, reference


@pytest.mark.parametrize("window", [1, 5])
@pytest.mark.parametrize("starts,n", CASES)
@pytest.mark.parametrize("backend", ["torch", "native", "native+dense"])
def test_layer_window_over_a_global_step_matches_dense(backend, starts, n, window):
    native = load_kernel() if backend != "torch" else None
    if backend != "torch" and native is None:
        pytest.skip("no C compiler for the native kernel")
    states = make_case(len(n) + window, starts, n)
    g = torch.Generator().manual_seed(11)
    kv = torch.randn(2, NUM_BLOCKS, BS, KVH, D, generator=g)
    T = sum(n)
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g)
    md = metadata(states, n, 0, native, dense_min=8 if backend == "native+dense" else 0)
    windowed = with_window(md, window)
    assert with_window(md, window) is windowed and with_window(md, 0) is md  # once per step and window
    out = paged_attention(q, k, v, kv, windowed, D**-0.5)
    torch.testing.assert_close(out, reference(states, n, q, kv, window), atol=2e-5, rtol=1e-4)
    # The global layers of the same step still see every key.
    torch.testing.assert_close(paged_attention(q, k, v, kv, md, D**-0.5), reference(states, n, q, kv, 0),
                               atol=2e-5, rtol=1e-4)


def test_layer_window_over_a_windowed_step_is_refused():
    states = make_case(1, [0], [5])
    md = metadata(states, [5], 4, None)
    with pytest.raises(ValueError, match="layer window of 2"):
        with_window(md, 2)
