"""Every C entry point Python calls, declared once (see declare.py), grouped by library.

The argument names are the C prototypes' (tests/unit/test_native_declarations.py checks each
declaration, and the fused decode step's structs, against the sources in pagedllm/native/csrc).
"""

from __future__ import annotations

import ctypes

from pagedllm import envs
from pagedllm.native.declare import I32, I64, PTR, VOID, Arg, Kernel, Library, f32, i32, i64, ptr


def _ints(*names: str) -> tuple[Arg, ...]:
    return tuple(i64(n) for n in names)


# paged_attention.c: the paged attention kernel (decode rows and prompt chunks alike) and the KV write.
PAGED_ATTENTION = Kernel("paged_attention", VOID, (
    ptr("q"), i32("q_dt"), i64("ldq"), ptr("k_cache"), ptr("v_cache"), i32("kv_dt"), ptr("fp8_table"),
    ptr("block_tables"), i64("bt_stride"), ptr("query_start_loc"), ptr("seq_lens"), ptr("work"), i64("num_work"),
    ptr("out"), *_ints("H", "KVH", "D", "BS"), f32("scale"), f32("v_scale"), i64("window")))
KV_CACHE_WRITE = Kernel("kv_cache_write", I32, (
    ptr("kc"), ptr("vc"), ptr("k"), i64("ldk"), ptr("v"), i64("ldv"), ptr("slots"), *_ints("T", "row_bytes",
                                                                                          "num_slots")))
ATTENTION = Library("paged_attention.c", (PAGED_ATTENTION, KV_CACHE_WRITE),
                    lambda: envs.PAGEDLLM_ATTENTION_BACKEND != "torch")

# flash_attention.c: prompt chunks over the paged cache, one entry point per element type.
_FLASH_ARGS = (
    ptr("q"), *_ints("q_start", "q_stride", "query_len", "seq_len"), ptr("k_cache"), ptr("v_cache"), ptr("blocks"),
    *_ints("BS", "H", "KVH", "D"), f32("scale"), i64("window"), ptr("out"))
FLASH_PREFILL_F32 = Kernel("flash_prefill_f32", I32, _FLASH_ARGS)
FLASH_PREFILL_BF16 = Kernel("flash_prefill_bf16", I32, _FLASH_ARGS)
FLASH_LANES = Kernel("flash_lanes", I32)
FLASH_BF16_WIDENED = Kernel("flash_bf16_widened", I32)
FLASH_BF16_AMX = Kernel("flash_bf16_amx", I32)
FLASH = Library("flash_attention.c", (FLASH_PREFILL_F32, FLASH_PREFILL_BF16, FLASH_LANES, FLASH_BF16_WIDENED,
                                      FLASH_BF16_AMX), lambda: envs.PAGEDLLM_NATIVE_FLASH)

# encoder_attention.c: an encoder step's bidirectional attention over each sequence, read from the
# flat QKV projection in place.
_ENCODER_ATTENTION_ARGS = (ptr("qkv"), i64("ld"), ptr("starts"), ptr("lens"), *_ints("nseq", "H", "D"), f32("scale"),
                           ptr("out"), i64("ldo"))
ENCODER_ATTENTION_F32 = Kernel("encoder_attention_f32", I32, _ENCODER_ATTENTION_ARGS)
ENCODER_ATTENTION_BF16 = Kernel("encoder_attention_bf16", I32, _ENCODER_ATTENTION_ARGS)
ENCODER_ATTENTION = Library("encoder_attention.c", (ENCODER_ATTENTION_F32, ENCODER_ATTENTION_BF16),
                            lambda: envs.PAGEDLLM_NATIVE_FLASH)

# small_m_gemm.c: GEMMs of a few rows.
SMALL_M_AVAILABLE = Kernel("small_m_available", I32)
SMALL_M_AMX_ROWS = Kernel("small_m_amx_rows", I64)
SMALL_M_AMX_FROM = Kernel("small_m_amx_from", I64, (i64("rows"),))
SMALL_M_ROW1 = Kernel("small_m_row1", I64, (i64("on"),))
SMALL_M_LINEAR = Kernel("small_m_linear", I32, (
    ptr("x"), i64("M"), ptr("w"), ptr("bias"), i64("N"), i64("K"), ptr("y"), i64("dt")))
