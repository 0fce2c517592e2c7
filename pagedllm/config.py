"""Typed configs, validated once at construction and never mutated afterwards. No torch here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from typing import Any

SCHEDULING_POLICIES = ("fcfs", "priority", "srtf", "fair")
PREEMPTION_MODES = ("recompute", "swap", "auto")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
EXECUTOR_BACKENDS = ("mp", "ray", "external_launcher")
# KV cache element types (vLLM's names; "fp8" means fp8_e4m3); "auto" is the model dtype.
KV_CACHE_DTYPES = ("auto", *DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
QUANTIZATION_METHODS = ("int8", "w8a8", "int4", "fp8", "awq", "gptq", "gguf", "compressed-tensors")
# Checkpoint quantizations applied without a flag (a GGUF file runs expanded unless --quantization gguf).
STORED_QUANTIZATION = ("awq", "gptq", "fp8", "compressed-tensors")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
EMBEDDING_QUANTIZATION_METHODS = ("int8", "w8a8", "int4", "fp8", "gguf")
"""Schemes under which the token embedding and LM head may be kept as codes too."""
# --quantization-skip preset: keep attention (q/k/v/o projections) in the model dtype.
SKIP_PRESETS = {"attention": ("*.self_attn.*",)}


RUNNERS = ("generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
ENCODER_MODEL_TYPES = ("bert",)
"""config.json model types that are bidirectional encoders (no KV cache, whole prompts, pooling only)."""


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into its output (vLLM's --pooler-config)."""

    pooling_type: str = "LAST"
    """LAST (the last token's hidden state), MEAN (the mean over the prompt), CLS (the first
    token's) or ALL (every token's)."""
    normalize: bool = True
    """Scale each embedding to unit L2 norm (after any `dimensions` truncation)."""
    dimensions: int | None = None
    """Keep the first `dimensions` values of each embedding (Matryoshka truncation); None: all."""
    activation: bool = True
    """Classifiers: apply the head's activation (sigmoid for one label, softmax for several)."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")


def read_json_object(text: Any, cls: type, example: str) -> dict[str, Any]:
    """A JSON config flag's value (vLLM's form: a JSON object, or a dict from Python) whose keys are
    fields of the dataclass `cls`; ValueError naming bad JSON (with `example`) or unknown keys."""
    if isinstance(text, str):
        import json

        try:
            text = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"cannot read {text!r} as JSON, e.g. {example} ({e})") from None
    if not isinstance(text, dict):
        raise ValueError(f"must be a JSON object, got {text!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(text) - known)
    if unknown:
        raise ValueError(f"unknown keys {unknown} (known: {sorted(known)})")
    return dict(text)


def _check_at_least(config: Any, minimum: int, *names: str) -> None:
    """ValueError naming the first of the fields `names` of `config` below `minimum`."""
    for name in names:
        value = getattr(config, name)
        if value < minimum:
            bound = "non-negative" if minimum == 0 else f"at least {minimum}"
            raise ValueError(f"{name} must be {bound}, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is laid out and sized."""

    block_size: int = 16
    """Tokens per KV cache block."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache; None picks a default from the machine's free memory."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks (overrides kv_cache_memory)."""
    enable_prefix_caching: bool = True
    """Reuse cached KV blocks across requests that share a prefix."""
    swap_space: float = 4.0
    """GiB of host memory for blocks of swapped-out requests (preemption mode swap/auto)."""
    calculate_kv_scales: bool = False
    """fp8 KV cache: set each layer's K and V scales from the first batch's absolute maxima
    (otherwise 1.0)."""
    disable_hybrid_kv_cache_manager: bool = False
    """Keep every block of every layer for the whole sequence, sliding-window layers too (by default
    the layers of each sliding window form their own groups, whose blocks that fall wholly outside
    the window are freed: core/kv_groups.py)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}")


SERVE_MAX_NUM_SHARED_PREFILL_TOKENS = 1024
"""The server's prompt-token cap of a shared step (`--max-num-shared-prefill-tokens` not given to
`pagedllm serve`). Chat clients wait for first tokens; an offline batch waits for its last one, so
offline engines (`LLM`, `run-batch`, `bench throughput`) keep the whole budget (0). Measured with
guidellm's 16 chat streams (docs/scheduling.md): mean time to first token 0.71-0.74 s with 1024
against 0.91-0.98 s uncapped, at 239 against 239-273 output tok/s; 512 gives 0.66-0.75 s but
205-224 tok/s. The 128-request offline workload loses 12 % of its output rate under a cap of 512."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How each step's token budget is shared among requests."""

    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens plus prompt chunks)."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_model_len: int = 8192
    """Longest sequence (prompt plus output) a request may reach."""
    policy: str = "fcfs"
    """Order of service: fcfs, priority, srtf or fair."""
    preemption_mode: str = "recompute"
    """What happens to a request evicted for lack of blocks: recompute (drop its blocks), swap
    (move them to the host pool; recompute when the pool is full) or auto (the cheaper of the two
    per victim, from FLOP/s and copy bandwidth measured at startup)."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prompt chunk per step (0 = no cap beyond the budget)."""
    max_num_partial_prefills: int = 0
    """Most requests with unfinished prompts scheduled in one step (0 = no limit)."""
    max_num_shared_prefill_tokens: int = 0
    """Prompt tokens one step may carry when more than one request shares it (0 = the whole
    budget). Decode tokens come on top, within max_num_batched_tokens; a lone request is not
    capped. Small steps give a burst's first tokens sooner (core/step.py, docs/scheduling.md).
    `pagedllm serve` defaults to SERVE_MAX_NUM_SHARED_PREFILL_TOKENS; offline engines to 0."""
    time_slice: int = 64
    """Fair share: steps a running request keeps its place while requests of other users wait;
    then it yields to a waiting request of a less-served user."""
    user_weights: dict[str, float] = field(default_factory=dict)
    """Fair share: weight per user (default 1)."""
    max_waiting_steps: int = 10_000
    """Aging: a request that has waited (or stayed swapped) this many steps is served before every
    other one and is no longer preempted for younger ones (bound in pagedllm/core/policies.py)."""

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "max_num_batched_tokens", "max_num_seqs", "max_model_len")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _check_at_least(self, 0, "long_prefill_token_threshold", "max_num_partial_prefills",
                        "max_num_shared_prefill_tokens")
        _check_at_least(self, 1, "time_slice", "max_waiting_steps")
        for user, w in self.user_weights.items():
            if not w > 0:
                raise ValueError(f"user weight must be positive, got {w} for user {user!r}")


