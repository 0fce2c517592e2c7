"""What every forward path takes (a prepared step) and returns (hidden states, or the head's output)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.worker.input_batch import BatchArrays


@dataclass(slots=True)
class PreparedStep:
    """One step, ready for a forward pass: the scheduler's output, its scheduled requests in batch
    order, their rows in the persistent batch, their scheduled token counts, and the batch's arrays."""

    so: SchedulerOutput
    req_ids: list[str]
    rows: np.ndarray
    counts: np.ndarray
    batch: BatchArrays
    grammar_masked: bool = False
    """Set by a head path that applied the step's structured-output bitmask to what it returns."""
    lora: bool = False
    """Some rows run with a LoRA adapter: the torch layers apply it, or the native decode step
    where it has the adapters' slots bound (NativeDecode.lora)."""
    lora_slots: np.ndarray | None = None
    """With `lora`: each token row's adapter slot (int32, -1: none), for the native decode step."""
    token_rows: BatchArrays | None = None
    """A step of decodes and speculative verifications (SchedulerOutput.spec_token_ids): every
    token as a decode row of its own (input_batch.token_rows), for the native decode path."""


class ForwardPath:
    """One way of running a step's forward pass; ForwardPaths.select_path picks one per step.

    run(step) returns, for a path whose `head` is False, the final hidden states of the step's
    tokens [num_tokens, hidden], or None on a pipeline stage before the last (it sent them on);
    for a path whose `head` is True, the step's sampled rows (batch.sample_rows) through the LM
    head: their logits [rows, vocab], or their greedy token ids (numpy int64) when every row
    samples greedily with nothing else to apply.
    """

    name = ""
    head = False

    def run(self, step: PreparedStep) -> torch.Tensor | np.ndarray | None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class PathSelector(Protocol):
    """Picks the path a step takes (ForwardPaths)."""

    def select_path(self, step: PreparedStep) -> ForwardPath: ...
