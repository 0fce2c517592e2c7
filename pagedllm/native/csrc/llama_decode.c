/*
 * One decode step of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2, Qwen3) or of Gemma 3
 * in a single native call: embedding (Gemma: times sqrt(hidden)) -> per layer [RMSNorm, QKV,
 * (Qwen3, Gemma 3: RMSNorm of each query and key head), RoPE, KV write, paged attention, O,
 * (Gemma 3: RMSNorm,) residual, RMSNorm, gate|up, SiLU*mul (Gemma 3: GELU-tanh*mul), down,
 * (Gemma 3: RMSNorm,) residual] -> final RMSNorm, for up to MAX_ROWS decode tokens. Gemma 3's
 * layers each have their own window, RoPE table and KV group (block tables and slots of their
 * group), and its norms are Gemma's (x * (1 + w), rounded once). A layer may have a mixture of
 * experts in place of the MLP (Qwen3-MoE, Mixtral: router_w): each thread routes every row for
 * itself (router GEMM, float32 softmax, top-k, renormalised), then computes its share of every
 * active expert's gate|up rows and down columns on the rows routed to that expert, and sums each
 * token's experts in ascending expert order, rounding as the torch path's FusedMoE.
 *
 * A decode step is a pass over the weights with a few rows of activations. Run as torch ops it is
 * about 80 small ops per layer, each paying Python dispatch; here the whole stack is one call and
 * the step's time is the weight reads. The paged attention is the same C function the model
 * runner calls for every other step (paged_attention.c, included below).
 *
 * Element types: dense weights, activations and the KV cache all float32 (dt 0), all bfloat16 (dt 1),
 * or all float16 (dt 2: AVX2 + F16C builds, dense layers only, its norms, SiLU and RoPE in the
 * scalar loops below, with the torch path's rounding points).
 * bf16 follows the rounding points of pagedllm's torch path (each op computes in float32 and
 * rounds its result to bf16; RMSNorm normalizes in float32, rounds, then scales by the weight); its
 * bf16 RMSNorm, RoPE and SiLU*mul are the torch path's own kernels (elementwise_bf16.c, included
 * below), so the two paths agree to the last bit except for the order of sums inside GEMMs.
 *
 * Threads: the step runs in one OpenMP parallel region (a team of torch's thread count), not one per
 * kernel: each thread normalizes the residual stream for itself, computes an equal share of every
 * GEMM's output rows (equal weight bytes), RoPE, KV writes and attention for its share of the
 * (row, KV head) items (shares of equal keys, attention_split), and SiLU*mul of the gate rows it
 * computed; a barrier stands only where the next op reads what other threads wrote (five per
 * layer). Every output element is computed as on one thread, so the team's results are the
 * one-thread step's to the bit. Models with quantized
 * linear layers run the step on the calling thread instead, each GEMM and quantized kernel with
 * its own team, as the torch path calls them. The caller may cap the threads (`threads`): a team
 * waits at each of its barriers for its slowest thread, so while another process holds a core
 * nearly every barrier waits for a descheduled thread's next time slice, and one thread is faster.
 *
 * llama_decode_head runs the same step on to the LM head: the logits of the rows that sample and,
 * for batches that sample greedily with nothing else, their argmax.
 *
 * GEMMs are the small-M kernel of small_m_gemm.c (included below), which the torch path also uses
 * for decode rows. Each of a layer's four linear layers may instead be quantized (4-bit group codes
 * of int4 / GGUF / AWQ / GPTQ, int8 codes, fp8 e4m3, w8a8's row-major int8 codes): then it runs the
 * same function of linear_quant.c (included below) that the torch path's LinearMethod calls, on
 * the same bf16 activations (w8a8: on the activations in dt, quantized per row as the torch path
 * does), so a quantized layer's output is the torch path's to the bit whenever its input is.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.c"
#include "elementwise_bf16.c"
#include "small_m_gemm.c"
/* linear_quant.c names its own tile sizes; small_m_gemm.c's are no longer needed here. */
#undef MR
#undef NR
#include "linear_quant.c"
#include "lora.c"

/* The unit of output rows a thread's share of a dense GEMM comes in: small_m_gemm.c's W block. */
#define SHARE_ROWS 4

#ifdef LQ_HAVE_KERNELS
#define LD_HAVE_QUANT 1 /* linear_quant.c compiled its kernels (AVX-512 BF16, or AVX2 + FMA) */
#else
#define LD_HAVE_QUANT 0
#endif

#define MAX_ROWS 256
#define MAX_EXPERTS 512 /* most experts of a mixture-of-experts layer */

/* How one linear layer's weight is kept: LQ_DENSE reads the layer's dense weight (the per-layer
 * *_w pointers, in dtype); the others are linear_quant.c's layouts (its BITS values): 4-bit and
 * int8 codes tiled by 16 output rows, e4m3 bytes [N, K], with bf16 scales and zeros per group. */
enum { LQ_DENSE = 0, LQ_E4M3 = 3, LQ_INT4 = 4, LQ_INT8 = 8, LQ_W8A8 = 9 };
/* How a quantized layer takes its activations (QuantLinear.int8_act): bf16, int8 per block of 32
 * inputs (4-bit and int8 tiles), or int8 with one scale per row (w8a8's row-major codes, whose
 * scales are fp32 [N] and whose "zeros" are the codes' int32 row sums; x goes in in dt). */
enum { ACT_BF16 = 0, ACT_INT8_BLOCK = 1, ACT_INT8_ROW = 2 };

typedef struct {
    int64_t kind;        /* LQ_* */
    int64_t group;       /* inputs per scale and zero */
    const void *codes, *scales, *zeros;
    const int64_t *perm; /* the input order the codes follow (GPTQ act-order), or NULL */
    int64_t int8_act;    /* ACT_*: 4-bit and int8 tiles: ACT_INT8_BLOCK (VNNI) or ACT_BF16; LQ_W8A8: ACT_INT8_ROW */
} QuantLinear;

/* One linear layer's LoRA slots (lora.c's layout): A [slots, n, K], B^T [slots, n, N] with
 * n = num_slices * rank, and each slice's [first, one past the last] output column. a NULL: the
 * layer has no LoRA. ap, bp: the same slots in the AMX tiles' layout (lora_amx.h), or NULL. */
