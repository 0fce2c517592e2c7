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
 * The fused decode step (pagedllm/worker/csrc/llama_decode.c) includes this file and calls the
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

#define ELEMENTWISE_PARALLEL_MIN (1 << 18)

#if defined(__AVX512F__)
/* The bf16 ops (written once, below) on 16 float32 lanes. */
typedef __m512 vbf;
#define BF_LANES 16
#define BF_LOAD(p) bf16x16_load(p)
#define BF_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), bf16x16_from_f32(v))
#define BF_ROUND(v) round_bf16(v)
#define BF_ADD _mm512_add_ps
#define BF_SUB _mm512_sub_ps
#define BF_MUL _mm512_mul_ps
#define BF_DIV _mm512_div_ps
#define BF_FMA _mm512_fmadd_ps
#define BF_SET1 _mm512_set1_ps
#define BF_ZERO _mm512_setzero_ps
#define BF_EXP exp512
#define BF_SUM lane_sum

/* ---- float32: the same three ops, one pass each (the torch formulas take 2-7 passes and as many
 * allocations). Products and sums are rounded one by one (no fused multiply-adds), as the torch
 * formulas round them; the RMSNorm statistics and exp differ from torch's in the last bits. */
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __mmask16 tail16(int64_t n, int64_t i) {
    return n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
}

/* One row of N: h = xr + add (written to hr) when add is given, else h = xr;
 * yr = w * (h * rsqrt(mean(h^2) + eps)). The fused decode step calls it on its rows too. */
static inline void rms_norm_f32_row(const float *xr, const float *add, float *hr, const float *w, int64_t N,
                                    float eps, float *yr) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < N; i += 16) {
        const __mmask16 k = tail16(N, i);
        __m512 h = _mm512_maskz_loadu_ps(k, xr + i);
        if (add) {
            h = _mm512_add_round_ps(h, _mm512_maskz_loadu_ps(k, add + i), RN);
            _mm512_mask_storeu_ps(hr + i, k, h);
        }
        ss = _mm512_fmadd_ps(h, h, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)N + eps));
    const float *src = add ? hr : xr;
    for (int64_t i = 0; i < N; i += 16) {
        const __mmask16 k = tail16(N, i);
        const __m512 n = _mm512_mul_round_ps(_mm512_maskz_loadu_ps(k, src + i), inv, RN);
        _mm512_mask_storeu_ps(yr + i, k, _mm512_mul_round_ps(_mm512_maskz_loadu_ps(k, w + i), n, RN));
    }
}

/* y[i] = silu(g[i]) * u[i] for i in [lo, hi), any range (the last lanes masked); the fused decode
 * step calls it on its threads' shares of the gate rows. */
static inline void silu_mul_f32_span(const float *g, const float *u, int64_t lo, int64_t hi, float *y) {
    for (int64_t i = lo; i < hi; i += 16) {
        const __mmask16 k = tail16(hi, i);
        const __m512 gv = _mm512_maskz_loadu_ps(k, g + i);
        const __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                          exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_round_ps(sv, _mm512_maskz_loadu_ps(k, u + i), RN));
    }
}

/* One row's W / hd heads of rotate-half RoPE in float32, read from xr and written to yr (may be
 * xr): y = x * cos + r * sin, r = [-x2, x1], each product rounded before the sum; c and s are
 * the position's table rows; (hd / 2) % 16 == 0. The fused decode step calls it on its rows too. */
static inline void rope_f32_row(const float *xr0, int64_t W, int64_t hd, const float *c, const float *s,
                                float *yr0) {
    const int64_t half = hd / 2;
    for (int64_t h0 = 0; h0 < W; h0 += hd) {
        const float *xr = xr0 + h0;
        float *yr = yr0 + h0;
        for (int64_t i = 0; i < half; i += 16) {
            const __m512 x1 = _mm512_loadu_ps(xr + i), x2 = _mm512_loadu_ps(xr + half + i);
            const __m512 lo = _mm512_add_round_ps(
                _mm512_mul_round_ps(x1, _mm512_loadu_ps(c + i), RN),
                _mm512_mul_round_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), _mm512_loadu_ps(s + i), RN), RN);
            const __m512 hi = _mm512_add_round_ps(
                _mm512_mul_round_ps(x2, _mm512_loadu_ps(c + half + i), RN),
                _mm512_mul_round_ps(x1, _mm512_loadu_ps(s + half + i), RN), RN);
            _mm512_storeu_ps(yr + i, lo);
            _mm512_storeu_ps(yr + half + i, hi);
        }
    }
}

#undef RN
#define ELEMENTWISE_F32 1
#elif defined(__AVX2__) && defined(__FMA__)
/* float32 on CPUs with AVX2 + FMA and no AVX-512: the same three ops on 8 lanes, with the rounding
 * points of the AVX-512 forms (each product through mul_rn8, so none is contracted into an FMA with
 * the sum after it). RMSNorm and SiLU rows whose length is not a multiple of 8 finish in scalar
 * code; RoPE rows come with (hd / 2) % 16 == 0, as for the AVX-512 form (both callers check it). */

/* exp256: bf16.h */

