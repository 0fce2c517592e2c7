/*
 * Batched LoRA deltas for rows of different adapters in one call (SGMV): for each row t whose
 * slot s = slots[t] is not negative,
 *
 *     h = x[t] A_s^T          (shrink: n = slices * R dot products of length K)
 *     y[t] += h B_s           (expand, slice by slice: slice j's R entries of h times its R rows
 *                              of B_s^T, over the slice's output columns ranges[j] only)
 *
 * with A [S, n, K] and B^T [S, n, N] (the adapter's scale folded into B; a fused layer's slices
 * are block-diagonal, so each slice's expand touches only its own columns). Zero entries of h
 * (the zero padding of a slot up to the largest rank, and slices an adapter leaves alone) are
 * skipped. Sums are in float32; x, A, B^T and y are float32 (dt 0) or bfloat16 (dt 1). The expand
 * keeps 64 output columns in registers across a slice's R rows. Rows are spread over the OpenMP
 * team when there are enough of them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline float ld(const void *p, int dt, int64_t i) {
    return dt ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(__AVX512F__)
static inline __m512 ld16(const void *p, int dt, int64_t i) {
    return dt ? bf16x16_load((const uint16_t *)p + i) : _mm512_loadu_ps((const float *)p + i);
}

static inline void add16(void *y, int dt, int64_t i, __m512 v) {
    if (dt) {
        uint16_t *yb = (uint16_t *)y + i;
        _mm256_storeu_si256((__m256i *)yb, bf16x16_from_f32(_mm512_add_ps(bf16x16_load(yb), v)));
    } else {
        float *yf = (float *)y + i;
        _mm512_storeu_ps(yf, _mm512_add_ps(_mm512_loadu_ps(yf), v));
    }
}
#endif

static float dot(const float *x, const void *a, int dt, int64_t K) {
    float s = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= K; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), ld16(a, dt, i), acc);
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < K; i++) s += x[i] * ld(a, dt, i);
    return s;
}

/* h[k] = x . a[k] for k < n (rows of a K apart), four rows at a time sharing the loads of x. */
static void shrink(const float *x, const void *a, int dt, int64_t n, int64_t K, float *h) {
    const size_t es = dt ? 2 : 4;
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 4 <= n && K % 16 == 0; k += 4) {
        const char *a0 = (const char *)a + (size_t)(k * K) * es;
        const char *a1 = a0 + (size_t)K * es, *a2 = a1 + (size_t)K * es, *a3 = a2 + (size_t)K * es;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < K; i += 16) {
            const __m512 xv = _mm512_loadu_ps(x + i);
            s0 = _mm512_fmadd_ps(xv, ld16(a0, dt, i), s0);
            s1 = _mm512_fmadd_ps(xv, ld16(a1, dt, i), s1);
            s2 = _mm512_fmadd_ps(xv, ld16(a2, dt, i), s2);
            s3 = _mm512_fmadd_ps(xv, ld16(a3, dt, i), s3);
        }
        h[k] = _mm512_reduce_add_ps(s0);
        h[k + 1] = _mm512_reduce_add_ps(s1);
        h[k + 2] = _mm512_reduce_add_ps(s2);
        h[k + 3] = _mm512_reduce_add_ps(s3);
    }
#endif
    for (; k < n; k++) h[k] = dot(x, (const char *)a + (size_t)(k * K) * es, dt, K);
}

static void add1(void *y, int dt, int64_t o, float v) {
    if (dt) ((uint16_t *)y)[o] = f32_to_bf16(bf16_to_f32(((uint16_t *)y)[o]) + v);
    else ((float *)y)[o] += v;
}