typedef struct {
    const void *a, *bt;
    const int64_t *ranges;
    int64_t num_slices;
    const void *ap, *bp;
} LoraLinear;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t dtype;  /* LD_F32, LD_BF16 or LD_F16 (dense layers only): weights, activations and KV cache */
    int64_t block_size, sliding_window, max_position;
    float eps, attn_scale;
    const void *embed;      /* [vocab, hidden] */
    const void *final_norm; /* [hidden] */
    const void *cos, *sin;  /* [max_position, head_dim] */
    /* Per layer, [num_layers] arrays of pointers; biases may be NULL. */
    const void *const *input_norm, *const *post_norm;
    const void *const *qkv_w, *const *qkv_b, *const *o_w, *const *o_b;
    const void *const *gate_up_w, *const *gate_up_b, *const *down_w, *const *down_b;
    void *const *k_cache, *const *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
    /* Per layer, [num_layers] arrays of descriptors of the four linear layers; NULL: all dense. */
    const QuantLinear *qkv_q, *o_q, *gate_up_q, *down_q;
    /* The LM head (llama_decode_head); NULL when the step ends at the final norm. */
    const void *lm_head; /* [vocab, hidden] */
    int64_t vocab;
    const QuantLinear *lm_head_q; /* the LM head's quantized codes (decode rows), or NULL: lm_head */
    /* The embedding's codes (linear_quant.c's layouts, embed_rows rows), or NULL: the dense embed. */
    const QuantLinear *embed_q;
    int64_t embed_rows;
    /* Threads of the step (and of the kernels it calls): 0 for torch's thread count, else this
     * many (the caller drops to 1 while another process holds a core; see native_decode.py). */
    int64_t threads;
    /* LoRA adapters (the server's --enable-lora): per layer, [num_layers] arrays of the four linear
     * layers' slots, or NULL; their rank (every slot's) and dtype (LD_F32 or LD_BF16). */
    const LoraLinear *lora_qkv, *lora_o, *lora_gate_up, *lora_down;
    int64_t lora_rank, lora_dtype;
    /* Per step: each row's adapter slot (-1: none), or NULL when no row of the step has one. */
    const int32_t *lora_slots;
    /* Qwen3's q/k norms: per layer, [num_layers] arrays of the RMSNorm weights [head_dim] applied
     * to each query and key head after the QKV projection and before RoPE (eps: eps); NULL: none. */
    const void *const *q_norm, *const *k_norm;
    /* Gemma 3 (all NULL / 0 for the Llama family and Qwen3). gemma 1: every RMSNorm is Gemma's
     * (float32 statistics, times 1 + w in float32, rounded once: GemmaRMSNorm) and the MLP's gate
     * goes through GELU (tanh approximation) instead of SiLU. embed_scale: the embedding rows times
     * this value (rounded to dtype), 0 for none. attn_out_norm / mlp_out_norm: per layer, the norms
     * of the attention's and the MLP's outputs before they join the residual stream (NULL: none). */
    int64_t gemma;
    float embed_scale;
    const void *const *attn_out_norm, *const *mlp_out_norm;
    /* Per layer ([num_layers]): its window of keys (0: every key; NULL: sliding_window for all),
     * its RoPE tables (NULL: cos / sin for all) and its KV group (NULL: one group). */
    const int64_t *layer_window;
    const void *const *layer_cos, *const *layer_sin;
    const int64_t *layer_group;
    /* Per step, with layer_group: each KV group's slot_mapping [M] and block tables [M, bt_stride]
     * (group 0's are the call's own); NULL without groups. */
    const int64_t *const *group_slots, *const *group_tables;
    /* Mixture-of-experts layers (Qwen3-MoE, Mixtral, OLMoE): per layer ([num_layers]) its router
     * [num_experts, hidden] (NULL: the layer's MLP is the dense gate_up_w / down_w), its experts'
     * stacked [gate | up] [num_experts, 2 * expert_inter, hidden] and down [num_experts, hidden,
     * expert_inter]. Each token takes its top_k experts by the float32 softmax of its router
     * logits, renormalised over the k when moe_renorm; the weights scale the experts' outputs in
     * float32 (moe_f32_weights: Mixtral) or rounded to dtype. router_w NULL: no such layers. */
    int64_t num_experts, top_k, expert_inter, moe_renorm, moe_f32_weights;
    const void *const *router_w, *const *experts_w13, *const *experts_w2;
} LlamaDecodeModel;

/* The value as stored in dtype dt, read back as float32 (rounds to bf16 or float16). */
static inline float round_dt(float v, int dt) {
    if (dt == LD_F32) return v;
    uint16_t h;
    st(&h, 0, v, dt);
    return ld(&h, 0, dt);
}

/* 1 / sqrt(mean(x[m]^2) + eps) of row m of x [M, H], summed in float32 in order (the scalar norms). */
static float inv_rms(const void *x, int64_t m, int64_t H, float eps, int dt) {
    float ss = 0.0f;
    for (int64_t i = 0; i < H; i++) {
        const float v = ld(x, m * H + i, dt);
        ss += v * v;
    }
    return 1.0f / sqrtf(ss / (float)H + eps);
}

/* out[m] = RMSNorm(x[m]) * weight: float32 statistics; bf16 rounds the normalized row before the
 * weight multiplies it (as the torch path does). */
static void rms_norm(const void *x, int64_t M, int64_t H, const void *weight, float eps, void *out, int dt) {
#if defined(ELEMENTWISE_BF16)
    if (dt == LD_BF16 && H % 16 == 0) { /* the torch path's kernel (elementwise_bf16.c) */
        for (int64_t m = 0; m < M; m++)
            rms_norm_bf16_row((const uint16_t *)x + m * H, NULL, NULL, weight, H, eps, (uint16_t *)out + m * H);
        return;
    }
#endif
    if (dt == LD_F32) { /* the torch path's kernel (without AVX-512, its plain-loop form) */
        for (int64_t m = 0; m < M; m++)
            rms_norm_f32_row((const float *)x + m * H, NULL, NULL, weight, H, eps, (float *)out + m * H);
        return;
    }
    for (int64_t m = 0; m < M; m++) {
        const float inv = inv_rms(x, m, H, eps, dt);
        for (int64_t i = 0; i < H; i++)
            st(out, m * H + i, round_dt(ld(x, m * H + i, dt) * inv, dt) * ld(weight, i, dt), dt);
    }
}

/* x[m, lo:hi] += y[m, lo:hi] (the residual stream, rows of N), rounded to dtype. */
static void add_inplace(void *x, const void *y, int64_t M, int64_t N, int64_t lo, int64_t hi, int dt) {
    if (dt == LD_F32) { /* a plain loop the compiler vectorizes */
        for (int64_t m = 0; m < M; m++) {
            float *xr = (float *)x + m * N;
            const float *yr = (const float *)y + m * N;
            for (int64_t i = lo; i < hi; i++) xr[i] += yr[i];
        }
        return;
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = m * N + lo; i < m * N + hi; i++) st(x, i, ld(x, i, dt) + ld(y, i, dt), dt);
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i] for i in [lo, hi), each op rounded to dtype. */
static void silu_mul(const void *gu, int64_t M, int64_t I, void *out, int dt, int64_t lo, int64_t hi) {
#if defined(ELEMENTWISE_BF16)
    if (dt == LD_BF16 && lo % 16 == 0 && (hi - lo) % 16 == 0) { /* the torch path's kernel */
        for (int64_t m = 0; m < M; m++) {
            const uint16_t *g = (const uint16_t *)gu + m * 2 * I;
            silu_mul_bf16_span(g + lo, g + I + lo, hi - lo, (uint16_t *)out + m * I + lo);
        }
        return;
    }
#endif
    if (dt == LD_F32) { /* the torch path's kernel (elementwise_bf16.c; without AVX-512, its plain-loop form) */
        for (int64_t m = 0; m < M; m++) {
            const float *g = (const float *)gu + m * 2 * I;
            silu_mul_f32_span(g, g + I, lo, hi, (float *)out + m * I);
        }
        return;
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = lo; i < hi; i++) {
            const float g = ld(gu, m * 2 * I + i, dt), u = ld(gu, m * 2 * I + I + i, dt);
            st(out, m * I + i, round_dt(g / (1.0f + expf(-g)), dt) * u, dt);
        }
}

#include "gemma_decode.c"

/* The model's RMSNorm of M rows of H: Gemma's or the Llama family's. */
static inline void norm_rows(const LlamaDecodeModel *md, const void *x, int64_t M, int64_t H, const void *weight,
                             void *out, int dt) {
    if (md->gemma)
        gemma_rms_norm(x, M, H, weight, md->eps, out, dt);
    else
        rms_norm(x, M, H, weight, md->eps, out, dt);
}

/* Rotate-half RoPE of `heads` heads of one row, read from src and written to dst (may alias):
 * out = x * cos + rotate_half(x) * sin, each product rounded to dtype before the sum. */
static void rope_row(const void *src, int64_t src_off, void *dst, int64_t dst_off, int64_t heads, int64_t D,
                     const void *cos, const void *sin, int64_t pos, int dt) {
    const int64_t half = D / 2;
#if defined(ELEMENTWISE_BF16)
    if (dt == LD_BF16 && half % 16 == 0) { /* the torch path's kernel */
        rope_bf16_row((const uint16_t *)src + src_off, heads * D, D, (const uint16_t *)cos + pos * D,
                      (const uint16_t *)sin + pos * D, (uint16_t *)dst + dst_off);
        return;
    }
#endif
    if (dt == LD_F32 && half % 16 == 0) { /* the torch path's kernel (without AVX-512, its plain-loop form) */
        rope_f32_row((const float *)src + src_off, heads * D, D, (const float *)cos + pos * D,
                     (const float *)sin + pos * D, (float *)dst + dst_off);
        return;
    }
    float buf[1024];
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t i = 0; i < D; i++) buf[i] = ld(src, src_off + h * D + i, dt);
        for (int64_t i = 0; i < D; i++) {
            const float rot = i < half ? -buf[i + half] : buf[i - half];
            const float c = ld(cos, pos * D + i, dt), s = ld(sin, pos * D + i, dt);
            st(dst, dst_off + h * D + i, round_dt(buf[i] * c, dt) + round_dt(rot * s, dt), dt);
        }
    }
}

