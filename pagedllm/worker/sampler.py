"""The names pagedllm.worker.model_runner imports from the sampler, until it imports them from
pagedllm.worker.sample (the package that holds them)."""

from pagedllm.worker.sample import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_topk_logprobs,
    sample_isolating_faults,
    sampler_fault_hook,
)

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_topk_logprobs",
    "sample_isolating_faults",
    "sampler_fault_hook",
]
