/*
 * Batched LoRA deltas for rows of different adapters in one call (SGMV): for each row t whose
 * slot s = slots[t] is not negative,
 *
 *     h = x[t] A_s^T          (shrink: n = slices * R dot products of length K)
 *     y[t] += h B_s           (expand, slice by slice: slice j's R entries of h times its R rows
 *                              of B_s^T, over the slice's output columns ranges[j] only)
 *
 * with A [S, n, K] and B^T [S, n, N] (the adapter's scale folded into B; a fused layer's slices
 * are block-diagonal, so each slice's expand touches only its own columns). Sums are in float32;
 * x, A, B^T and y are float32 (dt 0) or bfloat16 (dt 1).
 *
 * With AVX-512 and K a multiple of 16, the rows are ordered by slot and taken LORA_RB at a time
 * (each load of A and B^T serves all of them): lora_plan orders them, lora_block_h (the shrink:
 * bf16 dot products where rows and A are bf16 and the CPU has AVX-512 BF16, else float32 FMAs)
 * and lora_block_expand do one block. The fused decode step (llama_decode.c includes this file) runs
 * the same block functions inside its threads, each thread expanding only the output columns it
 * computed, so a row's delta is the same bits on either path: every output column is one FMA
 * chain over the slice's R entries of h from zero, then one rounded add to y, whatever columns a
 * call covers. Without AVX-512 (or K not a multiple of 16) lora_sgmv takes one row at a time.
 */
#ifndef PAGEDLLM_LORA_C
#define PAGEDLLM_LORA_C
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline float lora_ld(const void *p, int dt, int64_t i) {
    return dt ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static float lora_dot(const float *x, const void *a, int dt, int64_t K) {
    float s = 0.0f;
    for (int64_t i = 0; i < K; i++) s += x[i] * lora_ld(a, dt, i);
    return s;
}

static void lora_add1(void *y, int dt, int64_t o, float v) {
    if (dt) ((uint16_t *)y)[o] = f32_to_bf16(bf16_to_f32(((uint16_t *)y)[o]) + v);
    else ((float *)y)[o] += v;
}

/* One row without AVX-512: h = x A^T, then y[lo:hi] += h_j B_j for each slice j. */
static void lora_row_scalar(const float *x, const char *as, const char *bs, int w_dt, int64_t num_slices, int64_t R,
                            const int64_t *ranges, int64_t K, int64_t N, float *h, void *y, int y_dt) {
    const size_t es = w_dt ? 2 : 4;
    const int64_t n = num_slices * R;
    for (int64_t k = 0; k < n; k++) h[k] = lora_dot(x, as + (size_t)(k * K) * es, w_dt, K);
    for (int64_t j = 0; j < num_slices; j++)
        for (int64_t o = ranges[2 * j]; o < ranges[2 * j + 1]; o++) {
            float v = 0.0f;
            for (int64_t k = 0; k < R; k++) v += h[j * R + k] * lora_ld(bs + (size_t)((j * R + k) * N) * es, w_dt, o);
            lora_add1(y, y_dt, o, v);
        }
}

#if defined(__AVX512F__)
#define LORA_RB 4 /* rows of one slot handled together */
#define LORA_AVX512 1

/* 16 values from i (lanes outside mask k read as zero), widened to float32. */
static inline __m512 lora_ld16(const void *p, int dt, int64_t i, __mmask16 k) {
    if (dt)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(k, (const float *)p + i);
}

/* y[i:i+16] += v on the lanes of mask k, rounded to y's dtype. */
static inline void lora_add16(void *y, int dt, int64_t i, __m512 v, __mmask16 k) {
    if (dt) {
        uint16_t *yb = (uint16_t *)y + i;
        const __m512 s = _mm512_add_ps(lora_ld16(yb, 1, 0, k), v);
        _mm256_mask_storeu_epi16(yb, k, bf16x16_from_f32(s));
    } else {
        float *yf = (float *)y + i;
        _mm512_mask_storeu_ps(yf, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, yf), v));
    }
}

