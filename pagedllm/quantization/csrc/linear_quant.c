/*
 * y = x W^T for group-wise quantized weights (w = code * scale + zero per group of G inputs) and
 * bf16 activations, with AVX-512 BF16 dot products (vdpbf16ps) and fp32 accumulation; for the few
 * rows of a decode step, where torch's packed int4/int8 kernels and a per-call widening read the
 * weight at a fraction of the memory bandwidth. Larger batches expand the weight to bf16 once per
 * call (quant_dequant) for oneDNN, in the activations' dtype.
 *
 * Codes, BITS = 4: 16 bytes per 32 inputs of a row (byte j: code j in the low nibble, code j+16 in
 * the high one, as ggml's Q4_0 blocks), unsigned 0..15, read as code - 8 through a 16-entry bf16
 * table (vpermw); the zeros given are zero + 8 scale. BITS = 8: one signed byte per input, widened through fp32. BITS = 3 (fp8 e4m3): one
 * byte per input, whose exponent and mantissa move into bf16's fields (subnormals from a table).
 * Per 32 inputs: one
 * vdpbf16ps per x row into a per-group accumulator, scaled once per group. The zero term,
 * zero * sum(x over the group), is a dot product of the zeros with the group sums of x.
 *
 * Layouts: x [M, K] bf16; codes [N, K/2] uint8 (4 bits) or [N, K] int8 / e4m3; scales, zeros [N, K/G]
 * bf16; y [M, N] bf16 or fp32 (y_f32); K % G == 0, G % 32 == 0.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "../../attention/csrc/bf16.h"

#define MAXM 4
#define NR 4
/* Weights (times 4-row blocks of x) below which one thread does the product: a decode layer of a
 * small model is read in ~0.1 ms, and a parallel region on a machine shared with other work can
 * wait a whole scheduler slice for its second thread (measured: docs/quantization.md). */
#define PARALLEL_MIN_ELEMS (1 << 22)

/* bf16 bit patterns of code - 8 for the codes 0 .. 15 (centred, so that the zero the kernel adds,
 * zero + 8 scale, is small and its bf16 rounding too), repeated for both 256-bit lanes of vpermw. */
static inline __m512i code_table(void) {
    uint16_t t[32];
    for (int c = 0; c < 32; c++) t[c] = f32_to_bf16((float)((c & 15) - 8));
    return _mm512_loadu_si512((const void *)t);
}

/* 32 4-bit codes of one block as 32 bf16 values. */
static inline __m512bh widen32(const uint8_t *q, __m512i table) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q);
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table);
}

/* 32 int8 codes as 32 bf16 values (exact: |code| <= 128 fits bf16's 8-bit mantissa). */
static inline __m512bh widen32_i8(const int8_t *q) {
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
    const __m512i w2 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
    return _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(w2), _mm512_cvtepi32_ps(w));
}

/* bf16 bit patterns of the e4m3 subnormals m * 2^-9, m = 0..7 (lanes 8..31 unused). */
static inline __m512i e4m3_subnormal_table(void) {
    uint16_t t[32] = {0};
    for (int m = 1; m < 8; m++) t[m] = f32_to_bf16((float)m / 512.0f);
    return _mm512_loadu_si512((const void *)t);
}

/* 32 e4m3 bytes as 32 bf16 values (exact: e4m3's 3-bit mantissa and exponent range fit bf16;
 * the NaN code is not produced by the quantizer). */
static inline __m512bh widen32_e4m3(const uint8_t *q, __m512i sub_table) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)q));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
    const __m512i v = _mm512_mask_permutexvar_epi16(normal, sub, mag, sub_table);
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8);
    return (__m512bh)_mm512_or_si512(v, sign);
}

/* y rows m0 .. m0+MR-1, output rows n0 .. n0+nr-1 (MR and BITS constant after inlining: the
 * accumulators of a 1-row decode take 8 registers, not 32). */
static inline __attribute__((always_inline)) void quant_block(
    const int bits, const int MR, const uint16_t *x, int64_t m0, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *zeros, const float *xsum, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t nr,
    __m512i table, void *y, int y_f32) {
    const int64_t groups = K / G;
    __m512 acc[MAXM][NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 part[MAXM][NR];
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < NR; r++) part[m][r] = _mm512_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            __m512bh wv[NR];
            for (int r = 0; r < NR; r++) {
                const int64_t row = n0 + (r < nr ? r : 0);
                wv[r] = bits == 4   ? widen32(codes + row * (K / 2) + k / 2, table)
                        : bits == 3 ? widen32_e4m3(codes + row * K + k, table)
                                    : widen32_i8((const int8_t *)codes + row * K + k);
            }
            for (int m = 0; m < MR; m++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + m) * K + k));
                for (int r = 0; r < NR; r++) part[m][r] = _mm512_dpbf16_ps(part[m][r], xv, wv[r]);
            }
        }
        for (int r = 0; r < NR; r++) {
            const __m512 s = _mm512_set1_ps(bf16_to_f32(scales[(n0 + (r < nr ? r : 0)) * groups + g]));
            for (int m = 0; m < MR; m++) acc[m][r] = _mm512_fmadd_ps(part[m][r], s, acc[m][r]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int64_t r = 0; r < nr; r++) {
            float s = _mm512_reduce_add_ps(acc[m][r]);
            const uint16_t *z = zeros + (n0 + r) * groups;
            const float *xs = xsum + (m0 + m) * groups;
            for (int64_t g = 0; g < groups; g++) s += bf16_to_f32(z[g]) * xs[g];
            const int64_t i = (m0 + m) * N + n0 + r;
            if (y_f32)
                ((float *)y)[i] = s;
            else
                ((uint16_t *)y)[i] = f32_to_bf16(s);
        }
}