@dataclass(frozen=True)
class QuantizationConfig:
    """How linear weights are kept: scheme, group size and the layers left in the model dtype."""

    method: str
    """int8, w8a8, int4, fp8 (quantized from a float checkpoint at load; an FP8 checkpoint's own
    codes), awq, gptq, gguf or compressed-tensors (as stored)."""
    group_size: int = 128
    """Inputs per scale for int4."""
    skip: tuple[str, ...] = ()
    """Module-name globs (e.g. ``*.self_attn.*``) kept in the model dtype; the preset name
    ``attention`` stands for the attention projections."""
    clip_search: bool = False
    """int4: per group, search the clipping range that minimises the squared error."""
    embeddings: bool = False
    """Keep the token embedding and the LM head as codes too (int8/w8a8: int8 per 32 inputs; int4:
    4-bit groups; fp8: e4m3 per row; gguf: the file's blocks), with no dense copy."""
    lm_head: bool = False
    """Keep the LM head's codes in the scheme's layout too (int8/w8a8/gguf: int8 per 32 inputs;
    int4: 4-bit groups; fp8: e4m3 per row) beside its dense weight: decode-sized rows read the
    codes, larger calls and a tied token embedding the dense weight. Set for speculative
    decoding's quantized draft model (its passes read mostly the LM head otherwise)."""

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.method!r}")
        if self.group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(f"quantization group size must be one of {QUANTIZATION_GROUP_SIZES}, got {self.group_size}")
        for pattern in self.skip:
            if not pattern.strip():
                raise ValueError(f"quantization skip patterns must be non-empty globs, got {self.skip!r}")
        if self.embeddings and self.method not in EMBEDDING_QUANTIZATION_METHODS:
            raise ValueError(f"quantize_embeddings applies to quantization {EMBEDDING_QUANTIZATION_METHODS}, "
                             f"not {self.method!r}")
        if self.lm_head and (self.embeddings or self.method not in EMBEDDING_QUANTIZATION_METHODS):
            raise ValueError(f"lm_head codes apply to quantization {EMBEDDING_QUANTIZATION_METHODS} without "
                             f"quantize_embeddings, not {self.method!r} with embeddings={self.embeddings}")

    @property
    def skip_globs(self) -> tuple[str, ...]:
        """``skip`` with preset names expanded."""
        return tuple(g for p in self.skip for g in SKIP_PRESETS.get(p, (p,)))


