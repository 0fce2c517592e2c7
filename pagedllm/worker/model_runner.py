"""Turns a SchedulerOutput into tensors, runs the model, samples: the only place that does so.

A step is prepared (request states, KV block moves, the batch's arrays), runs on the one forward
path ForwardPaths.select_path picks for it (worker/forward/), is sampled, and is returned as a
ModelRunnerOutput. The KV cache and swap pool live in worker/kv_memory.py, the preemption cost
measurements in worker/preemption_cost.py.
"""

from __future__ import annotations

import logging
import mmap
import time
from typing import Any

import numpy as np
import torch

from pagedllm import envs
from pagedllm.attention.backend import TritonAttentionBackend, select_attention_backend
from pagedllm.attention.cpu_kernel import dense_thresholds
from pagedllm.attention.metadata import ForwardContext
from pagedllm.config import CacheConfig, DeviceConfig, LoRAConfig, ModelConfig
from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.core.scheduler_output import Logprobs, ModelRunnerOutput, SchedulerOutput
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import Linear
from pagedllm.layers.native_linear import amx_rows_from
from pagedllm.utils import tune_heap
from pagedllm.worker import device as dev
from pagedllm.worker import preemption_cost
from pagedllm.worker.cuda_graph import CudaGraphRunner
from pagedllm.worker.draft_runner import DraftRunner
from pagedllm.worker.forward import (
    CudaGraphPath,
    EagerPath,
    ForwardPaths,
    NativeDecodePath,
    NativeHeadPath,
    PipelinePath,
    PreparedStep,
)
from pagedllm.worker.input_batch import BatchArrays, InputBatch, token_rows
from pagedllm.worker.kv_memory import KVMemory
from pagedllm.worker.model_load import build_model
from pagedllm.worker.native_decode import NativeDecode
from pagedllm.worker.spec_decode import SpecRows, alone_rows, split_spec_rows, verifies_only, verify_step
from pagedllm.worker.pooler import Pooler
from pagedllm.worker.sample import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_grammar_bitmask,
    compute_topk_logprobs,
    sample_isolating_faults,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# A step's samples: (req_ids of the output, each one's sampled tokens, logprobs, failed requests).
