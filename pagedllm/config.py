"""Typed configs, validated once at construction and never mutated afterwards. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import Any

SCHEDULING_POLICIES = ("fcfs", "priority", "srtf", "fair")
PREEMPTION_MODES = ("recompute", "swap", "auto")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("int8", "w8a8", "int4", "fp8", "awq", "gptq", "gguf")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
# --quantization-skip preset: keep attention (q/k/v/o projections) in the model dtype.
SKIP_PRESETS = {"attention": ("*.self_attn.*",)}


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

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}")


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
    time_slice: int = 64
    """Fair share: steps a running request keeps its place while requests of other users wait;
    then it yields to a waiting request of a less-served user."""
    user_weights: dict[str, float] = field(default_factory=dict)
    """Fair share: weight per user (default 1)."""
    max_waiting_steps: int = 10_000
    """Aging: a request that has waited (or stayed swapped) this many steps is served before every
    other one and is no longer preempted for younger ones (bound in pagedllm/core/policies.py)."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be non-negative, got {self.long_prefill_token_threshold}"
            )
        if self.max_num_partial_prefills < 0:
            raise ValueError(f"max_num_partial_prefills must be non-negative, got {self.max_num_partial_prefills}")
        if self.time_slice < 1:
            raise ValueError(f"time_slice must be at least 1, got {self.time_slice}")
        if self.max_waiting_steps < 1:
            raise ValueError(f"max_waiting_steps must be at least 1, got {self.max_waiting_steps}")
        for user, w in self.user_weights.items():
            if not w > 0:
                raise ValueError(f"user weight must be positive, got {w} for user {user!r}")


@dataclass(frozen=True)
class QuantizationConfig:
    """How linear weights are kept: scheme, group size and the layers left in the model dtype."""

    method: str
    """int8, w8a8, int4, fp8 (quantized from a float checkpoint at load), awq, gptq or gguf (as stored)."""
    group_size: int = 128
    """Inputs per scale for int4."""
    skip: tuple[str, ...] = ()
    """Module-name globs (e.g. ``*.self_attn.*``) kept in the model dtype; the preset name
    ``attention`` stands for the attention projections."""
    clip_search: bool = False
    """int4: per group, search the clipping range that minimises the squared error."""

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.method!r}")
        if self.group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(f"quantization group size must be one of {QUANTIZATION_GROUP_SIZES}, got {self.group_size}")
        for pattern in self.skip:
            if not pattern.strip():
                raise ValueError(f"quantization skip patterns must be non-empty globs, got {self.skip!r}")

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
    """Compute and KV cache dtype: float32, bfloat16 or float16."""
    max_model_len: int = 8192
    """Longest sequence (prompt + output) accepted."""
    eos_token_ids: frozenset[int] = frozenset()
    """Token ids that end generation unless ignore_eos."""
    seed: int = 0
    """Seed of the engine's default random generator (unseeded requests)."""
    tokenizer: str | None = None
    """Tokenizer folder, when it differs from the model's."""
    quantization: QuantizationConfig | None = None
    """Quantized linear layers, or None for weights in the model dtype."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

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
        return getattr(self.hf_config, "sliding_window", None) or None

    def kv_bytes_per_token(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