/* Whether the step can run these linear layers (quantized ones need linear_quant.c's kernels). */
static int linears_supported(const QuantLinear *ql, int64_t num_layers) {
    if (ql == NULL) return 1;
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t k = ql[l].kind;
        if (k != LQ_DENSE && (!LD_HAVE_QUANT || (k != LQ_INT4 && k != LQ_INT8 && k != LQ_E4M3 && k != LQ_W8A8))) return 0;
        if ((k == LQ_W8A8) != (ql[l].int8_act == ACT_INT8_ROW)) return 0;
    }
    return 1;
}

/*
 * y[M, N] = x[M, K] W^T (+ bias) in dtype dt. Dense: the small-M GEMM, of rows [lo, hi) of y on
 * the calling thread inside the step's team, or of all rows over its own OpenMP team outside one
 * (team 0). Quantized (always outside a team, all rows): as the torch path's LinearMethod.apply,
 * x rounded to bf16 (in the layer's input order where it has one; w8a8: x in dt), the kernel's result in dt
 * (float32 straight from its accumulators, or rounded to bf16), then the bias added and rounded
 * to dt. xb: scratch for M * K bf16 values.
 */
static void linear(const QuantLinear *ql, const void *x, int64_t M, const void *w, const void *bias, int64_t N,
                   int64_t K, void *y, int dt, uint16_t *xb, int team, int64_t lo, int64_t hi) {
    if (ql == NULL || ql->kind == LQ_DENSE) {
        if (team)
            gemm_rows(x, M, w, bias, N, K, y, dt, lo, hi);
        else
            gemm(x, M, w, bias, N, K, y, dt);
        return;
    }
#if LD_HAVE_QUANT
    const int y_f32 = dt == LD_F32;
    if (ql->kind == LQ_W8A8) { /* x as it is, in dt: quantized per row from there, as the torch path does */
        w8a8_linear(x, M, ql->codes, ql->scales, ql->zeros, N, K, y, y_f32);
    } else {
        const uint16_t *xq = (const uint16_t *)x;
        if (dt == LD_F32 || ql->perm != NULL) {
            for (int64_t m = 0; m < M; m++)
                for (int64_t k = 0; k < K; k++) {
                    const int64_t src = m * K + (ql->perm != NULL ? ql->perm[k] : k);
                    xb[m * K + k] = dt == LD_F32 ? f32_to_bf16(((const float *)x)[src]) : ((const uint16_t *)x)[src];
                }
            xq = xb;
        }
        if (ql->kind == LQ_INT4)
            int4_linear_bf16(xq, M, ql->codes, ql->scales, ql->zeros, N, K, ql->group, y, y_f32, (int)ql->int8_act);
        else if (ql->kind == LQ_INT8)
            int8_linear_bf16(xq, M, ql->codes, ql->scales, ql->zeros, N, K, ql->group, y, y_f32, (int)ql->int8_act);
        else
            e4m3_linear_bf16(xq, M, ql->codes, ql->scales, ql->zeros, N, K, ql->group, y, y_f32, 0);
    }
    if (bias != NULL)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) st(y, m * N + n, ld(y, m * N + n, dt) + ld(bias, n, dt), dt);
#endif
}

/* The descriptor of layer l's linear, or NULL (dense). */
static inline const QuantLinear *qlin(const QuantLinear *ql, int64_t l) { return ql == NULL ? NULL : ql + l; }

static void *alloc(int64_t bytes) { return aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64)); }

/* Waits for the other threads of the step's team (team 1); nothing outside a team. */
static inline void team_sync(int team) {
    if (team) {
#pragma omp barrier
    }
}

/* Item (row, KV head) work of the attention split, besides one unit per key: its RoPE and KV write. */
#define ITEM_COST 16

/* The first item of thread t's share of the step's M * KVH (row, KV head) items: contiguous shares
 * of about equal work (each item's keys, seq_lens[m], plus ITEM_COST), so that a batch of mixed
 * context lengths does not leave one thread waiting at the barrier after attention. Every thread
 * computes the same boundaries. */
static int64_t attention_split(const int64_t *seq_lens, int64_t M, int64_t KVH, int t, int nth) {
    if (t <= 0) return 0;
    if (t >= nth) return M * KVH;
    int64_t total = 0;
    for (int64_t m = 0; m < M; m++) total += (seq_lens[m] + ITEM_COST) * KVH;
    const int64_t target = total * t / nth;
    int64_t done = 0;
    for (int64_t it = 0; it < M * KVH; it++) {
        if (done >= target) return it;
        done += seq_lens[it / KVH] + ITEM_COST;
    }
    return M * KVH;
}

/* One step's arguments and scratch, shared by the threads that run it. */
typedef struct {
    const LlamaDecodeModel *md;
    int64_t M, bt_stride;
    const int64_t *positions, *slot_mapping, *block_tables, *seq_lens, *qsl, *work;
    /* Shared activations; xn holds one [M, hidden] row set per thread (each normalizes for itself). */
    void *x, *xn, *qkv, *q, *attn, *o, *gu, *act;
    uint16_t *xb;
    /* 1: the step runs in one OpenMP team, each thread its share of every op and a barrier where
     * the next op reads what other threads wrote; 0: on the calling thread, each GEMM and the
     * attention opening their own team as the torch path's calls do (models with quantized layers,
     * whose kernel opens its own). */
    int team;
    /* 1: some rows are consecutive positions of one sequence (speculative decoding verifies a
     * request's proposals as rows of their own), so a row's attention reads K/V that another
     * thread's rows write in the same layer: a barrier stands between the writes and the attention. */
    int chained;
    /* llama_decode_head: S sample rows, their normed rows (one set per thread), the LM head's
     * result y [S, vocab], and each thread's argmax of its vocab share (index, value, NaN). */
    int64_t S;
    const int64_t *sample_rows;
    void *hs, *y;
    float *logits, *part_max;
    int64_t *part_idx;
    int *part_nan;
    /* Structured output: row mask_rows[s] of mask (int32 words, ldm apart; -1: no mask) allows
     * the tokens of sample row s whose bits are set; the others become -inf before the argmax. */
    const int32_t *mask;
    int64_t ldm;
    const int64_t *mask_rows;
    /* LoRA rows (md->lora_slots): ordered by slot in blocks of <= LORA_RB_MAX (lora_plan). lora_buf
     * holds h of every block, shared by the team (lora_hsize floats, lora_hblock a block), then
     * each thread's scratch for a block's rows (lora_scratch floats a thread). */
    int64_t lora_nblocks, lora_hsize, lora_hblock, lora_scratch;
    const int64_t *lora_order, *lora_blocks;
    float *lora_buf;
    /* Mixture-of-experts layers: the rows of the (token, expert) pairs grouped by expert, shared
     * ([M * top_k, hidden] expert outputs in ye; gu and act hold the pairs' rows), and each thread's
     * own routing (moe_scratch bytes a thread in moe_buf: moe_carve, moe_route). */
    void *ye;
    char *moe_buf;
    int64_t moe_scratch;
} Step;

#if defined(LORA_BLOCKS)
/* h of the LoRA rows of blocks [b_lo, b_hi) of the step (their slot's A times x [M, K]), for
 * one linear layer; xf: this thread's scratch. */
static void lora_shrink_step(const Step *c, const LoraLinear *ll, const void *x, int64_t K, float *h, float *xf,
                             int64_t b_lo, int64_t b_hi, void *pf) {
    const LlamaDecodeModel *md = c->md;
    const int wdt = (int)md->lora_dtype, dt = (int)md->dtype;
    const int64_t R = md->lora_rank, n = ll->num_slices * R, es = wdt == LD_F32 ? 4 : 2;
    const int amx = lora_amx_take(ll->ap, ll->bp, dt, wdt, K);
#if HAVE_AMX_BF16
    const int64_t pa = lora_amx_a_elems(n, K);
#else
    const int64_t pa = 0;
#endif
    for (int64_t bi = b_lo; bi < b_hi; bi++) {
        const int64_t b0 = c->lora_blocks[bi], s = md->lora_slots[c->lora_order[b0]];
        const int nb = (int)(c->lora_blocks[bi + 1] - b0);
        lora_h(amx, x, K, dt, c->M, c->lora_order + b0, nb, (const char *)ll->a + s * n * K * es,
               amx ? (const uint16_t *)ll->ap + s * pa : NULL, wdt, ll->num_slices, R, K, xf, h + bi * c->lora_hblock, pf);
    }
    lora_tiles_end(amx);
}

