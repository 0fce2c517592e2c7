"""The `Sampler` module: one step's logits to next tokens.

Batched over rows, it
1. blocks tokens outside `allowed_token_ids` and adds `logit_bias`;
2. blocks EOS and stop token ids while a row has fewer than `min_tokens` outputs;
3. applies repetition, presence and frequency penalties;
4. greedy rows take the argmax; random rows divide by their temperature, keep
   top-k, then top-p, then min-p, and draw by inverse CDF (one uniform number a
   row against the running sum of its probabilities), seeded rows from their own
   generator;
5. optionally returns logprobs of the sampled token and the top-k alternatives,
   computed from the raw logits (before any of the steps above).

A batch of plain greedy rows is a single argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.worker.sample.logprobs import compute_topk_logprobs
from pagedllm.worker.sample.metadata import SamplingMetadata
from pagedllm.worker.sample.ops import apply_penalties, draw_uniforms, row_argmax, sample_random_rows, select_rows

_NEG_INF = float("-inf")
# Random rows are sampled this many at a time (Sampler._sample_random).
SAMPLE_ROWS = 32


@dataclass
class SamplerOutput:
    """The step's sampled tokens and, when some row asked, their logprobs."""

    sampled_token_ids: torch.Tensor
    """[S] int64."""
    logprob_token_ids: torch.Tensor | None
    """[S, 1 + max_k] int64: the sampled token first, then the top max_k tokens by logprob."""
    logprobs: torch.Tensor | None
    """[S, 1 + max_k] float32 logprobs of those ids."""
    sampled_token_ranks: torch.Tensor | None
    """[S] int64 rank of the sampled token (1 = most likely)."""


class Sampler(torch.nn.Module):
    """Batched sampling for one step: logits processing, greedy / random draws and logprobs."""

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Samples one token per row of `logits` ([S, V] float32, left unmodified)."""
        assert logits.dim() == 2 and logits.shape[1] == md.vocab_size, (tuple(logits.shape), md.vocab_size)
        processed = self.process_logits(logits, md)
        if md.all_greedy:
            sampled = row_argmax(processed)
        else:
            sampled = self._sample_random(processed, md)
            if md.greedy_mask is not None:
                sampled = torch.where(md.greedy_mask, row_argmax(processed), sampled)
        if md.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, logprobs, ranks = compute_topk_logprobs(logits, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, ids, logprobs, ranks)

    def process_logits(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Allowed-token mask and logit bias, then min_tokens, then penalties; returns a new tensor if any apply."""
        logits = logits.float()
        if not md.needs_processing:
            return logits
        logits = logits.clone()
        if md.allowed_mask is not None:
            logits.masked_fill_(md.allowed_mask, _NEG_INF)
        if md.bias_index is not None:
            assert md.bias_values is not None
            logits.index_put_(md.bias_index, md.bias_values, accumulate=True)
        if md.min_tokens_index is not None:
            logits.index_put_(md.min_tokens_index, logits.new_full((), _NEG_INF))
        if md.penalties is not None:
            logits = apply_penalties(logits, md.penalties)
        return logits

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one inverse-CDF draw per row, SAMPLE_ROWS rows at
        a time (each pass over a chunk's [rows, V] temporaries stays in the cache, and none of them
        outgrows the heap that keeps them mapped between steps: 256 rows of 49,152 float32 logits
        are 50 MB, faulted in afresh by every op that makes one)."""
        assert md.temperature is not None
        u = draw_uniforms(logits.shape[0], md.generators, logits.device)
        if logits.shape[0] <= SAMPLE_ROWS:
            return sample_random_rows(logits, md.temperature, md.top_k, md.top_p, md.min_p, u)
        out = []
        for a in range(0, logits.shape[0], SAMPLE_ROWS):
            rows = slice(a, a + SAMPLE_ROWS)
            out.append(sample_random_rows(logits[rows], md.temperature[rows], select_rows(md.top_k, rows),
                                          select_rows(md.top_p, rows), select_rows(md.min_p, rows), u[rows]))
        return torch.cat(out)
