"""What the machine offers the engine: CPU feature flags and the dtype `--dtype auto` picks.

No torch here: the decision is a pure function of the flags, so it is testable with fake flag sets.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

# CPU flags (as /proc/cpuinfo spells them) that give native bfloat16 / float16 dot products.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_FLAGS = ("avx512_fp16", "amx_fp16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def choose_auto_dtype(flags: frozenset[str] | set[str], has_gpu: bool = False) -> tuple[str, str]:
    """(dtype, reason) that `--dtype auto` resolves to.

    bfloat16 on a GPU and on CPUs with AVX-512 BF16 or AMX-BF16 (hardware bf16 dot products, so
    GEMMs in bf16 run faster than in fp32 and weights take half the bytes); float32 otherwise.
    There pagedllm's bf16 widens to float32 and multiplies in float32 (AVX2 + FMA kernels): it
    halves the weight bytes, and so speeds up decode, but not the arithmetic of prompts, while
    float32 keeps every result exact against a float32 reference. `--dtype bfloat16` is the choice
    for memory or single-stream speed there.
    """
    if has_gpu:
        return "bfloat16", "a GPU is available"
    found = [f for f in BF16_FLAGS if f in flags]
    if found:
        return "bfloat16", f"the CPU has {' and '.join(found)}"
    return "float32", f"the CPU has none of {', '.join(BF16_FLAGS)}"


def resolve_dtype(requested: str, device: str = "cpu") -> str:
    """The dtype to run in; `auto` is decided here and the choice logged with its reason."""
    if requested != "auto":
        return requested
    if device == "cuda":
        dtype, why = "bfloat16", "a CUDA GPU"
    else:
        dtype, why = choose_auto_dtype(cpu_flags())
    logger.info("dtype auto -> %s (%s)", dtype, why)
    return dtype
