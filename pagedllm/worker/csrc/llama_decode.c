/*
 * One decode step of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) in a single native
 * call: embedding -> per layer [RMSNorm, QKV, RoPE, KV write, paged attention, O, residual,
 * RMSNorm, gate|up, SiLU*mul, down, residual] -> final RMSNorm, for up to MAX_ROWS decode tokens.
 *
 * A decode step is a pass over the weights with a few rows of activations. Run as torch ops it is
 * about 80 small ops per layer, each paying Python dispatch; here the whole stack is one call and
 * the step's time is the weight reads. The paged attention is the same C function the model
 * runner calls for every other step (paged_attention.c, included below).
 *
 * Element types: dense weights, activations and the KV cache all float32 (dt 0) or all bfloat16 (dt 1).
 * bf16 follows the rounding points of pagedllm's torch path (each op computes in float32 and
 * rounds its result to bf16; RMSNorm normalizes in float32, rounds, then scales by the weight), so
 * the two paths agree to the last bit except for the order of sums inside GEMMs and reductions.
 *
 * llama_decode_head runs the same step on to the LM head: the logits of the rows that sample and,
 * for batches that sample greedily with nothing else, their argmax.
 *
 * GEMMs are the small-M kernel of pagedllm/layers/csrc/small_m_gemm.c (included below), which
 * the torch path also uses for decode rows. Each of a layer's four linear layers may instead be
 * quantized (4-bit group codes of int4 / GGUF / AWQ / GPTQ, int8 codes, fp8 e4m3): then it runs
 * the same function of pagedllm/quantization/csrc/linear_quant.c (included below) that the
 * torch path's LinearMethod calls, on the same bf16 activations, so a quantized layer's output is
 * the torch path's to the bit whenever its input is.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../attention/csrc/paged_attention.c"
#include "../../layers/csrc/small_m_gemm.c"
/* linear_quant.c names its own tile sizes; small_m_gemm.c's are no longer needed here. */
#undef MR
#undef NR
#include "../../quantization/csrc/linear_quant.c"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LD_HAVE_QUANT 1 /* linear_quant.c compiled its kernels */
#else
#define LD_HAVE_QUANT 0
#endif

#define MAX_ROWS 16

/* How one linear layer's weight is kept: LQ_DENSE reads the layer's dense weight (the per-layer
 * *_w pointers, in dtype); the others are linear_quant.c's layouts (its BITS values): 4-bit and
 * int8 codes tiled by 16 output rows, e4m3 bytes [N, K], with bf16 scales and zeros per group. */
enum { LQ_DENSE = 0, LQ_E4M3 = 3, LQ_INT4 = 4, LQ_INT8 = 8 };

typedef struct {
    int64_t kind;        /* LQ_* */
    int64_t group;       /* inputs per scale and zero */
    const void *codes, *scales, *zeros;
    const int64_t *perm; /* the input order the codes follow (GPTQ act-order), or NULL */
    int64_t int8_act;    /* 4-bit and int8 codes: activations in int8 (VNNI) rather than bf16 */
} QuantLinear;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t dtype;  /* LD_F32 or LD_BF16: weights, activations and KV cache */
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
} LlamaDecodeModel;

/* The value as stored in dtype dt, read back as float32 (rounds to bf16 for dt 1). */
static inline float rnd(float v, int dt) { return dt == LD_F32 ? v : bf16_to_f32(f32_to_bf16(v)); }

/* out[m] = RMSNorm(x[m]) * weight: float32 statistics; bf16 rounds the normalized row before the
 * weight multiplies it (as the torch path does). */
static void rms_norm(const void *x, int64_t M, int64_t H, const void *weight, float eps, void *out, int dt) {
    for (int64_t m = 0; m < M; m++) {
        float ss = 0.0f;
        for (int64_t i = 0; i < H; i++) {
            const float v = ld(x, m * H + i, dt);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++)
            st(out, m * H + i, rnd(ld(x, m * H + i, dt) * inv, dt) * ld(weight, i, dt), dt);
    }
}

