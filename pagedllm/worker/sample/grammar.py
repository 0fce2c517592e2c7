"""Structured output's token bitmask applied to the logits: one pass over the step's constrained
rows, in place, before any other sampling step (so logprobs are those of the constrained
distribution, as vLLM reports them). The native kernel (sampling.c `apply_token_bitmask`) skips
the words whose 32 tokens are all allowed; elsewhere (a GPU, float16/bfloat16 logits, the kernel
switched off) a vectorized torch pass unpacks the bits."""

from __future__ import annotations

import torch

from pagedllm.worker.sample.kernel import _sampling_kernel

_NEG_INF = float("-inf")
_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: list[int],
                          mask_rows: list[int]) -> None:
    """Sets to -inf, in `logits[logit_rows[i]]`, every token whose bit is clear in
    `bitmask[mask_rows[i]]` (int32 words; bit b of word w stands for token 32 * w + b)."""
    if not logit_rows:
        return
    vocab = logits.shape[1]
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1
            and bitmask.is_contiguous() and _sampling_kernel() is not None):
        lr = torch.tensor(logit_rows, dtype=torch.int64)
        mr = torch.tensor(mask_rows, dtype=torch.int64)
        _sampling_kernel().apply_token_bitmask(logits.data_ptr(), logits.stride(0), vocab, bitmask.data_ptr(),
                                               bitmask.stride(0), lr.data_ptr(), mr.data_ptr(), len(logit_rows))
        return
    masks = bitmask[mask_rows].to(logits.device, non_blocking=True)
    blocked = ((masks.unsqueeze(-1) >> _SHIFTS.to(logits.device)) & 1).view(masks.shape[0], -1)[:, :vocab] == 0
    index = torch.tensor(logit_rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(blocked, _NEG_INF)
