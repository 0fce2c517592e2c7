/*
 * Fused bfloat16 elementwise ops of the decoder layer, each one pass over its rows, with the
 * rounding points of the reference (HF transformers) implementation:
 *
 *   rms_norm_bf16:  h = bf16(x + add) when `add` is given (written to h_out), else h = x;
 *                   y = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))), the mean in float32.
 *   silu_mul_bf16:  y = bf16(bf16(silu(gate)) * up), silu in float32, for x = [gate | up] rows.
 *   rope_bf16:      rotate-half RoPE of every head of a row, y = bf16(bf16(x * cos) + bf16(r * sin))
 *                   with r = [-x2, x1], cos/sin rows of the token's position (bf16 tables).
 *
 * Rows are split over the OpenMP team only when there are enough of them to pay for waking it.
 * The fused decode step (llama_decode.c) includes this file and calls the
 * per-row functions (rms_norm_bf16_row, silu_mul_bf16_span, rope_bf16_row) inside its own team,
 * so that its bf16 results are these kernels' to the bit (and silu_mul_f32_span for float32).
 * Layouts: x [T, N] with row stride ldx (elements); add, h_out and y [T, N] contiguous; all bf16
 * as uint16. rms_norm_f32, silu_mul_f32 and rope_f32 are the float32 ops in one pass each. Each
 * op has a 16-lane AVX-512 form and an 8-lane AVX2 + FMA form; other CPUs export none of them.
 */
#ifndef PAGEDLLM_ELEMENTWISE_BF16_C
#define PAGEDLLM_ELEMENTWISE_BF16_C
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* Elements (T x row length) from which an entry point splits its rows over the team. A prompt step's
 * rows pay for it from a few dozen rows on: at 256 rows of 576 (SmolLM2-135M) on two cores the
 * residual add + RMSNorm takes 34 us split against 65 us on one thread, RoPE of q and k 32 against
 * 56 us (bf16); the team's threads spin at the barrier between a step's calls, so waking it costs a
 * microsecond or two. The old bound, 1 << 18, kept those calls on one thread. */
#define ELEMENTWISE_PARALLEL_MIN (1 << 14)

#if defined(__AVX512F__)
#include "elementwise_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "elementwise_avx2.h"
#else
#include "elementwise_scalar.h"
#endif

/* The rope entry points' arguments: 1 when hd / 2 is not a multiple of 16 or W not a multiple of hd,
 * 2 when a position is outside the tables [0, max_pos), else 0. */
static inline int rope_args_error(int64_t T, int64_t W, int64_t hd, const int64_t *pos, int64_t max_pos) {
    if (hd % 2 || (hd / 2) % 16 || W % hd) return 1;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return 2;
    return 0;
}

#if defined(ELEMENTWISE_F32)
/* ---- float32 entry points (elementwise_avx512.h's or elementwise_avx2.h's row functions). */
/* h = x + add (written to h_out) when add is given, else h = x; y = w * (h * rsqrt(mean(h^2) + eps)). */
int rms_norm_f32(const float *x, int64_t ldx, const float *add, float *h_out, const float *w, int64_t T, int64_t N,
                 float eps, float *y) {
#pragma omp parallel for schedule(static) if (T * N >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++)
        rms_norm_f32_row(x + t * ldx, add ? add + t * N : 0, add ? h_out + t * N : 0, w, N, eps, y + t * N);
    return 0;
}

/* x [T, 2I] rows [gate | up] with row stride ldx; y [T, I] = silu(gate) * up. */
int silu_mul_f32(const float *x, int64_t ldx, int64_t T, int64_t I, float *y) {
#pragma omp parallel for schedule(static) if (T * I >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) silu_mul_f32_span(x + t * ldx, x + t * ldx + I, 0, I, y + t * I);
    return 0;
}

/* Rotate-half RoPE as rope_bf16, in float32 (rope_f32_row per row); (hd / 2) % 16 == 0.
 * Returns 2, writing nothing, when a position is outside the tables. */
int rope_f32(const float *x, int64_t ldx, int64_t T, int64_t W, int64_t hd, const int64_t *pos, const float *cos,
             const float *sin, int64_t max_pos, float *y) {
    const int err = rope_args_error(T, W, hd, pos, max_pos);
    if (err) return err;
#pragma omp parallel for schedule(static) if (T * W >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) rope_f32_row(x + t * ldx, W, hd, cos + pos[t] * hd, sin + pos[t] * hd, y + t * W);
    return 0;
}
#endif

#if defined(BF_LANES)
/* ---- bf16 rows, on the BF_LANES float32 lanes of this build (16 with AVX-512, 8 with AVX2 + FMA).
 * Rounding points: round to bf16 (BF_ROUND) between each product and the sum after it, so that
 * none is contracted into an FMA; row lengths are multiples of BF_LANES (the entry points ask for
 * 16 on both). */

