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
 * Where the CPU has AVX-512F (K a multiple of 16: lora_avx512.h) or AVX2 + FMA (any K:
 * lora_avx2.h), the rows are ordered by slot and taken LORA_RB at a time (each load of A and B^T
 * serves all of them): lora_plan orders them, lora_block_h (the shrink: with AVX-512, bf16 dot
 * products where rows and A are bf16 and the CPU has AVX-512 BF16, else float32 FMAs) and
 * lora_block_expand do one block. The fused decode step (llama_decode.c includes this file) runs
 * the same block functions inside its threads (each thread the shrink of its share of the blocks,
 * then, after a barrier, the expand of the output columns it computed), so a row's delta is the
 * same bits on either path: every output column is one FMA
 * chain over the slice's R entries of h from zero, then one rounded add to y, whatever columns a
 * call covers (the columns past the last full vector of a range too: under a mask, or in a
 * vector padded with zeros). With neither (or AVX-512 and K not a multiple of 16) lora_sgmv takes
 * one row at a time. Where the CPU has AMX-BF16 and the caller gives the slots' copies in the
 * tiles' layout (ap, bp), bf16 rows with bf16 adapters run on AMX tiles instead, LORA_AMX_RB rows
 * a block (lora_amx.h: h rounded to bf16 between the shrink and the expand), in lora_sgmv and the
 * fused step alike, so the two paths still give the same bits.
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

/* One row without the block kernels: h = x A^T, then y[lo:hi] += h_j B_j for each slice j. */
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
#include "lora_avx512.h"
#include "amx.h"
#if HAVE_AMX_BF16
#include "lora_amx.h"
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include "lora_avx2.h"
#endif

#if defined(LORA_RB)
#define LORA_BLOCKS 1 /* lora_plan and the ISA form's lora_block_h / lora_block_expand */
#if !defined(LORA_AMX_RB)
#define LORA_AMX_RB LORA_RB
static inline int lora_amx_take(const void *ap, const void *bp, int x_dt, int w_dt, int64_t K) {
    (void)ap, (void)bp, (void)x_dt, (void)w_dt, (void)K;
    return 0;
}
static inline int64_t lora_amx_scratch(int64_t n, int64_t K) { return (void)n, (void)K, 0; }
static inline int64_t lora_amx_h_floats(int64_t num_slices, int64_t R) { return (void)num_slices, (void)R, 0; }
#endif
#define LORA_RB_MAX (LORA_AMX_RB > LORA_RB ? LORA_AMX_RB : LORA_RB) /* the most rows of a block */

/* Floats of a thread's scratch for a block of a layer of K inputs and n = num_slices * R outputs
 * of the shrink, on either form; and of one block's h at the widest of num_slices slices. */
static inline int64_t lora_scratch_floats(int64_t n, int64_t K) {
    const int64_t v = LORA_RB * K, t = lora_amx_scratch(n, K);
    return v > t ? v : t;
}
static inline int64_t lora_h_floats(int64_t num_slices, int64_t R) {
    const int64_t v = LORA_RB_MAX * num_slices * R, t = lora_amx_h_floats(num_slices, R);
    return v > t ? v : t;
}

/* After a thread's blocks of a layer: releases the tiles where they ran on them (lora_amx_done). */
static inline void lora_tiles_end(int amx) {
#if HAVE_AMX_BF16
    if (amx) lora_amx_done();
#else
    (void)amx;
#endif
}

/* h of a block of nb <= LORA_RB_MAX rows of one slot (rows: their indices in x, T rows ldx
 * apart): on the tiles where amx (lora_amx_take; ap: the slot's packed A, h then bf16; pf: the
 * thread's LoraAmxPf or NULL), else LORA_RB rows at a time by the ISA form (as: the slot's A,
 * h [nb][n] float32). */
static void lora_h(int amx, const void *x, int64_t ldx, int x_dt, int64_t T, const int64_t *rows, int nb,
                   const char *as, const void *ap, int w_dt, int64_t num_slices, int64_t R, int64_t K, float *scratch,
                   float *h, void *pf) {
    const int64_t n = num_slices * R;
#if HAVE_AMX_BF16
    if (amx) {
        lora_amx_block_h((const uint16_t *)x, ldx, T, rows, nb, (const uint16_t *)ap, num_slices, R, K, scratch,
                         (uint16_t *)h, (LoraAmxPf *)pf);
        return;
    }
#else
    (void)amx, (void)T, (void)ap, (void)pf;
#endif
    for (int g = 0; g < nb; g += LORA_RB)
        lora_block_h(x, ldx, x_dt, rows + g, nb - g < LORA_RB ? nb - g : LORA_RB, as, w_dt, n, K, scratch, h + g * n);
}

/* yt[r][lo:hi] += the deltas of a block's nb rows from their h (lora_h, the same amx and pf). */
static void lora_expand(int amx, const float *h, int nb, const char *bs, const void *bp, int w_dt, int64_t num_slices,
                        int64_t R, const int64_t *ranges, int64_t N, int64_t lo, int64_t hi, char *const *yt, int y_dt,
                        void *pf) {
    const int64_t n = num_slices * R;
#if HAVE_AMX_BF16
    if (amx) {
        lora_amx_block_expand((const uint16_t *)h, nb, (const uint16_t *)bp, num_slices, R, ranges, N, lo, hi, yt,
                              y_dt, (LoraAmxPf *)pf);
        return;
    }
#else
    (void)amx, (void)bp, (void)pf;
#endif
    for (int g = 0; g < nb; g += LORA_RB)
        lora_block_expand(h + g * n, nb - g < LORA_RB ? nb - g : LORA_RB, bs, w_dt, num_slices, R, ranges, N, lo, hi,
                          yt + g, y_dt);
}