/* The rows with a slot, ordered by slot (stable), and the blocks of <= LORA_RB rows of one slot:
 * order [T] (the first *m entries used), blocks [nblocks + 1] (start of each block in order, then
 * *m). Returns nblocks. */
static int64_t lora_plan(const int32_t *slots, int64_t T, int64_t *order, int64_t *blocks, int64_t *m_out) {
    int64_t m = 0, nblocks = 0;
    int32_t max_slot = -1;
    for (int64_t t = 0; t < T; t++) max_slot = slots[t] > max_slot ? slots[t] : max_slot;
    for (int32_t s = 0; s <= max_slot; s++) {
        const int64_t first = m;
        for (int64_t t = 0; t < T; t++)
            if (slots[t] == s) {
                if ((m - first) % LORA_RB == 0) blocks[nblocks++] = m;
                order[m++] = t;
            }
    }
    blocks[nblocks] = m;
    *m_out = m;
    return nblocks;
}

/* xf [LORA_RB][K] float32: the block's nb rows of x (rows ldx apart; K a multiple of 16), zeros past nb. */
static void lora_load_rows(const void *x, int64_t ldx, int x_dt, const int64_t *rows, int nb, int64_t K, float *xf) {
    const size_t xs = x_dt ? 2 : 4;
    for (int r = 0; r < LORA_RB; r++) {
        float *xr = xf + r * K;
        if (r >= nb) {
            memset(xr, 0, (size_t)K * sizeof(float));
            continue;
        }
        const char *xt = (const char *)x + (size_t)(rows[r] * ldx) * xs;
        for (int64_t i = 0; i < K; i += 16) _mm512_storeu_ps(xr + i, lora_ld16(xt, x_dt, i, 0xffff));
    }
}

#if defined(__AVX512BF16__)
#define LORA_DPBF16 1
/* h [LORA_RB][n] = x A_s^T for bf16 rows x (xr: LORA_RB row pointers; rows past the block's may
 * repeat one of them, their h is not used) and the slot's bf16 A (as, [n, K], K a multiple of 32):
 * vdpbf16ps on pairs of inputs (the products exact in float32), 4 rows by 4 outputs at a time,
 * the 16 accumulators' lanes summed by lane_sums16 (lane_sum's pairing). */
static void lora_block_shrink_bf16(const uint16_t *const *xr, const uint16_t *as, int64_t n, int64_t K, float *h) {
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        __m512 acc[16];
        for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
        const uint16_t *a0 = as + k * K;
        for (int64_t i = 0; i < K; i += 32) {
            __m512bh av[4];
            for (int q = 0; q < 4; q++) av[q] = (__m512bh)_mm512_loadu_si512((const void *)(a0 + q * K + i));
            for (int r = 0; r < LORA_RB; r++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xr[r] + i));
                for (int q = 0; q < 4; q++) acc[r * 4 + q] = _mm512_dpbf16_ps(acc[r * 4 + q], xv, av[q]);
            }
        }
        float sums[16];
        _mm512_storeu_ps(sums, lane_sums16(acc));
        for (int r = 0; r < LORA_RB; r++)
            for (int q = 0; q < 4; q++) h[r * n + k + q] = sums[r * 4 + q];
    }
    for (; k < n; k++) {
        __m512 acc[LORA_RB];
        for (int r = 0; r < LORA_RB; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < K; i += 32) {
            const __m512bh av = (__m512bh)_mm512_loadu_si512((const void *)(as + k * K + i));
            for (int r = 0; r < LORA_RB; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512((const void *)(xr[r] + i)), av);
        }
        for (int r = 0; r < LORA_RB; r++) h[r * n + k] = lane_sum(acc[r]);
    }
}
#endif