static inline void rms_norm_f32_row(const float *xr, const float *add, float *hr, const float *w, int64_t N,
                                    float eps, float *yr) {
    __m256 ss = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= N; i += 8) {
        __m256 h = _mm256_loadu_ps(xr + i);
        if (add) {
            h = _mm256_add_ps(h, _mm256_loadu_ps(add + i));
            _mm256_storeu_ps(hr + i, h);
        }
        ss = _mm256_fmadd_ps(h, h, ss);
    }
    float tail = 0.f;
    for (int64_t j = i; j < N; j++) {
        const float h = add ? (hr[j] = xr[j] + add[j]) : xr[j];
        tail += h * h;
    }
    const float inv = 1.f / sqrtf((lane_sum8(ss) + tail) / (float)N + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    const float *src = add ? hr : xr;
    for (i = 0; i + 8 <= N; i += 8)
        _mm256_storeu_ps(yr + i, mul_rn8(_mm256_loadu_ps(w + i), mul_rn8(_mm256_loadu_ps(src + i), iv)));
    for (; i < N; i++) {
        const __m256 n = mul_rn8(_mm256_set1_ps(src[i]), iv);
        yr[i] = _mm256_cvtss_f32(mul_rn8(_mm256_set1_ps(w[i]), n));
    }
}

/* silu(g) = g / (1 + e^-g) on 8 lanes. */
static inline __m256 silu8(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

static inline void silu_mul_f32_span(const float *g, const float *u, int64_t lo, int64_t hi, float *y) {
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8)
        _mm256_storeu_ps(y + i, mul_rn8(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
    for (; i < hi; i++) y[i] = _mm256_cvtss_f32(mul_rn8(silu8(_mm256_set1_ps(g[i])), _mm256_set1_ps(u[i])));
}

static inline void rope_f32_row(const float *xr0, int64_t W, int64_t hd, const float *c, const float *s,
                                float *yr0) {
    const int64_t half = hd / 2;
    for (int64_t h0 = 0; h0 < W; h0 += hd) {
        const float *xr = xr0 + h0;
        float *yr = yr0 + h0;
        for (int64_t i = 0; i < half; i += 8) {
            const __m256 x1 = _mm256_loadu_ps(xr + i), x2 = _mm256_loadu_ps(xr + half + i);
            const __m256 lo = _mm256_add_ps(mul_rn8(x1, _mm256_loadu_ps(c + i)),
                                            mul_rn8(_mm256_sub_ps(_mm256_setzero_ps(), x2), _mm256_loadu_ps(s + i)));
            const __m256 hi = _mm256_add_ps(mul_rn8(x2, _mm256_loadu_ps(c + half + i)),
                                            mul_rn8(x1, _mm256_loadu_ps(s + half + i)));
            _mm256_storeu_ps(yr + i, lo);
            _mm256_storeu_ps(yr + half + i, hi);
        }
    }
}

/* The bf16 ops (written once, below) on 8 float32 lanes. */
typedef __m256 vbf;
#define BF_LANES 8
#define BF_LOAD(p) bf16x8_load(p)
#define BF_STORE(p, v) _mm_storeu_si128((__m128i *)(p), bf16x8_from_f32(v))
#define BF_ROUND(v) round_bf16_8(v)
#define BF_ADD _mm256_add_ps
#define BF_SUB _mm256_sub_ps
#define BF_MUL _mm256_mul_ps
#define BF_DIV _mm256_div_ps
#define BF_FMA _mm256_fmadd_ps
#define BF_SET1 _mm256_set1_ps
#define BF_ZERO _mm256_setzero_ps
#define BF_EXP exp256
#define BF_SUM lane_sum8
#define ELEMENTWISE_F32 1
#else
/* Neither AVX-512 nor AVX2 + FMA: the float32 row functions the fused decode step calls, as plain
 * loops the compiler vectorizes (expf through the vector math library under -ffast-math). Same
 * formulas as above; nothing is exported, so the torch path keeps torch's ops on these CPUs. */
static inline void rms_norm_f32_row(const float *xr, const float *add, float *hr, const float *w, int64_t N,
                                    float eps, float *yr) {
    const float *src = xr;
    if (add) {
        for (int64_t i = 0; i < N; i++) hr[i] = xr[i] + add[i];
        src = hr;
    }
    float ss = 0.f;
    for (int64_t i = 0; i < N; i++) ss += src[i] * src[i];
    const float inv = 1.f / sqrtf(ss / (float)N + eps);
    for (int64_t i = 0; i < N; i++) yr[i] = w[i] * (src[i] * inv);
}

static inline void silu_mul_f32_span(const float *g, const float *u, int64_t lo, int64_t hi, float *y) {
    for (int64_t i = lo; i < hi; i++) y[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

static inline void rope_f32_row(const float *xr0, int64_t W, int64_t hd, const float *c, const float *s,
                                float *yr0) {
    const int64_t half = hd / 2;
    for (int64_t h0 = 0; h0 < W; h0 += hd) {
        const float *xr = xr0 + h0;
        float *yr = yr0 + h0;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = xr[i], x2 = xr[half + i];
            yr[i] = x1 * c[i] + (-x2) * s[i];
            yr[half + i] = x2 * c[half + i] + x1 * s[half + i];
        }
    }
}
#endif

#if defined(ELEMENTWISE_F32)
/* ---- float32 entry points (the AVX-512 or AVX2 row functions above). */
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
    if (hd % 2 || (hd / 2) % 16 || W % hd) return 1;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return 2;
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
    const int64_t half = hd / 2;
    if (hd % 2 || half % 16 || W % hd) return 1;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return 2;
#pragma omp parallel for schedule(static) if (T * W >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) rope_bf16_row(x + t * ldx, W, hd, cos + pos[t] * hd, sin + pos[t] * hd, y + t * W);
    return 0;
}
#endif
#endif