/* x[m] += y[m] (the residual stream), rounded to dtype. */
static void add_inplace(void *x, const void *y, int64_t n, int dt) {
    for (int64_t i = 0; i < n; i++) st(x, i, ld(x, i, dt) + ld(y, i, dt), dt);
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i], each op rounded to dtype. */
static void silu_mul(const void *gu, int64_t M, int64_t I, void *out, int dt) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < I; i++) {
            const float g = ld(gu, m * 2 * I + i, dt), u = ld(gu, m * 2 * I + I + i, dt);
            st(out, m * I + i, rnd(g / (1.0f + expf(-g)), dt) * u, dt);
        }
}

/* Rotate-half RoPE of `heads` heads of one row, read from src and written to dst (may alias):
 * out = x * cos + rotate_half(x) * sin, each product rounded to dtype before the sum. */
static void rope_row(const void *src, int64_t src_off, void *dst, int64_t dst_off, int64_t heads, int64_t D,
                     const void *cos, const void *sin, int64_t pos, int dt) {
    const int64_t half = D / 2;
    float buf[1024];
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t i = 0; i < D; i++) buf[i] = ld(src, src_off + h * D + i, dt);
        for (int64_t i = 0; i < D; i++) {
            const float rot = i < half ? -buf[i + half] : buf[i - half];
            const float c = ld(cos, pos * D + i, dt), s = ld(sin, pos * D + i, dt);
            st(dst, dst_off + h * D + i, rnd(buf[i] * c, dt) + rnd(rot * s, dt), dt);
        }
    }
}

/* Whether the step can run these linear layers (quantized ones need linear_quant.c's kernels). */
static int linears_supported(const QuantLinear *ql, int64_t num_layers) {
    if (ql == NULL) return 1;
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t k = ql[l].kind;
        if (k != LQ_DENSE && (!LD_HAVE_QUANT || (k != LQ_INT4 && k != LQ_INT8 && k != LQ_E4M3))) return 0;
    }
    return 1;
}

/*
 * y[M, N] = x[M, K] W^T (+ bias) in dtype dt. Dense: the small-M GEMM. Quantized: as the torch
 * path's LinearMethod.apply, x rounded to bf16 (in the layer's input order where it has one), the
 * kernel's result in dt (float32 straight from its accumulators, or rounded to bf16), then the
 * bias added and rounded to dt. xb: scratch for M * K bf16 values.
 */
static void linear(const QuantLinear *ql, const void *x, int64_t M, const void *w, const void *bias, int64_t N,
                   int64_t K, void *y, int dt, uint16_t *xb) {
    if (ql == NULL || ql->kind == LQ_DENSE) {
        gemm(x, M, w, bias, N, K, y, dt);
        return;
    }
#if LD_HAVE_QUANT
    const uint16_t *xq = (const uint16_t *)x;
    if (dt == LD_F32 || ql->perm != NULL) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) {
                const int64_t src = m * K + (ql->perm != NULL ? ql->perm[k] : k);
                xb[m * K + k] = dt == LD_F32 ? f32_to_bf16(((const float *)x)[src]) : ((const uint16_t *)x)[src];
            }
        xq = xb;
    }
    const int y_f32 = dt == LD_F32;
    if (ql->kind == LQ_INT4)
        int4_linear_bf16(xq, M, ql->codes, ql->scales, ql->zeros, N, K, ql->group, y, y_f32, (int)ql->int8_act);
    else if (ql->kind == LQ_INT8)
        int8_linear_bf16(xq, M, ql->codes, ql->scales, ql->zeros, N, K, ql->group, y, y_f32, (int)ql->int8_act);
    else
        e4m3_linear_bf16(xq, M, ql->codes, ql->scales, ql->zeros, N, K, ql->group, y, y_f32, 0);
    if (bias != NULL)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) st(y, m * N + n, ld(y, m * N + n, dt) + ld(bias, n, dt), dt);
#endif
}

/* The descriptor of layer l's linear, or NULL (dense). */
static inline const QuantLinear *qlin(const QuantLinear *ql, int64_t l) { return ql == NULL ? NULL : ql + l; }

static void *alloc(int64_t bytes) { return aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64)); }

/*
 * input_ids, positions, slot_mapping, seq_lens [M]; block_tables [M, bt_stride] (int64).
 * out: [M, hidden] final normed hidden states in dtype. Returns 0, or 1 for a request the kernel
 * does not take (then nothing was written to the KV cache).
 */