/* y[m, lo:hi] += the LoRA rows' deltas from h (lora_shrink_step), y [M, N] in the step's dtype;
 * K: the layer's inputs. */
static void lora_expand_step(const Step *c, const LoraLinear *ll, const float *h, int64_t K, int64_t N, void *y,
                             int64_t lo, int64_t hi, void *pf) {
    const LlamaDecodeModel *md = c->md;
    const int wdt = (int)md->lora_dtype, dt = (int)md->dtype;
    const int64_t R = md->lora_rank, n = ll->num_slices * R, es = wdt == LD_F32 ? 4 : 2;
    const int64_t ys = dt == LD_F32 ? 4 : 2;
    const int amx = lora_amx_take(ll->ap, ll->bp, dt, wdt, K);
#if HAVE_AMX_BF16
    const int64_t pb = lora_amx_b_elems(ll->num_slices, R, N);
#else
    const int64_t pb = 0;
#endif
    for (int64_t bi = 0; bi < c->lora_nblocks; bi++) {
        const int64_t b0 = c->lora_blocks[bi], s = md->lora_slots[c->lora_order[b0]];
        const int nb = (int)(c->lora_blocks[bi + 1] - b0);
        char *yt[LORA_RB_MAX] = {0};
        for (int r = 0; r < nb; r++) yt[r] = (char *)y + c->lora_order[b0 + r] * N * ys;
        lora_expand(amx, h + bi * c->lora_hblock, nb, (const char *)ll->bt + s * n * N * es,
                    amx ? (const uint16_t *)ll->bp + s * pb : NULL, wdt, ll->num_slices, R, ll->ranges, N, lo, hi, yt,
                    dt, pf);
    }
    lora_tiles_end(amx);
}

#if HAVE_AMX_BF16
/* The runs of packed A and B^T lora_apply reads on this thread, in its order (lora_amx.h's
 * LoraAmxPf): the A of its blocks [b_lo, b_hi), then every block's B^T over columns [lo, hi),
 * then over [lo2, hi2). */
static void lora_pf_plan(const Step *c, const LoraLinear *ll, int64_t K, int64_t N, int64_t b_lo, int64_t b_hi,
                         int64_t lo, int64_t hi, int64_t lo2, int64_t hi2, LoraAmxPf *pf) {
    const int64_t R = c->md->lora_rank, n = ll->num_slices * R;
    const int64_t pa = lora_amx_a_elems(n, K), pb = lora_amx_b_elems(ll->num_slices, R, N);
    lora_amx_pf_init(pf);
    for (int64_t bi = b_lo; bi < b_hi; bi++)
        lora_amx_pf_a(pf, (const uint16_t *)ll->ap + c->md->lora_slots[c->lora_order[c->lora_blocks[bi]]] * pa, n, K);
    for (int pass = 0; pass < 2; pass++) {
        const int64_t l0 = pass ? lo2 : lo, l1 = pass ? hi2 : hi;
        for (int64_t bi = 0; bi < c->lora_nblocks && l1 > l0; bi++)
            lora_amx_pf_b(pf, (const uint16_t *)ll->bp + c->md->lora_slots[c->lora_order[c->lora_blocks[bi]]] * pb,
                          ll->num_slices, R, ll->ranges, N, l0, l1);
    }
    lora_amx_pf_advance(pf, LORA_AMX_LEAD);
}
#endif
#endif

/* Layer l's LoRA of one linear layer where the step has LoRA rows and the layer has slots, or NULL. */
static inline const LoraLinear *lora_of(const Step *c, const LoraLinear *ll, int64_t l) {
    return c->lora_nblocks > 0 && ll != NULL && ll[l].a != NULL ? ll + l : NULL;
}

/* The LoRA deltas of a linear layer's rows after its base GEMM wrote y[:, lo:hi) (and, for
 * gate|up, y[:, lo2:hi2)), for thread tid of nth: h from x, then the expand over those columns.
 * In a team each thread computes h of its share of the blocks into the team's h and waits for the
 * others before its expand (every block's h is the same bits whichever thread computes it; the
 * next write of h, the next layer's, comes after the team's barrier that follows every sublayer). */
static void lora_apply(const Step *c, const LoraLinear *ll, const void *x, int64_t K, void *y, int64_t N,
                       int64_t lo, int64_t hi, int64_t lo2, int64_t hi2, int tid, int nth) {
#if defined(LORA_BLOCKS)
    if (ll == NULL) return;
    float *h = c->lora_buf, *xf = c->lora_buf + c->lora_hsize + tid * c->lora_scratch;
    const int64_t nb = c->lora_nblocks, b_lo = c->team ? nb * tid / nth : 0, b_hi = c->team ? nb * (tid + 1) / nth : nb;
    void *pf = NULL;
#if HAVE_AMX_BF16
    LoraAmxPf pfs;
    if (lora_amx_take(ll->ap, ll->bp, (int)c->md->dtype, (int)c->md->lora_dtype, K)) {
        lora_pf_plan(c, ll, K, N, b_lo, b_hi, lo, hi, lo2, hi2, &pfs);
        pf = &pfs;
    }
#endif
    lora_shrink_step(c, ll, x, K, h, xf, b_lo, b_hi, pf);
    team_sync(c->team);
    lora_expand_step(c, ll, h, K, N, y, lo, hi, pf);
    if (hi2 > lo2) lora_expand_step(c, ll, h, K, N, y, lo2, hi2, pf);
#else
    (void)c, (void)ll, (void)x, (void)K, (void)y, (void)N, (void)lo, (void)hi, (void)lo2, (void)hi2, (void)tid,
        (void)nth;
#endif
}

/* The residual add of a sublayer's output c->o (columns [lo, hi) of each row: this thread's): as it
 * is, or (Gemma 3) through layer l's norm of its output, `norms`. The norm reads whole rows, which
 * other threads of a team wrote: it waits for them, then each thread norms every row into its
 * own scratch xn and adds its columns. */
static void add_normed(const Step *c, const void *const *norms, int64_t l, void *xn, int64_t lo, int64_t hi) {
    const LlamaDecodeModel *md = c->md;
    const int dt = (int)md->dtype;
    if (norms == NULL) {
        add_inplace(c->x, c->o, c->M, md->hidden, lo, hi, dt);
        return;
    }
    team_sync(c->team);
    norm_rows(md, c->o, c->M, md->hidden, norms[l], xn, dt);
    add_inplace(c->x, xn, c->M, md->hidden, lo, hi, dt);
}

/* One thread's routing of the step's rows (every thread of a team computes the same, for
 * itself): the router logits; each (token, slot) pair's expert and weight; the pairs grouped by
 * expert in ascending order, tokens ascending inside an expert (the torch path's stable sort):
 * their tokens (rows), weights (w) and input rows (xe), and each expert's first pair (start,
 * start[E] = M * top_k). */
typedef struct {
    void *logits, *xe;
    int64_t *rows, *start, *eid;
    float *w, *wt;
} MoeRoute;

/* Carves one thread's MoeRoute out of buf (NULL: only counts); returns its bytes. */
static int64_t moe_carve(const LlamaDecodeModel *md, int64_t M, char *buf, MoeRoute *r) {
    const int64_t E = md->num_experts, P = M * md->top_k, es = md->dtype == LD_F32 ? 4 : 2;
    const int64_t sizes[7] = {M * E * es, P * md->hidden * es, P * 8, (E + 1) * 8, P * 8, P * 4, P * 4};
    void *parts[7];
    int64_t off = 0;
    for (int i = 0; i < 7; i++) {
        parts[i] = buf == NULL ? NULL : buf + off;
        off += (sizes[i] + 63) / 64 * 64;
    }
    if (r != NULL) {
        r->logits = parts[0], r->xe = parts[1], r->rows = (int64_t *)parts[2], r->start = (int64_t *)parts[3];
        r->eid = (int64_t *)parts[4], r->w = (float *)parts[5], r->wt = (float *)parts[6];
    }
    return off;
}