/* Whether lora_block_shrink_bf16 takes this layer: bf16 rows and A, K a multiple of 32. */
static inline int lora_bf16_shrink(int x_dt, int w_dt, int64_t K) {
#if defined(LORA_DPBF16)
    return x_dt == 1 && w_dt == 1 && K % 32 == 0;
#else
    (void)x_dt, (void)w_dt, (void)K;
    return 0;
#endif
}

/* h [LORA_RB][n] of the block's rows (order[0:nb] of x, rows ldx apart) for the slot's A (as,
 * [n, K]): the bf16 dot products where lora_bf16_shrink, else float32 FMAs on the rows widened
 * into xf [LORA_RB][K]. */
static void lora_block_h(const void *x, int64_t ldx, int x_dt, const int64_t *order, int nb, const char *as, int w_dt,
                         int64_t n, int64_t K, float *xf, float *h);

/* h [LORA_RB][n] = xf A_s^T for the slot's A (as, [n, K]). */
static void lora_block_shrink(const float *xf, const char *as, int w_dt, int64_t n, int64_t K, float *h) {
    const size_t es = w_dt ? 2 : 4;
    for (int64_t k = 0; k < n; k++) {
        const char *ak = as + (size_t)(k * K) * es;
        __m512 acc[LORA_RB];
        for (int r = 0; r < LORA_RB; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < K; i += 16) {
            const __m512 av = lora_ld16(ak, w_dt, i, 0xffff);
            for (int r = 0; r < LORA_RB; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + r * K + i), av, acc[r]);
        }
        for (int r = 0; r < LORA_RB; r++) h[r * n + k] = lane_sum(acc[r]);
    }
}

static void lora_block_h(const void *x, int64_t ldx, int x_dt, const int64_t *order, int nb, const char *as, int w_dt,
                         int64_t n, int64_t K, float *xf, float *h) {
#if defined(LORA_DPBF16)
    if (lora_bf16_shrink(x_dt, w_dt, K)) {
        const uint16_t *xr[LORA_RB];
        for (int r = 0; r < LORA_RB; r++) xr[r] = (const uint16_t *)x + order[r < nb ? r : 0] * ldx;
        lora_block_shrink_bf16(xr, (const uint16_t *)as, n, K, h);
        return;
    }
#endif
    lora_load_rows(x, ldx, x_dt, order, nb, K, xf);
    lora_block_shrink(xf, as, w_dt, n, K, h);
}

/* yt[r][o] += sum over k of h[r][j R + k] B_s^T[j R + k][o], for the nb rows of the block and
 * the columns o of each slice j within [lo, hi): one FMA chain per column, 32 columns at a time,
 * then 16 under a mask (a column's value does not depend on which call or chunk covers it). */
static void lora_block_expand(const float *h, int nb, const char *bs, int w_dt, int64_t num_slices, int64_t R,
                              const int64_t *ranges, int64_t N, int64_t lo, int64_t hi, char *const *yt, int y_dt) {
    const size_t es = w_dt ? 2 : 4;
    const int64_t n = num_slices * R;
    for (int64_t j = 0; j < num_slices; j++) {
        const int64_t a = ranges[2 * j] > lo ? ranges[2 * j] : lo, b = ranges[2 * j + 1] < hi ? ranges[2 * j + 1] : hi;
        const char *bj = bs + (size_t)(j * R * N) * es;
        int64_t o = a;
        for (; o + 32 <= b; o += 32) {
            __m512 c0[LORA_RB], c1[LORA_RB];
            for (int r = 0; r < LORA_RB; r++) c0[r] = c1[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < R; k++) {
                const char *row = bj + (size_t)(k * N) * es;
                const __m512 b0 = lora_ld16(row, w_dt, o, 0xffff), b1 = lora_ld16(row, w_dt, o + 16, 0xffff);
                for (int r = 0; r < LORA_RB; r++) {
                    const __m512 hv = _mm512_set1_ps(h[r * n + j * R + k]);
                    c0[r] = _mm512_fmadd_ps(hv, b0, c0[r]);
                    c1[r] = _mm512_fmadd_ps(hv, b1, c1[r]);
                }
            }
            for (int r = 0; r < nb; r++) {
                lora_add16(yt[r], y_dt, o, c0[r], 0xffff);
                lora_add16(yt[r], y_dt, o + 16, c1[r], 0xffff);
            }
        }
        for (; o < b; o += 16) {
            const __mmask16 km = b - o >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (b - o)) - 1u);
            __m512 c0[LORA_RB];
            for (int r = 0; r < LORA_RB; r++) c0[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < R; k++) {
                const __m512 b0 = lora_ld16(bj + (size_t)(k * N) * es, w_dt, o, km);
                for (int r = 0; r < LORA_RB; r++) c0[r] = _mm512_fmadd_ps(_mm512_set1_ps(h[r * n + j * R + k]), b0, c0[r]);
            }
            for (int r = 0; r < nb; r++) lora_add16(yt[r], y_dt, o, c0[r], km);
        }
    }
}
#endif

