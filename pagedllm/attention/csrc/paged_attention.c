/*
 * Paged attention on CPU, reading K/V in place from the block-structured cache.
 *
 * Element types: queries/outputs in float32, bfloat16 or float16; the KV cache in those or in
 * one-byte fp8 codes (e4m3 / e5m2) decoded through a 256-entry table. Everything is converted
 * to float32 as it is loaded and accumulated in float32. A per-tensor K scale is folded into the
 * score scale and a per-tensor V scale into the output by the caller (v_scale below).
 *
 * Work is split into items (request, first query token, number of query tokens <= TILE) and
 * parallelized over items x KV heads. Each item keeps TILE x G query rows (G query heads share
 * one KV head) and streams the keys it may see in runs of KB = 16 keys (within one cache block),
 * with an online softmax.
 *
 * Register blocking: with at least TRANSPOSE_MIN_ROWS query rows per KV head (prompt chunks),
 * each run of K is converted once into a transposed float32 tile kt[D][KB], so that the scores of one query row against the 16 keys are one 16-lane vector built by D
 * fused multiply-adds (s[0:16] += q[d] * kt[d][0:16]) with no horizontal reduction; rows are
 * taken RB at a time so that each tile load feeds RB FMAs. A decode has only G rows, too few to
 * pay for the transpose: its K run is converted row by row and each score is one dot product. V is converted once per run into
 * vt[KB][D] and added as p[j] * vt[j] over D.
 *
 * Layouts: q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D];
 * block_tables [R, bt_stride]; query_start_loc [R + 1]; seq_lens [R]; work [W, 3].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define KB 16
#define RB 4
/* Query rows sharing a KV head from which the transposed K tile pays for its strided loads. */
#define TRANSPOSE_MIN_ROWS 8
#define PARALLEL_MIN_PAIRS 65536

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_FP8 = 3 };

/* dst[i] = value of element (off + i * stride) of src, for i < n. */
static inline void load_f32(float *restrict dst, const void *src, int64_t off, int64_t stride, int64_t n, int dt,
                            const float *restrict table) {
    switch (dt) {
    case DT_F32: {
        const float *s = (const float *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = s[i * stride];
        break;
    }
    case DT_BF16: {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i * stride]);
        break;
    }
    case DT_F16: {
        const _Float16 *s = (const _Float16 *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i * stride];
        break;
    }
    default: {
        const uint8_t *s = (const uint8_t *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = table[s[i * stride]];
        break;
    }
    }
}

static inline void store_f32(void *dst, int64_t off, const float *restrict src, float mul, int64_t n, int dt) {
    switch (dt) {
    case DT_F32: {
        float *d = (float *)dst + off;
        for (int64_t i = 0; i < n; i++) d[i] = src[i] * mul;
        break;
    }
    case DT_BF16: {
        uint16_t *d = (uint16_t *)dst + off;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i] * mul);
        break;
    }
    default: {
        _Float16 *d = (_Float16 *)dst + off;
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)(src[i] * mul);
        break;
    }
    }
}

static inline float dot_n(const float *restrict a, const float *restrict b, const int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Constant trip counts for the common head sizes (unrolled and vectorized once inlined). */
static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    if (d == 64) return dot_n(a, b, 64);
    if (d == 128) return dot_n(a, b, 128);
    return dot_n(a, b, d);
}

/* Scores of up to RB rows against the run's KB keys: s[r][j] = sum_d q[r][d] * kt[d][j]. */
static inline void scores_rb(float *restrict s, const float *restrict q, int64_t nr, const float *restrict kt,
                             int64_t D) {
    float a[RB][KB];
    for (int r = 0; r < RB; r++)
        for (int j = 0; j < KB; j++) a[r][j] = 0.f;
    if (nr == RB) {
        for (int64_t d = 0; d < D; d++) {
            const float *k = kt + d * KB;
            for (int r = 0; r < RB; r++) {
                const float qd = q[r * D + d];
#pragma omp simd
                for (int j = 0; j < KB; j++) a[r][j] += qd * k[j];
            }
        }
    } else {
        for (int64_t d = 0; d < D; d++) {
            const float *k = kt + d * KB;
            for (int64_t r = 0; r < nr; r++) {
                const float qd = q[r * D + d];
#pragma omp simd
                for (int j = 0; j < KB; j++) a[r][j] += qd * k[j];
            }
        }
    }
    for (int64_t r = 0; r < nr; r++) memcpy(s + r * KB, a[r], sizeof(float) * KB);
}

