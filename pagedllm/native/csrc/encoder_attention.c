/*
 * Bidirectional attention of an encoder's step (BERT): every sequence of the step attends over all
 * of its own tokens, read in place from the step's flat QKV projection, with no padding and no KV
 * cache. One work item is one (sequence, head); the items are shared over the OpenMP team (torch's
 * thread count) one at a time, dynamically.
 *
 * Per item, in float32 (bf16 inputs are widened exactly as they are read):
 *   1. K^T packed as kt[D][Lp] (Lp: the sequence length rounded up to 16, zero keys past it) and V
 *      as vv[L][D], once for the item;
 *   2. query rows RB at a time: scores against 16 keys a vector (each kt load feeds RB rows), the
 *      row's maximum, exp (a degree-6 2^x on the exponent split, relative error < 2e-7), the sum;
 *   3. P V into the rows' float32 outputs, 16 columns a vector, times 1 / sum, stored as float32 or
 *      rounded once to bfloat16.
 * Each row's result depends only on its own query and its sequence's keys and values, not on the
 * other rows or sequences of the call (pagedllm against itself is exact whatever the batch).
 *
 * Layouts: qkv [T, ld] rows, row t holding q (heads 0 .. H - 1, D each), then k, then v (H * D
 * each); out [T, ldo] rows, head h at h * D. starts[i], lens[i]: sequence i's first row and length.
 * D must be a multiple of 16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define RB 4 /* query rows per register block */
#define VL 16

/* 2^t for t <= 0 (t clamped at -126): 2^floor(t) from the exponent bits, 2^frac by a degree-6
 * polynomial. Written for the compiler to vectorize. */
