"""Structured output's token bitmask applied to the logits: one vectorized pass over the step's
constrained rows, in place, before any other sampling step (so logprobs are those of the
constrained distribution, as vLLM reports them)."""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")
_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: list[int],
                          mask_rows: list[int]) -> None:
    """Sets to -inf, in `logits[logit_rows[i]]`, every token whose bit is clear in
    `bitmask[mask_rows[i]]` (int32 words; bit b of word w stands for token 32 * w + b)."""
    if not logit_rows:
        return
    vocab = logits.shape[1]
    masks = bitmask[mask_rows] if len(mask_rows) != bitmask.shape[0] or mask_rows != list(range(len(mask_rows))) \
        else bitmask
    masks = masks.to(logits.device, non_blocking=True)
    shifts = _SHIFTS.to(logits.device)
    blocked = ((masks.unsqueeze(-1) >> shifts) & 1).view(masks.shape[0], -1)[:, :vocab] == 0
    if logit_rows == list(range(logits.shape[0])):
        logits.masked_fill_(blocked, _NEG_INF)
        return
    index = torch.tensor(logit_rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(blocked, _NEG_INF)
