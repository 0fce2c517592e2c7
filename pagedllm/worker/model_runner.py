"""Turns a SchedulerOutput into tensors, runs the model, samples: the only place that does so."""

from __future__ import annotations

import logging
import math
import mmap
import time
from collections.abc import Callable

import numpy as np
import psutil
import torch

from pagedllm.attention.cpu_kernel import QUERY_TILE, load_kernel
from pagedllm.attention.metadata import AttentionGroup, AttentionMetadata, set_attention_metadata
from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.core.scheduler_output import Logprobs, ModelRunnerOutput, SchedulerOutput
from pagedllm.layers.attention import Attention
from pagedllm.models.loader import ModelSource, iterate_weights
from pagedllm.models.registry import get_model_class
from pagedllm.quantization import QuantizationSetup, process_model
from pagedllm.worker.input_batch import BatchArrays, RequestState, build_batch
from pagedllm.worker.sampler import Sampler, SamplingMetadata, SamplingRow, compute_topk_logprobs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.dtype = _DTYPES[model_config.dtype]
        self.device = torch.device("cpu")
        self.requests: dict[str, RequestState] = {}
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
        self.num_blocks = 0
        self.num_swap_blocks = 0
        # The native CPU attention kernel serves float32; other dtypes use the torch backend.
        self.native_kernel = load_kernel() if self.dtype == torch.float32 else None

    # ---- set-up ---------------------------------------------------------------------------
    def load_model(self) -> None:
        mc = self.model_config
        t0 = time.perf_counter()
        cls = get_model_class(mc.hf_config)
        quant = QuantizationSetup(mc) if mc.quantization is not None else None
        with torch.device(self.device):
            model = cls(mc.hf_config, dtype=self.dtype, quant_config=quant)
        source = ModelSource(kind=mc.kind, path=mc.path, name=mc.served_model_name)  # type: ignore[arg-type]
        model.load_weights(iterate_weights(source, quant))
        process_model(model, self.dtype, f"{mc.quantization.method} quantization" if quant else "")
        model.eval()
        self.model = model
        n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        logger.info(
            "Loaded %s (%s, %.1fM parameters, %s) in %.1f s",
            mc.served_model_name,
            cls.__name__,
            n_params / 1e6,
            mc.dtype,
            time.perf_counter() - t0,
        )

    def determine_num_blocks(self) -> int:
        cc = self.cache_config
        per_block = self.model_config.kv_bytes_per_token() * self.block_size
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        budget = cc.kv_cache_memory
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
        mc = self.model_config
        shape = (2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]  # type: ignore[union-attr]
        self.kv_caches = [self._zeroed(shape) for _ in attn_layers]
        for layer in attn_layers:
            layer.kv_cache = self.kv_caches[layer.layer_idx]
        self.num_blocks = num_blocks

    def determine_num_swap_blocks(self) -> int:
        """Blocks that fit in `swap_space` GiB of host memory."""
        per_block = self.model_config.kv_bytes_per_token() * self.block_size
        return int(self.cache_config.swap_space * (1 << 30)) // per_block

    def initialize_swap_space(self, num_swap_blocks: int) -> None:
        """The host pool: on the CPU backend a second set of tensors shaped like the KV cache
        (lazily committed, so unused swap space costs no memory)."""
        mc = self.model_config
        shape = (2, num_swap_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.swap_caches = [self._zeroed(shape) for _ in self.kv_caches] if num_swap_blocks else []
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
            (torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs]), src_pool, dst_pool)
            for pairs, src_pool, dst_pool in moves
        ]
        for layer in range(len(self.kv_caches)):
            # Cache layout [2, num_blocks, block_size, heads, head_dim]: blocks on dim 1.
            data = [src_pool[layer].index_select(1, src) for src, _, src_pool, _ in index]
            for (_, dst, _, dst_pool), d in zip(index, data):
                dst_pool[layer].index_copy_(1, dst, d)

    def flops_per_token(self) -> float:
        """Linear-layer work of one token through the decoder layers (2 FLOPs per weight)."""
        assert self.model is not None
        return 2.0 * sum(p.numel() for name, p in self.model.named_parameters() if "layers." in name)

    def measure_preemption_rates(self) -> tuple[float, float]:
        """(FLOP/s of a prefill-sized matmul, bytes/s of swapping KV blocks out and back in).

        Run once at startup for preemption mode auto; the copy moves blocks of the idle cache
        through the real swap path (its contents are garbage before the first request anyway).
        """
        hidden = int(self.model_config.hf_config.hidden_size)
        a = torch.randn(256, hidden, dtype=self.dtype)
        b = torch.randn(hidden, 4 * hidden, dtype=self.dtype)
        flops = 2.0 * 256 * hidden * 4 * hidden / _best_time(lambda: torch.mm(a, b))
        k = min(16, self.num_blocks, self.num_swap_blocks)
        if k == 0:
            return flops, 1.0  # no swap pool: nothing can be swapped, whatever the rate
        pairs = [(i, i) for i in range(k)]
        so = SchedulerOutput([], [], {}, 0, blocks_to_swap_out=pairs, blocks_to_swap_in=pairs)
        per_block = self.model_config.kv_bytes_per_token() * self.block_size
        copy = 2.0 * k * per_block / _best_time(lambda: self._move_blocks(so))
        return flops, copy

    def _zeroed(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero tensor on anonymous memory: instant to create, pages committed on first write."""
        nbytes = math.prod(shape) * torch.empty(0, dtype=self.dtype).element_size()
        buf = mmap.mmap(-1, nbytes)
        self._kv_buffers.append(buf)
        return torch.frombuffer(buf, dtype=self.dtype).view(shape)

    # ---- per step -------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in so.finished_req_ids - so.preempted_req_ids:
            self.generators.pop(rid, None)
            self.prompt_logprobs_done.pop(rid, None)
        for new in so.new_reqs:
            params = new.sampling_params
            if params.seed is not None and new.req_id not in self.generators:
                self.generators[new.req_id] = torch.Generator().manual_seed(params.seed)
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=params,
                eos_token_ids=new.eos_token_ids,
            )
        for cached in so.cached_reqs:
            state = self.requests[cached.req_id]
            for i, block_id in cached.replaced_block_ids:  # copy-on-write: its private copy
                state.block_ids[i] = block_id
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _attention_metadata(self, batch: BatchArrays) -> AttentionMetadata:
        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a)

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
        )

    def _prompt_logprob_rows(
        self, states: list[RequestState], batch: BatchArrays
    ) -> list[tuple[str, np.ndarray, np.ndarray, int]]:
        """For requests asking prompt_logprobs: (req_id, flat rows, next-token ids, k) of this chunk.

        The logits at prompt position p score prompt token p + 1, so a chunk covering positions
        [s, e) yields logprobs for tokens s + 1 .. min(e, num_prompt - 1).
        """
        out = []
        for i, s in enumerate(states):
            k = s.sampling_params.prompt_logprobs
            if k is None:
                continue
            first = int(batch.seq_lens[i] - (batch.query_start_loc[i + 1] - batch.query_start_loc[i]))
            # After a preemption the prompt is computed again: skip positions already returned.
            start = max(first, self.prompt_logprobs_done.get(s.req_id, 0))
            end = min(int(batch.seq_lens[i]), s.num_prompt_tokens - 1)
            if end <= start:
                continue
            self.prompt_logprobs_done[s.req_id] = end
            rows = np.arange(start, end) - first + batch.query_start_loc[i]
            targets = np.asarray(s.token_ids[start + 1 : end + 1], dtype=np.int64)
            out.append((s.req_id, rows, targets, k))
        return out

    def _fork(self, so: SchedulerOutput, states: list[RequestState]) -> list[tuple[int, RequestState]]:
        """Creates this step's forked samples: (index of the parent in the batch, child state)."""
        index = {s.req_id: i for i, s in enumerate(states)}
        out = []
        for f in so.forked_reqs:
            i = index[f.parent_id]
            parent = states[i]
            child = RequestState(
                req_id=f.req_id,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                block_ids=list(f.block_ids),
                num_computed_tokens=len(parent.token_ids),
                sampling_params=f.sampling_params,
                eos_token_ids=parent.eos_token_ids,
            )
            if f.sampling_params.seed is not None and f.req_id not in self.generators:
                self.generators[f.req_id] = torch.Generator().manual_seed(f.sampling_params.seed)
            self.requests[f.req_id] = child
            out.append((i, child))
        return out

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        self._move_blocks(so)
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        if not states:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        batch = build_batch(
            states,
            list(so.num_scheduled_tokens.values()),
            self.block_size,
            self.model_config.sliding_window,
            build_groups=self.native_kernel is None,
            query_tile=QUERY_TILE,
        )
        md = self._attention_metadata(batch)
        with set_attention_metadata(md):
            hidden = self.model(torch.from_numpy(batch.input_ids), torch.from_numpy(batch.positions))  # type: ignore[misc]

        # Rows to sample: each request that completes its tokens, then each forked sample, which
        # samples from its parent's row with its own parameters and generator.
        forks = self._fork(so, states)
        row_of = {int(i): int(r) for i, r in zip(batch.sample_req_indices, batch.sample_rows)}
        sample_states = [states[i] for i in batch.sample_req_indices] + [child for _, child in forks]
        sample_rows = [int(r) for r in batch.sample_rows] + [row_of[i] for i, _ in forks]
        new_tokens: dict[str, list[int]] = {}
        logprobs: dict[str, Logprobs] = {}
        if sample_states:
            rows_t = torch.tensor(sample_rows, dtype=torch.long)
            logits = self.model.compute_logits(hidden[rows_t])  # type: ignore[union-attr]
            rows = [
                SamplingRow(
                    params=state.sampling_params,
                    generator=self.generators.get(state.req_id),
                    prompt_token_ids=state.prompt_token_ids,
                    output_token_ids=state.output_token_ids,
                    eos_token_ids=state.eos_token_ids,
                )
                for state in sample_states
            ]
            md_s = SamplingMetadata.from_rows(rows, logits.shape[-1], self.device)
            result = self.sampler(logits, md_s)
            tokens = result.sampled_token_ids.tolist()
            for j, state in enumerate(sample_states):
                state.token_ids.append(tokens[j])
                new_tokens[state.req_id] = [tokens[j]]
                k = state.sampling_params.logprobs
                if k is not None and result.logprobs is not None:
                    logprobs[state.req_id] = Logprobs(
                        token_ids=[result.logprob_token_ids[j, : k + 1].tolist()],
                        logprobs=[result.logprobs[j, : k + 1].tolist()],
                        ranks=[int(result.sampled_token_ranks[j])],
                    )

        prompt_logprobs: dict[str, Logprobs] = {}
        for rid, rows_np, targets, k in self._prompt_logprob_rows(states, batch):
            plogits = self.model.compute_logits(hidden[torch.from_numpy(rows_np)])  # type: ignore[union-attr]
            ids, lps, ranks = compute_topk_logprobs(plogits, torch.from_numpy(targets), k)
            prompt_logprobs[rid] = Logprobs(token_ids=ids.tolist(), logprobs=lps.tolist(), ranks=ranks.tolist())

        for state, n in zip(states, so.num_scheduled_tokens.values()):
            state.num_computed_tokens += n
        for i, child in forks:  # the parent computed the prompt: its prompt logprobs are done
            self.prompt_logprobs_done[child.req_id] = self.prompt_logprobs_done.get(states[i].req_id, 0)
        out_ids = req_ids + [child.req_id for _, child in forks]
        return ModelRunnerOutput(
            req_ids=out_ids,
            sampled_token_ids=[new_tokens.get(r, []) for r in out_ids],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
