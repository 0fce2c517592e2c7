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
 * Layouts: x [T, N] with row stride ldx (elements); add, h_out and y [T, N] contiguous; all bf16
 * as uint16.
 */
#include <math.h>
#include <stdint.h>

#include "../../attention/csrc/bf16.h"

#define PARALLEL_MIN_ELEMS (1 << 18)

#if defined(__AVX512F__)
/* bf16 value of v, back in float32. */
static inline __m512 round_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

/* float32 -> bf16 with round to nearest even (NaN-free inputs), 16 lanes. */
static inline __m256i rnd(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16));
}

/* N % 16 == 0. */
int rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *add, uint16_t *h_out, const uint16_t *w, int64_t T,
                  int64_t N, float eps, uint16_t *y) {
    if (N % 16) return 1;
#pragma omp parallel for schedule(static) if (T * N >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * ldx;
        uint16_t *hr = add ? h_out + t * N : 0;
        uint16_t *yr = y + t * N;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < N; i += 16) {
            __m512 h = bf16x16_load(xr + i);
            if (add) {
                const __m256i hb = rnd(_mm512_add_ps(h, bf16x16_load(add + t * N + i)));
                _mm256_storeu_si256((__m256i *)(hr + i), hb);
                h = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16));
            }
            ss = _mm512_fmadd_ps(h, h, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)N + eps));
        const uint16_t *src = add ? hr : xr;
        for (int64_t i = 0; i < N; i += 16) {
            const __m512 n = round_bf16(_mm512_mul_ps(bf16x16_load(src + i), inv));
            _mm256_storeu_si256((__m256i *)(yr + i), rnd(_mm512_mul_ps(bf16x16_load(w + i), n)));
        }
    }
    return 0;
}

/* x [T, 2I] rows [gate | up] with row stride ldx; y [T, I]; I % 16 == 0. */
int silu_mul_bf16(const uint16_t *x, int64_t ldx, int64_t T, int64_t I, uint16_t *y) {
    if (I % 16) return 1;
#pragma omp parallel for schedule(static) if (T * I >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * ldx, *u = g + I;
        uint16_t *yr = y + t * I;
        for (int64_t i = 0; i < I; i += 16) {
            const __m512 gv = bf16x16_load(g + i);
            const __m512 s = round_bf16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                                        exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
            _mm256_storeu_si256((__m256i *)(yr + i), rnd(_mm512_mul_ps(s, bf16x16_load(u + i))));
        }
    }
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
#pragma omp parallel for schedule(static) if (T * W >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos + pos[t] * hd, *s = sin + pos[t] * hd;
        for (int64_t h0 = 0; h0 < W; h0 += hd) {
            const uint16_t *xr = x + t * ldx + h0;
            uint16_t *yr = y + t * W + h0;
            for (int64_t i = 0; i < half; i += 16) {
                const __m512 x1 = bf16x16_load(xr + i), x2 = bf16x16_load(xr + half + i);
                const __m512 lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, bf16x16_load(c + i))),
                                                round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), bf16x16_load(s + i))));
                const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, bf16x16_load(c + half + i))),
                                                round_bf16(_mm512_mul_ps(x1, bf16x16_load(s + half + i))));
                _mm256_storeu_si256((__m256i *)(yr + i), rnd(lo));
                _mm256_storeu_si256((__m256i *)(yr + half + i), rnd(hi));
            }
        }
    }
    return 0;
}
#endif
