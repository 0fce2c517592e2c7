"""`SamplingRow`: one request's sampling inputs for a step, from which rows sampled one by one
(fault isolation) build their metadata. In a module of its own so that the persistent batch
(pagedllm/worker/input_batch.py), which builds rows and which the metadata module reads, imports
nothing that imports it back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sampling row's inputs for this step, built by the model runner."""

    params: SamplingParams
    """The request's sampling parameters."""
    generator: torch.Generator | None
    """Set when `params.seed` is not None; the runner owns it and keeps it across steps."""
    prompt_token_ids: list[int]
    """The prompt (for the repetition penalty)."""
    output_token_ids: list[int]
    """Tokens generated so far (for penalties and min_tokens)."""
    eos_token_ids: set[int] = field(default_factory=set)
    """The model's EOS ids, blocked together with stop_token_ids while fewer than min_tokens are generated."""