int llama_decode_step(const LlamaDecodeModel *md, int64_t M, const int64_t *input_ids, const int64_t *positions,
                      const int64_t *slot_mapping, const int64_t *block_tables, int64_t bt_stride,
                      const int64_t *seq_lens, void *out) {
    const int dt = (int)md->dtype;
    const int64_t Hd = md->hidden, D = md->head_dim, H = md->num_heads, KVH = md->num_kv_heads;
    const int64_t I = md->intermediate, qn = H * D, kvn = KVH * D, qkvn = qn + 2 * kvn;
    const int64_t es = dt == LD_F32 ? 4 : 2;
    if (M < 1 || M > MAX_ROWS || D > 1024 || (dt != LD_F32 && dt != LD_BF16)) return 1;
    if (!(small_m_available() & (dt == LD_F32 ? 1 : 2))) return 1;
    const int64_t kq = dt == LD_F32 ? 16 : 32; /* the GEMM tiles' column step */
    if (Hd % kq || qn % kq || I % kq) return 1;
    for (int64_t m = 0; m < M; m++)
        if (positions[m] < 0 || positions[m] >= md->max_position) return 1;
    if (!linears_supported(md->qkv_q, md->num_layers) || !linears_supported(md->o_q, md->num_layers) ||
        !linears_supported(md->gate_up_q, md->num_layers) || !linears_supported(md->down_q, md->num_layers))
        return 1;
    const int64_t widest = I > qn ? (I > Hd ? I : Hd) : (qn > Hd ? qn : Hd); /* the largest input size */

    void *x = alloc(M * Hd * es), *xn = alloc(M * Hd * es), *qkv = alloc(M * qkvn * es);
    void *q = alloc(M * qn * es), *attn = alloc(M * qn * es), *o = alloc(M * Hd * es);
    void *gu = alloc(M * 2 * I * es), *act = alloc(M * I * es);
    uint16_t *xb = alloc(M * widest * 2);
    int64_t *qsl = malloc((size_t)(M + 1) * sizeof(int64_t)), *work = malloc((size_t)M * 3 * sizeof(int64_t));
    for (int64_t m = 0; m <= M; m++) qsl[m] = m;
    for (int64_t m = 0; m < M; m++) {
        work[3 * m] = m;
        work[3 * m + 1] = 0;
        work[3 * m + 2] = 1;
    }
    for (int64_t m = 0; m < M; m++)
        memcpy((char *)x + m * Hd * es, (const char *)md->embed + input_ids[m] * Hd * es, (size_t)(Hd * es));

    for (int64_t l = 0; l < md->num_layers; l++) {
        rms_norm(x, M, Hd, md->input_norm[l], md->eps, xn, dt);
        linear(qlin(md->qkv_q, l), xn, M, md->qkv_w[l], md->qkv_b[l], qkvn, Hd, qkv, dt, xb);
        for (int64_t m = 0; m < M; m++) {
            const int64_t slot = slot_mapping[m];
            /* q rotated into its own rows; k rotated and v copied straight into their cache slots. */
            rope_row(qkv, m * qkvn, q, m * qn, H, D, md->cos, md->sin, positions[m], dt);
            rope_row(qkv, m * qkvn + qn, md->k_cache[l], slot * kvn, KVH, D, md->cos, md->sin, positions[m], dt);
            memcpy((char *)md->v_cache[l] + slot * kvn * es, (const char *)qkv + (m * qkvn + qn + kvn) * es,
                   (size_t)(kvn * es));
        }
        paged_attention(q, dt == LD_F32 ? DT_F32 : DT_BF16, md->k_cache[l], md->v_cache[l],
                        dt == LD_F32 ? DT_F32 : DT_BF16, NULL, block_tables, bt_stride, qsl, seq_lens, work, M, attn,
                        H, KVH, D, md->block_size, md->attn_scale, 1.0f, md->sliding_window);
        linear(qlin(md->o_q, l), attn, M, md->o_w[l], md->o_b[l], Hd, qn, o, dt, xb);
        add_inplace(x, o, M * Hd, dt);
        rms_norm(x, M, Hd, md->post_norm[l], md->eps, xn, dt);
        linear(qlin(md->gate_up_q, l), xn, M, md->gate_up_w[l], md->gate_up_b[l], 2 * I, Hd, gu, dt, xb);
        silu_mul(gu, M, I, act, dt);
        linear(qlin(md->down_q, l), act, M, md->down_w[l], md->down_b[l], Hd, I, o, dt, xb);
        add_inplace(x, o, M * Hd, dt);
    }
    rms_norm(x, M, Hd, md->final_norm, md->eps, out, dt);

    free(x), free(xn), free(qkv), free(q), free(attn), free(o), free(gu), free(act), free(xb), free(qsl), free(work);
    return 0;
}