/* Routes the normed rows xn (this thread's) through layer l's router into r, as the torch path's
 * route(): router logits in dtype, their softmax in float32, the top_k (the larger first, the
 * lower expert on ties), renormalised over the k (moe_renorm), the weights in float32
 * (moe_f32_weights) or rounded to dtype; then the pairs grouped by expert (a counting sort). */
static void moe_route(const Step *c, int64_t l, const void *xn, const MoeRoute *r) {
    const LlamaDecodeModel *md = c->md;
    const int dt = (int)md->dtype;
    const int64_t M = c->M, E = md->num_experts, K = md->top_k, Hd = md->hidden, es = dt == LD_F32 ? 4 : 2;
    float p[MAX_EXPERTS];
    gemm_rows(xn, M, md->router_w[l], NULL, E, Hd, r->logits, dt, 0, E);
    for (int64_t e = 0; e <= E; e++) r->start[e] = 0;
    for (int64_t m = 0; m < M; m++) {
        float mx = -INFINITY, sum = 0.0f, ksum = 0.0f;
        for (int64_t e = 0; e < E; e++) p[e] = ld(r->logits, m * E + e, dt), mx = p[e] > mx ? p[e] : mx;
        for (int64_t e = 0; e < E; e++) p[e] = expf(p[e] - mx), sum += p[e];
        const float inv = 1.0f / sum;
        for (int64_t e = 0; e < E; e++) p[e] *= inv;
        int64_t *ids = r->eid + m * K;
        for (int64_t k = 0; k < K; k++) { /* the largest not yet taken */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t j = 0; j < k; j++) taken |= ids[j] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            ids[k] = best, r->wt[m * K + k] = p[best], ksum += p[best];
            r->start[best + 1]++;
        }
        for (int64_t k = 0; k < K; k++) {
            float w = md->moe_renorm ? r->wt[m * K + k] / ksum : r->wt[m * K + k];
            r->wt[m * K + k] = md->moe_f32_weights ? w : round_dt(w, dt);
        }
    }
    for (int64_t e = 0; e < E; e++) r->start[e + 1] += r->start[e];
    int64_t next[MAX_EXPERTS];
    for (int64_t e = 0; e < E; e++) next[e] = r->start[e];
    for (int64_t i = 0; i < M * K; i++) { /* (token, slot) order: tokens ascending inside each expert */
        const int64_t j = next[r->eid[i]]++, m = i / K;
        r->rows[j] = m, r->w[j] = r->wt[i];
        memcpy((char *)r->xe + j * Hd * es, (const char *)xn + m * Hd * es, (size_t)(Hd * es));
    }
}

/* Layer l's mixture of experts on the normed rows xn into c->o (columns [lo, hi) of each row:
 * this thread's share of the down projections' outputs), each expert's two GEMMs on its pairs'
 * rows as the torch path's FusedMoE.run_experts: gate|up (this thread's rows of both), SiLU*mul,
 * a barrier, down, then each token's sum over its experts in ascending expert order, every
 * product and sum rounded to dtype. */
static void moe_mlp(const Step *c, int64_t l, const void *xn, int tid, int nth, int64_t *lo_out, int64_t *hi_out) {
    const LlamaDecodeModel *md = c->md;
    const int dt = (int)md->dtype, team = c->team;
    const int64_t E = md->num_experts, I = md->expert_inter, Hd = md->hidden, es = dt == LD_F32 ? 4 : 2;
    MoeRoute r;
    moe_carve(md, c->M, c->moe_buf + tid * c->moe_scratch, &r);
    moe_route(c, l, xn, &r);
    const char *w13 = (const char *)md->experts_w13[l], *w2 = (const char *)md->experts_w2[l];
    int64_t lo, hi;
    team_share(I, 16, tid, nth, &lo, &hi); /* whole 16-lane runs for SiLU*mul */
    for (int64_t e = 0; e < E; e++) {
        const int64_t a = r.start[e], n = r.start[e + 1] - a;
        if (n == 0) continue;
        const void *x = (const char *)r.xe + a * Hd * es;
        void *gu = (char *)c->gu + a * 2 * I * es, *act = (char *)c->act + a * I * es;
        const void *w = w13 + e * 2 * I * Hd * es;
        if (team) {
            linear(NULL, x, n, w, NULL, 2 * I, Hd, gu, dt, c->xb, team, lo, hi);
            linear(NULL, x, n, w, NULL, 2 * I, Hd, gu, dt, c->xb, team, I + lo, I + hi);
        } else {
            linear(NULL, x, n, w, NULL, 2 * I, Hd, gu, dt, c->xb, team, 0, 2 * I);
        }
        silu_mul(gu, n, I, act, dt, lo, hi);
    }
    team_sync(team);
    team_share(Hd, SHARE_ROWS, tid, nth, &lo, &hi);
    for (int64_t e = 0; e < E; e++) {
        const int64_t a = r.start[e], n = r.start[e + 1] - a;
        if (n == 0) continue;
        linear(NULL, (const char *)c->act + a * I * es, n, w2 + e * Hd * I * es, NULL, Hd, I,
               (char *)c->ye + a * Hd * es, dt, c->xb, team, lo, hi);
    }
    for (int64_t m = 0; m < c->M; m++)
        for (int64_t i = m * Hd + lo; i < m * Hd + hi; i++) st(c->o, i, 0.0f, dt);
    for (int64_t j = 0; j < c->M * md->top_k; j++) { /* the pairs in expert order */
        const int64_t m = r.rows[j];
        for (int64_t i = lo; i < hi; i++)
            st(c->o, m * Hd + i, ld(c->o, m * Hd + i, dt) + round_dt(ld(c->ye, j * Hd + i, dt) * r.w[j], dt), dt);
    }
    *lo_out = lo, *hi_out = hi;
}

/*
 * The decoder layers for thread tid of nth (team) or the calling thread (tid 0 of 1). Work split:
 * the norms are computed by every thread for itself (no barrier before the GEMM that reads them);
 * each GEMM's output rows are split into equal row blocks (equal weight bytes per thread), gate and
 * up by the same rows so that each thread's SiLU*mul reads only its own results, the residual add
 * by the columns each thread just computed; RoPE, the KV write and attention by (row, KV head),
 * in shares of about equal keys.
 * Barriers: after QKV, after attention, after O + residual, after SiLU*mul, after down + residual;
 * with Gemma's norms of the sublayer outputs, also after O and after down (add_normed).
 */