static inline float exp2_neg(float t) {
    t = t < -126.f ? -126.f : t;
    const float n = floorf(t), f = t - n;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6180677e-3f;
    p = p * f + 5.5503338e-2f;
    p = p * f + 2.4022650e-1f;
    p = p * f + 6.9314720e-1f;
    p = p * f + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

static inline float load_elem(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* One (sequence, head): rows s0 .. s0 + L - 1 of qkv, head h. */
static inline __attribute__((always_inline)) void item(
    const void *qkv, int64_t ld, int64_t s0, int64_t L, int64_t h, int64_t H, int64_t D, float scale, void *out,
    int64_t ldo, const int bf16, float *restrict kt, float *restrict vv, float *restrict sc, float *restrict qf,
    float *restrict o) {
    const int64_t Lp = (L + VL - 1) / VL * VL, es = bf16 ? 2 : 4;
    for (int64_t j = 0; j < L; j++) {
        const char *row = (const char *)qkv + (s0 + j) * ld * es;
        const void *k = row + (H + h) * D * es, *v = row + (2 * H + h) * D * es;
        for (int64_t d = 0; d < D; d++) kt[d * Lp + j] = load_elem(k, d, bf16);
        for (int64_t d = 0; d < D; d++) vv[j * D + d] = load_elem(v, d, bf16);
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = L; j < Lp; j++) kt[d * Lp + j] = 0.f;
    const float sl2 = scale * 1.44269504088896341f; /* scores in log2 units: exp(x) = 2^(x log2 e) */
    for (int64_t i0 = 0; i0 < L; i0 += RB) {
        const int nr = L - i0 < RB ? (int)(L - i0) : RB;
        for (int r = 0; r < RB; r++) { /* padding rows repeat the last row (computed, not stored) */
            const int64_t i = i0 + (r < nr ? r : nr - 1);
            const void *q = (const char *)qkv + ((s0 + i) * ld + h * D) * es;
            for (int64_t d = 0; d < D; d++) qf[r * D + d] = load_elem(q, d, bf16) * sl2;
        }
        for (int64_t j0 = 0; j0 < Lp; j0 += VL) {
            float acc[RB][VL] = {{0}};
            for (int64_t d = 0; d < D; d++) {
                const float *kr = kt + d * Lp + j0;
                for (int r = 0; r < RB; r++) {
                    const float qd = qf[r * D + d];
#pragma omp simd
                    for (int l = 0; l < VL; l++) acc[r][l] += qd * kr[l];
                }
            }
            for (int r = 0; r < RB; r++)
                for (int l = 0; l < VL; l++) sc[r * Lp + j0 + l] = acc[r][l];
        }
        float inv[RB];
        for (int r = 0; r < RB; r++) {
            float *s = sc + r * Lp;
            float m = s[0];
            for (int64_t j = 1; j < L; j++) m = s[j] > m ? s[j] : m;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < L; j++) {
                const float p = exp2_neg(s[j] - m);
                s[j] = p;
                sum += p;
            }
            inv[r] = 1.f / sum;
        }
        for (int64_t d0 = 0; d0 < D; d0 += VL) {
            float acc[RB][VL] = {{0}};
            for (int64_t j = 0; j < L; j++) {
                const float *vr = vv + j * D + d0;
                for (int r = 0; r < RB; r++) {
                    const float p = sc[r * Lp + j];
#pragma omp simd
                    for (int l = 0; l < VL; l++) acc[r][l] += p * vr[l];
                }
            }
            for (int r = 0; r < nr; r++)
                for (int l = 0; l < VL; l++) o[r * D + d0 + l] = acc[r][l] * inv[r];
        }
        for (int r = 0; r < nr; r++) {
            char *dst = (char *)out + ((s0 + i0 + r) * ldo + h * D) * es;
            if (bf16)
                for (int64_t d = 0; d < D; d++) ((uint16_t *)dst)[d] = f32_to_bf16(o[r * D + d]);
            else
                memcpy(dst, o + r * D, (size_t)D * 4);
        }
    }
}

static int encoder_attention(const void *qkv, int64_t ld, const int64_t *starts, const int64_t *lens, int64_t nseq,
                             int64_t H, int64_t D, float scale, void *out, int64_t ldo, const int bf16) {
    if (D % VL != 0) return 2;
    int64_t lmax = 1;
    for (int64_t i = 0; i < nseq; i++) lmax = lens[i] > lmax ? lens[i] : lmax;
    const int64_t lp = (lmax + VL - 1) / VL * VL;
    int failed = 0;
#pragma omp parallel
    {
        float *kt = aligned_alloc(64, (size_t)(D * lp * 4));
        float *vv = aligned_alloc(64, (size_t)(lp * D * 4));
        float *sc = aligned_alloc(64, (size_t)(RB * lp * 4));
        float *qf = aligned_alloc(64, (size_t)(RB * D * 4));
        float *o = aligned_alloc(64, (size_t)(RB * D * 4));
        if (!kt || !vv || !sc || !qf || !o) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int any_failed;
#pragma omp atomic read
        any_failed = failed;
        if (!any_failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < nseq * H; w++) {
                const int64_t i = w / H, h = w % H;
                if (bf16)
                    item(qkv, ld, starts[i], lens[i], h, H, D, scale, out, ldo, 1, kt, vv, sc, qf, o);
                else
                    item(qkv, ld, starts[i], lens[i], h, H, D, scale, out, ldo, 0, kt, vv, sc, qf, o);
            }
        }
        free(kt), free(vv), free(sc), free(qf), free(o);
    }
    return failed;
}

/* 0; 1 where a buffer could not be allocated, 2 where D is not a multiple of 16 (out not written). */
int encoder_attention_f32(const float *qkv, int64_t ld, const int64_t *starts, const int64_t *lens, int64_t nseq,
                          int64_t H, int64_t D, float scale, float *out, int64_t ldo) {
    return encoder_attention(qkv, ld, starts, lens, nseq, H, D, scale, out, ldo, 0);
}

int encoder_attention_bf16(const uint16_t *qkv, int64_t ld, const int64_t *starts, const int64_t *lens, int64_t nseq,
                           int64_t H, int64_t D, float scale, uint16_t *out, int64_t ldo) {
    return encoder_attention(qkv, ld, starts, lens, nseq, H, D, scale, out, ldo, 1);
}