/* y[lo:hi] += sum over k of h[k] * b[k * N + lo : hi], for the R rows k of one slice. */
static void expand(const float *h, const void *b, int w_dt, int64_t R, int64_t N, int64_t lo, int64_t hi, void *y,
                   int y_dt) {
    int64_t o = lo;
    const size_t es = w_dt ? 2 : 4;
#if defined(__AVX512F__)
    for (; o + 64 <= hi; o += 64) {
        __m512 r0 = _mm512_setzero_ps(), r1 = r0, r2 = r0, r3 = r0;
        for (int64_t k = 0; k < R; k++) {
            if (h[k] == 0.0f) continue;
            const __m512 hv = _mm512_set1_ps(h[k]);
            const void *row = (const char *)b + (size_t)(k * N) * es;
            r0 = _mm512_fmadd_ps(hv, ld16(row, w_dt, o), r0);
            r1 = _mm512_fmadd_ps(hv, ld16(row, w_dt, o + 16), r1);
            r2 = _mm512_fmadd_ps(hv, ld16(row, w_dt, o + 32), r2);
            r3 = _mm512_fmadd_ps(hv, ld16(row, w_dt, o + 48), r3);
        }
        add16(y, y_dt, o, r0);
        add16(y, y_dt, o + 16, r1);
        add16(y, y_dt, o + 32, r2);
        add16(y, y_dt, o + 48, r3);
    }
    for (; o + 16 <= hi; o += 16) {
        __m512 r0 = _mm512_setzero_ps();
        for (int64_t k = 0; k < R; k++) {
            if (h[k] == 0.0f) continue;
            r0 = _mm512_fmadd_ps(_mm512_set1_ps(h[k]), ld16((const char *)b + (size_t)(k * N) * es, w_dt, o), r0);
        }
        add16(y, y_dt, o, r0);
    }
#endif
    for (; o < hi; o++) {
        float v = 0.0f;
        for (int64_t k = 0; k < R; k++) v += h[k] * ld((const char *)b + (size_t)(k * N) * es, w_dt, o);
        add1(y, y_dt, o, v);
    }
}

#if defined(__AVX512F__)
#define RB 4 /* rows of one slot handled together: each load of A and B^T serves all of them */

/* The deltas of nb <= RB rows of one slot: xf [RB][K] float32 (rows past nb zero), h [RB][n]. */
static void block_rows(const float *xf, int nb, const char *as, const char *bs, int w_dt, int64_t num_slices,
                       int64_t R, const int64_t *ranges, int64_t K, int64_t N, float *h, char **yt, int y_dt) {
    const size_t es = w_dt ? 2 : 4;
    const int64_t n = num_slices * R;
    for (int64_t k = 0; k < n; k++) {
        const char *ak = as + (size_t)(k * K) * es;
        __m512 acc[RB];
        for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < K; i += 16) {
            const __m512 av = ld16(ak, w_dt, i);
            for (int r = 0; r < RB; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + r * K + i), av, acc[r]);
        }
        for (int r = 0; r < RB; r++) h[r * n + k] = _mm512_reduce_add_ps(acc[r]);
    }
    for (int64_t j = 0; j < num_slices; j++) {
        const int64_t lo = ranges[2 * j], hi = ranges[2 * j + 1];
        const char *bj = bs + (size_t)(j * R * N) * es;
        int64_t o = lo;
        for (; o + 32 <= hi; o += 32) {
            __m512 c0[RB], c1[RB];
            for (int r = 0; r < RB; r++) c0[r] = c1[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < R; k++) {
                const char *row = bj + (size_t)(k * N) * es;
                const __m512 b0 = ld16(row, w_dt, o), b1 = ld16(row, w_dt, o + 16);
                for (int r = 0; r < RB; r++) {
                    const __m512 hv = _mm512_set1_ps(h[r * n + j * R + k]);
                    c0[r] = _mm512_fmadd_ps(hv, b0, c0[r]);
                    c1[r] = _mm512_fmadd_ps(hv, b1, c1[r]);
                }
            }
            for (int r = 0; r < nb; r++) {
                add16(yt[r], y_dt, o, c0[r]);
                add16(yt[r], y_dt, o + 16, c1[r]);
            }
        }
        for (int r = 0; r < nb; r++) expand(h + r * n + j * R, bj, w_dt, R, N, o, hi, yt[r], y_dt);
    }
}
#endif

/* 0 on success; 1 for an unsupported dtype; 2 when scratch memory cannot be had. ranges holds
 * [first output column, one past the last] of each of the num_slices slices. With AVX-512 and K a
 * multiple of 16 the rows are ordered by slot and taken RB at a time (block_rows). */
