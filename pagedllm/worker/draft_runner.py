"""Speculative method draft_model on the worker: a draft model decodes a few tokens greedily ahead
of the target, in the same step, and the target verifies them (worker/spec_decode.py).

The scheduler reserves each speculating request's proposal slots (core/spec_decode.py,
DraftSlotsProposer: placeholders, as many as the adaptive controller allows). Before the target's
forward pass, `DraftRunner.propose` runs the draft:

1. one pass over every scheduled request's tokens the draft has not seen, up to and including its
   last known token: prompt chunks (the same chunks the target computes), plain decodes, and a
   speculating request's last token (with, after a step whose proposals were all accepted, the
   last of them); its argmax after a speculating request's last token is that request's first
   proposal;
2. k - 1 passes of one token per speculating request (the previous proposal in, the next out),
   while the request has proposals left to make.

The proposals then replace the placeholders (SchedulerOutput.spec_token_ids) and the target step
runs as for any other method. Greedy draft tokens are a point-mass proposal, so verification keeps
the target's distribution for sampled requests as it does for n-gram proposals.

The draft's KV cache has its own tensors (its own layers and head shape) indexed by the target's
block tables and slot mapping (same tokenizer, same positions), so the engine's one KV cache
manager holds both: every block id names a block in both caches, a block's bytes count both
(KVMemory.extra_bytes_per_block), and swaps and copy-on-write move both. The draft computes every
position the target computes, in the same step, except a proposal the draft made itself: when it
is accepted its K/V is already written, except the last of a fully accepted step's proposals,
which the draft writes at the start of the next step, or at once where it completes a block (only
full blocks are ever shared through prefix caching). So a block the prefix cache hands out holds
the draft's K/V too, also after a recompute preemption; a request's draft positions after its
computed tokens are written before they are read. Rejected proposals' slots are written again, as
the target's are.
"""

from __future__ import annotations

import logging
import mmap
import time
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backend import select_attention_backend
from pagedllm.attention.cpu_kernel import dense_thresholds
from pagedllm.attention.metadata import ForwardContext
from pagedllm.config import CacheConfig, DeviceConfig, ModelConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.layers.attention import Attention
from pagedllm.worker.forward import EagerPath
from pagedllm.worker.input_batch import BatchArrays, InputBatch, token_rows
from pagedllm.worker.kv_memory import KVMemory
from pagedllm.worker.model_load import build_model
from pagedllm.worker.native_decode import NativeDecode

logger = logging.getLogger(__name__)