LINEAR = Library("small_m_gemm.c", (SMALL_M_AVAILABLE, SMALL_M_LINEAR, SMALL_M_AMX_ROWS, SMALL_M_AMX_FROM, SMALL_M_ROW1),
                 lambda: envs.PAGEDLLM_NATIVE_LINEAR)

# elementwise_bf16.c: RMSNorm, SiLU·mul and RoPE rows; the float32 forms wherever the file builds
# its kernels, the bf16 ones with AVX-512 only.
_RMS_NORM_ARGS = (ptr("x"), i64("ldx"), ptr("add"), ptr("h_out"), ptr("w"), i64("T"), i64("N"), f32("eps"), ptr("y"))
_SILU_MUL_ARGS = (ptr("x"), i64("ldx"), i64("T"), i64("I"), ptr("y"))
_ROPE_ARGS = (ptr("x"), *_ints("ldx", "T", "W", "hd"), ptr("pos"), ptr("cos"), ptr("sin"), i64("max_pos"), ptr("y"))
RMS_NORM_F32 = Kernel("rms_norm_f32", I32, _RMS_NORM_ARGS)
SILU_MUL_F32 = Kernel("silu_mul_f32", I32, _SILU_MUL_ARGS)
ROPE_F32 = Kernel("rope_f32", I32, _ROPE_ARGS)
RMS_NORM_BF16 = Kernel("rms_norm_bf16", I32, _RMS_NORM_ARGS, required=False)
SILU_MUL_BF16 = Kernel("silu_mul_bf16", I32, _SILU_MUL_ARGS, required=False)
ROPE_BF16 = Kernel("rope_bf16", I32, _ROPE_ARGS, required=False)
ELEMENTWISE = Library("elementwise_bf16.c", (RMS_NORM_F32, SILU_MUL_F32, ROPE_F32, RMS_NORM_BF16, SILU_MUL_BF16,
                                             ROPE_BF16), lambda: envs.PAGEDLLM_NATIVE_ELEMENTWISE)

# linear_quant.c: linear layers on 4-bit, int8 and e4m3 group codes, and w8a8's row-major int8 codes.
_GROUP_LINEAR_ARGS = (ptr("x"), i64("M"), ptr("codes"), ptr("scales"), ptr("zeros"), *_ints("N", "K", "G"), ptr("y"),
                      i32("y_f32"), i32("int8_act"))
INT4_LINEAR_BF16 = Kernel("int4_linear_bf16", I32, _GROUP_LINEAR_ARGS)
INT8_LINEAR_BF16 = Kernel("int8_linear_bf16", I32, _GROUP_LINEAR_ARGS)
E4M3_LINEAR_BF16 = Kernel("e4m3_linear_bf16", I32, _GROUP_LINEAR_ARGS)
QUANT_DEQUANT = Kernel("quant_dequant", I32, (
    i32("bits"), ptr("codes"), ptr("scales"), ptr("zeros"), *_ints("N", "K", "G"), ptr("w"), i32("w_f32")))
QUANT_GATHER_ROWS = Kernel("quant_gather_rows", I32, (
    i32("bits"), ptr("codes"), ptr("scales"), ptr("zeros"), *_ints("N", "K", "G"), ptr("ids"), i64("M"), ptr("out"),
    i32("out_f32")))
QUANT_SET_PARALLEL_MIN = Kernel("quant_set_parallel_min", I64, (i64("elems"),))
W8A8_LINEAR = Kernel("w8a8_linear", I32, (
    ptr("x"), i64("M"), ptr("codes"), ptr("scales"), ptr("wsum"), i64("N"), i64("K"), ptr("y"), i32("f32")))
W8A8_QUANTIZE_ROWS = Kernel("w8a8_quantize_rows", I32, (
    ptr("x"), i64("M"), i64("K"), i32("f32"), ptr("xq"), ptr("d")))
