"""Engine arguments with vLLM's flag names, and their resolution into validated configs.

`EngineArgs` is the one source of the engine options: each field's metadata (help text, extra
flag names, choices, parser) generates the argparse flags of every subcommand, and the README's
flag table is checked against the same fields by a test.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import (
    DEVICES,
    DTYPES,
    EMBEDDING_QUANTIZATION_METHODS,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    LORA_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATION_METHODS,
    RUNNERS,
    SCHEDULING_POLICIES,
    SERVE_MAX_NUM_SHARED_PREFILL_TOKENS,
    STORED_QUANTIZATION,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    QuantizationConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    read_json_object,
)
from pagedllm.pooling_params import pooler_overrides


def parse_size(text: str | int) -> int:
    """'4GiB', '512MiB', '2G', '1000000' -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
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


def parse_structured_outputs_config(text: str | dict[str, Any] | StructuredOutputsConfig) -> StructuredOutputsConfig:
    """'{"backend": "xgrammar"}' (JSON, vLLM's form) -> StructuredOutputsConfig."""
    if isinstance(text, StructuredOutputsConfig):
        return text
    return StructuredOutputsConfig(**read_json_object(text, StructuredOutputsConfig, '{"backend": "xgrammar"}'))


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` for argparse: its ValueError's text becomes the flag's error line (argparse would
    otherwise print only "invalid <function name> value")."""

    def flag_value(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None

    return flag_value


def parse_speculative_config(text: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}' (JSON, vLLM's
    form) -> SpeculativeConfig; null or an empty object -> None (off)."""
    if text is None or isinstance(text, SpeculativeConfig):
        return text
    if isinstance(text, str) and text.strip() == "null":
        return None
    text = read_json_object(text, SpeculativeConfig, '{"method": "ngram", "num_speculative_tokens": 4}')
    if not text:
        return None
    method = text.get("method") or ("draft_model" if text.get("model") is not None else "ngram")
    text = {**text, "method": method}  # vLLM infers a draft model's method from "model"
    other = {"ngram": ("suffix_decoding_",), "suffix": ("prompt_lookup_",),
             "draft_model": ("suffix_decoding_", "prompt_lookup_")}.get(method, ())
    stray = sorted(k for k in text if k.startswith(other))
    if stray:
        raise ValueError(f"{stray} do not apply to method {method!r}")
    if "num_speculative_tokens" not in text:
        if method == "ngram" or method == "draft_model":
            raise ValueError("num_speculative_tokens is required (the most tokens proposed per step)")
        # vLLM's default for suffix: as many as the tree is deep
        text = {**text, "num_speculative_tokens": text.get("suffix_decoding_max_tree_depth", 24)}
    return SpeculativeConfig(**text)


def parse_user_weights(text: str | dict[str, float]) -> dict[str, float]:
    """'alice=2,bob=1' -> {'alice': 2.0, 'bob': 1.0} (fair-share weight per user)."""
    if isinstance(text, dict):
        return {str(k): float(v) for k, v in text.items()}
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


def parse_sizes(text: str | list[int] | tuple[int, ...]) -> list[int]:
    """'1,2,4,8' (or a list) -> [1, 2, 4, 8]: positive integers, sorted, without repeats."""
    items = list(text) if isinstance(text, (list, tuple)) else [p for p in str(text).replace(" ", "").split(",") if p]
    try:
        sizes = sorted({int(x) for x in items})
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a list of batch sizes (e.g. 1,2,4,8)") from None
    if any(s < 1 for s in sizes):
        raise ValueError(f"batch sizes must be positive, got {text!r}")
    return sizes


def default_cuda_graph_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then multiples of 8, up to max_num_seqs (at most 512)."""
    sizes = [1, 2, 4, *range(8, 513, 8)]
    return [s for s in sizes if s <= max_num_seqs] or [1]


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; 'cuda' without a GPU is an error."""
    import torch

    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise ValueError("device='cuda' but torch sees no CUDA GPU (use --device cpu or auto)")
    if device == "auto":
        return "cuda" if has_cuda else "cpu"
    return device
def parse_layer_partition(text: str | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """'16,14' -> (16, 14): decoder layers per pipeline stage."""
    if isinstance(text, (list, tuple)):
        return tuple(int(x) for x in text)
    try:
        return tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError(f"cannot read {text!r} as layers per stage (e.g. 16,14)") from None


# Defaults of the fields that configure the cache and the scheduler are those of their configs:
# one declaration each (pagedllm/config.py).
_CACHE = CacheConfig
_SCHED = SchedulerConfig
_LORA = LoRAConfig


def arg(
    default: Any,
    help: str,
    *,
    flags: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    shown_default: str | None = None,
    cli: bool = True,
) -> Any:
    """An EngineArgs field with what its command-line flag needs.

    `flags` are extra names besides the field's own (`max_num_seqs` -> `--max-num-seqs`);
    `parse` turns the command-line string (and a value given from Python) into the field's
    value; `shown_default` is the default as the README's flag table states it.
    """
    meta = {"help": help, "flags": flags, "choices": choices, "parse": parse,
            "shown_default": shown_default, "cli": cli}
    if isinstance(default, (dict, list, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


@dataclass
class EngineArgs:
    """Everything that configures an engine; names follow vLLM's engine arguments."""

    model: str | None = arg(
        None, "model folder (config.json + safetensors), .gguf file, or smollm2-135m-instruct (default)",
        shown_default="smollm2-135m-instruct")
    tokenizer: str | None = arg(None, "tokenizer folder, if not the model's", shown_default="model's")
    served_model_name: str | None = arg(None, "model name reported to clients", shown_default="model's name")
    dtype: str = arg("auto", "compute dtype (auto: bfloat16 on a GPU or where the CPU has AVX-512 BF16, AMX, or AVX2 + FMA without AVX-512; else float32)",
                     choices=("auto", *DTYPES))
    kv_cache_dtype: str = arg("auto", "KV cache element type (auto: the compute dtype; fp8 = fp8_e4m3, "
                              "with per-tensor scales)", choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = arg(False, "fp8 KV cache: scales from the first batch's K/V maxima (else 1.0)")
    quantization: str | None = arg(
        None, "linear weights: int8, w8a8, int4, fp8 (quantized at load, or an FP8 checkpoint's own), awq, gptq, "
        "gguf, compressed-tensors (kept as stored)",
        flags=("-q",), choices=QUANTIZATION_METHODS,
        shown_default="checkpoint's (awq/gptq/fp8/compressed-tensors), else none")
    quantization_group_size: int = arg(
        128, "int4: inputs per scale (" + ", ".join(map(str, QUANTIZATION_GROUP_SIZES)) + ")", parse=int)
    quantization_skip: str | None = arg(
        None, "comma-separated module globs kept unquantized, or attention (quantize only the MLP)",
        shown_default="none")
    quantization_clip_search: bool = arg(False, "int4: search each group's clipping range")
    quantize_embeddings: bool = arg(
        False, "with --quantization int8, w8a8, int4, fp8 or gguf: keep the token embedding and LM head "
        "as codes too (int8/w8a8: int8 per 32 inputs; int4: the group size's 4-bit codes; fp8: e4m3 per row)")
    max_model_len: int | None = arg(None, "longest prompt + output", parse=int, shown_default="model's")
    seed: int = arg(0, "seed for unseeded sampling", parse=int)
    block_size: int = arg(_CACHE.block_size, "tokens per KV cache block", parse=int)
    kv_cache_memory: int | None = arg(
        None, "bytes for the KV cache, e.g. 2GiB", parse=parse_size,
        shown_default="CPU: 30% of free memory, at most 4 GiB; GPU: what --gpu-memory-utilization leaves")
    num_kv_blocks: int | None = arg(None, "exact number of KV cache blocks (overrides --kv-cache-memory)",
                                    flags=("--num-gpu-blocks-override",), parse=int)
    enable_prefix_caching: bool = arg(_CACHE.enable_prefix_caching, "reuse cached KV blocks of shared prefixes")
    disable_hybrid_kv_cache_manager: bool = arg(
        _CACHE.disable_hybrid_kv_cache_manager, "keep every KV block of sliding-window layers too (one block "
        "table for all layers) instead of freeing the blocks outside each window")
    swap_space: float = arg(_CACHE.swap_space, "GiB of host memory for swapped-out blocks (swap/auto)", parse=float)
    max_num_batched_tokens: int | None = arg(None, "token budget of one step (decodes + prompt chunks)",
                                             parse=int, shown_default=str(_SCHED.max_num_batched_tokens))
    max_num_seqs: int = arg(_SCHED.max_num_seqs, "most requests running at once", parse=int)
    scheduling_policy: str = arg(
        _SCHED.policy, "order of service: fcfs, priority (lower first), srtf (shortest remaining work), "
        "fair (weighted share of tokens per user)", choices=SCHEDULING_POLICIES)
    preemption_mode: str = arg(
        _SCHED.preemption_mode, "evict for lack of blocks by recompute, swap (to --swap-space) or auto (cheaper, measured)",
        choices=PREEMPTION_MODES)
    long_prefill_token_threshold: int = arg(_SCHED.long_prefill_token_threshold, "cap on one request's prompt chunk per step (0: none)", parse=int)
    max_num_partial_prefills: int = arg(_SCHED.max_num_partial_prefills, "most unfinished prompts per step (0: no limit)", parse=int)
    max_num_shared_prefill_tokens: int | None = arg(
        None, "prompt tokens of a step that more than one request shares, decodes on top (0: the whole "
        "token budget); smaller gives the first tokens of a burst sooner",
        parse=int, shown_default=f"{SERVE_MAX_NUM_SHARED_PREFILL_TOKENS} (serve), {_SCHED.max_num_shared_prefill_tokens} (offline)")
    time_slice: int = arg(_SCHED.time_slice, "fair policy: steps a running request keeps its place while other users wait",
                          parse=int)
    user_weights: dict[str, float] = arg(
        {}, "fair policy: weight per user, e.g. alice=2,bob=1 (others: 1)", parse=parse_user_weights,
        shown_default="all 1")
    max_waiting_steps: int = arg(_SCHED.max_waiting_steps, "aging: steps after which a waiting request goes before all others",
                                 parse=int)
    device: str = arg("auto", "where the model runs (auto: cuda when torch sees a GPU, else cpu)", choices=DEVICES)
    gpu_memory_utilization: float = arg(
        0.9, "GPU: share of the GPU's memory for weights, activations and the KV cache", parse=float)
    cuda_graph_sizes: list[int] | None = arg(
        None, "GPU: decode batch sizes captured as CUDA graphs, e.g. 1,2,4,8", parse=parse_sizes,
        shown_default="1,2,4,8,16,... up to --max-num-seqs (at most 512)")
    enforce_eager: bool = arg(False, "GPU: never use CUDA graphs")
    tensor_parallel_size: int = arg(1, "ranks splitting each layer (heads, MLP columns/rows)", flags=("-tp",),
                                    parse=int)
    pipeline_parallel_size: int = arg(1, "pipeline stages splitting the layers", flags=("-pp",), parse=int)
    distributed_executor_backend: str = arg(
        "mp", "how ranks start: mp (worker processes on this host), ray (Ray cluster), external_launcher "
        "(one engine per rank under torchrun)", choices=EXECUTOR_BACKENDS)
    structured_outputs_config: StructuredOutputsConfig = arg(
        StructuredOutputsConfig(), 'constrained decoding as JSON: {"backend": "auto|xgrammar|guidance", '
        '"enable_in_reasoning": false}', parse=parse_structured_outputs_config, shown_default='{"backend": "auto"}')
    reasoning_parser: str | None = arg(
        None, "where a reasoning model's thinking ends: deepseek_r1 or qwen3 (reasoning_content in chat "
        "replies; structured output and tool calls apply to the answer after it)", shown_default="none")
    speculative_config: SpeculativeConfig | None = arg(
        None, 'speculative decoding as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 4}, {"method": "suffix"} or a draft model, '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3} (without "model" and with '
        '"quantization": "int4": the target itself, quantized) (docs/speculative.md)', parse=parse_speculative_config,
        shown_default="off")
    runner: str = arg(
        "auto", "generate (sampling) or pooling (embeddings, scores); auto: pooling for encoders, bare *Model "
        "architectures, *ForSequenceClassification and sentence-transformers folders", choices=("auto", *RUNNERS))
    pooler_config: dict[str, Any] | None = arg(
        None, 'pooling requests\' defaults as JSON, e.g. {"pooling_type": "MEAN", "normalize": true, "dimensions": '
        '256, "activation": true}; pooling_type LAST, MEAN, CLS or ALL (keys left out: the model\'s, e.g. its '
        'sentence-transformers folder\'s; a generate-runner decoder: LAST, normalised)',
        parse=pooler_overrides, shown_default="model's")
    pipeline_layer_partition: tuple[int, ...] | None = arg(
        None, "decoder layers per pipeline stage, e.g. 16,14 (default: even split)", parse=parse_layer_partition,
        shown_default="even")
    enable_lora: bool = arg(False, "serve LoRA adapters (docs/lora.md): requests name one, batches mix them")
    max_loras: int = arg(_LORA.max_loras, "LoRA: distinct adapters in one step", parse=int)
    max_lora_rank: int = arg(_LORA.max_lora_rank, "LoRA: largest adapter rank (every slot is padded to it)", parse=int)
    max_cpu_loras: int | None = arg(None, "LoRA: adapters kept loaded in host memory, least recently used "
                                    "dropped first", parse=int, shown_default="--max-loras")
    lora_dtype: str = arg(_LORA.lora_dtype, "LoRA: the adapters' dtype (auto: the compute dtype)", choices=LORA_DTYPES)

    def __post_init__(self) -> None:
        # Values given from Python go through the same parsers as the command line, so
        # LLM(kv_cache_memory="256MiB") means what --kv-cache-memory 256MiB means.
        for f in dataclasses.fields(self):
            parse = f.metadata.get("parse")
            value = getattr(self, f.name)
            if parse is not None and isinstance(value, (str, dict, list, tuple)) and value is not None:
                try:
                    setattr(self, f.name, parse(value))
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{f.name}={value!r}: {e}") from None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        if model_positional:
            g.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                           help="model folder, .gguf file or the embedded default (smollm2-135m-instruct)")
        for f in dataclasses.fields(EngineArgs):
            m = f.metadata
            if not m.get("cli", True):
                continue
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            names = (flag_name(f), *m["flags"])
            help_text = m["help"].replace("%", "%%")
            if isinstance(default, bool):
                g.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
                continue
            kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
            if m["choices"] is not None:
                kwargs["choices"] = m["choices"]
            if m["parse"] is not None:
                kwargs["type"] = m["parse"] if m["parse"] in (int, float) else _flag_type(m["parse"])
            g.add_argument(*names, **kwargs)
        return parser

    @classmethod
    def flag_table(cls) -> list[tuple[str, str, str]]:
        """(flags, default, help) per command-line option, as the README's table states them."""
        rows = []
        for f in dataclasses.fields(cls):
            m = f.metadata
            if not m.get("cli", True):
                continue
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            names = [flag_name(f), *m["flags"]]
            if isinstance(default, bool):
                names = [f"{flag_name(f)} / --no-{flag_name(f)[2:]}", *m["flags"]]
                shown = "on" if default else "off"
            else:
                shown = m["shown_default"] or ("—" if default is None else str(default))
            rows.append((", ".join(names), shown, m["help"]))
        return rows

    @classmethod
    def flag_table_markdown(cls) -> str:
        """The README's engine flag table."""
        lines = ["| flag | default | meaning |", "|---|---|---|"]
        for names, default, help_text in cls.flag_table():
            flags = ", ".join(f"`{n.strip()}`" for n in names.split(", "))
            lines.append(f"| {flags} | {default} | {help_text} |")
        return "\n".join(lines)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in vars(args).items() if k in names}
        if getattr(args, "model_tag", None) and not kwargs.get("model"):
            kwargs["model"] = args.model_tag
        return cls(**kwargs)

    def create_cache_config(self) -> CacheConfig:
        """The cache config these flags give (as create_engine_config builds it)."""
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            swap_space=self.swap_space,
            calculate_kv_scales=self.calculate_kv_scales,
            disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
        )

    def create_scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler config these flags give; `max_model_len` is resolved by the caller."""
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens or _SCHED.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_num_shared_prefill_tokens=(_SCHED.max_num_shared_prefill_tokens
                                           if self.max_num_shared_prefill_tokens is None
                                           else self.max_num_shared_prefill_tokens),
            time_slice=self.time_slice,
            user_weights=dict(self.user_weights),
            max_waiting_steps=self.max_waiting_steps,
        )
    def _quantization_config(self, source: Any, hf_config: Any) -> QuantizationConfig | None:
        from pagedllm.models.loader.quantized import checkpoint_quantization

        stored = checkpoint_quantization(source, hf_config)
        if stored is not None and stored not in QUANTIZATION_METHODS:
            raise ValueError(f"{source.path}: checkpoint quantization {stored!r} is not supported "
                             f"(pre-quantized: {', '.join(STORED_QUANTIZATION)})")
        method = self.quantization or (stored if stored in STORED_QUANTIZATION else None)
        if method is None:
            if self.quantize_embeddings:
                raise ValueError("quantize_embeddings=True needs a quantization (int8, w8a8, int4, fp8 or gguf), "
                                 "got quantization=None")
            return None
        if stored in STORED_QUANTIZATION and method != stored:
            raise ValueError(f"quantization={method!r}: the checkpoint is quantized with {stored!r}")
        if method in ("awq", "gptq", "gguf", "compressed-tensors") and stored != method:
            raise ValueError(f"quantization={method!r} needs a {method} checkpoint, {source.path} is not one")
        skip = tuple(p.strip() for p in (self.quantization_skip or "").split(",") if p.strip())
        return QuantizationConfig(method=method, group_size=int(self.quantization_group_size), skip=skip,
                                  clip_search=self.quantization_clip_search, embeddings=self.quantize_embeddings)

    def _pooling(self, source: Any, hf_config: Any) -> tuple[str, PoolerConfig | None, int | None]:
        """(runner, pooler config, a sentence-transformers folder's max_seq_length) of the model."""
        from pagedllm.models.loader.pooling import default_pooler, default_runner, sentence_transformers_config

        folder = source.path if source.kind == "hf" else None
        runner = default_runner(hf_config, folder) if self.runner == "auto" else self.runner
        arch = (getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")])[0]
        if runner == "generate" and default_runner(hf_config, None) == "pooling":
            raise ValueError(f"runner='generate': {arch} has no LM head; serve it with --runner pooling")
        pooler = PoolerConfig(**{**default_pooler(hf_config, folder), **pooler_overrides(self.pooler_config)})
        if runner == "generate":  # a decoder answers pooling requests beside generation (LAST, normalised)
            return runner, pooler, None
        if getattr(hf_config, "model_type", None) == "bert" and getattr(hf_config, "sep_token_id", None) is None:
            from pagedllm.models.loader import load_tokenizer

            # BERT types a position after the first [SEP] as the pair's second text (models/bert.py).
            hf_config.sep_token_id = load_tokenizer(source, self.tokenizer).sep_token_id
        return runner, pooler, sentence_transformers_config(folder).get("max_seq_length")

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.hardware import resolve_dtype
        from pagedllm.models.loader import load_generation_eos_ids, load_hf_config, resolve_model

        source = resolve_model(self.model)
        hf_config = load_hf_config(source)
        max_pos = int(getattr(hf_config, "max_position_embeddings", 0) or 8192)
        runner, pooler, st_max_len = self._pooling(source, hf_config)
        max_model_len = self.max_model_len or min(max_pos, st_max_len or max_pos)
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        if max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's max_position_embeddings={max_pos}"
            )
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        model_config = ModelConfig(
            model=self.model or source.name,
            kind=source.kind,
            path=source.path,
            served_model_name=self.served_model_name or source.name,
            hf_config=hf_config,
            dtype=dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            max_model_len=max_model_len,
            eos_token_ids=frozenset(load_generation_eos_ids(source)),
            seed=self.seed,
            tokenizer=self.tokenizer,
            quantization=self._quantization_config(source, hf_config),
            runner=runner,
            pooler_config=pooler,
        )
        cache_config = self.create_cache_config()
        if model_config.is_encoder:  # an encoder keeps no KV cache, so there is no prefix to reuse
            cache_config = dataclasses.replace(cache_config, enable_prefix_caching=False)
        scheduler_config = self.create_scheduler_config(max_model_len)
        graph_sizes = self.cuda_graph_sizes if self.cuda_graph_sizes is not None else default_cuda_graph_sizes(
            self.max_num_seqs)
        device_config = DeviceConfig(
            device=device,
            gpu_memory_utilization=self.gpu_memory_utilization,
            cuda_graph_sizes=tuple(s for s in graph_sizes if s <= self.max_num_seqs),
            enforce_eager=self.enforce_eager,
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            pipeline_layer_partition=self.pipeline_layer_partition,
        )
        quant = model_config.quantization
        if parallel_config.tensor_parallel_size > 1 and quant is not None and quant.method in ("awq", "gptq", "gguf"):
            raise ValueError(
                f"quantization={quant.method!r} keeps packed checkpoint weights, which are not split over "
                f"tensor_parallel_size={parallel_config.tensor_parallel_size} ranks; use tensor_parallel_size=1 "
                "or a quantization applied at load (int8, w8a8, int4, fp8)"
            )
        parallel_config.check_model(
            model_config.num_layers, model_config.num_heads, model_config.num_kv_heads,
            int(getattr(hf_config, "intermediate_size", 0) or 0),
        )
        so_config = self.structured_outputs_config
        if self.reasoning_parser is not None:
            from pagedllm.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # names the known parsers if unknown
            so_config = dataclasses.replace(so_config, reasoning_parser=self.reasoning_parser)
        return EngineConfig(model_config, cache_config, scheduler_config, device_config, parallel_config, so_config,
                            self._lora_config(parallel_config), self.speculative_config,
                            self._draft_model_config(model_config, parallel_config))

    def _draft_model_config(self, target: ModelConfig, parallel_config: ParallelConfig) -> ModelConfig | None:
        """The draft model of speculative method draft_model, resolved like the target: its own
        folder (or the target's), its quantization applied at load; same dtype, KV cache dtype and
        max_model_len. ValueError where its vocabulary is not the target's."""
        spec = self.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        from pagedllm.models.loader import load_hf_config, resolve_model

        if parallel_config.world_size > 1:
            raise ValueError(f"speculative method 'draft_model' runs on one rank, got tensor_parallel_size="
                             f"{parallel_config.tensor_parallel_size}, pipeline_parallel_size="
                             f"{parallel_config.pipeline_parallel_size}")
        name = spec.model if spec.model is not None else target.model
        source = resolve_model(name)
        hf_config = load_hf_config(source)
        if int(hf_config.vocab_size) != target.vocab_size:
            raise ValueError(f"the draft model {name!r} has a vocabulary of {int(hf_config.vocab_size)} tokens, the "
                             f"target {target.model!r} one of {target.vocab_size}: a draft must share the "
                             "target's tokenizer and vocabulary")
        if target.is_encoder or target.runner != "generate":
            raise ValueError("speculative method 'draft_model' needs a generating decoder, got runner="
                             f"{target.runner!r}")
        max_pos = int(getattr(hf_config, "max_position_embeddings", 0) or target.max_model_len)
        if max_pos < target.max_model_len:
            raise ValueError(f"the draft model {name!r} reaches {max_pos} positions, fewer than max_model_len="
                             f"{target.max_model_len}")
        # As -q quantizes, and the LM head's codes beside its dense weight (a draft pass reads
        # mostly the head otherwise; docs/speculative.md); the token embedding stays as stored.
        quant = EngineArgs(quantization=spec.quantization, quantization_group_size=self.quantization_group_size,
                           )._quantization_config(source, hf_config)
        if quant is not None and quant.method in EMBEDDING_QUANTIZATION_METHODS and not quant.embeddings:
            quant = dataclasses.replace(quant, lm_head=True)
        return dataclasses.replace(target, model=name, kind=source.kind, path=source.path, served_model_name=name,
                                   hf_config=hf_config, quantization=quant, tokenizer=None)

    def _lora_config(self, parallel_config: ParallelConfig) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if parallel_config.pipeline_parallel_size > 1:
            raise ValueError(f"enable_lora=True runs with pipeline_parallel_size=1, got "
                             f"{parallel_config.pipeline_parallel_size} (tensor parallel is supported)")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras, lora_dtype=self.lora_dtype)