static void step_layers(const Step *c, int tid, int nth) {
    const LlamaDecodeModel *md = c->md;
    const int dt = (int)md->dtype, team = c->team;
    const int64_t M = c->M, Hd = md->hidden, D = md->head_dim, H = md->num_heads, KVH = md->num_kv_heads;
    const int64_t G = H / KVH, I = md->intermediate, qn = H * D, kvn = KVH * D, qkvn = qn + 2 * kvn;
    const int64_t es = dt == LD_F32 ? 4 : 2;
    const int qdt = dt == LD_F32 ? DT_F32 : dt == LD_BF16 ? DT_BF16 : DT_F16;
    void *xn = (char *)c->xn + tid * M * Hd * es;
    int64_t lo, hi;
    const int64_t att_lo = attention_split(c->seq_lens, M, KVH, tid, nth),
                  att_hi = attention_split(c->seq_lens, M, KVH, tid + 1, nth);
    for (int64_t l = 0; l < md->num_layers; l++) {
        const void *cos = md->layer_cos != NULL ? md->layer_cos[l] : md->cos;
        const void *sin = md->layer_sin != NULL ? md->layer_sin[l] : md->sin;
        const int64_t window = md->layer_window != NULL ? md->layer_window[l] : md->sliding_window;
        const int64_t group = md->layer_group != NULL ? md->layer_group[l] : 0;
        const int64_t *slots = md->layer_group != NULL ? md->group_slots[group] : c->slot_mapping;
        const int64_t *tables = md->layer_group != NULL ? md->group_tables[group] : c->block_tables;
        norm_rows(md, c->x, M, Hd, md->input_norm[l], xn, dt);
        team_share(qkvn, SHARE_ROWS, tid, nth, &lo, &hi);
        linear(qlin(md->qkv_q, l), xn, M, md->qkv_w[l], md->qkv_b[l], qkvn, Hd, c->qkv, dt, c->xb, team, lo, hi);
        lora_apply(c, lora_of(c, md->lora_qkv, l), xn, Hd, c->qkv, qkvn, team ? lo : 0, team ? hi : qkvn, 0, 0, tid, nth);
        team_sync(team);
        /* q rotated into its own rows; k rotated and v copied straight into their cache slots.
         * With q/k norms, each head is normed into its destination first and rotated in place
         * there (the torch path's order: RMSNorm rounded to dtype, then RoPE). */
        lo = att_lo, hi = att_hi;
        for (int64_t it = lo; it < hi; it++) {
            const int64_t m = it / KVH, kh = it % KVH, slot = slots[m], pos = c->positions[m];
            const int64_t src = m * qkvn + qn + kh * D, dst = slot * kvn + kh * D;
            const int64_t qsrc = m * qkvn + kh * G * D, qdst = m * qn + kh * G * D;
            if (md->q_norm != NULL) {
                norm_rows(md, (const char *)c->qkv + qsrc * es, G, D, md->q_norm[l], (char *)c->q + qdst * es, dt);
                rope_row(c->q, qdst, c->q, qdst, G, D, cos, sin, pos, dt);
                norm_rows(md, (const char *)c->qkv + src * es, 1, D, md->k_norm[l], (char *)md->k_cache[l] + dst * es,
                          dt);
                rope_row(md->k_cache[l], dst, md->k_cache[l], dst, 1, D, cos, sin, pos, dt);
            } else {
                rope_row(c->qkv, qsrc, c->q, qdst, G, D, cos, sin, pos, dt);
                rope_row(c->qkv, src, md->k_cache[l], dst, 1, D, cos, sin, pos, dt);
            }
            memcpy((char *)md->v_cache[l] + dst * es, (const char *)c->qkv + (src + kvn) * es, (size_t)(D * es));
        }
        if (c->chained) team_sync(team);
        if (team)
            paged_attention_items(c->q, qdt, qn, md->k_cache[l], md->v_cache[l], qdt, NULL, tables, c->bt_stride, c->qsl,
                                  c->seq_lens, c->work, lo, hi, c->attn, H, KVH, D, md->block_size, md->attn_scale,
                                  1.0f, window);
        else
            paged_attention(c->q, qdt, qn, md->k_cache[l], md->v_cache[l], qdt, NULL, tables, c->bt_stride, c->qsl,
                            c->seq_lens, c->work, M, c->attn, H, KVH, D, md->block_size, md->attn_scale, 1.0f, window);
        team_sync(team);
        team_share(Hd, SHARE_ROWS, tid, nth, &lo, &hi);
        linear(qlin(md->o_q, l), c->attn, M, md->o_w[l], md->o_b[l], Hd, qn, c->o, dt, c->xb, team, lo, hi);
        lora_apply(c, lora_of(c, md->lora_o, l), c->attn, qn, c->o, Hd, team ? lo : 0, team ? hi : Hd, 0, 0, tid, nth);
        add_normed(c, md->attn_out_norm, l, xn, lo, hi);
        team_sync(team);
        norm_rows(md, c->x, M, Hd, md->post_norm[l], xn, dt);
        if (md->router_w != NULL && md->router_w[l] != NULL) {
            moe_mlp(c, l, xn, tid, nth, &lo, &hi);
            add_normed(c, md->mlp_out_norm, l, xn, lo, hi);
            team_sync(team);
            continue;
        }
        team_share(I, 16, tid, nth, &lo, &hi); /* whole 16-lane runs for SiLU*mul */
        if (team) { /* gate rows [lo, hi) and the up rows that pair with them */
            linear(NULL, xn, M, md->gate_up_w[l], md->gate_up_b[l], 2 * I, Hd, c->gu, dt, c->xb, team, lo, hi);
            linear(NULL, xn, M, md->gate_up_w[l], md->gate_up_b[l], 2 * I, Hd, c->gu, dt, c->xb, team, I + lo, I + hi);
        } else {
            linear(qlin(md->gate_up_q, l), xn, M, md->gate_up_w[l], md->gate_up_b[l], 2 * I, Hd, c->gu, dt, c->xb,
                   team, 0, 2 * I);
        }
        if (team)
            lora_apply(c, lora_of(c, md->lora_gate_up, l), xn, Hd, c->gu, 2 * I, lo, hi, I + lo, I + hi, tid, nth);
        else
            lora_apply(c, lora_of(c, md->lora_gate_up, l), xn, Hd, c->gu, 2 * I, 0, 2 * I, 0, 0, tid, nth);
        if (md->gemma)
            gelu_tanh_mul(c->gu, M, I, c->act, dt, lo, hi);
        else
            silu_mul(c->gu, M, I, c->act, dt, lo, hi);
        team_sync(team);
        team_share(Hd, SHARE_ROWS, tid, nth, &lo, &hi);
        linear(qlin(md->down_q, l), c->act, M, md->down_w[l], md->down_b[l], Hd, I, c->o, dt, c->xb, team, lo, hi);
        lora_apply(c, lora_of(c, md->lora_down, l), c->act, I, c->o, Hd, team ? lo : 0, team ? hi : Hd, 0, 0, tid, nth);
        add_normed(c, md->mlp_out_norm, l, xn, lo, hi);
        team_sync(team);
    }
}

#if HAVE_AVX512
/* 16 elements of v from i (lanes past hi hold -inf), widened to float32. */
static inline __m512 argmax_load(const void *v, int64_t i, int64_t hi, int dt) {
    const __mmask16 k = tail16(hi, i);
    const __m512i neg_inf = _mm512_set1_epi32((int)0xff800000u);
    if (dt == LD_F32)
        return _mm512_castsi512_ps(_mm512_mask_loadu_epi32(neg_inf, k, (const uint32_t *)v + i));
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)v + i)), 16);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(neg_inf, k, w));
}

/* The lanes of x that hold a NaN, from the bits (-ffast-math may fold a float compare). */
static inline __mmask16 argmax_nans(__m512 x) {
    const __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
    return _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
}
#endif

/* Index of the largest of v[lo, hi) (the first one on ties; the first NaN if there is one, as
 * torch.argmax does), its value in *max and whether it is a NaN in *nan. One vectorizable pass
 * finds the maximum and whether there is a NaN (from the bits: the kernels build with
 * -ffast-math, under which isnan() may fold to false); a second pass finds where it first occurs. */
static int64_t argmax_range(const void *v, int64_t lo, int64_t hi, int dt, float *max, int *nan_out) {
#if HAVE_AVX512
    if (hi > lo && dt != LD_F16) { /* the same answer 16 lanes at a time */
        __m512 vm = argmax_load(v, lo, hi, dt);
        __mmask16 nans = 0;
        for (int64_t i = lo; i < hi; i += 16) {
            const __m512 x = argmax_load(v, i, hi, dt);
            nans |= argmax_nans(x);
            vm = _mm512_max_ps(vm, x);
        }
        const float m = _mm512_reduce_max_ps(vm);
        *max = m;
        *nan_out = nans != 0;
        const __m512 mv = _mm512_set1_ps(m);
        for (int64_t i = lo; i < hi; i += 16) {
            const __m512 x = argmax_load(v, i, hi, dt);
            const __mmask16 hit = nans ? argmax_nans(x) : _mm512_cmp_ps_mask(x, mv, _CMP_EQ_OQ);
            if (hit) return i + __builtin_ctz((unsigned)hit);
        }
        return lo;
    }
#endif
    const uint32_t *u32 = (const uint32_t *)v;
    const uint16_t *u16 = (const uint16_t *)v;
    const uint16_t inf16 = dt == LD_F16 ? 0x7c00u : 0x7f80u; /* a 16-bit NaN's bits lie above */
    int nan = 0;
    float m = ld(v, lo, dt);
    if (dt == LD_F32) {
        const float *f = (const float *)v;
        for (int64_t i = lo; i < hi; i++) {
            nan |= (u32[i] & 0x7fffffffu) > 0x7f800000u;
            m = f[i] > m ? f[i] : m;
        }
    } else {
        for (int64_t i = lo; i < hi; i++) {
            nan |= (u16[i] & 0x7fffu) > inf16;
            const float x = ld(v, i, dt);
            m = x > m ? x : m;
        }
    }
    *max = m;
    *nan_out = nan;
    for (int64_t i = lo; i < hi; i++) {
        const int is_nan = dt == LD_F32 ? (u32[i] & 0x7fffffffu) > 0x7f800000u : (u16[i] & 0x7fffu) > inf16;
        if (nan ? is_nan : ld(v, i, dt) == m) return i;
    }
    return lo;
}

