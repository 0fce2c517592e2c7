"""Turns one step's logits into next tokens.

The model runner gathers the S rows that sample a token this step, builds a `SamplingMetadata`
once (`metadata`: from its persistent batch, or from per-row `SamplingRow`s, `row`), and calls
`Sampler()(logits, metadata)` (`sampler`), through `sample_isolating_faults` (`isolation`), which
fails only the requests whose rows raise on their own. The algorithms are in `ops` (penalties,
top-k / top-p / min-p cuts, inverse-CDF draws) and `logprobs`; `kernel` binds the native sampling
kernel (pagedllm/native/csrc/sampling.c) that `ops` calls where it runs. `grammar` applies
structured output's token bitmask to the constrained rows' logits before all of this.
"""

from pagedllm.worker.sample.grammar import apply_grammar_bitmask
from pagedllm.worker.sample.isolation import IsolatedSample, sample_isolating_faults
from pagedllm.worker.sample.logprobs import compute_topk_logprobs
from pagedllm.worker.sample.metadata import PenaltyMetadata, SamplingMetadata, sampler_fault_hook
from pagedllm.worker.sample.ops import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    draw_uniforms,
    pick_from_probs,
    row_argmax,
    top_candidates,
)
from pagedllm.worker.sample.row import SamplingRow
from pagedllm.worker.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "apply_grammar_bitmask",
    "IsolatedSample",
    "PenaltyMetadata",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "compute_topk_logprobs",
    "draw_uniforms",
    "pick_from_probs",
    "row_argmax",
    "sample_isolating_faults",
    "sampler_fault_hook",
    "top_candidates",
]