_Sampled = tuple[list[str], list[list[int]], dict[str, Logprobs], dict[str, str]]


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
        lora_config: LoRAConfig | None = None,
        draft_config: ModelConfig | None = None,
        speculative: bool = False,
    ) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        self.lora: Any = None  # the LoRA slots and adapters (pagedllm/lora/manager.py), with --enable-lora
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
        self.speculative = speculative or draft_config is not None  # any method (see execute_model)
        self._cuda_graphs: CudaGraphRunner | None = None
        # Small decode-only steps as one native call (CPU; set once the KV cache exists).
        self._native_decode: NativeDecode | None = None
        self._static_sampling: tuple[tuple[int, int, bytes], SamplingMetadata] | None = None
        self.generators: dict[str, torch.Generator] = {}
        # req_id -> prompt positions whose prompt logprobs were already returned; kept across a
        # recompute preemption so the recomputed prompt does not return them a second time.
        self.prompt_logprobs_done: dict[str, int] = {}
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.kv = KVMemory(model_config, cache_config, self.device_config, self.kv_dtype, self.device)
        # The requests this worker holds, in preallocated arrays updated as they change.
        self.input_batch = InputBatch(model_config.max_model_len, self.block_size,
                                      num_kv_groups=self.kv.groups.num_groups)
        self._weight_arena: mmap.mmap | None = None  # holds the weights where huge pages are offered
        # Chosen once; bound with this runner's forward context to every attention layer. Triton
        # attention on the GPU (and, for tests, on the CPU under Triton's interpreter); on the CPU
        # the native kernel (every dtype and KV cache dtype), or the torch reference where it
        # cannot be compiled.
        triton = self.is_cuda or envs.PAGEDLLM_ATTENTION_BACKEND == "triton"
        self.attn_backend = select_attention_backend(
            triton=triton, block_size=self.block_size,
            num_queries_per_kv=model_config.num_heads // model_config.num_kv_heads)
        self.forward_context = ForwardContext()
        # How the input batch lays out attention work for this backend (fixed once it is chosen):
        # with the native CPU kernel, prompt chunks past dense_thresholds attend densely (the
        # native bf16 or fp32 flash kernel, or torch's flash attention for long chunks).
        native = self.attn_backend.native is not None
        dense_tokens, dense_pairs = dense_thresholds(self.dtype, self.kv_dtype, model_config.head_dim) if native else (0, 0)
        self.batch_options: dict[str, Any] = {
            "build_groups": self.attn_backend.needs_groups, "query_tile": self.attn_backend.query_tile,
            "dense_min_tokens": dense_tokens, "dense_min_pairs": dense_pairs,
        }
        # Steps of decodes and verifications only (spec_decode.verifies_only): native work items of one token.
        self.token_options = {**self.batch_options, "query_tile": 1} if native else self.batch_options
        # The forward paths, built once the model is loaded (see _build_paths).
        self.paths: ForwardPaths | None = None
        self.pooler = Pooler(None)  # pooling requests' hidden states (worker/pooler.py)
        # Speculative method draft_model: the draft model, its KV cache and passes (worker/draft_runner.py).
        self.draft = (DraftRunner(draft_config, cache_config, self.device_config, self.dtype, self.kv_dtype,
                                  self.device, self.input_batch) if draft_config is not None else None)
        if self.draft is not None and (self.kv.groups.num_groups != 1 or self.kv.groups.windows[0]):
            raise ValueError(f"speculative method 'draft_model' needs a target whose KV keeps every position "
                             f"({self.kv.groups.describe()})")

    @property
    def native_kernel(self) -> Any:
        """The compiled CPU attention kernel the backend calls, or None."""
        return self.attn_backend.native

    @property
    def triton_attention(self) -> bool:
        return isinstance(self.attn_backend, TritonAttentionBackend)

    @property
    def native_decode(self) -> NativeDecode | None:
        """The fused decode step (CPU), or None; setting it (None: the torch path) rebuilds the paths."""
        return self._native_decode

    @native_decode.setter
    def native_decode(self, nd: NativeDecode | None) -> None:
        self._native_decode = nd
        self._build_paths()

    @property
    def cuda_graphs(self) -> CudaGraphRunner | None:
        """The captured decode graphs (GPU), or None; setting them rebuilds the paths."""
        return self._cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, graphs: CudaGraphRunner | None) -> None:
        self._cuda_graphs = graphs
        self._build_paths()

    # The KV cache and swap pool (kv_memory.KVMemory).
    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.kv.kv_caches

    @property
    def swap_caches(self) -> list[torch.Tensor]:
        return self.kv.swap_caches

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def num_swap_blocks(self) -> int:
        return self.kv.num_swap_blocks

    # ---- set-up ---------------------------------------------------------------------------
    def load_model(self) -> None:
        mc = self.model_config
        t0 = time.perf_counter()
        model, self._weight_arena = build_model(mc, self.dtype, self.device, self.parallel)
        if self.lora_config is not None:
            from pagedllm.lora.manager import LoRAManager

            self.lora = LoRAManager(model, self.lora_config, self.dtype, self.device, triton=self.triton_attention)
        attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        for layer in attn_layers:
            layer.context, layer.backend = self.forward_context, self.attn_backend
        self.kv.bind(attn_layers)
        self.model = model
        self.pooler.model = model
        self._build_paths()
        if self.draft is not None:
            self.draft.load()
            self.kv.extra_bytes_per_block = self.draft.bytes_per_block()
        n_params = parameter_count(model)
        logger.info(
            "Loaded %s (%s, %.1fM parameters, %s) in %.1f s",
            mc.served_model_name,
            type(model).__name__,
            n_params / 1e6,
            mc.dtype,
            time.perf_counter() - t0,
        )

    def _build_paths(self) -> None:
        """The forward paths of this runner's model, parallel layout, CUDA graphs and native step."""
        if self.model is None:
            return
        eager = EagerPath(self.model, self.forward_context, self.attn_backend, self.device, self.model_config)
        if self.parallel.pp_size > 1:
            pipeline = PipelinePath(eager, self.parallel, self.input_batch, self.model_config.sliding_window,
                                    self.batch_options, int(self.model_config.hf_config.hidden_size), self.dtype)
            self.paths = ForwardPaths(eager, pipeline=pipeline)
            return
        nd = self._native_decode
        native = NativeDecodePath(nd, eager) if nd is not None else None
        if self._cuda_graphs is not None:
            graph = CudaGraphPath(self._cuda_graphs, ForwardPaths(eager, native=native))
            self.paths = ForwardPaths(eager, cuda_graph=graph)
            return
        head = None
        if native is not None:
            head = NativeHeadPath(nd, native, self.input_batch, self._sampling_metadata,  # type: ignore[arg-type]
                                  self.model, self.device)
        self.paths = ForwardPaths(eager, native=native, native_head=head)

    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token on this rank: its stage's layers and its KV heads."""
        return self.kv.bytes_per_token()

    def determine_num_blocks(self) -> int:
        return self.kv.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv.allocate(num_blocks)
        if self.draft is not None:
            self.draft.allocate(num_blocks)
        if getattr(self.model, "pooling_only", False):
            return  # no decode steps: neither CUDA graphs nor the fused native decode step
        single = self.kv.groups.num_groups == 1  # the graphs read one block table; the fused step each group's
        if not single and self.device_config.use_cuda_graphs:
            logger.info("KV cache in %s: no CUDA graphs", self.kv.groups.describe())
        if self.device_config.use_cuda_graphs and single:
            self.capture_cuda_graphs()
        if not self.is_cuda and self.native_kernel is not None:
            self.native_decode = NativeDecode.create(
                self.model, self.kv_caches, self.dtype, self.kv_dtype,  # type: ignore[arg-type]
                self.block_size, self.model_config.sliding_window, self.kv.groups)

    def capture_cuda_graphs(self) -> None:
        """Decode-only steps at the configured padded batch sizes, captured once (GPU only)."""
        from pagedllm.attention.triton_attention import choose_num_splits

        mc = self.model_config
        sizes = self.device_config.cuda_graph_sizes
        sms = dev.num_sms(self.device)
        graphs = CudaGraphRunner(
            self.model,  # type: ignore[arg-type]
            sizes,
            max_blocks_per_seq=-(-mc.max_model_len // self.block_size),
            sliding_window=mc.sliding_window or 0,
            num_splits={b: choose_num_splits(b, mc.num_kv_heads, mc.max_model_len, sms) for b in sizes},
            device=self.device,
            context=self.forward_context,
            lora=self.lora if self.lora is not None and self.lora.triton else None)  # its kernels captured too
        graphs.capture()
        self.cuda_graphs = graphs

    def determine_num_swap_blocks(self) -> int:
        """Blocks that fit in `swap_space` GiB of host memory."""
        return self.kv.determine_num_swap_blocks()

    def initialize_swap_space(self, num_swap_blocks: int) -> None:
        for kv in self._kv_memories():
            kv.allocate_swap(num_swap_blocks)

    def _kv_memories(self) -> tuple[KVMemory, ...]:
        """The caches a block id names: the model's, and a speculative draft model's beside it."""
        return (self.kv,) if self.draft is None else (self.kv, self.draft.kv)

    def flops_per_token(self) -> float:
        """Linear-layer work of one token through the decoder layers (2 FLOPs per weight)."""
        assert self.model is not None
        return preemption_cost.flops_per_token(self.model)

    def measure_preemption_rates(self) -> tuple[float, float]:
        """(FLOP/s of a prefill-sized matmul, bytes/s of swapping KV blocks out and back in), run
        once at startup for preemption mode auto."""
        return preemption_cost.measure_preemption_rates(
            self.kv, int(self.model_config.hf_config.hidden_size), self.dtype)

    # ---- per step -------------------------------------------------------------------------
    @property
    def requests(self) -> dict[str, int]:
        """The requests this worker holds: req_id -> its row in the persistent batch."""
        return self.input_batch.req_index

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        amx_rows_from(alone_rows(so) if self.speculative else 0)  # bf16 on AMX: rows as a step without proposals
        step = self._prepare(so)
        if step is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        paths = self.paths
        # A step with pooling requests takes a path that returns every token's hidden state.
        pooling = bool(self.pooler.states) and self.pooler.in_step(step)
        path = (paths.pipeline or paths.eager) if pooling else paths.select_path(step)  # type: ignore[union-attr]
        out = path.run(step)
        if so.spec_token_ids:  # the proposals were inputs only: the sampler appends what it keeps
            self._drop_proposals(so)
        forks = self._fork(so, step.rows)
        if out is None:  # an earlier pipeline stage: the next stage carries on
            self._advance(step, forks)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        hidden = None if path.head else out
        pooled = self.pooler.pool(step, out, self.input_batch.num_tokens[step.rows]) if pooling else None
        sampled = self._sample(step, forks, out if path.head else None, hidden)
        if step.lora and self.lora.step.failed:  # requests whose adapter could not be read fail alone
            sampled[3].update(self.lora.step.failed)
        result = self._output(step, forks, hidden, sampled)
        if pooled:
            result.pooled = pooled
        if self.draft is not None:
            self.draft.after_step(result)
        return result

    def _prepare(self, so: SchedulerOutput) -> PreparedStep | None:
        """The scheduler's changes applied to the persistent batch, this step's KV block moves
        done, and the scheduled requests' arrays; None when nothing is scheduled."""
        self._update_states(so)
        if so.blocks_to_swap_out or so.blocks_to_swap_in or so.blocks_to_copy:
            for kv in self._kv_memories():
                kv.move_blocks(so.blocks_to_swap_out, so.blocks_to_swap_in, so.blocks_to_copy)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return None
        rows = self.input_batch.rows_of(req_ids)
        counts = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        if self.draft is not None:  # its proposals replace the scheduler's placeholders
            self.draft.propose(so, req_ids, rows, counts)
        if so.spec_token_ids:  # proposals follow the last token, as known tokens for this step's layout
            for rid, proposals in so.spec_token_ids.items():
                self.input_batch.extend_tokens(self.input_batch.req_index[rid], proposals)
        tokens = verifies_only(so)  # each token attends alone, in the decode form, as without proposals
        batch = self.input_batch.prepare(rows, counts, self.model_config.sliding_window,
                                         **(self.token_options if tokens else self.batch_options))
        lora = self.lora is not None and self.lora.prepare(req_ids, batch.query_start_loc)
        step = PreparedStep(so, req_ids, rows, counts, batch, lora=lora,
                            lora_slots=self.lora.step.token_slots if lora else None)
        if tokens and self._native_decode is not None and not lora and not batch.kv_groups:
            step.token_rows = token_rows(batch)  # the native step takes each token as a row
        return step

    def _drop_proposals(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        for rid, proposals in so.spec_token_ids.items():
            ib.num_tokens[ib.req_index[rid]] -= len(proposals)

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
            if self.lora is not None:
                self.lora.remove_request(rid)
        for rid in so.finished_req_ids - so.preempted_req_ids:
            self.generators.pop(rid, None)
            self.prompt_logprobs_done.pop(rid, None)
            self.pooler.drop(rid)
        for new in so.new_reqs:
            if new.pooling is not None:
                self.pooler.add(new.req_id, new.pooling, new.num_computed_tokens)
            params = new.sampling_params
            ib.add(new.req_id, list(new.prompt_token_ids) + list(new.output_token_ids), len(new.prompt_token_ids),
                   new.block_ids, new.num_computed_tokens, params, self._generator(new.req_id, params),
                   new.eos_token_ids)
            if self.lora is not None:
                self.lora.add_request(new.req_id, new.lora_request)
        index = ib.req_index
        for cached in so.cached_reqs:
            i = index[cached.req_id]
            for j, block_id in cached.replaced_block_ids:  # copy-on-write: its private copy
                ib.block_table[i, j] = block_id
            if cached.num_blocks >= 0:  # blocks of rejected proposals, freed
                ib.truncate_blocks(i, cached.num_blocks)
            ib.append_blocks(i, cached.new_block_ids)
            ib.num_computed_tokens[i] = cached.num_computed_tokens

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
            if self.lora is not None:
                self.lora.fork(f.parent_id, f.req_id)
            out.append((index[parent], child))
        return out

    def _advance(self, step: PreparedStep, forks: list[tuple[int, int]]) -> None:
        ib = self.input_batch
        rows = step.rows
        ib.num_computed_tokens[rows] += step.counts
        for i, child in forks:  # the parent computed the prompt: its prompt logprobs are done
            self.prompt_logprobs_done[ib.req_ids[child]] = self.prompt_logprobs_done.get(ib.req_ids[rows[i]], 0)

    def record_sampled(self, out: ModelRunnerOutput) -> None:
        """On ranks that do not sample: appends the driver's tokens of the previous step."""
        ib = self.input_batch
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids):
            i = ib.req_index.get(rid)
            if i is not None and tokens:
                ib.extend_tokens(i, tokens)

    def _sampling_metadata(self, rows: np.ndarray, vocab_size: int) -> SamplingMetadata:
        """Sampling tensors for these rows: the parameter part is reused while the same rows hold
        the same requests (a plain greedy batch then costs nothing per step)."""
        ib = self.input_batch
        key = (ib.version, vocab_size, rows.tobytes())
        if self._static_sampling is None or self._static_sampling[0] != key:
            self._static_sampling = (key, SamplingMetadata.static_from_batch(ib, rows, vocab_size, self.device))
        return self._static_sampling[1].with_token_state(ib, rows, self.device)

    def _sample(self, step: PreparedStep, forks: list[tuple[int, int]], head: torch.Tensor | np.ndarray | None,
                hidden: torch.Tensor | None) -> _Sampled:
        """Samples each request that completes its tokens, then each forked sample (from its
        parent's row, with its own parameters and generator), from `hidden` through the LM head,
        or from a head path's output `head` (logits, or greedy token ids). Their tokens go into
        the persistent batch."""
        ib = self.input_batch
        batch = step.batch
        sample_req, sample_rows = batch.sample_req_indices, batch.sample_rows
        spec = spec_head = None
        if step.so.spec_token_ids:  # speculating requests are verified on their own (below)
            spec, others = split_spec_rows(step.so.spec_token_ids, step.req_ids, step.rows, sample_req, sample_rows)
            sample_req, sample_rows = sample_req[others], sample_rows[others]
            if head is not None:  # the head path gave every flat row's token ids or logits
                spec_head, head = head, head[sample_rows if isinstance(head, np.ndarray) else torch.from_numpy(sample_rows)]
        sample_slots = step.rows[sample_req]
        if forks:
            parents = np.asarray([i for i, _ in forks], dtype=np.int64)
            sample_slots = np.concatenate([sample_slots, np.asarray([c for _, c in forks], dtype=np.int64)])
            sample_rows = np.concatenate([sample_rows, batch.query_start_loc[parents + 1] - 1])
        out_ids = step.req_ids + [ib.req_ids[c] for _, c in forks]
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
        out_pos = sample_req.tolist() + list(range(len(step.req_ids), len(out_ids)))
        if (step.so.grammar_bitmask is not None and len(sample_slots) and self.parallel.is_driver
                and not step.grammar_masked):
            self._apply_grammar(logits, step.so, [out_ids[p] for p in out_pos])
        if isinstance(head, np.ndarray) and len(sample_slots):  # greedy rows, nothing else: the native call's argmax
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
        if spec is not None:
            self._verify(spec, hidden, spec_head, out_ids, sampled, logprobs, failed)
        return out_ids, sampled, logprobs, failed

    def _verify(self, spec: SpecRows, hidden: torch.Tensor | None, head: torch.Tensor | np.ndarray | None,
                out_ids: list[str], sampled: list[list[int]], logprobs: dict[str, Logprobs],
                failed: dict[str, str]) -> None:
        """The speculating requests' proposals verified against the target's logits at their
        positions (worker/spec_decode.py), or against its argmax there where the head path gave
        token ids (`head`, indexed by flat row): each keeps its accepted proposals and one token more."""
        res = verify_step(self.model, self.sampler, self.input_batch, spec, hidden, head, self.device,
                          self.parallel.is_driver)
        if res is None:
            return
        kept, errors, lps = res
        for i, err in errors.items():
            failed[out_ids[spec.out_pos[i]]] = err
        for i, lp in lps.items():
            logprobs[out_ids[spec.out_pos[i]]] = lp
        for i, tokens in enumerate(kept):
            if tokens is not None:
                self.input_batch.extend_tokens(int(spec.slots[i]), tokens)
                sampled[spec.out_pos[i]] = tokens

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, so: SchedulerOutput, row_ids: list[str]) -> None:
        """Masks the logits of the constrained rows (`row_ids`: the request of each logits row)."""
        rows = so.structured_rows
        hits = [(j, rows[rid]) for j, rid in enumerate(row_ids) if rid in rows]
        if hits:
            apply_grammar_bitmask(logits, so.grammar_bitmask, [j for j, _ in hits], [m for _, m in hits])

    def _output(self, step: PreparedStep, forks: list[tuple[int, int]], hidden: torch.Tensor | None,
                sampled: _Sampled) -> ModelRunnerOutput:
        """The step's prompt logprobs (from `hidden`), the batch advanced past its tokens, and the
        runner's output."""
        prompt_logprobs: dict[str, Logprobs] = {}
        for rid, rows_np, targets, k in self._prompt_logprob_rows(step.rows, step.batch):
            plogits = self.model.compute_logits(hidden[torch.from_numpy(rows_np).to(self.device)])  # type: ignore[union-attr, index]
            if not self.parallel.is_driver:
                continue
            ids, lps, ranks = compute_topk_logprobs(plogits, torch.from_numpy(targets).to(self.device), k)
            prompt_logprobs[rid] = Logprobs(token_ids=ids.tolist(), logprobs=lps.tolist(), ranks=ranks.tolist())
        self._advance(step, forks)
        out_ids, tokens, logprobs, failed = sampled
        return ModelRunnerOutput(
            req_ids=out_ids,
            sampled_token_ids=tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            failed=failed,
        )

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
