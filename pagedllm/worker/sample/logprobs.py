"""Logprobs of the sampled tokens and of each row's most likely alternatives."""

from __future__ import annotations

import torch


def compute_topk_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of `token_ids` and of each row's top-k tokens, from log_softmax(logits).

    Returns ids [N, 1 + k] int64 (the given token first, then the top k by logprob, descending), their float32
    logprobs [N, 1 + k], and ranks [N] int64 of the given token (1 + number of tokens with a strictly larger
    logprob). k is capped at the vocabulary size.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    ids = torch.cat([token_ids, top_ids], dim=1)
    return ids, torch.cat([token_logprobs, top_logprobs], dim=1), ranks
