"""The Triton kernels compile for a Hopper GPU (sm_90) here, without one: the real compiler
(not the interpreter) checks types, shapes and the PTX of each variant the GPU path launches."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedllm.attention import triton_attention as ta  # noqa: E402
from pagedllm.attention import triton_fused as tf  # noqa: E402

pytestmark = pytest.mark.triton_interp
_FLOATS = {"scale_log2", "k_scale", "v_scale", "eps"}


def compile_for_hopper(fn, pointers: dict[str, str], constexprs: dict) -> None:
    """Compiles `fn` to a cubin for sm_90; scalar arguments are i32 (i64 for strides), fp32 for scales."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name.startswith("stride") else "i32"
    compiled = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32))
    assert len(compiled.asm["cubin"]) > 0


def attention_pointers(act: str, cache: str) -> dict[str, str]:
    i64 = "*i64"
    return dict(q_ptr=act, k_cache_ptr=cache, v_cache_ptr=cache, out_ptr=act, block_tables_ptr=i64,
                query_start_loc_ptr=i64, seq_lens_ptr=i64, work_ptr=i64, part_out_ptr="*fp32", part_ml_ptr="*fp32")


@pytest.mark.parametrize(
    "act,cache,qpk,d,bs,block_m,splits,fp8,sw",
    [
        ("*bf16", "*bf16", 4, 128, 16, 64, 1, False, False),  # Llama-8B prompt chunk
        ("*bf16", "*bf16", 4, 128, 64, 16, 8, False, True),  # long decodes, split-K, sliding window
        ("*fp32", "*fp32", 3, 64, 32, 16, 1, False, False),  # SmolLM2 in float32 (IEEE dots)
        ("*bf16", "*u8", 4, 128, 16, 16, 4, True, False),  # fp8 cache
    ],
)
def test_attention_kernel_compiles(act, cache, qpk, d, bs, block_m, splits, fp8, sw) -> None:
    consts = dict(QPK=qpk, HEAD_DIM=d, D_PAD=d, BLOCK_SIZE=bs, TILE_N=64, BLOCK_M=block_m, NUM_SPLITS=splits,
                  FP8=fp8, USE_SW=sw, IEEE=act == "*fp32")
    compile_for_hopper(ta._attention_kernel, attention_pointers(act, cache), consts)


def test_split_combine_kernel_compiles() -> None:
    ptrs = dict(out_ptr="*bf16", query_start_loc_ptr="*i64", work_ptr="*i64", part_out_ptr="*fp32",
                part_ml_ptr="*fp32")
    compile_for_hopper(ta._combine_splits_kernel, ptrs, dict(QPK=4, HEAD_DIM=128, D_PAD=128, BLOCK_M=16, NUM_SPLITS=8))


@pytest.mark.parametrize("cache,fp8", [("*bf16", False), ("*u8", True)])
def test_kv_write_kernel_compiles(cache: str, fp8: bool) -> None:
    ptrs = dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache, slot_ptr="*i64")
    compile_for_hopper(ta._write_kv_kernel, ptrs, dict(ROW=1024, ROW_PAD=1024, BLOCK_SIZE=16, FP8=fp8))


@pytest.mark.parametrize("dtype,residual", [("*bf16", True), ("*fp32", False)])
def test_rms_norm_kernel_compiles(dtype: str, residual: bool) -> None:
    ptrs = dict(x_ptr=dtype, res_ptr=dtype, w_ptr=dtype, out_ptr=dtype)
    compile_for_hopper(tf._rms_norm_kernel, ptrs, dict(N=576, N_PAD=1024, ADD_RESIDUAL=residual))


def test_rope_kernel_compiles() -> None:
    ptrs = dict(src_ptr="*bf16", dst_ptr="*bf16", pos_ptr="*i64", cos_ptr="*bf16", sin_ptr="*bf16")
    compile_for_hopper(tf._rope_kernel, ptrs, dict(HEADS=9, HEADS_PAD=16, HALF=32, HALF_PAD=32))


@pytest.mark.parametrize("act,w,block_m,split", [("*bf16", "*bf16", 16, 8), ("*fp32", "*fp32", 64, 1),
                                                 ("*fp16", "*fp16", 32, 2), ("*bf16", "*fp32", 16, 8),
                                                 ("*fp32", "*bf16", 64, 1)])
def test_lora_kernels_compile(act: str, w: str, block_m: int, split: int) -> None:
    from pagedllm.lora import triton_lora as tl_

    ieee = w == "*fp32"
    shrink = dict(x_ptr=act, a_ptr=w, h_ptr="*fp32", meta_ptr="*i32")
    compile_for_hopper(tl_._shrink_kernel, shrink, dict(NUM_SLOTS=4, SPLIT=split, BLOCK_M=block_m, BLOCK_N=64,
                                                        BLOCK_K=tl_.BLOCK_K, IEEE=ieee))
    expand = dict(h_ptr="*fp32", bt_ptr=w, y_ptr=act, meta_ptr="*i32", ranges_ptr="*i64")
    compile_for_hopper(tl_._expand_kernel, expand, dict(NUM_SLOTS=4, SPLIT=split, NUM_SLICES=3, R_PAD=16,
                                                        BLOCK_M=block_m, BLOCK_N=64, IEEE=ieee))