/* One row: h = bf16(x + add) into hr when add is given (else h = x), y = bf16(w * bf16(h * inv)). */
static inline void rms_norm_bf16_row(const uint16_t *xr, const uint16_t *add, uint16_t *hr, const uint16_t *w,
                                     int64_t N, float eps, uint16_t *yr) {
    vbf ss = BF_ZERO();
    for (int64_t i = 0; i < N; i += BF_LANES) {
        vbf h = BF_LOAD(xr + i);
        if (add) {
            h = BF_ROUND(BF_ADD(h, BF_LOAD(add + i)));
            BF_STORE(hr + i, h);
        }
        ss = BF_FMA(h, h, ss);
    }
    const vbf inv = BF_SET1(1.f / sqrtf(BF_SUM(ss) / (float)N + eps));
    const uint16_t *src = add ? hr : xr;
    for (int64_t i = 0; i < N; i += BF_LANES) {
        const vbf n = BF_ROUND(BF_MUL(BF_LOAD(src + i), inv));
        BF_STORE(yr + i, BF_MUL(BF_LOAD(w + i), n));
    }
}

/* y[i] = bf16(bf16(silu(g[i])) * u[i]) for i < n. */
static inline void silu_mul_bf16_span(const uint16_t *g, const uint16_t *u, int64_t n, uint16_t *y) {
    for (int64_t i = 0; i < n; i += BF_LANES) {
        const vbf gv = BF_LOAD(g + i);
        const vbf s = BF_ROUND(BF_DIV(gv, BF_ADD(BF_SET1(1.f), BF_EXP(BF_SUB(BF_ZERO(), gv)))));
        BF_STORE(y + i, BF_MUL(s, BF_LOAD(u + i)));
    }
}

/* The heads of one row: xr [W] to yr [W], W = heads * hd; c, s: the position's cos and sin rows. */
static inline void rope_bf16_row(const uint16_t *xr0, int64_t W, int64_t hd, const uint16_t *c, const uint16_t *s,
                                 uint16_t *yr0) {
    const int64_t half = hd / 2;
    for (int64_t h0 = 0; h0 < W; h0 += hd) {
        const uint16_t *xr = xr0 + h0;
        uint16_t *yr = yr0 + h0;
        for (int64_t i = 0; i < half; i += BF_LANES) {
            const vbf x1 = BF_LOAD(xr + i), x2 = BF_LOAD(xr + half + i);
            const vbf lo = BF_ADD(BF_ROUND(BF_MUL(x1, BF_LOAD(c + i))),
                                  BF_ROUND(BF_MUL(BF_SUB(BF_ZERO(), x2), BF_LOAD(s + i))));
            const vbf hi = BF_ADD(BF_ROUND(BF_MUL(x2, BF_LOAD(c + half + i))), BF_ROUND(BF_MUL(x1, BF_LOAD(s + half + i))));
            BF_STORE(yr + i, lo);
            BF_STORE(yr + half + i, hi);
        }
    }
}
#define ELEMENTWISE_BF16 1

/* ---- bf16 entry points. */
/* N % 16 == 0. */
int rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *add, uint16_t *h_out, const uint16_t *w, int64_t T,
                  int64_t N, float eps, uint16_t *y) {
    if (N % 16) return 1;
#pragma omp parallel for schedule(static) if (T * N >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++)
        rms_norm_bf16_row(x + t * ldx, add ? add + t * N : 0, add ? h_out + t * N : 0, w, N, eps, y + t * N);
    return 0;
}

/* x [T, 2I] rows [gate | up] with row stride ldx; y [T, I]; I % 16 == 0. */
int silu_mul_bf16(const uint16_t *x, int64_t ldx, int64_t T, int64_t I, uint16_t *y) {
    if (I % 16) return 1;
#pragma omp parallel for schedule(static) if (T * I >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) silu_mul_bf16_span(x + t * ldx, x + t * ldx + I, I, y + t * I);
    return 0;
}

/* x [T, W] (row stride ldx), W = heads * hd; cos, sin [max_pos, hd]; y [T, W]; (hd / 2) % 16 == 0.
 * Returns 2, writing nothing, when a position is outside the tables. */
int rope_bf16(const uint16_t *x, int64_t ldx, int64_t T, int64_t W, int64_t hd, const int64_t *pos,
              const uint16_t *cos, const uint16_t *sin, int64_t max_pos, uint16_t *y) {
    const int err = rope_args_error(T, W, hd, pos, max_pos);
    if (err) return err;
#pragma omp parallel for schedule(static) if (T * W >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) rope_bf16_row(x + t * ldx, W, hd, cos + pos[t] * hd, sin + pos[t] * hd, y + t * W);
    return 0;
}
#endif
#endif