int lora_sgmv(const void *x, int64_t ldx, int x_dt, int64_t T, const int32_t *slots, const void *a,
              const void *bt, int w_dt, int64_t num_slices, int64_t R, const int64_t *ranges, int64_t K, int64_t N,
              void *y, int64_t ldy, int y_dt) {
    if ((x_dt != 0 && x_dt != 1) || (w_dt != 0 && w_dt != 1) || (y_dt != 0 && y_dt != 1)) return 1;
    const size_t es = w_dt ? 2 : 4, xs_size = x_dt ? 2 : 4, ys = y_dt ? 2 : 4;
    const int64_t n = num_slices * R;
    int failed = 0;
#if defined(__AVX512F__)
    if (K % 16 == 0) {
        /* rows with a slot, ordered by slot (stable), and the blocks of <= RB rows of one slot */
        int64_t *order = (int64_t *)malloc((size_t)(2 * T + 1) * sizeof(int64_t));
        if (!order) return 2;
        int64_t *blocks = order + T, m = 0, nblocks = 0;
        int32_t max_slot = -1;
        for (int64_t t = 0; t < T; t++) max_slot = slots[t] > max_slot ? slots[t] : max_slot;
        for (int32_t s = 0; s <= max_slot; s++) {
            const int64_t first = m;
            for (int64_t t = 0; t < T; t++)
                if (slots[t] == s) {
                    if ((m - first) % RB == 0) blocks[nblocks++] = m;
                    order[m++] = t;
                }
        }
        blocks[nblocks] = m;
#pragma omp parallel if (nblocks >= 4) reduction(| : failed)
        {
            float *xf = (float *)malloc((size_t)(RB * K + RB * n) * sizeof(float));
            if (!xf) {
                failed = 1;
            } else {
                float *h = xf + RB * K;
#pragma omp for schedule(static)
                for (int64_t bi = 0; bi < nblocks; bi++) {
                    const int64_t b0 = blocks[bi];
                    const int nb = (int)(blocks[bi + 1] - b0);
                    const int32_t s = slots[order[b0]];
                    char *yt[RB];
                    for (int r = 0; r < RB; r++) {
                        float *xr = xf + r * K;
                        if (r >= nb) {
                            memset(xr, 0, (size_t)K * sizeof(float));
                            yt[r] = NULL;
                            continue;
                        }
                        const int64_t t = order[b0 + r];
                        const char *xt = (const char *)x + (size_t)(t * ldx) * xs_size;
                        for (int64_t i = 0; i < K; i += 16) _mm512_storeu_ps(xr + i, ld16(xt, x_dt, i));
                        yt[r] = (char *)y + (size_t)(t * ldy) * ys;
                    }
                    block_rows(xf, nb, (const char *)a + (size_t)s * n * K * es,
                               (const char *)bt + (size_t)s * n * N * es, w_dt, num_slices, R, ranges, K, N, h, yt,
                               y_dt);
                }
                free(xf);
            }
        }
        free(order);
        return failed ? 2 : 0;
    }
#endif
#pragma omp parallel if (T >= 16) reduction(| : failed)
    {
        float *xf = (float *)malloc((size_t)(K + n) * sizeof(float));
        if (!xf) {
            failed = 1;
        } else {
            float *h = xf + K;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                const int32_t s = slots[t];
                if (s < 0) continue;
                const char *xt = (const char *)x + (size_t)(t * ldx) * xs_size;
                for (int64_t i = 0; i < K; i++) xf[i] = ld(xt, x_dt, i);
                const char *as = (const char *)a + (size_t)s * n * K * es;
                const char *bs = (const char *)bt + (size_t)s * n * N * es;
                shrink(xf, as, w_dt, n, K, h);
                void *yt = (char *)y + (size_t)(t * ldy) * ys;
                for (int64_t j = 0; j < num_slices; j++)
                    expand(h + j * R, bs + (size_t)(j * R * N) * es, w_dt, R, N, ranges[2 * j], ranges[2 * j + 1], yt,
                           y_dt);
            }
            free(xf);
        }
    }
    return failed ? 2 : 0;
}
