"""Native CPU paged attention (pagedllm/native/csrc/paged_attention.c: OpenMP, reads K/V in place
from the blocks, in float32, bfloat16, float16 or fp8 with per-tensor scales, accumulating in
float32), the flash kernel for prompt chunks (flash_attention.c) and the KV cache write: their
Python wrappers and the policy of which chunks take which kernel. The kernels are built and bound
by pagedllm.native (declared in pagedllm.native.kernels); the torch backend is the fallback.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from pagedllm import native
from pagedllm.native import kernels
from pagedllm.native.declare import Binding

# Query tokens of one request handled together by one work item (they share every K/V load).
QUERY_TILE = 8
# Where the flash kernel does not run (float16, fp8 or mixed dtypes; see flash_runs): prompt chunks
# of at least this many tokens skip the paged kernel: their context is gathered once and attended
# with torch's fused SDPA, which runs GEMM-shaped tiles near the matmul rate.
DENSE_MIN_TOKENS = 128
# ... and at least this many query-key pairs: below it the paged kernel is as fast and the flash
# call's fixed cost dominates (a 512-token first chunk has 131k pairs; 512 after 2048, 1.2M).
DENSE_MIN_PAIRS = 1 << 20
# Queries and cache both bf16, or both float32: chunks of at least this many tokens take the native
# flash kernel (flash_attention.c), whatever their context; one call per chunk and layer (about
# 14 us of fixed cost against the paged kernel's 8), so the smallest chunks stay in the paged
# kernel's single batched call. One thread, SmolLM2's shape (9 heads, 3 KV heads, D 64), against
# the paged kernel's prompt path: bf16 1.8x faster at 32 tokens, 3.3x at 64, 4-5x at 128-512, 5.8x
# for 256 tokens after 1,024; float32 (benchmarks/bench_flash_prefill.py --crossover) 0.9x at 16
# tokens, 1.3x at 32 (2.9x after 256 cached), 2.2x at 64, 2.8x at 128, 3-4.6x at 256-512.
FLASH_MIN_TOKENS = {torch.bfloat16: 64, torch.float32: 32}
# bf16 on AMX tiles (CPUs with AMX-BF16, head size a multiple of 32: flash_bf16_amx) against the
# paged kernel's prompt path, 2-core Xeon (bench_flash_prefill.py 2 --crossover): 1.3x at 16 tokens
# after 0, 3.4-5x after 256-2,048, 2.4-14x from 32 tokens on; and 2-3.7x torch's flash at every size.
FLASH_MIN_TOKENS_AMX = 16
# bf16 widened to float32 (CPUs without AVX-512 BF16) runs the float32 form and takes its limit:
# against the paged kernel's bf16 prompt path on a 2-core Zen 1 host (bench_flash_prefill.py 2
# --dtype bfloat16 --crossover), 1.1x at 16 tokens, 1.6-1.7x at 32, 1.7-2.9x at 48-512 tokens.
# The kernel's AVX2 form (8-lane float32 FMAs; CPUs without AVX-512) keeps about 70 % of the FMA
# rate at every size (43-47 GFLOP/s on a 2-core Zen host whose float32 GEMM peak is 60-75), while
# torch's flash attention gains on large chunks. Measured there (bench_flash_prefill.py 2 --dtype
# float32 [--crossover | --long-context]; torch / native time, results/avx2_flash_prefill.txt):
# 1.05-3x for chunks of 16-512 tokens after 0-2,048, 0.96-1.7x for 32-512 after 3,072-6,144, but
# 0.88-1.02x for 1,024 after 3,072-6,144, 0.89x for 2,048 after 2,048, 0.83x for 856 after 6,144
# and 0.95x for 7,000 after 0. So on that form, chunks of at least this many query-key pairs
# (query tokens x keys) without a sliding window (which torch runs as a masked SDPA) take torch's.
FLASH_AVX2_MAX_PAIRS = 1 << 22


@lru_cache(maxsize=1)
def load_kernel() -> Binding | None:
    """The paged attention kernel, or None (with one warning) when it cannot be built here or
    PAGEDLLM_ATTENTION_BACKEND=torch."""
    return native.load(kernels.ATTENTION)


def kv_cache_write(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """k, v [T, kv_heads, head_dim] (each token's heads contiguous, tokens at any stride) written to
    their slots of kv_cache [2, num_blocks, block_size, kv_heads, head_dim] in one native call, with
    index_copy_'s result; False (nothing written) where the kernel does not apply (other dtypes or
    layouts, no kernel) and the caller copies with torch. An out-of-range slot raises IndexError."""
    lib = load_kernel()
    if (lib is None or k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype or kv_cache.device.type != "cpu"
            or not kv_cache.is_contiguous() or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or k.dim() != 3 or v.shape != k.shape or k.shape[1:] != kv_cache.shape[3:]
            or slot_mapping.shape != (k.shape[0],)):
        return False
    kvh, d = k.shape[1:]
    if any(t.stride(2) != 1 or t.stride(1) != d for t in (k, v)):
        return False
    es = k.element_size()
    nb, bs = kv_cache.shape[1:3]
    half = nb * bs * kvh * d * es
    base = kv_cache.data_ptr()
    rc = lib.kv_cache_write(
        base,  # kc
        base + half,  # vc
        k.data_ptr(),  # k
        k.stride(0) * es,  # ldk
        v.data_ptr(),  # v
        v.stride(0) * es,  # ldv
        slot_mapping.data_ptr(),  # slots
        k.shape[0],  # T
        kvh * d * es,  # row_bytes
        nb * bs,  # num_slots
    )
    if rc == 2:
        raise IndexError(f"KV cache write: a slot outside [0, {nb * bs})")
    return True


# The flash kernel's entry point for each query and cache element type (flash_attention.c), both
# wherever the CPU has AVX-512F or AVX2 + FMA: bf16 through bf16 dot products with AVX-512 BF16,
# else widened to float32 (flash_bf16_widened).
_FLASH_FUNCTIONS = {torch.float32: kernels.FLASH_PREFILL_F32.name, torch.bfloat16: kernels.FLASH_PREFILL_BF16.name}


@lru_cache(maxsize=1)
def load_flash() -> Binding | None:
    """The flash-attention kernel for long prompt chunks (flash_attention.c), or None where the CPU
    has neither AVX-512 nor AVX2 + FMA, it cannot be built, or PAGEDLLM_NATIVE_FLASH=0."""
    return native.load(kernels.FLASH)


def flash_function(dtype: torch.dtype) -> Any:
    """The flash kernel's entry point for queries and a cache of `dtype`, or None where it has none."""
    lib, name = load_flash(), _FLASH_FUNCTIONS.get(dtype)
    return getattr(lib, name, None) if lib is not None and name is not None else None