/* Index of the largest of n values (the first one on ties; the first NaN if there is one, as
 * torch.argmax does). One vectorizable pass finds the maximum and whether there is a NaN (from
 * the bits: the kernels build with -ffast-math, under which isnan() may fold to false); a second
 * pass finds where the maximum first occurs. */
static int64_t argmax_row(const void *v, int64_t n, int dt) {
    const uint32_t *u32 = (const uint32_t *)v;
    const uint16_t *u16 = (const uint16_t *)v;
    int nan = 0;
    float m = ld(v, 0, dt);
    if (dt == LD_F32) {
        const float *f = (const float *)v;
        for (int64_t i = 0; i < n; i++) {
            nan |= (u32[i] & 0x7fffffffu) > 0x7f800000u;
            m = f[i] > m ? f[i] : m;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            nan |= (u16[i] & 0x7fffu) > 0x7f80u;
            const float x = bf16_to_f32(u16[i]);
            m = x > m ? x : m;
        }
    }
    for (int64_t i = 0; i < n; i++) {
        const int is_nan = dt == LD_F32 ? (u32[i] & 0x7fffffffu) > 0x7f800000u : (u16[i] & 0x7fffu) > 0x7f80u;
        if (nan ? is_nan : ld(v, i, dt) == m) return i;
    }
    return 0;
}

/*
 * The decode step (arguments as llama_decode_step) on to the LM head, for the S rows sample_rows
 * of the batch: logits [S, vocab] float32 (the LM head's result in dtype, widened, as the torch
 * path's LMHead returns it) when logits is not NULL, and each row's argmax when tokens is not
 * NULL. Returns 0, or 1 for a request the kernel does not take (nothing written anywhere).
 */
int llama_decode_head(const LlamaDecodeModel *md, int64_t M, const int64_t *input_ids, const int64_t *positions,
                      const int64_t *slot_mapping, const int64_t *block_tables, int64_t bt_stride,
                      const int64_t *seq_lens, int64_t S, const int64_t *sample_rows, float *logits,
                      int64_t *tokens) {
    const int dt = (int)md->dtype;
    const int64_t Hd = md->hidden, V = md->vocab, es = dt == LD_F32 ? 4 : 2;
    if (md->lm_head == NULL || V < 1 || S < 1 || S > M || M > MAX_ROWS) return 1;
    for (int64_t s = 0; s < S; s++)
        if (sample_rows[s] < 0 || sample_rows[s] >= M) return 1;
    void *h = alloc(M * Hd * es), *hs = alloc(S * Hd * es);
    /* float32 GEMMs write the logits in place; bf16 ones go through a bf16 buffer. */
    void *y = dt == LD_F32 && logits != NULL ? (void *)logits : alloc(S * V * es);
    const int rc = llama_decode_step(md, M, input_ids, positions, slot_mapping, block_tables, bt_stride, seq_lens, h);
    if (rc == 0) {
        for (int64_t s = 0; s < S; s++)
            memcpy((char *)hs + s * Hd * es, (const char *)h + sample_rows[s] * Hd * es, (size_t)(Hd * es));
        if (md->lm_head_q != NULL) {
            uint16_t *xb = alloc(S * Hd * 2);
            linear(md->lm_head_q, hs, S, NULL, NULL, V, Hd, y, dt, xb);
            free(xb);
        } else {
            gemm(hs, S, md->lm_head, NULL, V, Hd, y, dt);
        }
        if (logits != NULL && y != (void *)logits)
            for (int64_t i = 0; i < S * V; i++) logits[i] = bf16_to_f32(((const uint16_t *)y)[i]);
        if (tokens != NULL)
            for (int64_t s = 0; s < S; s++) tokens[s] = argmax_row((const char *)y + s * V * es, V, dt);
    }
    if (y != (void *)logits) free(y);
    free(h), free(hs);
    return rc;
}