@dataclass(frozen=True)
class ModelConfig:
    """The model to run, resolved from a folder, a .gguf file or the embedded default."""

    model: str
    """What the user named (path or the default model's name)."""
    kind: str
    """'hf' (config.json + safetensors folder) or 'gguf'."""
    path: str
    """The folder or .gguf file the weights come from."""
    served_model_name: str
    """Name reported to API clients."""
    hf_config: Any
    """The transformers PretrainedConfig describing the architecture."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16."""
    kv_cache_dtype: str = ""
    """Element type of the KV cache: float32, bfloat16, float16, fp8_e4m3 or fp8_e5m2 ("" or
    auto: the compute dtype; fp8: fp8_e4m3)."""
    max_model_len: int = 8192
    """Longest sequence (prompt + output) accepted."""
    eos_token_ids: frozenset[int] = frozenset()
    """Token ids that end generation unless ignore_eos."""
    seed: int = 0
    """Seed of the engine's default random generator (unseeded requests)."""
    tokenizer: str | None = None
    """Tokenizer folder, when it differs from the model's."""
    load_format: str = "auto"
    """'auto' reads the weights from `path`; 'dummy' fills them with small random values (benchmarks
    of a model shape from its config.json alone)."""
    quantization: QuantizationConfig | None = None
    """Quantized linear layers, or None for weights in the model dtype."""
    runner: str = "generate"
    """'generate' (sampling) or 'pooling' (embeddings, scores: prompts in, pooled hidden states out)."""
    pooler_config: PoolerConfig | None = None
    """Pooling requests' defaults (pooling type, normalisation, dimensions): the pooling runner's, and a
    generate-runner decoder's (LAST, normalised, unless --pooler-config says otherwise)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.kv_cache_dtype not in ("", *KV_CACHE_DTYPES):
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        kv = {"": self.dtype, "auto": self.dtype, "fp8": "fp8_e4m3"}.get(self.kv_cache_dtype, self.kv_cache_dtype)
        object.__setattr__(self, "kv_cache_dtype", kv)  # resolved once, at construction

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder (BERT family): pooling only, whole prompts, no KV cache kept."""
        return getattr(self.hf_config, "model_type", None) in ENCODER_MODEL_TYPES

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.hf_config, "head_dim", None) or self.hf_config.hidden_size // self.num_heads)

    @property
    def sliding_window(self) -> int | None:
        """The window every layer shares, or None: no window, or one that only some layers have
        (Gemma 3's `layer_types` mixes sliding and full attention; those layers carry their own)."""
        window = getattr(self.hf_config, "sliding_window", None) or None
        layer_types = getattr(self.hf_config, "layer_types", None)
        if window and layer_types and any(t != "sliding_attention" for t in layer_types):
            return None
        return window

    def layer_windows(self) -> list[int]:
        """Each layer's sliding window (0: full attention), as the model's attention layers apply it."""
        return layer_sliding_windows(self.hf_config)

    def kv_bytes_per_token(self) -> int:
        if self.is_encoder:
            return 0  # an encoder keeps no KV cache
        itemsize = KV_CACHE_ITEMSIZE[self.kv_cache_dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


SLIDING_ATTENTION, FULL_ATTENTION = "sliding_attention", "full_attention"


def attention_layer_types(hf_config: Any) -> list[str]:
    """Each layer's kind (Gemma 3): `layer_types`, else every `sliding_window_pattern`-th layer (6)
    global."""
    types = getattr(hf_config, "layer_types", None)
    n = int(hf_config.num_hidden_layers)
    if types:
        if len(types) != n or any(t not in (SLIDING_ATTENTION, FULL_ATTENTION) for t in types):
            raise ValueError(f"layer_types {list(types)} must name {SLIDING_ATTENTION!r} or {FULL_ATTENTION!r} "
                             f"for each of the {n} layers")
        return list(types)
    pattern = int(getattr(hf_config, "sliding_window_pattern", None) or 6)
    return [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n)]


# model_type of the families whose layers carry their own windows (models/gemma3.py).
PER_LAYER_WINDOW_TYPES = ("gemma3_text", "gemma3")


