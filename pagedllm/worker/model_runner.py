"""Turns a SchedulerOutput into tensors, runs the model, samples: the only place that does so."""

from __future__ import annotations

import logging
import math
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import torch

from pagedllm.attention.backend import TritonAttentionBackend, select_attention_backend
from pagedllm.attention.cpu_kernel import dense_thresholds
from pagedllm.attention.metadata import AttentionGroup, AttentionMetadata, DenseAttention, ForwardContext
from pagedllm.config import CacheConfig, DeviceConfig, ModelConfig
from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.core.scheduler_output import Logprobs, ModelRunnerOutput, SchedulerOutput
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import Linear, dense_linear
from pagedllm.models.loader import ModelSource, iterate_weights
from pagedllm.models.registry import get_model_class
from pagedllm.quantization import QuantizationSetup, process_model
from pagedllm.utils import trim_heap, tune_heap
from pagedllm.worker import device as dev
from pagedllm.worker.cuda_graph import CudaGraphRunner
from pagedllm.worker.host_memory import anonymous_zeros, move_weights_to_huge_pages
from pagedllm.worker.input_batch import BatchArrays, InputBatch
from pagedllm.worker.native_decode import NativeDecode
from pagedllm.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_topk_logprobs,
    sample_isolating_faults,
    sampler_fault_hook,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Default KV budget: this share of the memory available after loading, at most this many bytes.
_DEFAULT_KV_FRACTION = 0.3
_DEFAULT_KV_MAX_BYTES = 4 << 30


def _best_time(fn: Callable[[], object], reps: int = 5) -> float:
    """Fastest of `reps` timed calls after one warm-up call, in seconds."""
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _micro_batches(counts: list[int], n: int) -> list[tuple[int, int]]:
    """Cuts requests into at most n contiguous runs of about equal tokens, as [start, end) indices.

    counts [4, 1, 1, 1, 1], n 2 -> total 8, cut once 4 tokens are reached -> [(0, 1), (1, 5)].
    """
    total = sum(counts)
    bounds, start, acc = [], 0, 0
    for i, c in enumerate(counts):
        acc += c
        if acc * n >= total * (len(bounds) + 1) and i + 1 < len(counts) and len(bounds) + 1 < n:
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(counts)))
    return bounds


def parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters, a quantized linear layer's weights counted as the float matrix they
    stand for (their codes and scales are buffers, and a packed word holds several weights)."""
    params = {id(p): p for p in model.parameters()}
    n = sum(p.numel() for p in params.values())
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, Linear) and not (isinstance(w, torch.nn.Parameter) and id(w) in params):
            n += m.in_features * m.out_features
    return n


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device_config: DeviceConfig | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        self.model_config = model_config
        # This rank's place among the tensor/pipeline-parallel ranks (a single rank by default).
        self.parallel = parallel or ParallelContext()
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.dtype = _DTYPES[model_config.dtype]
        self.kv_dtype = _KV_DTYPES[model_config.kv_cache_dtype]
        # ---- device: chosen once; every tensor of a step is created on it ----
        self.device_config = device_config or DeviceConfig()
        self.device = torch.device(self.device_config.device)
        self.is_cuda = self.device.type == "cuda"
        if not self.is_cuda:
            tune_heap()
        self.cuda_graphs: CudaGraphRunner | None = None
        # Small decode-only steps as one native call (CPU; set once the KV cache exists).
        self.native_decode: NativeDecode | None = None
        # The requests this worker holds, in preallocated arrays updated as they change.
        self.input_batch = InputBatch(model_config.max_model_len, self.block_size)
        self._static_sampling: tuple[tuple[int, int, bytes], SamplingMetadata] | None = None
        self.generators: dict[str, torch.Generator] = {}
        # req_id -> prompt positions whose prompt logprobs were already returned; kept across a
        # recompute preemption so the recomputed prompt does not return them a second time.
        self.prompt_logprobs_done: dict[str, int] = {}
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        # Host pool for swapped-out blocks: per layer, the same layout with num_swap_blocks blocks.
        self.swap_caches: list[torch.Tensor] = []
        self._kv_buffers: list[mmap.mmap] = []
        self._weight_arena: mmap.mmap | None = None  # holds the weights where huge pages are offered
        self.num_blocks = 0
        self.num_swap_blocks = 0
        # Chosen once; bound with this runner's forward context to every attention layer. Triton
        # attention on the GPU (and, for tests, on the CPU under Triton's interpreter); on the CPU
        # the native kernel (every dtype and KV cache dtype), or the torch reference where it
        # cannot be compiled.
        triton = self.is_cuda or os.environ.get("PAGEDLLM_ATTENTION_BACKEND", "").lower() == "triton"
        self.attn_backend = select_attention_backend(
            triton=triton, block_size=self.block_size,
            num_queries_per_kv=model_config.num_heads // model_config.num_kv_heads)
        self.forward_context = ForwardContext()
        # How the input batch lays out attention work for this backend (fixed once it is chosen):
        # with the native CPU kernel, prompt chunks past dense_thresholds attend densely (the
        # native bf16 or fp32 flash kernel, or torch's flash attention for long chunks).
        dense_tokens, dense_pairs = (dense_thresholds(self.dtype, self.kv_dtype, model_config.head_dim)
                                     if self.attn_backend.native is not None else (0, 0))
        self.batch_options: dict[str, Any] = {
            "build_groups": self.attn_backend.needs_groups,
            "query_tile": self.attn_backend.query_tile,
            "dense_min_tokens": dense_tokens,
            "dense_min_pairs": dense_pairs,
        }

    @property
    def native_kernel(self) -> Any:
        """The compiled CPU attention kernel the backend calls, or None."""
        return self.attn_backend.native

    @property
    def triton_attention(self) -> bool:
        return isinstance(self.attn_backend, TritonAttentionBackend)

    # ---- set-up ---------------------------------------------------------------------------
    def load_model(self) -> None:
        mc = self.model_config
        t0 = time.perf_counter()
        cls = get_model_class(mc.hf_config)
        quant = QuantizationSetup(mc) if mc.quantization is not None else None
        with torch.device(self.device):
            model = cls(mc.hf_config, dtype=self.dtype, parallel=self.parallel, quant_config=quant)
        if mc.load_format == "dummy":
            dev.initialize_dummy_weights(model, mc.seed)
        else:
            source = ModelSource(kind=mc.kind, path=mc.path, name=mc.served_model_name)  # type: ignore[arg-type]
            model.load_weights(iterate_weights(source, quant))
        process_model(model, self.dtype, f"{mc.quantization.method} quantization" if quant else "", quant)
        if not self.is_cuda:
            self._weight_arena = move_weights_to_huge_pages(model)
            trim_heap()  # the loaded copies' pages, freed into a heap that keeps its free pages
        model.eval()
        for layer in self._attention_layers(model):
            layer.context, layer.backend = self.forward_context, self.attn_backend
        self.model = model
        n_params = parameter_count(model)
        logger.info(
            "Loaded %s (%s, %.1fM parameters, %s) in %.1f s",
            mc.served_model_name,
            cls.__name__,
            n_params / 1e6,
            mc.dtype,
            time.perf_counter() - t0,
        )

    @staticmethod
    def _attention_layers(model: torch.nn.Module) -> list[Attention]:
        return [m for m in model.modules() if isinstance(m, Attention)]

    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token on this rank: its stage's layers and its KV heads."""
        layers = self._attention_layers(self.model)  # type: ignore[arg-type]
        itemsize = torch.empty(0, dtype=self.kv_dtype).element_size()
        return sum(2 * a.num_kv_heads * a.head_dim * itemsize for a in layers)

    def determine_num_blocks(self) -> int:
        cc = self.cache_config
        per_block = self.kv_bytes_per_token() * self.block_size
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        budget = cc.kv_cache_memory
        if budget is None and self.is_cuda:
            budget = dev.gpu_kv_cache_budget(self.device, self.device_config.gpu_memory_utilization, self.model_config)
        if budget is None:
            budget = min(int(psutil.virtual_memory().available * _DEFAULT_KV_FRACTION), _DEFAULT_KV_MAX_BYTES)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={budget} bytes holds no block: one block of {self.block_size} tokens "
                f"needs {per_block} bytes for this model"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        attn_layers = self._attention_layers(self.model)  # type: ignore[arg-type]
        # Per layer of this stage, this rank's KV heads only.
        self.kv_caches = [
            self._zeroed((2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim)) for a in attn_layers
        ]
        for layer, cache in zip(attn_layers, self.kv_caches):
            layer.kv_cache = cache
            layer.calculate_kv_scales = self.cache_config.calculate_kv_scales
        self.num_blocks = num_blocks
        if self.device_config.use_cuda_graphs:
            self.capture_cuda_graphs()
        if not self.is_cuda and self.native_kernel is not None:
            self.native_decode = NativeDecode.create(
                self.model, self.kv_caches, self.dtype, self.kv_dtype,  # type: ignore[arg-type]
                self.block_size, self.model_config.sliding_window)

    def capture_cuda_graphs(self) -> None:
        """Decode-only steps at the configured padded batch sizes, captured once (GPU only)."""
        from pagedllm.attention.triton_attention import choose_num_splits

        mc = self.model_config
        sizes = self.device_config.cuda_graph_sizes
        sms = dev.num_sms(self.device)
        self.cuda_graphs = CudaGraphRunner(
            self.model,  # type: ignore[arg-type]
            sizes,
            max_blocks_per_seq=-(-mc.max_model_len // self.block_size),
            sliding_window=mc.sliding_window or 0,
            num_splits={b: choose_num_splits(b, mc.num_kv_heads, mc.max_model_len, sms) for b in sizes},
            device=self.device,
            context=self.forward_context,
        )
        self.cuda_graphs.capture()

    def determine_num_swap_blocks(self) -> int:
        """Blocks that fit in `swap_space` GiB of host memory."""
        per_block = self.kv_bytes_per_token() * self.block_size
        return int(self.cache_config.swap_space * (1 << 30)) // per_block

    def initialize_swap_space(self, num_swap_blocks: int) -> None:
        """The host pool: on the CPU backend a second set of tensors shaped like the KV cache
        (lazily committed, so unused swap space costs no memory)."""
        shapes = [(2, num_swap_blocks, *kv.shape[2:]) for kv in self.kv_caches]
        if self.is_cuda:
            self.swap_caches = [dev.pinned_zeros(shape, self.kv_dtype) for shape in shapes] if num_swap_blocks else []
        else:
            self.swap_caches = [self._zeroed(shape) for shape in shapes] if num_swap_blocks else []
        self.num_swap_blocks = num_swap_blocks

    def _move_blocks(self, so: SchedulerOutput) -> None:
        """Swap-out, swap-in and copy-on-write pairs, in every layer, before the forward pass.

        Every source is read before any destination is written: a device block freed by a
        swap-out may be the destination of a swap-in or a copy in the same step (and a host block
        freed by a swap-in the destination of a swap-out).
        """
        moves = [
            (pairs, src_pool, dst_pool)
            for pairs, src_pool, dst_pool in (
                (so.blocks_to_swap_out, self.kv_caches, self.swap_caches),
                (so.blocks_to_swap_in, self.swap_caches, self.kv_caches),
                (so.blocks_to_copy, self.kv_caches, self.kv_caches),
            )
            if pairs
        ]
        if not moves:
            return
        index = [
            (
                torch.tensor([p[0] for p in pairs], device=src_pool[0].device),
                torch.tensor([p[1] for p in pairs], device=dst_pool[0].device),
                src_pool,
                dst_pool,
            )
            for pairs, src_pool, dst_pool in moves
        ]
        def raw(t: torch.Tensor) -> torch.Tensor:  # fp8 blocks move as bytes (no fp8 index_copy_)
            return t.view(torch.uint8) if t.element_size() == 1 else t

        for layer in range(len(self.kv_caches)):
            # Cache layout [2, num_blocks, block_size, heads, head_dim]: blocks on dim 1.
            data = [raw(src_pool[layer]).index_select(1, src) for src, _, src_pool, _ in index]
            for (_, dst, _, dst_pool), d in zip(index, data):
                raw(dst_pool[layer]).index_copy_(1, dst, d.to(dst_pool[layer].device))

    def flops_per_token(self) -> float:
        """Linear-layer work of one token through the decoder layers (2 FLOPs per weight)."""
        assert self.model is not None
        return 2.0 * sum(m.in_features * m.out_features for name, m in self.model.named_modules()
                         if isinstance(m, Linear) and "layers." in name)

    def measure_preemption_rates(self) -> tuple[float, float]:
        """(FLOP/s of a prefill-sized matmul, bytes/s of swapping KV blocks out and back in).

        Run once at startup for preemption mode auto; the copy moves blocks of the idle cache
        through the real swap path (its contents are garbage before the first request anyway).
        """
        hidden = int(self.model_config.hf_config.hidden_size)
        a = torch.randn(256, hidden, dtype=self.dtype, device=self.device)
        w = torch.randn(4 * hidden, hidden, dtype=self.dtype, device=self.device)
        sync = torch.cuda.synchronize if self.is_cuda else (lambda: None)
        # The GEMM path the model's own prefill takes (oneDNN for float32 on the CPU, where torch.mm's
        # MKL path runs at about half that rate).
        flops = 2.0 * 256 * hidden * 4 * hidden / _best_time(lambda: (dense_linear(a, w), sync()))
        k = min(16, self.num_blocks, self.num_swap_blocks)
        if k == 0:
            return flops, 1.0  # no swap pool: nothing can be swapped, whatever the rate
        pairs = [(i, i) for i in range(k)]
        so = SchedulerOutput([], [], {}, 0, blocks_to_swap_out=pairs, blocks_to_swap_in=pairs)
        per_block = self.kv_bytes_per_token() * self.block_size
        copy = 2.0 * k * per_block / _best_time(lambda: (self._move_blocks(so), sync()))
        return flops, copy

    def _zeroed(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero tensor, its pages committed on first write (host_memory.anonymous_zeros on the CPU)."""
        if self.is_cuda:
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        t, buf = anonymous_zeros(shape, self.kv_dtype)
        self._kv_buffers.append(buf)
        return t

    # ---- per step -------------------------------------------------------------------------
    @property
    def requests(self) -> dict[str, int]:
        """The requests this worker holds: req_id -> its row in the persistent batch."""
        return self.input_batch.req_index

    def _generator(self, req_id: str, params: Any) -> torch.Generator | None:
        """The request's generator, created on first sight (kept across a preemption)."""
        if params is None or params.seed is None:
            return None
        gen = self.generators.get(req_id)
        if gen is None:
            gen = self.generators[req_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        return gen

    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        for rid in so.finished_req_ids:
            ib.remove(rid)
        for rid in so.finished_req_ids - so.preempted_req_ids:
            self.generators.pop(rid, None)
            self.prompt_logprobs_done.pop(rid, None)
        for new in so.new_reqs:
            params = new.sampling_params
            ib.add(new.req_id, list(new.prompt_token_ids) + list(new.output_token_ids), len(new.prompt_token_ids),
                   new.block_ids, new.num_computed_tokens, params, self._generator(new.req_id, params),
                   new.eos_token_ids)
        index = ib.req_index
        for cached in so.cached_reqs:
            i = index[cached.req_id]
            for j, block_id in cached.replaced_block_ids:  # copy-on-write: its private copy
                ib.block_table[i, j] = block_id
            ib.append_blocks(i, cached.new_block_ids)
            ib.num_computed_tokens[i] = cached.num_computed_tokens

    def _attention_metadata(self, batch: BatchArrays) -> AttentionMetadata:
        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        groups = [
            AttentionGroup(
                batch_size=g.batch_size,
                max_query_len=g.max_query_len,
                query_index=t(g.query_index),
                out_rows=t(g.out_rows),
                out_dest=t(g.out_dest),
                block_tables=t(g.block_tables),
                mask=t(g.mask),
            )
            for g in batch.groups
        ]
        return AttentionMetadata(
            num_tokens=len(batch.input_ids),
            slot_mapping=t(batch.slot_mapping),
            block_tables=t(batch.block_tables),
            query_start_loc=t(batch.query_start_loc),
            seq_lens=t(batch.seq_lens),
            work=t(batch.work),
            sliding_window=self.model_config.sliding_window or 0,
            groups=groups,
            native=self.native_kernel,
            dense=[
                DenseAttention(d.query_start, d.query_len, t(d.blocks), d.seq_len)
                for d in batch.dense
            ],
            **self._gpu_attention_fields(batch),
        )

    def _gpu_attention_fields(self, batch: BatchArrays) -> dict[str, int]:
        """Launch shape of the Triton kernel: longest work item, key-range splits."""
        if not self.triton_attention:
            return {}
        from pagedllm.attention.triton_attention import choose_num_splits

        counts = batch.work[:, 2]
        max_seq = int(batch.seq_lens.max()) if len(batch.seq_lens) else 0
        sms = dev.num_sms(self.device) if self.is_cuda else dev.INTERPRETER_SMS
        splits = choose_num_splits(len(counts), self.model_config.num_kv_heads, max_seq, sms)
        return {"max_query_len": int(counts.max()) if len(counts) else 0, "num_splits": splits, "triton": True}

    def _prompt_logprob_rows(
        self, rows: np.ndarray, batch: BatchArrays
    ) -> list[tuple[str, np.ndarray, np.ndarray, int]]:
        """For requests asking prompt_logprobs: (req_id, flat rows, next-token ids, k) of this chunk.

        The logits at prompt position p score prompt token p + 1, so a chunk covering positions
        [s, e) yields logprobs for tokens s + 1 .. min(e, num_prompt - 1).
        """
        ib = self.input_batch
        out = []
        for i in np.nonzero(ib.prompt_logprobs[rows] >= 0)[0]:
            r = rows[i]
            rid, k = ib.req_ids[r], int(ib.prompt_logprobs[r])
            first = int(batch.seq_lens[i] - (batch.query_start_loc[i + 1] - batch.query_start_loc[i]))
            # After a preemption the prompt is computed again: skip positions already returned.
            start = max(first, self.prompt_logprobs_done.get(rid, 0))
            end = min(int(batch.seq_lens[i]), int(ib.num_prompt_tokens[r]) - 1)
            if end <= start:
                continue
            self.prompt_logprobs_done[rid] = end
            flat = np.arange(start, end) - first + batch.query_start_loc[i]
            targets = ib.token_ids[r, start + 1 : end + 1].copy()
            out.append((rid, flat, targets, k))
        return out

    def _fork(self, so: SchedulerOutput, rows: np.ndarray) -> list[tuple[int, int]]:
        """Creates this step's forked samples: (index of the parent in the batch, child's row)."""
        if not so.forked_reqs:
            return []
        ib = self.input_batch
        index = {int(r): i for i, r in enumerate(rows)}
        out = []
        for f in so.forked_reqs:
            parent = ib.req_index[f.parent_id]
            child = ib.fork(parent, f.req_id, f.block_ids, f.sampling_params,
                            self._generator(f.req_id, f.sampling_params))
            out.append((index[parent], child))
        return out

    def _advance(self, rows: np.ndarray, counts: np.ndarray, forks: list[tuple[int, int]]) -> None:
        ib = self.input_batch
        ib.num_computed_tokens[rows] += counts
        for i, child in forks:  # the parent computed the prompt: its prompt logprobs are done
            self.prompt_logprobs_done[ib.req_ids[child]] = self.prompt_logprobs_done.get(ib.req_ids[rows[i]], 0)

    def record_sampled(self, out: ModelRunnerOutput) -> None:
        """On ranks that do not sample: appends the driver's tokens of the previous step."""
        ib = self.input_batch
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids):
            i = ib.req_index.get(rid)
            if i is not None and tokens:
                ib.extend_tokens(i, tokens)

    def _model_inputs(self, batch: BatchArrays) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.from_numpy(batch.input_ids).to(self.device, non_blocking=True)
        return ids, torch.from_numpy(batch.positions).to(self.device, non_blocking=True)

    def _forward(self, rows: np.ndarray, counts: np.ndarray, batch: BatchArrays) -> torch.Tensor | None:
        """Runs this rank's layers; the final hidden states on the last stage, else None.
        `rows`: the scheduled requests' rows in the persistent batch, in batch order; `counts`:
        their scheduled tokens.

        With pipeline stages the requests are cut into up to pp_size micro-batches of about equal
        tokens; each stage sends a micro-batch on as soon as it is done and starts the next, so
        the stages work at the same time (stage 0 on micro-batch 1 while stage 1 runs
        micro-batch 0). The last stage concatenates them back into the batch's row order.
        """
        p = self.parallel
        if p.pp_size == 1:
            hidden = self.cuda_graphs.run(batch) if self.cuda_graphs is not None else None
            nd = self.native_decode
            if hidden is None and nd is not None and nd.applies(len(batch.input_ids), len(batch.seq_lens),
                                                                bool(batch.dense)):
                hidden = nd.run(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                                batch.seq_lens)
            if hidden is not None:
                return hidden
            with self.forward_context.set(self._attention_metadata(batch)):
                return self.model(*self._model_inputs(batch))  # type: ignore[misc]
        hidden_size = int(self.model_config.hf_config.hidden_size)
        outs, sends = [], []
        for a, b in _micro_batches(counts.tolist(), p.pp_size):
            mb = batch if (a, b) == (0, len(counts)) else self.input_batch.prepare(
                rows[a:b], counts[a:b], self.model_config.sliding_window, **self.batch_options)
            h_in = None
            if not p.is_first_stage:
                h_in = p.recv_from_prev_stage([(len(mb.input_ids), hidden_size)], self.dtype)[0]
            with self.forward_context.set(self._attention_metadata(mb)):
                h = self.model(*self._model_inputs(mb), h_in)  # type: ignore[misc]
            if p.is_last_stage:
                outs.append(h)
            else:
                sends.append((h, p.send_to_next_stage([h])))
        for _, works in sends:
            for w in works:
                w.wait()
        return torch.cat(outs) if outs else None

    def _native_head(self, so: SchedulerOutput, rows: np.ndarray,
                     batch: BatchArrays) -> np.ndarray | torch.Tensor | None:
        """This step through the native decode call on to the LM head, where it applies: the
        sampled rows' token ids when they all sample greedily with no logits processing and no
        logprobs (the sampler would take the argmax of the same logits), else their logits; None
        where the step takes the usual path (the forward pass, then the LM head in torch).

        It applies to decode-only steps the fused step takes, on one rank, with no forked samples
        and no prompt logprobs (both need hidden states), whose sampled rows are few enough that
        the torch path's LM head is the same GEMM."""
        nd = self.native_decode
        if (nd is None or self.cuda_graphs is not None or self.parallel.pp_size != 1 or so.forked_reqs
                or not nd.applies(len(batch.input_ids), len(batch.seq_lens), bool(batch.dense))
                or not nd.head_applies(len(batch.sample_rows))):
            return None
        ib = self.input_batch
        if (ib.prompt_logprobs[rows] >= 0).any():
            return None
        sample_slots = rows[batch.sample_req_indices]
        greedy = False
        if sampler_fault_hook() is None:
            try:
                md = self._sampling_metadata(sample_slots, nd.vocab)
            except Exception:  # the sampler reports it (and fails the row) from the logits
                md = None
            greedy = md is not None and md.argmax_only
        return nd.run_head(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                           batch.seq_lens, batch.sample_rows, greedy)

    def _sampling_metadata(self, rows: np.ndarray, vocab_size: int) -> SamplingMetadata:
        """Sampling tensors for these rows: the parameter part is reused while the same rows hold
        the same requests (a plain greedy batch then costs nothing per step)."""
        ib = self.input_batch
        key = (ib.version, vocab_size, rows.tobytes())
        if self._static_sampling is None or self._static_sampling[0] != key:
            self._static_sampling = (key, SamplingMetadata.static_from_batch(ib, rows, vocab_size, self.device))
        return self._static_sampling[1].with_token_state(ib, rows, self.device)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        self._move_blocks(so)
        ib = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        rows = ib.rows_of(req_ids)
        counts = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        batch = ib.prepare(rows, counts, self.model_config.sliding_window, **self.batch_options)
        # A small decode step may run on to the LM head (and the argmax) in one native call.
        head = self._native_head(so, rows, batch)
        hidden = self._forward(rows, counts, batch) if head is None else None
        forks = self._fork(so, rows)
        if hidden is None and head is None:  # an earlier pipeline stage: the next stage carries on
            self._advance(rows, counts, forks)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        # Rows to sample: each request that completes its tokens, then each forked sample, which
        # samples from its parent's row with its own parameters and generator.
        sample_slots = rows[batch.sample_req_indices]
        sample_rows = batch.sample_rows
        if forks:
            parents = np.asarray([i for i, _ in forks], dtype=np.int64)
            sample_slots = np.concatenate([sample_slots, np.asarray([c for _, c in forks], dtype=np.int64)])
            sample_rows = np.concatenate([sample_rows, batch.query_start_loc[parents + 1] - 1])
        out_ids = req_ids + [ib.req_ids[c] for _, c in forks]
        sampled: list[list[int]] = [[] for _ in out_ids]
        logprobs: dict[str, Logprobs] = {}
        failed: dict[str, str] = {}
        result = None
        # Every tensor-parallel rank of the last stage computes logits (the vocabulary is split);
        # only the driver samples, and the others learn its tokens with the next step.
        if isinstance(head, torch.Tensor):
            logits = head
        elif len(sample_slots) and head is None:
            rows_t = torch.from_numpy(sample_rows).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[rows_t])  # type: ignore[index, union-attr]
        # where each sampled row's request sits in out_ids: the scheduled ones, then the forks
        out_pos = batch.sample_req_indices.tolist() + list(range(len(req_ids), len(out_ids)))
        if isinstance(head, np.ndarray):  # greedy rows, nothing else: the native call's argmax
            result = SamplerOutput(torch.from_numpy(head), None, None, None)
        elif len(sample_slots) and self.parallel.is_driver:
            # A row whose sampling raises fails its request alone; the others are sampled as usual.
            iso = sample_isolating_faults(
                self.sampler, logits, lambda: [ib.sampling_row(int(i)) for i in sample_slots], self.device,
                metadata=lambda: self._sampling_metadata(sample_slots, logits.shape[-1]),
                generators=[ib.generators[int(i)] for i in sample_slots[ib.seeded[sample_slots]]])
            failed = {out_ids[out_pos[j]]: err for j, err in iso.failed.items()}
            if iso.failed:
                sample_slots = sample_slots[iso.kept]
                out_pos = [out_pos[j] for j in iso.kept]
            result = iso.output
        if result is not None:
            tokens = result.sampled_token_ids.cpu().numpy()  # the step's one device -> host sync
            if result.logprobs is not None and self.is_cuda:
                result.logprob_token_ids, result.logprobs, result.sampled_token_ranks = (
                    result.logprob_token_ids.cpu(), result.logprobs.cpu(), result.sampled_token_ranks.cpu())  # type: ignore[union-attr]
            ib.append_tokens(sample_slots, tokens)
            for pos, tok in zip(out_pos, tokens.tolist()):
                sampled[pos] = [tok]
            if result.logprobs is not None:
                for j in np.nonzero(ib.logprobs[sample_slots] >= 0)[0]:
                    k = int(ib.logprobs[sample_slots[j]])
                    logprobs[out_ids[out_pos[j]]] = Logprobs(
                        token_ids=[result.logprob_token_ids[j, : k + 1].tolist()],  # type: ignore[index]
                        logprobs=[result.logprobs[j, : k + 1].tolist()],
                        ranks=[int(result.sampled_token_ranks[j])],  # type: ignore[index]
                    )

        prompt_logprobs: dict[str, Logprobs] = {}
        for rid, rows_np, targets, k in self._prompt_logprob_rows(rows, batch):
            plogits = self.model.compute_logits(hidden[torch.from_numpy(rows_np).to(self.device)])  # type: ignore[union-attr]
            if not self.parallel.is_driver:
                continue
            ids, lps, ranks = compute_topk_logprobs(plogits, torch.from_numpy(targets).to(self.device), k)
            prompt_logprobs[rid] = Logprobs(token_ids=ids.tolist(), logprobs=lps.tolist(), ranks=ranks.tolist())

        self._advance(rows, counts, forks)
        return ModelRunnerOutput(
            req_ids=out_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            failed=failed,
        )
