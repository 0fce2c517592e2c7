"""Speculative method draft_model on the worker: a draft model decodes a few tokens greedily ahead
of the target, in the same step, and the target verifies them (worker/spec_decode.py).

The scheduler reserves each speculating request's proposal slots (core/spec_decode.py,
DraftSlotsProposer: placeholders, as many as the adaptive controller allows). Before the target's
forward pass, `DraftRunner.propose` runs the draft for the requests that speculate this step, and
for no other (a step without proposals, such as every step with 32 or more running requests on a
CPU, runs no draft pass at all):

1. one pass over each speculating request's tokens the draft has not computed, up to and including
   its last known token: its last token, and what it computed in steps without proposals (its
   prompt, decodes while it did not speculate; with, after a step whose proposals were all
   accepted, the last of them); its argmax after the last token is the request's first proposal;
2. k - 1 passes of one token per speculating request (the previous proposal in, the next out),
   while the request has proposals left to make.

The proposals then replace the placeholders (SchedulerOutput.spec_token_ids) and the target step
runs as for any other method. Greedy draft tokens are a point-mass proposal, so verification keeps
the target's distribution for sampled requests as it does for n-gram proposals; what the draft
proposes never changes a greedy request's tokens.

The draft's KV cache has its own tensors (its own layers and head shape) indexed by the target's
block tables and slot mapping (same tokenizer, same positions), so the engine's one KV cache
manager holds both: every block id names a block in both caches, a block's bytes count both
(KVMemory.extra_bytes_per_block), and swaps and copy-on-write move both. The draft computes a
request's positions lazily, when it next speculates; a proposal the draft made itself and the
target accepted already holds its K/V, except the last of a fully accepted step's proposals, which
the draft writes in its next pass, or at once where it completes a block. The runner keeps the set
of device blocks whose draft K/V is whole (`valid`), through copies, swaps (host blocks remember
it) and fresh allocations, so a request that starts on blocks another request computed (a
prefix-cache hit, a swap-in, a fork) starts its draft after the leading whole ones. A request's
draft positions after its computed tokens are written before they are read; rejected proposals'
slots are written again, as the target's are.
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
        """req_id -> positions from 0 whose draft K/V is written (requests that have speculated)."""
        self.valid: set[int] = set()
        """Device blocks whose every position holds the draft's K/V (a prefix-cache hit on one is
        one for the draft too)."""
        self.host_valid: dict[int, bool] = {}
        """Host (swap) blocks: whether the device block swapped out to it was in `valid`."""
        self._step: tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
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
        """Runs the draft over the speculating requests' tokens it has not computed and decodes
        their proposals, which replace the placeholders in so.spec_token_ids; no pass at all in a
        step without proposals. Leaves the persistent batch's tokens as they were."""
        self._track_blocks(so)
        for rid in so.finished_req_ids:  # a preempted request's draft positions come back with its blocks
            self.computed.pop(rid, None)
        spec = so.spec_token_ids
        pick = [i for i, r in enumerate(req_ids) if spec.get(r)]
        if not pick:
            return
        ib = self.ib
        idx = np.asarray(pick, dtype=np.int64)
        req_ids, rows, counts = [req_ids[i] for i in pick], rows[idx], counts[idx]
        saved, saved_tokens = ib.num_computed_tokens[rows].copy(), ib.num_tokens[rows].copy()
        ks = np.fromiter((len(spec[r]) for r in req_ids), dtype=np.int64, count=len(req_ids))
        ends = saved + counts - ks  # past each request's last known token
        starts = np.fromiter((min(self.computed[r] if r in self.computed else self._valid_prefix(int(row)), c)
                              for r, row, c in zip(req_ids, rows.tolist(), saved.tolist())),
                             dtype=np.int64, count=len(req_ids))
        self._step = (req_ids, rows, starts, ends, ks)
        try:
            ib.num_computed_tokens[rows] = starts
            batch = ib.prepare(rows, ends - starts, self.config.sliding_window, **self.batch_options)
            tokens = self._run(batch, batch.query_start_loc[1:] - 1)
            drafted = {i: [int(t)] for i, t in enumerate(tokens.tolist())}
            for j in range(1, int(ks.max())):
                active = np.flatnonzero(ks > j)
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
        """Records what the draft has computed of each speculating request of the step just run:
        through its last known token, and the proposals it wrote that the target accepted; writes
        a fully accepted step's last proposal at once where it completes a block; marks the full
        blocks it has now computed."""
        if self._step is None:
            return
        req_ids, rows, starts, ends, ks = self._step
        self._step = None
        kept = dict(zip(out.req_ids, out.sampled_token_ids))
        late = []
        for i, rid in enumerate(req_ids):
            k = int(ks[i])
            accepted = max(len(kept.get(rid) or ()) - 1, 0)
            self.computed[rid] = int(ends[i]) + min(accepted, k - 1)
            if accepted == k and (int(ends[i]) + k) % self.block_size == 0 and rid in self.ib.req_index:
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
        bs, table = self.block_size, self.ib.block_table
        for i, rid in enumerate(req_ids):
            if rid in self.ib.req_index:
                self.valid.update(table[int(rows[i]), int(starts[i]) // bs : self.computed[rid] // bs].tolist())

    def _valid_prefix(self, row: int) -> int:
        """Positions from 0 of the request in this batch row whose draft K/V its blocks hold: its
        leading blocks the draft has computed in full (a prefix-cache hit, a swapped-in request)."""
        n = 0
        for b in self.ib.block_table[row, : int(self.ib.num_blocks[row])].tolist():
            if b not in self.valid:
                break
            n += 1
        return n * self.block_size

    def _track_blocks(self, so: SchedulerOutput) -> None:
        """Keeps `valid` (the device blocks whose draft K/V is whole) through the step's block moves
        (a destination is whole where its source was; every source is read before any destination
        is written) and allocations (a block handed out to be written afresh is not)."""
        valid, host = self.valid, self.host_valid
        if so.blocks_to_swap_out or so.blocks_to_swap_in or so.blocks_to_copy:
            outs = [(h, b in valid) for b, h in so.blocks_to_swap_out]
            ins = [(b, host.get(h, False)) for h, b in [*so.blocks_to_swap_in]]
            ins += [(d, s in valid) for s, d in so.blocks_to_copy]
            host.update(outs)
            for b, whole in ins:
                (valid.add if whole else valid.discard)(b)
        bs = self.block_size
        for new in so.new_reqs:  # blocks past its computed tokens are written afresh
            valid.difference_update(new.block_ids[new.num_computed_tokens // bs :])
        for cached in so.cached_reqs:
            valid.difference_update(cached.new_block_ids)

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