/* The rows with a slot, ordered by slot (stable), and the blocks of <= rb rows of one slot:
 * order [T] (the first *m entries used), blocks [nblocks + 1] (start of each block in order, then
 * *m). Returns nblocks. */
static int64_t lora_plan(const int32_t *slots, int64_t T, int rb, int64_t *order, int64_t *blocks, int64_t *m_out) {
    int64_t m = 0, nblocks = 0;
    int32_t max_slot = -1;
    for (int64_t t = 0; t < T; t++) max_slot = slots[t] > max_slot ? slots[t] : max_slot;
    for (int32_t s = 0; s <= max_slot; s++) {
        const int64_t first = m;
        for (int64_t t = 0; t < T; t++)
            if (slots[t] == s) {
                if ((m - first) % rb == 0) blocks[nblocks++] = m;
                order[m++] = t;
            }
    }
    blocks[nblocks] = m;
    *m_out = m;
    return nblocks;
}
#endif

/* 0 on success; 1 for an unsupported dtype; 2 when scratch memory cannot be had. ranges holds
 * [first output column, one past the last] of each of the num_slices slices. ap and bp: the
 * slots' A and B^T in the AMX tiles' layout (lora_amx.h), or NULL (the deltas then run on the
 * vector form). */
int lora_sgmv(const void *x, int64_t ldx, int x_dt, int64_t T, const int32_t *slots, const void *a,
              const void *bt, const void *ap, const void *bp, int w_dt, int64_t num_slices, int64_t R,
              const int64_t *ranges, int64_t K, int64_t N, void *y, int64_t ldy, int y_dt) {
    if ((x_dt != 0 && x_dt != 1) || (w_dt != 0 && w_dt != 1) || (y_dt != 0 && y_dt != 1)) return 1;
    const size_t es = w_dt ? 2 : 4, xs_size = x_dt ? 2 : 4, ys = y_dt ? 2 : 4;
    const int64_t n = num_slices * R;
    int failed = 0;
#if defined(LORA_BLOCKS)
    if (lora_blocks_take(K)) {
        const int amx = lora_amx_take(ap, bp, x_dt, w_dt, K);
        int64_t *order = (int64_t *)malloc((size_t)(2 * T + 1) * sizeof(int64_t));
        if (!order) return 2;
        int64_t *blocks = order + T, m;
        const int64_t nblocks = lora_plan(slots, T, amx ? LORA_AMX_RB : LORA_RB, order, blocks, &m);
        const int64_t sf = lora_scratch_floats(n, K), hf = lora_h_floats(num_slices, R);
#if HAVE_AMX_BF16
        const int64_t pa = lora_amx_a_elems(n, K), pb = lora_amx_b_elems(num_slices, R, N);
#else
        const int64_t pa = 0, pb = 0;
#endif
#pragma omp parallel if (nblocks >= 4) reduction(| : failed)
        {
            float *xf = (float *)aligned_alloc(64, (size_t)((sf + hf + 15) / 16 * 16) * sizeof(float));
            if (!xf) {
                failed = 1;
            } else {
                float *h = xf + sf;
#if HAVE_AMX_BF16
                LoraAmxPf pfs, *pf = amx ? &pfs : NULL;
#else
                void *pf = NULL;
#endif
#pragma omp for schedule(static)
                for (int64_t bi = 0; bi < nblocks; bi++) {
                    const int64_t b0 = blocks[bi];
                    const int nb = (int)(blocks[bi + 1] - b0);
                    const int32_t s = slots[order[b0]];
                    char *yt[LORA_RB_MAX] = {0};
                    for (int r = 0; r < nb; r++) yt[r] = (char *)y + (size_t)(order[b0 + r] * ldy) * ys;
#if HAVE_AMX_BF16
                    if (pf) { /* this block's A and B^T, then the next block's where its slot differs */
                        lora_amx_pf_init(pf);
                        for (int64_t bj = bi; bj < nblocks && bj < bi + 2; bj++) {
                            const int32_t sj = slots[order[blocks[bj]]];
                            if (bj > bi && sj == s) break;
                            lora_amx_pf_a(pf, (const uint16_t *)ap + sj * pa, n, K);
                            lora_amx_pf_b(pf, (const uint16_t *)bp + sj * pb, num_slices, R, ranges, N, 0, N);
                        }
                        lora_amx_pf_advance(pf, LORA_AMX_LEAD);
                    }
#endif
                    lora_h(amx, x, ldx, x_dt, T, order + b0, nb, (const char *)a + (size_t)s * n * K * es,
                           amx ? (const uint16_t *)ap + s * pa : NULL, w_dt, num_slices, R, K, xf, h, pf);
                    lora_expand(amx, h, nb, (const char *)bt + (size_t)s * n * N * es,
                                amx ? (const uint16_t *)bp + s * pb : NULL, w_dt, num_slices, R, ranges, N, 0, N, yt,
                                y_dt, pf);
                }
                lora_tiles_end(amx);
                free(xf);
            }
        }
        free(order);
        return failed ? 2 : 0;
    }
#endif
    (void)ap, (void)bp; /* the vector and scalar forms read the row-major copies */
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
/* Whether lora_sgmv and the fused decode step run bf16 deltas on AMX tiles when given the slots'
 * packed copies (an AMX-BF16 build and the tile registers lent to this process): 1 or 0. */
int lora_amx_available(void) {
#if HAVE_AMX_BF16 && defined(LORA_BLOCKS)
    return amx_permitted();
#else
    return 0;
#endif
}
#endif
