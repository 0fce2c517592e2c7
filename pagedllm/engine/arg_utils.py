"""Engine arguments with vLLM's flag names, and their resolution into validated configs."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import (
    DTYPES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '2G', '1000000' -> bytes."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
             "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in units or not num:
        raise ValueError(f"cannot read {text!r} as a size in bytes (e.g. 2GiB, 512MiB, 1000000)")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size in bytes (e.g. 2GiB, 512MiB, 1000000)") from None
    return int(value * units[unit])


def parse_user_weights(text: str) -> dict[str, float]:
    """'alice=2,bob=1' -> {'alice': 2.0, 'bob': 1.0} (fair-share weight per user)."""
    weights: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in str(text).split(","))):
        user, sep, value = item.partition("=")
        try:
            w = float(value)
        except ValueError:
            w = float("nan")
        if not sep or not user.strip() or not w > 0:
            raise ValueError(f"cannot read {item!r} as user=weight with a positive weight (e.g. alice=2,bob=1)")
        weights[user.strip()] = w
    return weights


@dataclass
class EngineArgs:
    """Everything that configures an engine; names follow vLLM's engine arguments."""

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    swap_space: float = 4.0
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 0
    time_slice: int = 64
    user_weights: dict[str, float] = field(default_factory=dict)
    max_waiting_steps: int = 10_000

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        if model_positional:
            g.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                           help="model folder, .gguf file or the embedded default (smollm2-135m-instruct)")
        g.add_argument("--model", default=None,
                       help="model folder (config.json + safetensors), .gguf file, or smollm2-135m-instruct (default)")
        g.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
        g.add_argument("--served-model-name", default=None, help="model name reported to clients")
        g.add_argument("--dtype", default="auto", choices=("auto", *DTYPES), help="compute dtype (auto: float32 on CPU)")
        g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: model's)")
        g.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
        g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
        g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                       help="bytes for the KV cache, e.g. 2GiB (default: 30%% of free memory, at most 4GiB)")
        g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks", type=int, default=None,
                       help="exact number of KV cache blocks (overrides --kv-cache-memory)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse cached KV blocks of shared prefixes")
        g.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped-out blocks")
        g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
        g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
        g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                       help="order of service: fcfs, priority (lower first), srtf (shortest remaining work), "
                            "fair (weighted share of tokens per user)")
        g.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES,
                       help="evict for lack of blocks by recompute, swap (to --swap-space) or auto (cheaper, measured)")
        g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                       help="cap on one request's prompt chunk per step (0: none)")
        g.add_argument("--max-num-partial-prefills", type=int, default=0,
                       help="most unfinished prompts per step (0: no limit)")
        g.add_argument("--time-slice", type=int, default=64,
                       help="fair policy: steps a running request keeps its place while other users wait")
        g.add_argument("--user-weights", type=parse_user_weights, default={},
                       help="fair policy: weight per user, e.g. alice=2,bob=1 (others: 1)")
        g.add_argument("--max-waiting-steps", type=int, default=10_000,
                       help="aging: steps after which a waiting request goes before all others")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in vars(args).items() if k in names}
        if getattr(args, "model_tag", None) and not kwargs.get("model"):
            kwargs["model"] = args.model_tag
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.models.loader import load_generation_eos_ids, load_hf_config, resolve_model

        source = resolve_model(self.model)
        hf_config = load_hf_config(source)
        max_pos = int(getattr(hf_config, "max_position_embeddings", 0) or 8192)
        max_model_len = self.max_model_len or max_pos
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        if max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's max_position_embeddings={max_pos}"
            )
        dtype = "float32" if self.dtype == "auto" else self.dtype
        model_config = ModelConfig(
            model=self.model or source.name,
            kind=source.kind,
            path=source.path,
            served_model_name=self.served_model_name or source.name,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            eos_token_ids=frozenset(load_generation_eos_ids(source)),
            seed=self.seed,
            tokenizer=self.tokenizer,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            swap_space=self.swap_space,
        )
        budget = self.max_num_batched_tokens or 2048
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            time_slice=self.time_slice,
            user_weights=dict(self.user_weights),
            max_waiting_steps=self.max_waiting_steps,
        )
        return EngineConfig(model_config, cache_config, scheduler_config)
