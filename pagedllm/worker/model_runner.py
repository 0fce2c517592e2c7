"""Turns a SchedulerOutput into tensors, runs the model, samples: the only place that does so."""

from __future__ import annotations

import logging
import math
import mmap
import time

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
from pagedllm.worker.input_batch import BatchArrays, RequestState, build_batch
from pagedllm.worker.sampler import Sampler, SamplingMetadata, SamplingRow, compute_topk_logprobs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Default KV budget: this share of the memory available after loading, at most this many bytes.
_DEFAULT_KV_FRACTION = 0.3
_DEFAULT_KV_MAX_BYTES = 4 << 30


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
        self._kv_buffers: list[mmap.mmap] = []
        self.num_blocks = 0
        # The native CPU attention kernel serves float32; other dtypes use the torch backend.
        self.native_kernel = load_kernel() if self.dtype == torch.float32 else None

    # ---- set-up ---------------------------------------------------------------------------
    def load_model(self) -> None:
        mc = self.model_config
        t0 = time.perf_counter()
        cls = get_model_class(mc.hf_config)
        with torch.device(self.device):
            model = cls(mc.hf_config, dtype=self.dtype)
        source = ModelSource(kind=mc.kind, path=mc.path, name=mc.served_model_name)  # type: ignore[arg-type]
        model.load_weights(iterate_weights(source))
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

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
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

        sampled: list[list[int]] = [[] for _ in states]
        logprobs: dict[str, Logprobs] = {}
        sample_idx = batch.sample_req_indices
        if len(sample_idx):
            logits = self.model.compute_logits(hidden[torch.from_numpy(batch.sample_rows)])  # type: ignore[union-attr]
            rows = [
                SamplingRow(
                    params=states[i].sampling_params,
                    generator=self.generators.get(states[i].req_id),
                    prompt_token_ids=states[i].prompt_token_ids,
                    output_token_ids=states[i].output_token_ids,
                    eos_token_ids=states[i].eos_token_ids,
                )
                for i in sample_idx
            ]
            md_s = SamplingMetadata.from_rows(rows, logits.shape[-1], self.device)
            result = self.sampler(logits, md_s)
            tokens = result.sampled_token_ids.tolist()
            for j, i in enumerate(sample_idx):
                state = states[i]
                state.token_ids.append(tokens[j])
                sampled[i] = [tokens[j]]
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
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs
        )