W8A8_SCALE_ROWS = Kernel("w8a8_scale_rows", I32, (
    ptr("acc"), i64("M"), i64("N"), ptr("d"), ptr("scales"), ptr("y"), i32("f32")))
W8A8_AMX_ROWS = Kernel("w8a8_amx_rows", I64)
W8A8_AMX_FROM = Kernel("w8a8_amx_from", I64, (i64("rows"),))
W8A8_VNNI_ROWS = Kernel("w8a8_vnni_rows", I64)
W8A8_VNNI_FROM = Kernel("w8a8_vnni_from", I64, (i64("rows"),))
INT8_DOT_PEAK = Kernel("int8_dot_peak", I64, (i64("iters"),))
QUANT = Library("linear_quant.c", (INT4_LINEAR_BF16, INT8_LINEAR_BF16, E4M3_LINEAR_BF16, QUANT_DEQUANT,
                                   QUANT_GATHER_ROWS, QUANT_SET_PARALLEL_MIN, W8A8_LINEAR, W8A8_QUANTIZE_ROWS,
                                   W8A8_SCALE_ROWS, W8A8_AMX_ROWS, W8A8_AMX_FROM,
                                   W8A8_VNNI_ROWS, W8A8_VNNI_FROM, INT8_DOT_PEAK), lambda: envs.PAGEDLLM_NATIVE_QUANT)


# llama_decode.c: the fused decode step over a model described by these structs (its typedefs).
class QuantLinear(ctypes.Structure):
    """One quantized linear layer's codes, as the step's kernels read them."""

    _fields_ = [("kind", ctypes.c_int64), ("group", ctypes.c_int64), ("codes", PTR), ("scales", PTR),
                ("zeros", PTR), ("perm", PTR), ("int8_act", ctypes.c_int64)]


_PP = ctypes.POINTER(ctypes.c_void_p)


class LoraLinear(ctypes.Structure):
    """One linear layer's LoRA slots (lora.c's layout: A [slots, n, K], B^T [slots, n, N]; ap, bp:
    the same in the AMX tiles' layout of lora_amx.h, or NULL)."""

    _fields_ = [("a", PTR), ("bt", PTR), ("ranges", PTR), ("num_slices", ctypes.c_int64), ("ap", PTR), ("bp", PTR)]