def layer_sliding_windows(hf_config: Any) -> list[int]:
    """Each layer's sliding window in tokens (0: full attention), as transformers applies it: per
    layer kind for the families of PER_LAYER_WINDOW_TYPES (their default pattern where the config
    has no `layer_types`); else `sliding_window` on the layers `layer_types` names
    `sliding_attention` (Qwen2 with use_sliding_window: those from max_window_layers on); else the
    model-wide `sliding_window` (Mistral) or none."""
    n = int(hf_config.num_hidden_layers)
    window = int(getattr(hf_config, "sliding_window", None) or 0)
    if getattr(hf_config, "model_type", None) in PER_LAYER_WINDOW_TYPES:
        return [window if t == SLIDING_ATTENTION else 0 for t in attention_layer_types(hf_config)]
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        if len(layer_types) != n:
            raise ValueError(f"layer_types names {len(layer_types)} layers, the model has {n}")
        return [window if t == SLIDING_ATTENTION else 0 for t in layer_types]
    return [window] * n


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs, and the GPU-only options."""

    device: str = "cpu"
    """'cpu' or 'cuda' (resolved from 'auto' by EngineArgs)."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's total memory this engine may use (weights, activations, KV cache)."""
    cuda_graph_sizes: tuple[int, ...] = ()
    """Batch sizes of decode-only steps captured as CUDA graphs; larger decode batches run eagerly,
    smaller ones are padded to the next size."""
    enforce_eager: bool = False
    """Never use CUDA graphs."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if any(s < 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive, got {list(self.cuda_graph_sizes)}")

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device == "cuda" and not self.enforce_eager and bool(self.cuda_graph_sizes)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over worker processes (ranks = tensor x pipeline)."""

    tensor_parallel_size: int = 1
    """Ranks that split each layer's heads and MLP columns/rows (two all-reduces per layer)."""
    pipeline_parallel_size: int = 1
    """Stages that split the layers; each stage is tensor_parallel_size ranks."""
    distributed_executor_backend: str = "mp"
    """How ranks are started: mp (worker processes on this host, supervised by the engine), ray
    (workers placed on a Ray cluster) or external_launcher (one engine per rank under torchrun)."""
    pipeline_layer_partition: tuple[int, ...] | None = None
    """Decoder layers per pipeline stage (sums to the model's layers); None splits evenly."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}"
            )
        part = self.pipeline_layer_partition
        if part is not None and (len(part) != self.pipeline_parallel_size or min(part) < 1):
            raise ValueError(
                f"pipeline_layer_partition {list(part)} must give at least one layer to each of the "
                f"{self.pipeline_parallel_size} pipeline stages"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_model(self, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
        """One ValueError naming the numbers when the model cannot be split this way."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if num_heads % tp:
            raise ValueError(
                f"the model's {num_heads} attention heads are not divisible by tensor_parallel_size={tp}"
            )
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"the model's {num_kv_heads} KV heads and tensor_parallel_size={tp}: one must divide the other"
            )
        if intermediate_size % tp:
            raise ValueError(
                f"the model's MLP size {intermediate_size} is not divisible by tensor_parallel_size={tp}"
            )
        if pp > num_layers:
            raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers")
        if self.pipeline_layer_partition is not None and sum(self.pipeline_layer_partition) != num_layers:
            raise ValueError(
                f"pipeline_layer_partition {list(self.pipeline_layer_partition)} sums to "
                f"{sum(self.pipeline_layer_partition)}, but the model has {num_layers} layers"
            )

    def stage_layers(self, num_layers: int, stage: int) -> tuple[int, int]:
        """[start, end) decoder layers of a pipeline stage: the partition, or an even split with the
        remainder on the first stages (30 layers, pp=4 -> 8, 8, 7, 7)."""
        pp = self.pipeline_parallel_size
        sizes = list(self.pipeline_layer_partition or [num_layers // pp + (i < num_layers % pp) for i in range(pp)])
        start = sum(sizes[:stage])
        return start, start + sizes[stage]


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Constrained decoding: which grammar library compiles the requests' structures, and the
    reasoning parser that tells the engine where a reasoning model's thinking ends (the structure
    applies to the answer after it)."""

    backend: str = "auto"
    """'xgrammar', 'guidance' (llguidance), or 'auto': xgrammar, and llguidance for what xgrammar
    cannot compile (a JSON schema feature it does not support)."""
    reasoning_parser: str | None = None
    """Name of the reasoning parser (deepseek_r1, qwen3), or None for a model that does not think."""
    enable_in_reasoning: bool = False
    """Constrain the thinking too (by default the structure starts after the thinking ends)."""

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(
                f"structured outputs backend must be one of {STRUCTURED_OUTPUT_BACKENDS}, got {self.backend!r}"
            )


LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoRAConfig:
    """Batched LoRA serving (docs/lora.md): adapters resident in one step, their padded rank, the
    adapters kept loaded in host memory, and their dtype."""

    max_loras: int = 1
    """Distinct adapters in one step (the layers' LoRA slots)."""
    max_lora_rank: int = 16
    """Largest adapter rank; every slot is padded to it."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory, least recently used dropped first (None: max_loras)."""
    lora_dtype: str = "auto"
    """The adapters' dtype (auto: the model's compute dtype)."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config): each step a speculating request proposes
    up to `num_speculative_tokens` tokens after its last one, the target model verifies them in the
    same forward pass as the rest of the batch, and the accepted ones (plus one token of its own)
    are kept. Method ngram: the tokens that followed the latest earlier occurrence of the request's
    last `prompt_lookup_max` .. `prompt_lookup_min` tokens in its own prompt and output. Method
    suffix: the most frequent continuation of the request's longest matching suffix in its own
    tokens and in recent requests' outputs (core/spec_suffix.py). Method draft_model: a smaller
    model sharing the target's vocabulary (or the target itself, quantized) decodes greedily ahead
    of the target on the worker (worker/draft_runner.py)."""

    method: str = "ngram"
    """How tokens are proposed (ngram, suffix, draft_model)."""
    num_speculative_tokens: int = 3
    """Most tokens proposed per request and step."""
    prompt_lookup_min: int = 1
    """Shortest suffix of the request's tokens looked up (ngram)."""
    prompt_lookup_max: int = 4
    """Longest suffix looked up; the longest that matches wins, the latest occurrence among ties."""
    suffix_decoding_max_tree_depth: int = 24
    """Suffix: the longest match plus proposal, in tokens (vLLM's name and default)."""
    suffix_decoding_max_cached_requests: int = 10000
    """Suffix: finished requests whose outputs are kept for other requests' lookups (first in,
    first out); 0: none, each request looks in its own tokens only."""
    suffix_decoding_max_spec_factor: float = 1.0
    """Suffix: a proposal is at most this many times as long as the match it follows."""
    suffix_decoding_min_token_prob: float = 0.1
    """Suffix: proposals stop where a token's estimated probability (the product of the
    continuations' frequencies along the proposal) falls below this."""
    model: str | None = None
    """draft_model: the draft model's folder, .gguf file or name (it must share the target's
    vocabulary); None, or the target's own name: the target itself (a self-draft)."""
    quantization: str | None = None
    """draft_model: the draft's quantization applied at load (int4, int8, ...; pagedllm's -q
    schemes), or None: as its checkpoint is stored."""
    draft_tensor_parallel_size: int | None = None
    """draft_model: the draft's tensor-parallel ranks; only 1 (the draft runs on the driver's rank)."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        ints = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "suffix_decoding_max_tree_depth",
                "suffix_decoding_max_cached_requests")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"{name} must be a number, got {value!r}")
        _check_at_least(self, 1, "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                        "suffix_decoding_max_tree_depth")
        _check_at_least(self, 0, "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], got {self.suffix_decoding_min_token_prob}")
        if self.num_speculative_tokens > 32:
            raise ValueError(f"num_speculative_tokens must be at most 32, got {self.num_speculative_tokens}")
        if self.method != "draft_model":
            given = [n for n in ("model", "quantization", "draft_tensor_parallel_size") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{given} apply to method 'draft_model' only, not {self.method!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"draft_tensor_parallel_size must be 1 (the draft runs on one rank), "
                             f"got {self.draft_tensor_parallel_size!r}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be at least prompt_lookup_min "
                f"({self.prompt_lookup_min})"
            )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora_config: LoRAConfig | None = None
    """Set where LoRA adapters are served (--enable-lora)."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding, or None (off: no step does any work for it)."""
    draft_model_config: ModelConfig | None = None
    """Speculative decoding's draft model (method draft_model), resolved like the target."""
