"""Typed configs, validated once at construction and never mutated afterwards. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import Any

SCHEDULING_POLICIES = ("fcfs", "priority", "srtf", "fair")
PREEMPTION_MODES = ("recompute", "swap", "auto")
DTYPES = ("float32", "bfloat16", "float16")
# KV cache element types (vLLM's names; "fp8" means fp8_e4m3); "auto" is the model dtype.
KV_CACHE_DTYPES = ("auto", *DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("", *KV_CACHE_DTYPES):
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        kv = {"": self.dtype, "auto": self.dtype, "fp8": "fp8_e4m3"}.get(self.kv_cache_dtype, self.kv_cache_dtype)
        object.__setattr__(self, "kv_cache_dtype", kv)  # resolved once, at construction

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
        itemsize = KV_CACHE_ITEMSIZE[self.kv_cache_dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
