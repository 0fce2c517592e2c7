"""The native sampling kernel (pagedllm/native/csrc/sampling.c) and its ctypes binding: each row's
top-p cut in one pass, and whole draws of top-p rows in one call. Every entry point returns None
where the kernel does not apply (not float32 CPU rows, or it does not build here, or
PAGEDLLM_NATIVE_SAMPLING=0); the caller then takes its torch path."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from pagedllm import native
from pagedllm.native import kernels


@lru_cache(maxsize=1)
def _sampling_kernel() -> Any:
    """The bound kernel, or None; its switch is read once per process, as for the other kernels."""
    return native.load(kernels.SAMPLING)


def top_p_cuts_apply(logits: torch.Tensor) -> bool:
    """Whether top_p_cuts runs on these logits: float32 CPU rows, and the kernel builds here."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] >= 1 and _sampling_kernel() is not None)


def sample_rows_native(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor | None:
    """One token per row of raw logits [S, V] (no top-k), in one native call (sampling.c
    `sample_rows`): divided by the row's temperature, cut at its top_p (top_p_cuts' cut) and then
    at min_p times its largest probability, drawn by inverse CDF in vocabulary order with its
    uniform number u [S, 1] (pick_from_probs' rule). None where it does not apply."""
    if not top_p_cuts_apply(logits):
        return None
    S = logits.shape[0]
    f32 = [t.to(torch.float32).contiguous() for t in (temperature, top_p, torch.zeros(S) if min_p is None else min_p)]
    uu = u.reshape(S).to(torch.float64).contiguous()
    tokens = torch.empty(S, dtype=torch.int64)
    if _sampling_kernel().sample_rows(logits.data_ptr(), logits.stride(0), S, logits.shape[1], f32[0].data_ptr(),
                                      f32[1].data_ptr(), f32[2].data_ptr(), uu.data_ptr(), tokens.data_ptr()):
        return None
    return tokens


def top_p_cuts(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Each row's top-p cut [S, 1] (the logit of the last token its nucleus keeps; -inf: the whole
    row) in O(V) a row by the native kernel (pagedllm/native/csrc/sampling.c); None where it does
    not apply (top_p_cuts_apply; the caller sorts)."""
    if not top_p_cuts_apply(logits):
        return None
    lib = _sampling_kernel()
    p = top_p.to(torch.float32).contiguous()
    cut = torch.empty(logits.shape[0], 1, dtype=torch.float32)
    if lib.top_p_cuts(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], p.data_ptr(),
                      cut.data_ptr()):
        return None
    return cut