class LlamaDecodeModel(ctypes.Structure):
    """The model the step runs: shapes, and pointers to its parameters and KV caches."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in (
            "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "dtype",
            "block_size", "sliding_window", "max_position")),
        ("eps", ctypes.c_float),
        ("attn_scale", ctypes.c_float),
        ("embed", PTR), ("final_norm", PTR), ("cos", PTR), ("sin", PTR),
        *((name, _PP) for name in (
            "input_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b", "down_w", "down_b",
            "k_cache", "v_cache")),
        *((name, ctypes.POINTER(QuantLinear)) for name in ("qkv_q", "o_q", "gate_up_q", "down_q")),
        # The LM head (llama_decode_head): NULL when the step ends at the final norm.
        ("lm_head", PTR), ("vocab", ctypes.c_int64),
        ("lm_head_q", ctypes.POINTER(QuantLinear)),  # NULL: the dense lm_head
        ("embed_q", ctypes.POINTER(QuantLinear)), ("embed_rows", ctypes.c_int64),  # NULL: the dense embed
        ("threads", ctypes.c_int64),  # 0: torch's thread count
        # LoRA: per layer [num_layers] slots of the four linear layers (NULL: none), rank, dtype.
        *((name, ctypes.POINTER(LoraLinear)) for name in ("lora_qkv", "lora_o", "lora_gate_up", "lora_down")),
        ("lora_rank", ctypes.c_int64), ("lora_dtype", ctypes.c_int64),
        ("lora_slots", PTR),  # per step: each row's slot (int32, -1: none), or NULL
        # Qwen3's per-head RMSNorm of q and k before RoPE: per layer [num_layers] weights (NULL: none).
        ("q_norm", _PP), ("k_norm", _PP),
        # Gemma 3: Gemma's norms and GELU-tanh (gemma 1), the embedding scale (0: none), the norms
        # of the sublayer outputs (NULL: none); per layer its window, RoPE tables and KV group
        # (NULL: the model-wide ones, one group); per step each group's slots and block tables.
        ("gemma", ctypes.c_int64), ("embed_scale", ctypes.c_float),
        ("attn_out_norm", _PP), ("mlp_out_norm", _PP),
        ("layer_window", PTR), ("layer_cos", _PP), ("layer_sin", _PP), ("layer_group", PTR),
        ("group_slots", _PP), ("group_tables", _PP),
        # Mixture-of-experts layers: experts, top-k, each expert's width, renormalise, float32
        # routing weights; per layer [num_layers] the router and stacked expert weights (NULL
        # router: a dense MLP; NULL router_w: no such layers).
        *((name, ctypes.c_int64) for name in ("num_experts", "top_k", "expert_inter", "moe_renorm",
                                              "moe_f32_weights")),
        ("router_w", _PP), ("experts_w13", _PP), ("experts_w2", _PP),
    ]


_STEP_ARGS = (Arg("md", ctypes.POINTER(LlamaDecodeModel)), i64("M"), ptr("input_ids"), ptr("positions"),
              ptr("slot_mapping"), ptr("block_tables"), i64("bt_stride"), ptr("seq_lens"))
LLAMA_DECODE_STEP = Kernel("llama_decode_step", I32, (*_STEP_ARGS, ptr("out")))
LLAMA_DECODE_HEAD = Kernel("llama_decode_head", I32, (
    *_STEP_ARGS, i64("S"), ptr("sample_rows"), ptr("logits"), ptr("tokens"), ptr("mask"), i64("ldm"),
    ptr("mask_rows")))
ARGMAX_ROWS = Kernel("argmax_rows", I32, (ptr("x"), i64("ldx"), i64("S"), i64("V"), i32("dt"), ptr("out")))
DECODE = Library("llama_decode.c", (SMALL_M_AVAILABLE, SMALL_M_AMX_FROM, SMALL_M_ROW1, LLAMA_DECODE_STEP, LLAMA_DECODE_HEAD,
                                    ARGMAX_ROWS),
                 lambda: envs.PAGEDLLM_NATIVE_DECODE)

# sampling.c: top-p cut-offs and draws of sampled rows; structured output's token bitmask.
TOP_P_CUTS = Kernel("top_p_cuts", I32, (ptr("x"), i64("ldx"), i64("S"), i64("V"), ptr("top_p"), ptr("cut")))
SAMPLE_ROWS = Kernel("sample_rows", I32, (
    ptr("x"), i64("ldx"), i64("S"), i64("V"), ptr("temperature"), ptr("top_p"), ptr("min_p"), ptr("u"),
    ptr("tokens")))
APPLY_TOKEN_BITMASK = Kernel("apply_token_bitmask", I32, (
    ptr("x"), i64("ldx"), i64("V"), ptr("mask"), i64("ldm"), ptr("logit_rows"), ptr("mask_rows"), i64("R")))
SAMPLING = Library("sampling.c", (TOP_P_CUTS, SAMPLE_ROWS, APPLY_TOKEN_BITMASK), lambda: envs.PAGEDLLM_NATIVE_SAMPLING)

# lora.c: the LoRA deltas of rows of several adapters in one call.
LORA_SGMV = Kernel("lora_sgmv", I32, (
    ptr("x"), i64("ldx"), i32("x_dt"), i64("T"), ptr("slots"), ptr("a"), ptr("bt"), ptr("ap"), ptr("bp"),
    i32("w_dt"), *_ints("num_slices", "R"), ptr("ranges"), *_ints("K", "N"), ptr("y"), i64("ldy"), i32("y_dt")))
LORA_AMX_AVAILABLE = Kernel("lora_amx_available", I32)
LORA = Library("lora.c", (LORA_SGMV, LORA_AMX_AVAILABLE), lambda: envs.PAGEDLLM_NATIVE_LORA)

LIBRARIES = (ATTENTION, FLASH, LINEAR, ELEMENTWISE, QUANT, DECODE, SAMPLING, LORA)