/* out[s] = the argmax of row s of x [S, V] (rows ldx elements apart, dtype dt), with torch.argmax's
 * answer (argmax_range): the sampler's argmax (greedy rows) of batches the
 * fused step does not end. Rows spread over the OpenMP team. Returns 1, writing nothing, for an
 * empty row or another dtype. */
int argmax_rows(const void *x, int64_t ldx, int64_t S, int64_t V, int dt, int64_t *out) {
    if (V < 1 || (dt != LD_F32 && dt != LD_BF16)) return 1;
    const int64_t es = dt == LD_F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (S * V >= (1 << 16))
    for (int64_t s = 0; s < S; s++) {
        float m;
        int nan;
        out[s] = argmax_range((const char *)x + s * ldx * es, 0, V, dt, &m, &nan);
    }
    return 0;
}

/* -inf into y[lo, hi) (dtype dt) wherever the bit of the token is clear in mask (bit t % 32 of
 * word t / 32); words with every bit set are skipped whole. */
static void mask_span(void *y, int64_t lo, int64_t hi, const uint32_t *mask, int dt) {
    for (int64_t w = lo / 32; w * 32 < hi; w++) {
        const uint32_t bits = mask[w];
        if (bits == 0xffffffffu) continue;
        const int64_t a = w * 32 > lo ? w * 32 : lo, b = w * 32 + 32 < hi ? w * 32 + 32 : hi;
        for (int64_t t = a; t < b; t++) {
            if ((bits >> (t - w * 32)) & 1u) continue;
            if (dt == LD_F32)
                ((uint32_t *)y)[t] = 0xff800000u;
            else
                ((uint16_t *)y)[t] = dt == LD_F16 ? 0xfc00u : 0xff80u;
        }
    }
}

/* The step for thread tid of nth: the layers, then either the final norm of its rows into out
 * [M, hidden] (S 0), or the LM head: the final norm of the sample rows, the logits of its share of
 * the vocabulary (widened into c->logits where asked) and, for c->part_idx, the argmax of each
 * sample row over that share. */
static void step_thread(const Step *c, void *out, int tid, int nth) {
    const LlamaDecodeModel *md = c->md;
    const int dt = (int)md->dtype;
    const int64_t Hd = md->hidden, V = md->vocab, S = c->S, es = dt == LD_F32 ? 4 : 2;
    step_layers(c, tid, nth);
    if (S == 0) {
        for (int64_t m = tid; m < c->M; m += nth)
            norm_rows(md, (const char *)c->x + m * Hd * es, 1, Hd, md->final_norm, (char *)out + m * Hd * es, dt);
        return;
    }
    void *hs = (char *)c->hs + tid * S * Hd * es;
    for (int64_t s = 0; s < S; s++)
        norm_rows(md, (const char *)c->x + c->sample_rows[s] * Hd * es, 1, Hd, md->final_norm, (char *)hs + s * Hd * es,
                  dt);
    int64_t lo, hi;
    team_share(V, SHARE_ROWS, tid, nth, &lo, &hi);
    linear(md->lm_head_q, hs, S, md->lm_head, NULL, V, Hd, c->y, dt, c->xb, c->team, lo, hi);
    if (c->mask != NULL)
        for (int64_t s = 0; s < S; s++)
            if (c->mask_rows[s] >= 0)
                mask_span((char *)c->y + s * V * es, lo, hi, (const uint32_t *)(c->mask + c->mask_rows[s] * c->ldm),
                          dt);
    if (c->logits != NULL && c->y != (void *)c->logits)
        for (int64_t s = 0; s < S; s++)
            for (int64_t i = s * V + lo; i < s * V + hi; i++) c->logits[i] = ld(c->y, i, dt);
    if (c->part_idx != NULL)
        for (int64_t s = 0; s < S; s++)
            c->part_idx[tid * S + s] = hi > lo ? argmax_range((const char *)c->y + s * V * es, lo, hi, dt,
                                                              &c->part_max[tid * S + s], &c->part_nan[tid * S + s])
                                               : -1;
}

/* Whether every linear layer is dense (the step can run in one team). */
static int all_dense(const QuantLinear *ql, int64_t num_layers) {
    if (ql != NULL)
        for (int64_t l = 0; l < num_layers; l++)
            if (ql[l].kind != LQ_DENSE) return 0;
    return 1;
}