static inline __attribute__((always_inline)) int quant_linear(
    const int bits, const uint16_t *x, int64_t M, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *zeros, int64_t N, int64_t K, int64_t G, void *y, int y_f32) {
    if (M < 1 || G % 32 != 0 || K % G != 0) return 1;
    const int64_t groups = K / G;
    /* Group sums of x (bf16 values in fp32), for the zero term. */
    float *xsum = (float *)malloc(sizeof(float) * M * groups);
    if (!xsum) return 2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) s += bf16_to_f32(x[m * K + k]);
            xsum[m * groups + g] = s;
        }
    const int64_t nblocks = (N + NR - 1) / NR;
    const int64_t mblocks = (M + MAXM - 1) / MAXM;
    const __m512i table = bits == 3 ? e4m3_subnormal_table() : code_table();
#pragma omp parallel for schedule(static) if (N * K * mblocks >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < mblocks * nblocks; t++) {
        const int64_t m0 = t / nblocks * MAXM, n0 = t % nblocks * NR;
        const int64_t nr = N - n0 < NR ? N - n0 : NR;
        switch (M - m0 < MAXM ? M - m0 : MAXM) {
        case 1: quant_block(bits, 1, x, m0, codes, scales, zeros, xsum, N, K, G, n0, nr, table, y, y_f32); break;
        case 2: quant_block(bits, 2, x, m0, codes, scales, zeros, xsum, N, K, G, n0, nr, table, y, y_f32); break;
        case 3: quant_block(bits, 3, x, m0, codes, scales, zeros, xsum, N, K, G, n0, nr, table, y, y_f32); break;
        default: quant_block(bits, 4, x, m0, codes, scales, zeros, xsum, N, K, G, n0, nr, table, y, y_f32);
        }
    }
    free(xsum);
    return 0;
}

int int4_linear_bf16(const uint16_t *x, int64_t M, const uint8_t *codes, const uint16_t *scales,
                     const uint16_t *zeros, int64_t N, int64_t K, int64_t G, void *y, int y_f32) {
    return quant_linear(4, x, M, codes, scales, zeros, N, K, G, y, y_f32);
}

int int8_linear_bf16(const uint16_t *x, int64_t M, const int8_t *codes, const uint16_t *scales,
                     const uint16_t *zeros, int64_t N, int64_t K, int64_t G, void *y, int y_f32) {
    return quant_linear(8, x, M, (const uint8_t *)codes, scales, zeros, N, K, G, y, y_f32);
}

int e4m3_linear_bf16(const uint16_t *x, int64_t M, const uint8_t *codes, const uint16_t *scales,
                     const uint16_t *zeros, int64_t N, int64_t K, int64_t G, void *y, int y_f32) {
    return quant_linear(3, x, M, codes, scales, zeros, N, K, G, y, y_f32);
}

/* W [N, K] in bf16, or fp32 (w_f32), from the same layout (for batches, where oneDNN's GEMM beats a
 * pass per 4 rows). */
int quant_dequant(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int64_t N,
                  int64_t K, int64_t G, void *w, int w_f32) {
    if (G % 32 != 0 || K % G != 0 || (bits != 4 && bits != 8 && bits != 3)) return 1;
    const int64_t groups = K / G;
    const __m512i sub_table = e4m3_subnormal_table();
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_ELEMS)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t k = 0; k < K; k += 32) {
            const __m512 s = _mm512_set1_ps(bf16_to_f32(scales[n * groups + k / G]));
            const __m512 z = _mm512_set1_ps(bf16_to_f32(zeros[n * groups + k / G]));
            __m512 lo, hi;
            if (bits == 4) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(codes + n * (K / 2) + k / 2));
                const __m128i msk = _mm_set1_epi8(0x0f);
                const __m512 eight = _mm512_set1_ps(8.0f);
                lo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, msk))), eight);
                hi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), msk))),
                                   eight);
            } else if (bits == 3) {
                const __m512i v = (__m512i)widen32_e4m3(codes + n * K + k, sub_table);
                lo = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(v));
                hi = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(v, 1));
            } else {
                const int8_t *q = (const int8_t *)codes + n * K + k;
                lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
                hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
            }
            const __m512 wl = _mm512_fmadd_ps(lo, s, z), wh = _mm512_fmadd_ps(hi, s, z);
            if (w_f32) {
                _mm512_storeu_ps((float *)w + n * K + k, wl);
                _mm512_storeu_ps((float *)w + n * K + k + 16, wh);
            } else {
                _mm512_storeu_si512((void *)((uint16_t *)w + n * K + k), (__m512i)_mm512_cvtne2ps_pbh(wh, wl));
            }
        }
    }
    return 0;
}
#endif