void paged_attention(const void *q, int q_dt, const void *k_cache, const void *v_cache, int kv_dt,
                     const float *fp8_table, const int64_t *block_tables, int64_t bt_stride,
                     const int64_t *query_start_loc, const int64_t *seq_lens, const int64_t *work, int64_t num_work,
                     void *out, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale, float v_scale,
                     int64_t window) {
    const int64_t G = H / KVH;
    /* Query-row x key pairs of the call: below PARALLEL_MIN_PAIRS (a few hundred microseconds of
     * work, e.g. one decode) one thread does it all, as waking the team would cost more. */
    int64_t pairs = 0;
    for (int64_t w = 0; w < num_work; w++) pairs += work[3 * w + 2] * seq_lens[work[3 * w]];
    pairs *= H;
#pragma omp parallel for schedule(dynamic, 1) collapse(2) if (pairs >= PARALLEL_MIN_PAIRS)
    for (int64_t w = 0; w < num_work; w++) {
        for (int64_t kh = 0; kh < KVH; kh++) {
            const int64_t r = work[3 * w], t0 = work[3 * w + 1], nt = work[3 * w + 2];
            const int64_t qs = query_start_loc[r];
            const int64_t qlen = query_start_loc[r + 1] - qs;
            const int64_t ctx0 = seq_lens[r] - qlen; /* position of the request's first query token */
            const int64_t *bt = block_tables + r * bt_stride;
            const int64_t rows = nt * G;
            float m[rows], l[rows], s[rows * KB];
            float acc[rows * D], qf[rows * D];
            float kt[D * KB], vt[KB * D];
            int64_t pos[rows];
            for (int64_t i = 0; i < nt; i++) {
                for (int64_t g = 0; g < G; g++) {
                    const int64_t row = i * G + g;
                    /* Scaled once here, so scores come out of the FMAs ready for the softmax. */
                    load_f32(qf + row * D, q, ((qs + t0 + i) * H + kh * G + g) * D, 1, D, q_dt, NULL);
                    for (int64_t d = 0; d < D; d++) qf[row * D + d] *= scale;
                    pos[row] = ctx0 + t0 + i;
                    m[row] = -INFINITY;
                    l[row] = 0.f;
                }
            }
            memset(acc, 0, sizeof(float) * rows * D);
            const int64_t last = ctx0 + t0 + nt - 1;
            int64_t first = 0;
            if (window > 0 && ctx0 + t0 - window + 1 > 0) first = ctx0 + t0 - window + 1;
            const int64_t stride = KVH * D; /* elements between consecutive slots of a block */
            for (int64_t k0 = first, kn; k0 <= last; k0 += kn) {
                /* A run of keys inside one cache block: consecutive slots. */
                const int64_t off = k0 % BS;
                kn = BS - off;
                if (kn > KB) kn = KB;
                if (kn > last + 1 - k0) kn = last + 1 - k0;
                const int64_t base = ((bt[k0 / BS] * BS + off) * KVH + kh) * D;
                for (int64_t j = 0; j < kn; j++) load_f32(vt + j * D, v_cache, base + j * stride, 1, D, kv_dt, fp8_table);
                if (rows >= TRANSPOSE_MIN_ROWS) {
                    /* kt[d][j] = K[key j][d]: one strided load per d; keys past the run are 0. */
                    for (int64_t d = 0; d < D; d++) {
                        load_f32(kt + d * KB, k_cache, base + d, stride, kn, kv_dt, fp8_table);
                        for (int64_t j = kn; j < KB; j++) kt[d * KB + j] = 0.f;
                    }
                    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
                        const int64_t nr = rows - r0 < RB ? rows - r0 : RB;
                        scores_rb(s + r0 * KB, qf + r0 * D, nr, kt, D);
                    }
                } else {
                    /* Few rows (a decode): the transpose would not pay; contiguous rows, dot each. */
                    for (int64_t j = 0; j < kn; j++) load_f32(kt + j * D, k_cache, base + j * stride, 1, D, kv_dt, fp8_table);
                    for (int64_t row = 0; row < rows; row++)
                        for (int64_t j = 0; j < kn; j++) s[row * KB + j] = dot(qf + row * D, kt + j * D, D);
                }
                for (int64_t row = 0; row < rows; row++) {
                    float *sr = s + row * KB;
                    float mx = -INFINITY;
                    for (int64_t j = 0; j < kn; j++) {
                        const int64_t key = k0 + j;
                        const int visible = key <= pos[row] && (window <= 0 || key > pos[row] - window);
                        if (!visible) sr[j] = -INFINITY;
                        if (sr[j] > mx) mx = sr[j];
                    }
                    if (mx == -INFINITY) continue;
                    float *ar = acc + row * D;
                    if (mx > m[row]) {
                        const float alpha = expf(m[row] - mx); /* 0 on the first run */
                        l[row] *= alpha;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) ar[d] *= alpha;
                        m[row] = mx;
                    }
                    /* exp over the whole run at once (vectorized); hidden keys give exactly 0. */
                    float p[KB];
                    const float mr = m[row];
#pragma omp simd
                    for (int64_t j = 0; j < kn; j++) p[j] = expf(sr[j] - mr);
                    for (int64_t j = 0; j < kn; j++) {
                        l[row] += p[j];
                        const float pj = p[j];
                        const float *vj = vt + j * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) ar[d] += pj * vj[d];
                    }
                }
            }
            for (int64_t i = 0; i < nt; i++) {
                for (int64_t g = 0; g < G; g++) {
                    const int64_t row = i * G + g;
                    const float inv = l[row] > 0.f ? v_scale / l[row] : 0.f;
                    store_f32(out, ((qs + t0 + i) * H + kh * G + g) * D, acc + row * D, inv, D, q_dt);
                }
            }
        }
    }
}