/* 0 on success; 1 for an unsupported dtype; 2 when scratch memory cannot be had. ranges holds
 * [first output column, one past the last] of each of the num_slices slices. */
int lora_sgmv(const void *x, int64_t ldx, int x_dt, int64_t T, const int32_t *slots, const void *a,
              const void *bt, int w_dt, int64_t num_slices, int64_t R, const int64_t *ranges, int64_t K, int64_t N,
              void *y, int64_t ldy, int y_dt) {
    if ((x_dt != 0 && x_dt != 1) || (w_dt != 0 && w_dt != 1) || (y_dt != 0 && y_dt != 1)) return 1;
    const size_t es = w_dt ? 2 : 4, xs_size = x_dt ? 2 : 4, ys = y_dt ? 2 : 4;
    const int64_t n = num_slices * R;
    int failed = 0;
#if defined(__AVX512F__)
    if (K % 16 == 0) {
        int64_t *order = (int64_t *)malloc((size_t)(2 * T + 1) * sizeof(int64_t));
        if (!order) return 2;
        int64_t *blocks = order + T, m;
        const int64_t nblocks = lora_plan(slots, T, order, blocks, &m);
#pragma omp parallel if (nblocks >= 4) reduction(| : failed)
        {
            float *xf = (float *)malloc((size_t)(LORA_RB * K + LORA_RB * n) * sizeof(float));
            if (!xf) {
                failed = 1;
            } else {
                float *h = xf + LORA_RB * K;
#pragma omp for schedule(static)
                for (int64_t bi = 0; bi < nblocks; bi++) {
                    const int64_t b0 = blocks[bi];
                    const int nb = (int)(blocks[bi + 1] - b0);
                    const int32_t s = slots[order[b0]];
                    char *yt[LORA_RB] = {0};
                    for (int r = 0; r < nb; r++) yt[r] = (char *)y + (size_t)(order[b0 + r] * ldy) * ys;
                    lora_block_h(x, ldx, x_dt, order + b0, nb, (const char *)a + (size_t)s * n * K * es, w_dt, n, K, xf,
                                 h);
                    lora_block_expand(h, nb, (const char *)bt + (size_t)s * n * N * es, w_dt, num_slices, R, ranges,
                                      N, 0, N, yt, y_dt);
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
                for (int64_t i = 0; i < K; i++) xf[i] = lora_ld(xt, x_dt, i);
                lora_row_scalar(xf, (const char *)a + (size_t)s * n * K * es, (const char *)bt + (size_t)s * n * N * es,
                                w_dt, num_slices, R, ranges, K, N, h, (char *)y + (size_t)(t * ldy) * ys, y_dt);
            }
            free(xf);
        }
    }
    return failed ? 2 : 0;
}
#endif