class DraftRunner:
    """The draft model, its KV cache and what it has computed of each request (module docstring)."""

    def __init__(self, config: ModelConfig, cache_config: CacheConfig, device_config: DeviceConfig,
                 dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device, input_batch: InputBatch) -> None:
        self.config = config
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.device = device
        self.ib = input_batch
        self.block_size = cache_config.block_size
        self.kv = KVMemory(config, cache_config, device_config, kv_dtype, device)
        if self.kv.groups.num_groups != 1:
            raise ValueError(f"the draft model {config.model!r} keeps its KV in {self.kv.groups.num_groups} layer "
                             "groups (sliding windows); a draft model needs one")
        self.backend = select_attention_backend(
            triton=device.type == "cuda", block_size=self.block_size,
            num_queries_per_kv=config.num_heads // config.num_kv_heads)
        dense_tokens, dense_pairs = (dense_thresholds(dtype, kv_dtype, config.head_dim)
                                     if self.backend.native is not None else (0, 0))
        self.batch_options: dict[str, Any] = {
            "build_groups": self.backend.needs_groups, "query_tile": self.backend.query_tile,
            "dense_min_tokens": dense_tokens, "dense_min_pairs": dense_pairs}
        self.context = ForwardContext()
        self.model: torch.nn.Module | None = None
        self.eager: EagerPath | None = None
        self.native: NativeDecode | None = None
        self._arena: mmap.mmap | None = None
        self.computed: dict[str, int] = {}
        """req_id -> positions from 0 whose draft K/V is written (a preempted request's kept)."""
        self._step: tuple[list[str], np.ndarray, np.ndarray, np.ndarray] | None = None
        self.passes = 0
        """Draft forward passes run (for benchmarks and tests)."""
        self.seconds = 0.0
        """Time spent in them."""

    def load(self) -> None:
        t0 = time.perf_counter()
        model, self._arena = build_model(self.config, self.dtype, self.device, ParallelContext())
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        for layer in layers:
            layer.context, layer.backend = self.context, self.backend
        self.kv.bind(layers)
        self.model = model
        self.eager = EagerPath(model, self.context, self.backend, self.device, self.config)
        q = self.config.quantization
        logger.info("Loaded the draft model %s (%s%s) in %.1f s; its KV cache takes %d bytes per block beside the "
                    "target's", self.config.model, type(model).__name__, f", {q.method}" if q else "",
                    time.perf_counter() - t0, self.kv.bytes_per_block())

    def bytes_per_block(self) -> int:
        return self.kv.bytes_per_block()

    def allocate(self, num_blocks: int) -> None:
        """The draft's cache of the target's block count, and its fused decode step where one applies."""
        self.kv.allocate(num_blocks)
        if self.device.type != "cuda" and self.backend.native is not None:
            self.native = NativeDecode.create(self.model, self.kv.kv_caches, self.dtype, self.kv_dtype,  # type: ignore[arg-type]
                                              self.block_size, self.config.sliding_window)

    # ---- per step -------------------------------------------------------------------------
    def propose(self, so: SchedulerOutput, req_ids: list[str], rows: np.ndarray, counts: np.ndarray) -> None:
        """Runs the draft over the step's new tokens and decodes each speculating request's
        proposals, which replace its placeholders in so.spec_token_ids. Leaves the persistent
        batch's tokens as they were."""
        for rid in so.finished_req_ids - so.preempted_req_ids:
            self.computed.pop(rid, None)
        ib = self.ib
        spec = so.spec_token_ids
        saved, saved_tokens = ib.num_computed_tokens[rows].copy(), ib.num_tokens[rows].copy()
        ks = np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64, count=len(req_ids))
        ends = saved + counts - ks  # past the last known token each request computes this step
        starts = np.fromiter((min(self.computed.get(r, c), c) for r, c in zip(req_ids, saved.tolist())),
                             dtype=np.int64, count=len(req_ids))
        self._step = (req_ids, rows, ends, ks)
        try:
            ib.num_computed_tokens[rows] = starts
            batch = ib.prepare(rows, ends - starts, self.config.sliding_window, **self.batch_options)
            first = np.flatnonzero(ks > 0)
            tokens = self._run(batch, batch.query_start_loc[first + 1] - 1)
            drafted = {int(i): [int(t)] for i, t in zip(first, tokens)}
            for j in range(1, int(ks.max()) if len(ks) else 0):
                active = np.asarray([i for i in first if ks[i] > j], dtype=np.int64)
                for i in active.tolist():
                    ib.extend_tokens(int(rows[i]), drafted[i][-1:])
                ib.num_computed_tokens[rows[active]] = ends[active] + j - 1
                step = ib.prepare(rows[active], np.ones(len(active), dtype=np.int64), self.config.sliding_window,
                                  **self.batch_options)
                for i, t in zip(active.tolist(), self._run(step, np.arange(len(active))).tolist()):
                    drafted[i].append(int(t))
        finally:
            ib.num_computed_tokens[rows] = saved
            ib.num_tokens[rows] = saved_tokens
        for i, toks in drafted.items():
            spec[req_ids[i]] = toks

    def after_step(self, out: ModelRunnerOutput) -> None:
        """Records what the draft has computed of each request of the step just run: through its
        last known token, and the proposals it wrote that the target accepted; writes a fully
        accepted step's last proposal at once where it completes a block."""
        if self._step is None:
            return
        req_ids, rows, ends, ks = self._step
        self._step = None
        kept = dict(zip(out.req_ids, out.sampled_token_ids))
        late = []
        for i, rid in enumerate(req_ids):
            k = int(ks[i])
            accepted = max(len(kept.get(rid) or ()) - 1, 0) if k else 0
            self.computed[rid] = int(ends[i]) + min(accepted, k - 1) if k else int(ends[i])
            if k and accepted == k and (int(ends[i]) + k) % self.block_size == 0 and rid in self.ib.req_index:
                late.append(i)
        if late:
            idx = np.asarray(late, dtype=np.int64)
            ib = self.ib
            saved = ib.num_computed_tokens[rows[idx]].copy()
            try:
                ib.num_computed_tokens[rows[idx]] = ends[idx] + ks[idx] - 1
                step = ib.prepare(rows[idx], np.ones(len(idx), dtype=np.int64), self.config.sliding_window,
                                  **self.batch_options)
                self._run(step, np.zeros(0, dtype=np.int64))
            finally:
                ib.num_computed_tokens[rows[idx]] = saved
            for i in late:
                self.computed[req_ids[i]] = int(ends[i] + ks[i])

    def _run(self, batch: BatchArrays, sample_rows: np.ndarray) -> np.ndarray:
        """One draft forward pass over `batch`, writing its K/V; the argmax token after each of
        the flat rows `sample_rows`. The fused native step where it takes the pass (each token a
        row of its own), else the torch layers and LM head."""
        t0 = time.perf_counter()
        self.passes += 1
        nd = self.native
        rows = batch if len(batch.input_ids) == len(batch.seq_lens) else token_rows(batch)
        out = None
        if nd is not None and not batch.dense and nd.applies(len(rows.input_ids), len(rows.seq_lens), False):
            if len(sample_rows) and nd.head_applies(len(sample_rows)):
                out = nd.run_head(rows.input_ids, rows.positions, rows.slot_mapping, rows.block_tables,
                                  rows.seq_lens, sample_rows, True)
            elif not len(sample_rows) and nd.run(rows.input_ids, rows.positions, rows.slot_mapping,
                                                 rows.block_tables, rows.seq_lens) is not None:
                out = np.zeros(0, dtype=np.int64)
        if out is None:
            hidden = self.eager.forward(batch)  # type: ignore[union-attr]
            if len(sample_rows):
                logits = self.model.compute_logits(hidden[torch.from_numpy(sample_rows).to(self.device)])  # type: ignore[union-attr]
                out = logits.float().argmax(dim=-1).cpu().numpy()
            else:
                out = np.zeros(0, dtype=np.int64)
        self.seconds += time.perf_counter() - t0
        return out