def flash_runs(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flash_prefill runs chunks of these queries and cache on the CPU: both float32 or both
    bf16, head size a multiple of 16, and the kernel built with that entry point."""
    return dtype == kv_dtype and head_dim % 16 == 0 and flash_function(dtype) is not None


def dense_thresholds(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(tokens, query-key pairs) from which a prompt chunk on the CPU attends densely: with the flash
    kernel, every chunk of FLASH_MIN_TOKENS[dtype]+ tokens; otherwise torch's flash for long chunks only."""
    if flash_runs(dtype, kv_dtype, head_dim):
        return flash_min_tokens(dtype), 0
    return DENSE_MIN_TOKENS, DENSE_MIN_PAIRS


def flash_min_tokens(dtype: torch.dtype) -> int:
    """The fewest tokens of a chunk the flash kernel takes in `dtype` (FLASH_MIN_TOKENS, by form)."""
    if dtype == torch.bfloat16 and flash_bf16_amx():
        return FLASH_MIN_TOKENS_AMX
    return FLASH_MIN_TOKENS[torch.float32 if dtype == torch.bfloat16 and flash_bf16_widened() else dtype]


@lru_cache(maxsize=1)
def flash_lanes() -> int:
    """The float32 lanes of the built kernel's form (16: AVX-512, 8: AVX2 + FMA), 0 without one;
    asked once, not per chunk."""
    lib = load_flash()
    return lib.flash_lanes() if lib is not None else 0


@lru_cache(maxsize=1)
def flash_bf16_amx() -> bool:
    """Whether the built kernel runs bf16 chunks on AMX tiles (CPUs with AMX-BF16)."""
    lib = load_flash()
    return lib is not None and bool(lib.flash_bf16_amx())


@lru_cache(maxsize=1)
def flash_bf16_widened() -> bool:
    """Whether the built kernel runs bf16 widened to float32 (CPUs without AVX-512 BF16)."""
    lib = load_flash()
    return lib is not None and bool(lib.flash_bf16_widened())


def flash_takes(query_len: int, seq_len: int, sliding_window: int = 0) -> bool:
    """Whether a chunk the kernel can run should run there rather than in torch's flash attention:
    always with the AVX-512 form; with the AVX2 form (float32, or bf16 widened to float32), below
    FLASH_AVX2_MAX_PAIRS or with a window."""
    lanes = flash_lanes()
    return lanes == 16 or (lanes == 8 and (sliding_window > 0 or query_len * seq_len < FLASH_AVX2_MAX_PAIRS))


def flash_supported(q: torch.Tensor, kv_cache: torch.Tensor, query_len: int, seq_len: int,
                    sliding_window: int = 0) -> bool:
    """Whether flash_prefill runs this chunk of `query_len` tokens over `seq_len` keys (CPU tensors;
    see flash_runs and flash_takes)."""
    return (q.device.type == "cpu" and flash_runs(q.dtype, kv_cache.dtype, q.shape[-1])
            and flash_takes(query_len, seq_len, sliding_window))


def flash_prefill(q: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, query_start: int,
                  query_len: int, seq_len: int, scale: float, sliding_window: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Attention of one prompt chunk (queries q[query_start : query_start + query_len], at positions
    seq_len - query_len ..) over keys 0 .. seq_len - 1 of the paged cache, read through `blocks`
    ([ceil(seq_len / block_size)] int64 block ids), causal, within `sliding_window` when > 0.
    q: [T, H, D] and kv_cache: [2, num_blocks, block_size, KVH, D], both bf16 or both float32.
    -> [query_len, H * D] in q's dtype (written into `out`, contiguous rows of the step's output,
    when given), or None where the kernel could not allocate its buffers."""
    fn = flash_function(q.dtype)
    if fn is None or kv_cache.dtype != q.dtype:
        raise RuntimeError(f"the native flash kernel does not run {q.dtype} over a {kv_cache.dtype} cache here")
    _, H, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()  # rows of one token must be contiguous; tokens may sit in wider rows
    _, _, bs, kvh, _ = kv_cache.shape
    blocks = blocks.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty(query_len, H * D, dtype=q.dtype)
    elif out.shape != (query_len, H * D) or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"flash_prefill: out must be a contiguous [{query_len}, {H * D}] {q.dtype} tensor, "
                         f"got {tuple(out.shape)} {out.dtype}")
    rc = fn(
        q.data_ptr(),  # q
        query_start,  # q_start
        q.stride(0),  # q_stride
        query_len,  # query_len
        seq_len,  # seq_len
        kv_cache[0].data_ptr(),  # k_cache
        kv_cache[1].data_ptr(),  # v_cache
        blocks.data_ptr(),  # blocks
        bs,  # BS
        H,  # H
        kvh,  # KVH
        D,  # D
        scale,  # scale
        sliding_window,  # window
        out.data_ptr(),  # out
    )
    if rc != 0:
        return None
    return out


# Element-type codes of the kernel (see DT_* in paged_attention.c).
_QUERY_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_KV_CODES = {**_QUERY_CODES, **{d: 3 for d in FP8_DTYPES}}
KERNEL_DTYPES = tuple(_QUERY_CODES)


@lru_cache(maxsize=None)
def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """[256] float32 value of each one-byte code of an fp8 dtype (what the kernel decodes with)."""
    if dtype not in FP8_DTYPES:
        return torch.zeros(1)
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().contiguous()


def paged_attention_native(
    lib: Binding,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    work: torch.Tensor,
    scale: float,
    sliding_window: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q: [T, H, D] (float32/bfloat16/float16; each token's heads contiguous, tokens at any stride:
    a view into a fused projection's rows is read in place); kv_cache: [2, num_blocks, block_size,
    KVH, D] in one of those or an fp8 dtype, holding K / k_scale and V / v_scale. -> [T, H * D]."""
    T, H, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D or (T > 1 and q.stride(0) < H * D):
        q = q.contiguous()
    _, _, bs, kvh, _ = kv_cache.shape
    out = torch.empty(T, H * D, dtype=q.dtype)
    table = fp8_table(kv_cache.dtype)
    lib.paged_attention(
        q.data_ptr(),  # q
        _QUERY_CODES[q.dtype],  # q_dt
        q.stride(0) if T > 1 else H * D,  # ldq
        kv_cache[0].data_ptr(),  # k_cache
        kv_cache[1].data_ptr(),  # v_cache
        _KV_CODES[kv_cache.dtype],  # kv_dt
        table.data_ptr(),  # fp8_table
        block_tables.data_ptr(),  # block_tables
        block_tables.shape[1],  # bt_stride
        query_start_loc.data_ptr(),  # query_start_loc
        seq_lens.data_ptr(),  # seq_lens
        work.data_ptr(),  # work
        work.shape[0],  # num_work
        out.data_ptr(),  # out
        H,  # H
        kvh,  # KVH
        D,  # D
        bs,  # BS
        scale * k_scale,  # scale
        v_scale,  # v_scale
        sliding_window,  # window
    )
    return out

