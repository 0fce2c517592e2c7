"""Pooling requests in the model runner: their hidden states gathered chunk by chunk, pooled when
the last prompt chunk has run, post-processed (classifier head, Matryoshka truncation, L2
normalisation) and returned instead of a sampled token.

A prompt may arrive in several chunks (steps), so each pooling type keeps only what it needs
between them: MEAN a float32 running sum and count, CLS the first position's hidden state, LAST
nothing until the chunk that ends the prompt, ALL every position's. The runner costs a generation
step nothing while no pooling request is held (`Pooler.states` is empty).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.core.scheduler_output import PooledOutput
from pagedllm.worker.forward.base import PreparedStep


@dataclass
class _State:
    params: Any  # PoolingParams, resolved
    total: torch.Tensor | None = None  # MEAN: running sum; CLS: the first hidden state
    count: int = 0
    chunks: list[torch.Tensor] = field(default_factory=list)  # ALL


class Pooler:
    def __init__(self, model: torch.nn.Module | None) -> None:
        self.model = model  # set by the runner once loaded
        self.states: dict[str, _State] = {}

    def add(self, req_id: str, params: Any, num_computed_tokens: int) -> None:
        """A pooling request sent to the worker. Sent again after a swap preemption (computed
        tokens kept) it keeps what it gathered; from position 0 (new, or preempted by recompute)
        it starts afresh."""
        if num_computed_tokens == 0 or req_id not in self.states:
            self.states[req_id] = _State(params)

    def drop(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def in_step(self, step: PreparedStep) -> bool:
        states = self.states
        return any(rid in states for rid in step.req_ids)

    def pool(self, step: PreparedStep, hidden: torch.Tensor, num_tokens: np.ndarray) -> dict[str, PooledOutput]:
        """Gathers this step's hidden states of the pooling requests, returns the outputs of those
        whose prompt ends in this step, and takes every pooling row out of the step's sampling.
        `num_tokens`: each scheduled request's known tokens (its prompt, for a pooling request)."""
        batch = step.batch
        qsl, seq_lens = batch.query_start_loc, batch.seq_lens
        finished: list[tuple[str, _State, torch.Tensor]] = []
        pooling_rows = []
        for i, rid in enumerate(step.req_ids):
            st = self.states.get(rid)
            if st is None:
                continue
            pooling_rows.append(i)
            s, e = int(qsl[i]), int(qsl[i + 1])
            end = int(seq_lens[i])
            start = end - (e - s)
            h = hidden[s:e]
            kind = st.params.pooling_type
            if kind == "MEAN":
                chunk_sum = h.float().sum(0)
                st.total = chunk_sum if st.total is None else st.total + chunk_sum
                st.count += e - s
            elif kind == "CLS" and start == 0:
                st.total = h[0].float()
            elif kind == "ALL":
                st.chunks.append(h.float())
            if end < int(num_tokens[i]):
                continue
            if kind == "MEAN":
                vec = st.total / st.count  # type: ignore[operator]
            elif kind == "CLS":
                vec = st.total
            elif kind == "LAST":
                vec = h[-1].float()
            else:
                vec = torch.cat(st.chunks)
            finished.append((rid, st, vec))  # type: ignore[arg-type]
        if pooling_rows:
            keep = ~np.isin(batch.sample_req_indices, pooling_rows)
            batch.sample_req_indices = batch.sample_req_indices[keep]
            batch.sample_rows = batch.sample_rows[keep]
        out = {}
        for rid, st, vec in finished:
            del self.states[rid]
            out[rid] = self._output(st.params, vec)
        return out

    def _output(self, params: Any, vec: torch.Tensor) -> PooledOutput:
        if params.task == "classify":
            logits = self.model.classify(vec.to(self._dtype).unsqueeze(0))[0].float()  # type: ignore[operator]
            if params.activation:
                logits = torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)
            vec = logits
        else:
            if params.dimensions is not None:
                vec = vec[..., : params.dimensions]
            if params.normalize:
                vec = F.normalize(vec, p=2, dim=-1)
        arr = vec.detach().to("cpu", torch.float32).contiguous().numpy()
        return PooledOutput(shape=list(arr.shape), data=arr.tobytes())

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype  # type: ignore[union-attr]
