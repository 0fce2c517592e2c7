"""Fault isolation: one request whose sampling raises fails alone.

`sample_isolating_faults` is what the runner calls: when sampling the batch raises, it finds the
rows that raise on their own, reports them as failed (their requests end with an error) and
samples the other rows as if the failed ones had never been in the batch. An error no single row
explains is re-raised (an engine fault).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.worker.sample.metadata import SamplingMetadata, sampler_fault_hook
from pagedllm.worker.sample.row import SamplingRow
from pagedllm.worker.sample.sampler import Sampler, SamplerOutput

logger = logging.getLogger(__name__)


@dataclass
class IsolatedSample:
    """One step's sampling with failing rows left out."""

    output: SamplerOutput | None
    """The sampled rows' tokens (and logprobs), in `kept` order; None when every row failed."""
    kept: list[int]
    """Indices (into the step's rows) of the rows sampled."""
    failed: dict[int, str]
    """Row index -> the error that row raised on its own."""


def sample_isolating_faults(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow] | Callable[[], list[SamplingRow]],
    device: torch.device,
    metadata: Callable[[], SamplingMetadata] | None = None,
    generators: list[torch.Generator] | None = None,
) -> IsolatedSample:
    """Samples every row at once; if that raises, isolates the rows that raise on their own.

    `metadata` builds the batch's sampling tensors (default: from the rows); `rows` are the per-row
    views, or a function that builds them (called only when needed); `generators` are the rows' random generators
    (default: those of the rows). Failing rows are reported as failed and the others are sampled
    again, together, from the same logits, with their random generators first put back where they
    were: greedy and seeded rows get exactly the tokens they would have got had the failed rows
    never been in the batch. If no single row raises, the batch's error is re-raised: it is not any
    one request's fault.
    """
    vocab_size = logits.shape[-1]
    given = rows

    def row_views() -> list[SamplingRow]:
        return given() if callable(given) else given

    if generators is None:
        generators = [r.generator for r in row_views() if r.generator is not None]
    saved = [(g, g.get_state()) for g in generators]
    if metadata is None or sampler_fault_hook() is not None:  # the test hook sits in from_rows
        metadata = lambda: SamplingMetadata.from_rows(row_views(), vocab_size, device)  # noqa: E731
    try:
        out = sampler(logits, metadata())
        return IsolatedSample(out, list(range(logits.shape[0])), {})
    except Exception as batch_error:
        error = batch_error

    def rewind() -> None:
        for g, state in saved:
            g.set_state(state)

    views = row_views()
    failed: dict[int, str] = {}
    for i, row in enumerate(views):
        rewind()
        try:
            sampler(logits[i : i + 1], SamplingMetadata.from_rows([row], vocab_size, device))
        except Exception as e:
            failed[i] = f"{type(e).__name__}: {e}"
    if not failed:
        raise error
    logger.error("sampling failed for %d of %d rows: %s", len(failed), len(views), "; ".join(failed.values()))
    rewind()
    kept = [i for i in range(len(views)) if i not in failed]
    if not kept:
        return IsolatedSample(None, [], failed)
    index = torch.tensor(kept, dtype=torch.long, device=logits.device)
    out = sampler(logits.index_select(0, index), SamplingMetadata.from_rows([views[i] for i in kept], vocab_size, device))
    return IsolatedSample(out, kept, failed)