/* The step (S 0) or the step on to the LM head; see llama_decode_step and llama_decode_head. */
static int run_step(const LlamaDecodeModel *md, int64_t M, const int64_t *input_ids, const int64_t *positions,
                    const int64_t *slot_mapping, const int64_t *block_tables, int64_t bt_stride,
                    const int64_t *seq_lens, void *out, int64_t S, const int64_t *sample_rows, float *logits,
                    int64_t *tokens, const int32_t *mask, int64_t ldm, const int64_t *mask_rows) {
    const int dt = (int)md->dtype;
    const int64_t Hd = md->hidden, D = md->head_dim, H = md->num_heads, KVH = md->num_kv_heads, V = md->vocab;
    const int64_t I = md->intermediate, qn = H * D, kvn = KVH * D, qkvn = qn + 2 * kvn;
    const int64_t es = dt == LD_F32 ? 4 : 2;
    if (M < 1 || M > MAX_ROWS || D > 1024 || (dt != LD_F32 && dt != LD_BF16 && dt != LD_F16)) return 1;
    if (!(small_m_available() & (dt == LD_F32 ? 1 : dt == LD_BF16 ? 2 : 8))) return 1;
    /* float16: dense layers only (the quantized kernels take float32 or bf16 activations) */
    if (dt == LD_F16 && (!all_dense(md->qkv_q, md->num_layers) || !all_dense(md->o_q, md->num_layers) ||
                         !all_dense(md->gate_up_q, md->num_layers) || !all_dense(md->down_q, md->num_layers) ||
                         md->embed_q != NULL || md->lm_head_q != NULL))
        return 1;
    const int64_t kq = dt == LD_F32 ? 16 : 32; /* the GEMM tiles' column step */
    if (Hd % kq || qn % kq || I % kq) return 1;
    for (int64_t m = 0; m < M; m++)
        if (positions[m] < 0 || positions[m] >= md->max_position) return 1;
    if (!linears_supported(md->qkv_q, md->num_layers) || !linears_supported(md->o_q, md->num_layers) ||
        !linears_supported(md->gate_up_q, md->num_layers) || !linears_supported(md->down_q, md->num_layers))
        return 1;
    if (md->embed_q != NULL && !linears_supported(md->embed_q, 1)) return 1;
    if (md->layer_group != NULL && (md->group_slots == NULL || md->group_tables == NULL)) return 1;
    if (md->gemma && dt == LD_F16) return 1; /* Gemma's norms and GELU: float32 and bfloat16 only */
#if !defined(LORA_BLOCKS)
    if (md->lora_slots != NULL) return 1; /* the LoRA rows' block kernels need AVX-512F or AVX2 + FMA */
#endif
    if (md->lora_slots != NULL && ((md->lora_dtype != LD_F32 && md->lora_dtype != LD_BF16) || dt == LD_F16 ||
                                   md->lora_rank < 1))
        return 1;
    const int moe = md->router_w != NULL;
    const int64_t Ie = moe ? md->expert_inter : 0, P = moe ? M * md->top_k : 0;
    if (moe && (md->experts_w13 == NULL || md->experts_w2 == NULL || md->num_experts < 1 ||
                md->num_experts > MAX_EXPERTS || md->top_k < 1 || md->top_k > md->num_experts || Ie < 1 || Ie % kq))
        return 1;
    const int64_t wide = I > Ie ? I : Ie;
    const int64_t widest = wide > qn ? (wide > Hd ? wide : Hd) : (qn > Hd ? qn : Hd); /* the largest input size */
    const int torch_threads = omp_get_max_threads();
    if (md->threads > 0 && md->threads != torch_threads) omp_set_num_threads((int)md->threads); /* until return */
    const int team = omp_get_max_threads() > 1 && all_dense(md->qkv_q, md->num_layers) &&
                     all_dense(md->o_q, md->num_layers) && all_dense(md->gate_up_q, md->num_layers) &&
                     all_dense(md->down_q, md->num_layers) && (S == 0 || md->lm_head_q == NULL);
    const int nth = team ? omp_get_max_threads() : 1;

    int64_t *qsl = malloc((size_t)(M + 1) * sizeof(int64_t)), *work = malloc((size_t)M * 3 * sizeof(int64_t));
    for (int64_t m = 0; m <= M; m++) qsl[m] = m;
    for (int64_t m = 0; m < M; m++) {
        work[3 * m] = m;
        work[3 * m + 1] = 0;
        work[3 * m + 2] = 1;
    }
    /* Rows that continue the row before them in the same block table (see Step.chained). */
    int chained = 0;
    for (int64_t m = 1; m < M && !chained; m++)
        chained = positions[m] == positions[m - 1] + 1 && block_tables[m * bt_stride] == block_tables[(m - 1) * bt_stride];
    Step c = {.md = md, .M = M, .chained = chained, .bt_stride = bt_stride, .positions = positions, .slot_mapping = slot_mapping,
              .block_tables = block_tables, .seq_lens = seq_lens, .qsl = qsl, .work = work, .team = team, .S = S,
              .sample_rows = sample_rows, .logits = logits, .mask = mask, .ldm = ldm, .mask_rows = mask_rows};
    c.x = alloc(M * Hd * es), c.xn = alloc(nth * M * Hd * es), c.qkv = alloc(M * qkvn * es);
    c.q = alloc(M * qn * es), c.attn = alloc(M * qn * es), c.o = alloc(M * Hd * es);
    const int64_t gu_rows = P > M ? P : M; /* the dense MLP's rows, or the experts' (token, expert) pairs */
    c.gu = alloc(gu_rows * 2 * wide * es), c.act = alloc(gu_rows * wide * es), c.xb = alloc(M * widest * 2);
    if (moe) {
        c.ye = alloc(P * Hd * es);
        c.moe_scratch = moe_carve(md, M, NULL, NULL);
        c.moe_buf = alloc(nth * c.moe_scratch);
    }
    int64_t *lora_order = NULL;
#if defined(LORA_BLOCKS)
    if (md->lora_slots != NULL) {
        lora_order = malloc((size_t)(2 * M + 1) * sizeof(int64_t));
        int64_t m;
        c.lora_order = lora_order, c.lora_blocks = lora_order + M;
        /* blocks of LORA_AMX_RB rows where the deltas may run on AMX tiles (either form takes them) */
        const int rb = dt == LD_BF16 && md->lora_dtype == LD_BF16 && lora_amx_available() ? LORA_AMX_RB : LORA_RB;
        c.lora_nblocks = lora_plan(md->lora_slots, M, rb, lora_order, lora_order + M, &m);
        /* h of every block at the widest layer's n (qkv's three slices), then a thread's scratch */
        c.lora_hblock = (lora_h_floats(3, md->lora_rank) + 15) / 16 * 16;
        c.lora_hsize = c.lora_nblocks * c.lora_hblock;
        c.lora_scratch = (lora_scratch_floats(3 * md->lora_rank, widest) + 15) / 16 * 16;
        if (c.lora_nblocks > 0)
            c.lora_buf = alloc((c.lora_hsize + nth * c.lora_scratch) * (int64_t)sizeof(float));
    }
#endif
    if (S > 0) {
        c.hs = alloc(nth * S * Hd * es);
        /* float32 GEMMs write the logits in place; bf16 ones go through a bf16 buffer. */
        c.y = dt == LD_F32 && logits != NULL ? (void *)logits : alloc(S * V * es);
        if (tokens != NULL) {
            c.part_idx = malloc((size_t)(nth * S) * sizeof(int64_t));
            c.part_max = malloc((size_t)(nth * S) * sizeof(float));
            c.part_nan = malloc((size_t)(nth * S) * sizeof(int));
        }
    }
    if (md->embed_q != NULL) {
#if LD_HAVE_QUANT
        /* the rows as the torch path's lookup expands them (quant_gather_rows, in dtype) */
        const QuantLinear *e = md->embed_q;
        quant_gather_rows((int)e->kind, e->codes, e->scales, e->zeros, md->embed_rows, Hd, e->group, input_ids, M,
                          c.x, dt == LD_F32);
#endif
    } else {
        for (int64_t m = 0; m < M; m++)
            memcpy((char *)c.x + m * Hd * es, (const char *)md->embed + input_ids[m] * Hd * es, (size_t)(Hd * es));
    }

    if (md->embed_scale != 0.0f) /* Gemma: the rows times sqrt(hidden) in dtype */
        for (int64_t i = 0; i < M * Hd; i++) st(c.x, i, ld(c.x, i, dt) * md->embed_scale, dt);

    if (team) {
#pragma omp parallel num_threads(nth)
        step_thread(&c, out, omp_get_thread_num(), omp_get_num_threads());
    } else {
        step_thread(&c, out, 0, 1);
    }

    /* Each sample row's argmax: the first share's NaN if any share has one, else the largest of
     * the shares' maxima (the earliest share on ties). */
    if (tokens != NULL)
        for (int64_t s = 0; s < S; s++) {
            int64_t best = -1;
            float bmax = 0.0f;
            int bnan = 0;
            for (int t = 0; t < nth; t++) {
                const int64_t i = c.part_idx[t * S + s];
                if (i < 0 || bnan) continue;
                const float v = c.part_max[t * S + s];
                if (c.part_nan[t * S + s] || best < 0 || v > bmax) best = i, bmax = v, bnan = c.part_nan[t * S + s];
            }
            tokens[s] = best;
        }

    free(c.x), free(c.xn), free(c.qkv), free(c.q), free(c.attn), free(c.o), free(c.gu), free(c.act), free(c.xb);
    free(qsl), free(work), free(lora_order), free(c.lora_buf), free(c.ye), free(c.moe_buf);
    if (S > 0) {
        if (c.y != (void *)logits) free(c.y);
        free(c.hs), free(c.part_idx), free(c.part_max), free(c.part_nan);
    }
    if (omp_get_max_threads() != torch_threads) omp_set_num_threads(torch_threads);
    return 0;
}

/*
 * input_ids, positions, slot_mapping, seq_lens [M]; block_tables [M, bt_stride] (int64).
 * out: [M, hidden] final normed hidden states in dtype. Returns 0, or 1 for a request the kernel
 * does not take (then nothing was written to the KV cache).
 */
int llama_decode_step(const LlamaDecodeModel *md, int64_t M, const int64_t *input_ids, const int64_t *positions,
                      const int64_t *slot_mapping, const int64_t *block_tables, int64_t bt_stride,
                      const int64_t *seq_lens, void *out) {
    return run_step(md, M, input_ids, positions, slot_mapping, block_tables, bt_stride, seq_lens, out, 0, NULL, NULL,
                    NULL, NULL, 0, NULL);
}

/*
 * The decode step (arguments as llama_decode_step) on to the LM head, for the S rows sample_rows
 * of the batch: logits [S, vocab] float32 (the LM head's result in dtype, widened, as the torch
 * path's LMHead returns it) when logits is not NULL, and each row's argmax when tokens is not
 * NULL. With a mask (structured output: int32 words [*, ldm], mask_rows [S] naming each sample
 * row's mask row or -1), the tokens a row's mask does not allow are -inf in its logits and never
 * its argmax. Returns 0, or 1 for a request the kernel does not take (nothing written anywhere).
 */
int llama_decode_head(const LlamaDecodeModel *md, int64_t M, const int64_t *input_ids, const int64_t *positions,
                      const int64_t *slot_mapping, const int64_t *block_tables, int64_t bt_stride,
                      const int64_t *seq_lens, int64_t S, const int64_t *sample_rows, float *logits,
                      int64_t *tokens, const int32_t *mask, int64_t ldm, const int64_t *mask_rows) {
    if (md->lm_head == NULL || md->vocab < 1 || S < 1 || S > M || M > MAX_ROWS) return 1;
    for (int64_t s = 0; s < S; s++)
        if (sample_rows[s] < 0 || sample_rows[s] >= M) return 1;
    return run_step(md, M, input_ids, positions, slot_mapping, block_tables, bt_stride, seq_lens, NULL, S, sample_rows,
                    logits, tokens, mask, ldm, mask_rows);
}
