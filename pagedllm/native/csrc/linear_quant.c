/*
 * y = x W^T for group-wise quantized weights (w = (u - offset) * scale + zero per group of G inputs,
 * u the stored code) and bf16 activations, for the few rows of a decode step, where torch's packed
 * int4/int8 kernels and a per-call widening read the weight at a fraction of the memory bandwidth.
 * Larger batches expand the weight to bf16 once per call (quant_dequant) for oneDNN, in the
 * activations' dtype.
 *
 * 4-bit codes (int4, GGUF <= 4 bits, AWQ, GPTQ; offset 8) and int8 codes (int8, GGUF Q5/Q6/Q8;
 * stored as code + 128, offset 128) are tiled by TR = 16 output rows, so that one 512-bit register
 * holds one 32-bit lane per output row:
 *   4 bits: per tile, per 8 inputs k..k+7, 64 bytes; dword j = row j, its byte i holds the code of
 *           input k+i in the low nibble and of input k+4+i in the high one. [N/16, K*8] bytes.
 *   int8:   per tile, per 4 inputs k..k+3, 64 bytes; dword j = row j, byte i = input k+i. [N/16, K*16].
 *   scales, zeros: per tile, per group, the 16 rows' bf16 values. [N/16, K/G, 16].
 * N is padded to a multiple of 16 (padding rows: code 0, scale 0, zero 0); the zeros given are the
 * zeros of the centred codes u - offset (zero + offset * scale), small, so their bf16 rounding is too.
 *
 * Two ways to take the activations (int8_act, chosen per call):
 *   int8 (VNNI, as ggml's Q4_0 x Q8_0 dot products): each x row quantized once per call to int8 per
 *     block of 32 inputs (q = round(x / d), d = max|x| / 127, fp32); per block and 16 rows, one
 *     vpdpbusd (u8 codes x s8 q -> s32) per 4 inputs, the offset folded in as -offset * sum(q), the
 *     block's int32 sums scaled by d in fp32, each group's sum by its scale.
 *   bf16: exact products of the codes (in fp32) and x (bf16 widened to fp32), fp32 FMAs, the
 *     offset moved into the zero term.
 * Either way the zero term, zero * sum(x over the group), uses the exact group sums of x.
 *
 * e4m3 (fp8) keeps a row-major layout: codes [N, K], scales and zeros [N, K/G]; one byte per input,
 * whose exponent and mantissa move into bf16's fields (subnormals from a table), one vdpbf16ps per
 * 32 inputs per x row into a per-group accumulator, scaled once per group.
 *
 * x [M, K] bf16; y [M, N] bf16 or fp32 (y_f32); K % G == 0, G % 32 == 0.
 *
 * w8a8 (w8a8_linear) keeps its int8 codes row-major, [N, K], the matrix torch._int_mm reads for
 * batches (as its transpose, a view), with one fp32 scale per output row, and quantizes each row
 * of x to int8 with one scale per row, as the torch path does; see there.
 *
 * CPUs with AVX2 and FMA but not AVX-512 BF16 run the same layouts and the same arithmetic in 8-lane
 * vectors (LQ_AVX2 below): each tile as two halves of 8 output rows (bytes 0-31 and 32-63 of each
 * 64-byte chunk); without VNNI, the int8 products are vpmaddubsw pairs (u8 x s8 -> s16) summed
 * into int32 by vpmaddwd, exact in both forms:
 *   4-bit codes x q: |2 * 15 * 127| per pair, so a whole block of 32 inputs (8 pairs per lane)
 *     adds up in int16 (30,480 at most) before one vpmaddwd;
 *   int8 codes: read as signed codes (the byte ^ 0x80, offset 0), multiplied as |c| x sign(q, c)
 *     (at most 2 * 128 * 127 per pair), one vpmaddwd per 4 inputs;
 *   w8a8: the codes and each row's q both signed, |c| x sign(q, c) alike.
 * The int32 sums are the AVX-512 kernel's, so each output differs from it only by the order of
 * its fp32 additions (w8a8: not at all; both equal the torch path to the bit). e4m3 codes widen
 * through fp16 fields (F16C) and meet x in fp32 FMAs, one output row at a time.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LQ_AVX2 1
#endif

#if defined(LQ_AVX512) || defined(LQ_AVX2)
#define LQ_HAVE_KERNELS 1 /* the kernels below are compiled (llama_decode.c asks) */
#include <immintrin.h>

#include "bf16.h"

#define MAXM 4
#define NR 4
#define TR 16 /* output rows per tile of the 4-bit and int8 layouts */
/* Weights (times 4-row blocks of x) below which one thread does the product. With the int8
 * path a decode layer of SmolLM2 (0.33 M - 1.8 M weights) is read in 10-60 us, and two threads
 * still beat one on every one of them (benchmarks/bench_quant_kernels.py --decode-pass, and the
 * single-stream decode A/B in docs/quantization.md), the smallest (o_proj) by the least. */
#define QUANT_PARALLEL_MIN_DEFAULT (1 << 18)
static int64_t quant_parallel_min_ = -1;

/* The threshold in force: PAGEDLLM_QUANT_PARALLEL_MIN where set (read once), else the default. */
static inline int64_t quant_parallel_min_get(void) {
    if (quant_parallel_min_ < 0) {
        const char *e = getenv("PAGEDLLM_QUANT_PARALLEL_MIN");
        quant_parallel_min_ = e != NULL && *e ? strtoll(e, NULL, 10) : QUANT_PARALLEL_MIN_DEFAULT;
    }
    return quant_parallel_min_;
}
#define quant_parallel_min quant_parallel_min_get()

/* One tile: TR output rows x K inputs; scales and zeros [groups][TR] bf16 (see the layout above). */
static inline int64_t tile_code_bytes(int bits, int64_t K) { return bits == 4 ? K * TR / 2 : K * TR; }

/* The activations of a call, prepared once for every tile: fp32 copies (the float path), or int8
 * values per block of 32 with their scale d (x ~= d q) and the integer term -offset * sum(q) that
 * turns sum(u q) over a block into sum((u - offset) q) (the int8 path); and the exact group sums
 * of x for the zero term. */
typedef struct {
    float *xf;     /* [M, K] */
    int8_t *xq;    /* [M, K] */
    float *xd;     /* [M, K/32] */
    int32_t *xc;   /* [M, K/32] */
    float *xsum;   /* [M, K/G] */
} Acts;
#endif

#if defined(LQ_AVX512)
typedef __m512i lq_table_t;
#define e4m3_table e4m3_subnormal_table
#define INT8_OFFSET 128 /* int8 tiles meet the activations as unsigned bytes, code + 128 */

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
    const int MR, const uint16_t *x, int64_t m0, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *zeros, const float *xsum, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t nr,
    lq_table_t table, void *y, int y_f32) {
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
                wv[r] = widen32_e4m3(codes + row * K + k, table);
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

/* One block of 32 bf16 activations as int8 (the int8 path): q = round(x / d), d = max|x| / 127;
 * returns d, and sum(q) in *qsum. */
static inline float quantize_block32(const uint16_t *x, int8_t *q, int32_t *qsum) {
    const __m512 lo = bf16x16_load(x), hi = bf16x16_load(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    /* round to nearest (even), |q| <= 127 */
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qh));
    *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
    return amax / 127.f;
}

/* y rows m0 .. m0+MR-1 of one tile's TR output rows (MR, BITS and INT8 constant after inlining). */
static inline __attribute__((always_inline)) void tile_block(
    const int bits, const int MR, const int int8_act, const Acts *a, int64_t m0, const uint8_t *tc,
    const uint16_t *ts, const uint16_t *tz, int64_t K, int64_t G, float out[MAXM][TR]) {
    const int64_t groups = K / G, nb = K / 32;
    const __m512i nib = _mm512_set1_epi8(0x0f), byte = _mm512_set1_epi32(0xff);
    __m512 acc[MAXM];
    for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 part[MAXM];
        for (int m = 0; m < MR; m++) part[m] = _mm512_setzero_ps();
        for (int64_t kb = g * G; kb < (g + 1) * G; kb += 32) {
            if (int8_act) {
                __m512i ia[MAXM], ib[MAXM];
                for (int m = 0; m < MR; m++) {
                    ia[m] = _mm512_set1_epi32(a->xc[(m0 + m) * nb + kb / 32]);
                    ib[m] = _mm512_setzero_si512();
                }
                for (int c = 0; c < (bits == 4 ? 4 : 8); c++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(tc + (bits == 4 ? (kb + 8 * c) * 8 : (kb + 4 * c) * 16)));
                    for (int m = 0; m < MR; m++) {
                        const int8_t *q = a->xq + (m0 + m) * K + kb;
                        int32_t q0, q1;
                        if (bits == 4) {
                            memcpy(&q0, q + 8 * c, 4), memcpy(&q1, q + 8 * c + 4, 4);
                            ia[m] = _mm512_dpbusd_epi32(ia[m], _mm512_and_si512(v, nib), _mm512_set1_epi32(q0));
                            ib[m] = _mm512_dpbusd_epi32(ib[m], _mm512_and_si512(_mm512_srli_epi16(v, 4), nib),
                                                        _mm512_set1_epi32(q1));
                        } else {
                            memcpy(&q0, q + 4 * c, 4);
                            if (c & 1)
                                ib[m] = _mm512_dpbusd_epi32(ib[m], v, _mm512_set1_epi32(q0));
                            else
                                ia[m] = _mm512_dpbusd_epi32(ia[m], v, _mm512_set1_epi32(q0));
                        }
                    }
                }
                for (int m = 0; m < MR; m++)
                    part[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia[m], ib[m])),
                                              _mm512_set1_ps(a->xd[(m0 + m) * nb + kb / 32]), part[m]);
            } else {
                /* sum of u x in fp32 (u the stored code, exact in fp32); the offset goes to the zero term */
                for (int c = 0; c < (bits == 4 ? 4 : 8); c++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(tc + (bits == 4 ? (kb + 8 * c) * 8 : (kb + 4 * c) * 16)));
                    const __m512i halves[2] = {bits == 4 ? _mm512_and_si512(v, nib) : v,
                                               _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)};
                    for (int h = 0; h < (bits == 4 ? 2 : 1); h++)
                        for (int i = 0; i < 4; i++) {
                            const __m512 w = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(halves[h], 8 * i), byte));
                            const int64_t k = kb + (bits == 4 ? 8 * c + 4 * h : 4 * c) + i;
                            for (int m = 0; m < MR; m++)
                                part[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(a->xf[(m0 + m) * K + k]), part[m]);
                        }
                }
            }
        }
        const __m512 s = bf16x16_load(ts + g * TR);
        __m512 z = bf16x16_load(tz + g * TR);
        /* the float path's sum(u x) carries offset * sum(x): zero' - offset * scale */
        if (!int8_act) z = _mm512_fnmadd_ps(s, _mm512_set1_ps(bits == 4 ? 8.f : 128.f), z);
        for (int m = 0; m < MR; m++) {
            acc[m] = _mm512_fmadd_ps(part[m], s, acc[m]);
            acc[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(a->xsum[(m0 + m) * groups + g]), acc[m]);
        }
    }
    for (int m = 0; m < MR; m++) _mm512_storeu_ps(out[m], acc[m]);
}

/* IEEE single-precision a / b rounded to nearest: the explicit-rounding form is kept as written
 * under -ffast-math (no reciprocal), so it rounds as torch's division does (the products below
 * take the same explicit rounding, so that they are not reassociated). */
static inline float div_rn(float a, float b) {
    return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(a), _mm_set_ss(b), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* 16 values of a row of x (bf16 or fp32) from k, zeros past K. */
static inline __m512 load16_x(const void *x, int x_f32, int64_t k, int64_t K) {
    const __mmask16 mk = K - k >= 16 ? (__mmask16)0xffff : k >= K ? 0 : (__mmask16)((1u << (K - k)) - 1);
    if (x_f32) return _mm512_maskz_loadu_ps(mk, (const float *)x + k);
    const __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One activation row as the torch path quantizes it (kernels.int8_dynamic_linear): d = max(max|x| / 127,
 * 1e-12), q = clamp(rint(x / d), -127, 127) with an IEEE division; stored as q + 128 (u8, the unsigned
 * operand of vpdpbusd), KP >= K bytes, the padding 128 (q = 0). Returns d. */
static float w8a8_quantize_row(const void *x, int x_f32, int64_t K, int64_t KP, uint8_t *q) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16_x(x, x_f32, k, K)));
    float d = div_rn(_mm512_reduce_max_ps(mx), 127.f);
    const float dmin = (float)1e-12;
    d = d < dmin ? dmin : d;
    const __m512 dv = _mm512_set1_ps(d);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < KP; k += 16) {
        const __m512 r = _mm512_div_round_ps(load16_x(x, x_f32, k, K), dv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i i = _mm512_cvt_roundps_epi32(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        i = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(i, lo), hi), off);
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(i));
    }
    return d;
}

/* The four sums of a0 .. a3's 16 int32 lanes, as one 128-bit vector. */
static inline __m128i hsum4_epi32(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    const __m256i v = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

/* y rows m0 .. m0+MR-1, output rows n0 .. n0+NR-1 (past N: the last row again): int32 sums of
 * (q + 128) c over K, one vpdpbusd per 64 inputs per (x row, code row); the last 64 inputs masked
 * where K % 64 (codes past K read as 0). The code rows are read one after another by one load, so
 * that the weight is one sequential stream of constant stride, and prefetched 2 KB ahead. Per call
 * on 30 distinct 3072 x 576 weights (out of cache), one thread, with the int8 tiles at 56-65 us in
 * the same runs: this order 64-66 us; without the prefetch 72-83; two loads (two chains) per 128
 * bytes 102-105; four rows interleaved per 64 bytes 101-116; and an all-ones masked load per 64
 * bytes instead of a plain one tripled the time. */
static inline __attribute__((always_inline)) void w8a8_block(
    const int MR, const uint8_t *xq, int64_t KP, const int8_t *codes, int64_t N, int64_t K, int64_t n0,
    __m128i out[MAXM]) {
    __m512i acc[MAXM][NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_si512();
    for (int r = 0; r < NR; r++) {
        const int8_t *wr = codes + (n0 + r < N ? n0 + r : N - 1) * K;
        for (int64_t k = 0; k < K; k += 64) {
            const __mmask64 mk = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
            _mm_prefetch((const char *)(wr + k + 2048), _MM_HINT_T0);
            const __m512i w = K - k >= 64 ? _mm512_loadu_si512((const void *)(wr + k)) : _mm512_maskz_loadu_epi8(mk, wr + k);
            for (int m = 0; m < MR; m++)
                acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], _mm512_loadu_si512((const void *)(xq + m * KP + k)), w);
        }
    }
    for (int m = 0; m < MR; m++) out[m] = hsum4_epi32(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
}

/* Up to 16 outputs of one row: y[i..] = (acc * d) * s, each product rounded to fp32 as torch rounds
 * it (kept as written under -ffast-math), stored in fp32 or rounded to bf16; lanes past mk untouched. */
static inline void w8a8_store_scaled(__m512 acc, float d, __m512 s, void *y, int64_t i, __mmask16 mk, int f32) {
    const __m512 v = _mm512_mul_round_ps(_mm512_mul_round_ps(acc, _mm512_set1_ps(d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                         s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (f32)
        _mm512_mask_storeu_ps((float *)y + i, mk, v);
    else
        _mm256_mask_storeu_epi16((uint16_t *)y + i, mk, (__m256i)_mm512_cvtneps_pbh(v));
}

/* Outputs n0 .. n0+nr-1 of x rows m0 .. m0+mr-1 (w8a8_linear's unit of work): the int32 sums, the
 * +128 of the activations taken off as 128 wsum, then (float(acc) * d) * s, the four outputs of a
 * row at once. */
static inline void w8a8_tile(const uint8_t *xq, int64_t KP, const int8_t *codes, const float *scales, const int32_t *wsum,
                             const float *d, int64_t N, int64_t K, int64_t m0, int mr, int64_t n0, int64_t nr, void *y,
                             int f32) {
    __m128i sums[MAXM];
    const uint8_t *xb = xq + m0 * KP;
    switch (mr) {
    case 1: w8a8_block(1, xb, KP, codes, N, K, n0, sums); break;
    case 2: w8a8_block(2, xb, KP, codes, N, K, n0, sums); break;
    case 3: w8a8_block(3, xb, KP, codes, N, K, n0, sums); break;
    default: w8a8_block(4, xb, KP, codes, N, K, n0, sums);
    }
    const __mmask16 rows = (__mmask16)((1u << nr) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(rows, scales + n0);
    const __m512i off = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(rows, wsum + n0), 7);
    for (int m = 0; m < mr; m++)
        w8a8_store_scaled(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_zextsi128_si512(sums[m]), off)), d[m0 + m], s, y,
                          (m0 + m) * N + n0, rows, f32);
}

/* A row quantized by w8a8_quantize_row (q + 128, KP bytes) as signed int8 q, K bytes: the top bit flipped. */
static inline void w8a8_row_to_signed(const uint8_t *row, int8_t *q, int64_t K) {
    for (int64_t k = 0; k < K; k += 64) {
        const __mmask64 mk = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        const __m512i v = _mm512_xor_si512(_mm512_load_si512((const void *)(row + k)), _mm512_set1_epi8((char)0x80));
        _mm512_mask_storeu_epi8(q + k, mk, v);
    }
}

/* One row of w8a8_scale_rows: y[n] = (float(acc[n]) * d) * scales[n]. */
static inline void w8a8_scale_row(const int32_t *acc, int64_t N, float d, const float *scales, void *y, int64_t i0,
                                  int f32) {
    for (int64_t n = 0; n < N; n += 16) {
        const __mmask16 mk = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
        w8a8_store_scaled(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mk, acc + n)), d, _mm512_maskz_loadu_ps(mk, scales + n),
                          y, i0 + n, mk, f32);
    }
}

/* Store 16 fp32 weights of a row at w (bf16 or fp32). */
static inline void store16(void *w, int64_t i, __m512 v, int w_f32) {
    if (w_f32)
        _mm512_storeu_ps((float *)w + i, v);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)w + i), (__m256i)_mm512_cvtneps_pbh(v));
}

/* Row n of W ([K] values at w, bf16 or fp32 (w_f32)) from the layouts above. */
static inline void dequant_row(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                               int64_t n, int64_t K, int64_t G, void *w, int w_f32, lq_table_t sub_table) {
    const int64_t groups = K / G, t = n / TR, r = n % TR;
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t si = bits == 3 ? n * groups + k / G : (t * groups + k / G) * TR + r;
        const __m512 s = _mm512_set1_ps(bf16_to_f32(scales[si]));
        const __m512 z = _mm512_set1_ps(bf16_to_f32(zeros[si]));
        __m512 v;
        if (bits == 3) {
            if (k % 32) continue;
            const __m512i e = (__m512i)widen32_e4m3(codes + n * K + k, sub_table);
            const __m512 lo = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(e));
            const __m512 hi = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(e, 1));
            store16(w, k, _mm512_fmadd_ps(lo, s, z), w_f32);
            store16(w, k + 16, _mm512_fmadd_ps(hi, s, z), w_f32);
            continue;
        }
        const uint8_t *tc = codes + t * tile_code_bytes(bits, K);
        uint32_t d[4];
        if (bits == 4) {
            /* 16 inputs: two 8-input chunks; dword r of a chunk holds inputs 0-3 (low nibbles), 4-7 */
            for (int c = 0; c < 2; c++) memcpy(&d[c], tc + (k + 8 * c) * 8 + r * 4, 4);
            const __m128i b = _mm_set_epi32(0, 0, (int)d[1], (int)d[0]);
            const __m128i m4 = _mm_set1_epi8(0x0f);
            const __m128i codes16 = _mm_unpacklo_epi32(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));
            v = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes16)), _mm512_set1_ps(8.f));
        } else {
            for (int c = 0; c < 4; c++) memcpy(&d[c], tc + (k + 4 * c) * 16 + r * 4, 4);
            const __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)d), _mm_set1_epi8((char)0x80));
            v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
        }
        store16(w, k, _mm512_fmadd_ps(v, s, z), w_f32);
    }
}

#elif defined(LQ_AVX2)
typedef int lq_table_t; /* e4m3 subnormals come from a conversion, no table */
static inline lq_table_t e4m3_table(void) { return 0; }
#define INT8_OFFSET 0 /* int8 tiles meet the activations as signed codes, the stored byte ^ 0x80 */

/* IEEE single-precision a / b and a * b, rounded to nearest, as written: -ffast-math may turn a
 * division by a constant into a product by its reciprocal and regroup products of products, which
 * would round differently from the torch path that w8a8 equals to the bit. */
static inline float div_rn(float a, float b) {
    __m128 r = _mm_set_ss(a);
    __asm__("vdivss %1, %0, %0" : "+x"(r) : "x"(_mm_set_ss(b)));
    return _mm_cvtss_f32(r);
}

static inline __m256 div_rn8(__m256 a, __m256 b) {
    __asm__("vdivps %1, %0, %0" : "+x"(a) : "x"(b));
    return a;
}

/* mul_rn8: bf16.h */

/* 16 e4m3 bytes as fp32, times 2^-8 (exact): an fp16 holding a byte's exponent and mantissa in its
 * own fields is the e4m3 value times 2^-8, normals and subnormals alike (the exponent biases are 15
 * and 7), so the bytes move into fp16 fields, the sign on top, and F16C widens them. The callers
 * fold E4M3_F16_SCALE into the scale (a power of two: the products round as the unscaled ones). */
#define E4M3_F16_SCALE 256.f
static inline void widen16_e4m3(const uint8_t *q, __m256 *lo, __m256 *hi) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* e4m3: y rows m0 .. m0+MR-1, output rows n0 .. n0+nr-1, one output row at a time (its bytes one
 * sequential stream; x's rows stay in L1), two accumulators per x row per group. */
static inline __attribute__((always_inline)) void quant_block(
    const int MR, const uint16_t *x, int64_t m0, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *zeros, const float *xsum, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t nr,
    lq_table_t table, void *y, int y_f32) {
    (void)table;
    const int64_t groups = K / G;
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *wr = codes + (n0 + r) * K;
        __m256 acc[MAXM];
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256 part[MAXM][2];
            for (int m = 0; m < MR; m++) part[m][0] = part[m][1] = _mm256_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                _mm_prefetch((const char *)(wr + k + 1024), _MM_HINT_T0);
                __m256 w0, w1;
                widen16_e4m3(wr + k, &w0, &w1);
                for (int m = 0; m < MR; m++) {
                    const uint16_t *xr = x + (m0 + m) * K + k;
                    part[m][0] = _mm256_fmadd_ps(w0, bf16x8_load(xr), part[m][0]);
                    part[m][1] = _mm256_fmadd_ps(w1, bf16x8_load(xr + 8), part[m][1]);
                }
            }
            const __m256 s = _mm256_set1_ps(bf16_to_f32(scales[(n0 + r) * groups + g]) * E4M3_F16_SCALE);
            for (int m = 0; m < MR; m++) acc[m] = _mm256_fmadd_ps(_mm256_add_ps(part[m][0], part[m][1]), s, acc[m]);
        }
        for (int m = 0; m < MR; m++) {
            float s = lane_sum8(acc[m]);
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
}

/* 32 int32 lanes (a, b, c, d in input order, each within [-128, 127]) as 32 int8 bytes, in order. */
static inline void store32_epi8(int8_t *q, __m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* One block of 32 bf16 activations as int8 (the int8 path): q = round(x / d), d = max|x| / 127;
 * returns d, and sum(q) in *qsum. */
static inline float quantize_block32(const uint16_t *x, int8_t *q, int32_t *qsum) {
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) {
        v[i] = bf16x8_load(x + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], abs_mask));
    }
    const float amax = lane_max8(mx);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)); /* nearest (even), |q| <= 127 */
    store32_epi8(q, qi[0], qi[1], qi[2], qi[3]);
    *qsum = lane_sum8_epi32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
    return amax / 127.f;
}

/* y rows m0 .. m0+MR-1 of one tile's TR output rows (MR, BITS and INT8 constant after inlining), as
 * two halves of 8 rows, each over all of K (the tile's codes stay in L1 for the second half). */
static inline __attribute__((always_inline)) void tile_block(
    const int bits, const int MR, const int int8_act, const Acts *a, int64_t m0, const uint8_t *tc,
    const uint16_t *ts, const uint16_t *tz, int64_t K, int64_t G, float out[MAXM][TR]) {
    const int64_t groups = K / G, nb = K / 32;
    const __m256i nib = _mm256_set1_epi8(0x0f), byte = _mm256_set1_epi32(0xff), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        const uint8_t *th = tc + 32 * h;
        __m256 acc[MAXM];
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256 part[MAXM];
            for (int m = 0; m < MR; m++) part[m] = _mm256_setzero_ps();
            for (int64_t kb = g * G; kb < (g + 1) * G; kb += 32) {
                if (int8_act) {
                    __m256i ia[MAXM];
                    if (bits == 4) {
                        __m256i s16[MAXM]; /* the block's pair sums, in int16 (|sum| <= 8 * 2 * 15 * 127) */
                        for (int m = 0; m < MR; m++) s16[m] = _mm256_setzero_si256();
                        for (int c = 0; c < 4; c++) {
                            const __m256i v = _mm256_loadu_si256((const __m256i *)(th + (kb + 8 * c) * 8));
                            const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                            for (int m = 0; m < MR; m++) {
                                const int8_t *q = a->xq + (m0 + m) * K + kb + 8 * c;
                                int32_t q0, q1;
                                memcpy(&q0, q, 4), memcpy(&q1, q + 4, 4);
                                s16[m] = _mm256_add_epi16(s16[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(q0)),
                                                                                   _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q1))));
                            }
                        }
                        for (int m = 0; m < MR; m++)
                            ia[m] = _mm256_add_epi32(_mm256_madd_epi16(s16[m], ones), _mm256_set1_epi32(a->xc[(m0 + m) * nb + kb / 32]));
                    } else {
                        for (int m = 0; m < MR; m++) ia[m] = _mm256_set1_epi32(a->xc[(m0 + m) * nb + kb / 32]);
                        for (int c = 0; c < 8; c++) {
                            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(th + (kb + 4 * c) * 16)),
                                                               _mm256_set1_epi8((char)0x80));
                            const __m256i aw = _mm256_abs_epi8(w);
                            for (int m = 0; m < MR; m++) {
                                int32_t q0;
                                memcpy(&q0, a->xq + (m0 + m) * K + kb + 4 * c, 4);
                                const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(q0), w));
                                ia[m] = _mm256_add_epi32(ia[m], _mm256_madd_epi16(p, ones));
                            }
                        }
                    }
                    for (int m = 0; m < MR; m++)
                        part[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m]), _mm256_set1_ps(a->xd[(m0 + m) * nb + kb / 32]), part[m]);
                } else {
                    /* sum of u x in fp32 (u the stored code, exact in fp32); the offset goes to the zero term */
                    for (int c = 0; c < (bits == 4 ? 4 : 8); c++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(th + (bits == 4 ? (kb + 8 * c) * 8 : (kb + 4 * c) * 16)));
                        const __m256i halves[2] = {bits == 4 ? _mm256_and_si256(v, nib) : v,
                                                   _mm256_and_si256(_mm256_srli_epi16(v, 4), nib)};
                        for (int hh = 0; hh < (bits == 4 ? 2 : 1); hh++)
                            for (int i = 0; i < 4; i++) {
                                const __m256 w = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(halves[hh], 8 * i), byte));
                                const int64_t k = kb + (bits == 4 ? 8 * c + 4 * hh : 4 * c) + i;
                                for (int m = 0; m < MR; m++)
                                    part[m] = _mm256_fmadd_ps(w, _mm256_set1_ps(a->xf[(m0 + m) * K + k]), part[m]);
                            }
                    }
                }
            }
            const __m256 s = bf16x8_load(ts + g * TR + 8 * h);
            __m256 z = bf16x8_load(tz + g * TR + 8 * h);
            /* the float path's sum(u x) carries offset * sum(x): zero' - offset * scale */
            if (!int8_act) z = _mm256_fnmadd_ps(s, _mm256_set1_ps(bits == 4 ? 8.f : 128.f), z);
            for (int m = 0; m < MR; m++) {
                acc[m] = _mm256_fmadd_ps(part[m], s, acc[m]);
                acc[m] = _mm256_fmadd_ps(z, _mm256_set1_ps(a->xsum[(m0 + m) * groups + g]), acc[m]);
            }
        }
        for (int m = 0; m < MR; m++) _mm256_storeu_ps(out[m] + 8 * h, acc[m]);
    }
}

/* 8 values of a row of x (bf16 or fp32) from k, zeros past K. */
static inline __m256 load8_x(const void *x, int x_f32, int64_t k, int64_t K) {
    if (K - k >= 8) return x_f32 ? _mm256_loadu_ps((const float *)x + k) : bf16x8_load((const uint16_t *)x + k);
    float t[8] = {0};
    for (int64_t i = k; i < K; i++) t[i - k] = x_f32 ? ((const float *)x)[i] : bf16_to_f32(((const uint16_t *)x)[i]);
    return _mm256_loadu_ps(t);
}

/* One activation row as the torch path quantizes it (kernels.int8_dynamic_linear): d = max(max|x| / 127,
 * 1e-12), q = clamp(rint(x / d), -127, 127) with an IEEE division; stored as signed q, KP >= K bytes
 * (KP % 32 == 0), the padding 0. Returns d. */
static float w8a8_quantize_row(const void *x, int x_f32, int64_t K, int64_t KP, uint8_t *q) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load8_x(x, x_f32, k, K), abs_mask));
    float d = div_rn(lane_max8(mx), 127.f);
    const float dmin = (float)1e-12;
    d = d < dmin ? dmin : d;
    const __m256 dv = _mm256_set1_ps(d);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (int64_t k = 0; k < KP; k += 32) {
        __m256i i[4];
        for (int j = 0; j < 4; j++) { /* MXCSR's default rounding: nearest, ties to even */
            i[j] = _mm256_cvtps_epi32(div_rn8(load8_x(x, x_f32, k + 8 * j, K), dv));
            i[j] = _mm256_min_epi32(_mm256_max_epi32(i[j], lo), hi);
        }
        store32_epi8((int8_t *)q + k, i[0], i[1], i[2], i[3]);
    }
    return d;
}

/* y rows m0 .. m0+MR-1, output rows n0 .. n0+NR-1 (past N: the last row again): int32 sums of q c over
 * K, |c| x sign(q, c) per 32 inputs, one code row at a time (one sequential stream, prefetched 2 KB
 * ahead); the last 32 inputs copied where K % 32 (q is 0 past K). */
static inline __attribute__((always_inline)) void w8a8_block(
    const int MR, const uint8_t *xq, int64_t KP, const int8_t *codes, int64_t N, int64_t K, int64_t n0,
    int32_t out[MAXM][NR]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < NR; r++) {
        const int8_t *wr = codes + (n0 + r < N ? n0 + r : N - 1) * K;
        __m256i acc[MAXM];
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_si256();
        for (int64_t k = 0; k < K; k += 32) {
            _mm_prefetch((const char *)(wr + k + 2048), _MM_HINT_T0);
            __m256i w;
            if (K - k >= 32) {
                w = _mm256_loadu_si256((const __m256i *)(wr + k));
            } else {
                int8_t t[32] = {0};
                memcpy(t, wr + k, (size_t)(K - k));
                w = _mm256_loadu_si256((const __m256i *)t);
            }
            const __m256i aw = _mm256_abs_epi8(w);
            for (int m = 0; m < MR; m++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(xq + m * KP + k));
                acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(q, w)), ones));
            }
        }
        for (int m = 0; m < MR; m++) out[m][r] = lane_sum8_epi32(acc[m]);
    }
}

/* (float(acc) * d) * s, each product rounded to fp32 as torch rounds it, stored in fp32 or bf16. */
static inline void w8a8_store1(int32_t acc, float d, float s, void *y, int64_t i, int f32) {
    const float v = _mm_cvtss_f32(_mm256_castps256_ps128(
        mul_rn8(mul_rn8(_mm256_set1_ps((float)acc), _mm256_set1_ps(d)), _mm256_set1_ps(s))));
    if (f32)
        ((float *)y)[i] = v;
    else
        ((uint16_t *)y)[i] = f32_to_bf16(v);
}

/* Outputs n0 .. n0+nr-1 of x rows m0 .. m0+mr-1 (w8a8_linear's unit of work). */
static inline void w8a8_tile(const uint8_t *xq, int64_t KP, const int8_t *codes, const float *scales, const int32_t *wsum,
                             const float *d, int64_t N, int64_t K, int64_t m0, int mr, int64_t n0, int64_t nr, void *y,
                             int f32) {
    (void)wsum; /* q is signed here: no offset to take off */
    int32_t sums[MAXM][NR];
    const uint8_t *xb = xq + m0 * KP;
    switch (mr) {
    case 1: w8a8_block(1, xb, KP, codes, N, K, n0, sums); break;
    case 2: w8a8_block(2, xb, KP, codes, N, K, n0, sums); break;
    case 3: w8a8_block(3, xb, KP, codes, N, K, n0, sums); break;
    default: w8a8_block(4, xb, KP, codes, N, K, n0, sums);
    }
    for (int m = 0; m < mr; m++)
        for (int64_t r = 0; r < nr; r++) w8a8_store1(sums[m][r], d[m0 + m], scales[n0 + r], y, (m0 + m) * N + n0 + r, f32);
}

/* A row quantized by w8a8_quantize_row (already signed) into q, K bytes. */
static inline void w8a8_row_to_signed(const uint8_t *row, int8_t *q, int64_t K) { memcpy(q, row, (size_t)K); }

/* One row of w8a8_scale_rows: y[n] = (float(acc[n]) * d) * scales[n]. */
static inline void w8a8_scale_row(const int32_t *acc, int64_t N, float d, const float *scales, void *y, int64_t i0,
                                  int f32) {
    const __m256 dv = _mm256_set1_ps(d);
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
        const __m256 v = mul_rn8(mul_rn8(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(acc + n))), dv),
                                 _mm256_loadu_ps(scales + n));
        if (f32) {
            _mm256_storeu_ps((float *)y + i0 + n, v);
        } else {
            float t[8];
            _mm256_storeu_ps(t, v);
            for (int j = 0; j < 8; j++) ((uint16_t *)y)[i0 + n + j] = f32_to_bf16(t[j]);
        }
    }
    for (; n < N; n++) w8a8_store1(acc[n], d, scales[n], y, i0 + n, f32);
}

/* Store 8 fp32 weights of a row at w (bf16, rounded to nearest even, or fp32). */
static inline void store8(void *w, int64_t i, __m256 v, int w_f32) {
    if (w_f32) {
        _mm256_storeu_ps((float *)w + i, v);
        return;
    }
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    _mm_storeu_si128((__m128i *)((uint16_t *)w + i), _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}

/* Row n of W ([K] values at w, bf16 or fp32 (w_f32)) from the layouts above, 8 inputs at a time. */
static inline void dequant_row(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                               int64_t n, int64_t K, int64_t G, void *w, int w_f32, lq_table_t sub_table) {
    (void)sub_table;
    const int64_t groups = K / G, t = n / TR, r = n % TR;
    const uint8_t *tc = codes + t * tile_code_bytes(bits == 3 ? 8 : bits, K);
    for (int64_t k = 0; k < K; k += 8) {
        const int64_t si = bits == 3 ? n * groups + k / G : (t * groups + k / G) * TR + r;
        const __m256 s = _mm256_set1_ps(bf16_to_f32(scales[si]));
        const __m256 z = _mm256_set1_ps(bf16_to_f32(zeros[si]));
        __m256 v;
        if (bits == 3) {
            if (k % 16) continue; /* 16 inputs at a time, in one group (G % 32 == 0) */
            __m256 lo, hi;
            widen16_e4m3(codes + n * K + k, &lo, &hi);
            const __m256 s8 = _mm256_mul_ps(s, _mm256_set1_ps(E4M3_F16_SCALE));
            store8(w, k, _mm256_fmadd_ps(lo, s8, z), w_f32);
            store8(w, k + 8, _mm256_fmadd_ps(hi, s8, z), w_f32);
            continue;
        } else if (bits == 4) {
            /* one dword of the 8-input chunk: inputs 0-3 in the low nibbles, 4-7 in the high ones */
            int32_t d;
            memcpy(&d, tc + k * 8 + r * 4, 4);
            const __m128i b = _mm_cvtsi32_si128(d), m4 = _mm_set1_epi8(0x0f);
            const __m128i c8 = _mm_unpacklo_epi32(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));
            v = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c8)), _mm256_set1_ps(8.f));
        } else {
            int32_t d[2];
            memcpy(&d[0], tc + k * 16 + r * 4, 4), memcpy(&d[1], tc + (k + 4) * 16 + r * 4, 4);
            const __m128i b = _mm_xor_si128(_mm_loadl_epi64((const __m128i *)d), _mm_set1_epi8((char)0x80));
            v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        }
        store8(w, k, _mm256_fmadd_ps(v, s, z), w_f32);
    }
}
#endif

#ifdef LQ_HAVE_KERNELS
static int e4m3_linear(const uint16_t *x, int64_t M, const uint8_t *codes, const uint16_t *scales,
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
    const lq_table_t table = e4m3_table();
#pragma omp parallel for schedule(static) if (N * K * mblocks >= quant_parallel_min)
    for (int64_t t = 0; t < mblocks * nblocks; t++) {
        const int64_t m0 = t / nblocks * MAXM, n0 = t % nblocks * NR;
        const int64_t nr = N - n0 < NR ? N - n0 : NR;
        switch (M - m0 < MAXM ? M - m0 : MAXM) {
        case 1: quant_block(1, x, m0, codes, scales, zeros, xsum, N, K, G, n0, nr, table, y, y_f32); break;
        case 2: quant_block(2, x, m0, codes, scales, zeros, xsum, N, K, G, n0, nr, table, y, y_f32); break;
        case 3: quant_block(3, x, m0, codes, scales, zeros, xsum, N, K, G, n0, nr, table, y, y_f32); break;
        default: quant_block(4, x, m0, codes, scales, zeros, xsum, N, K, G, n0, nr, table, y, y_f32);
        }
    }
    free(xsum);
    return 0;
}

int e4m3_linear_bf16(const uint16_t *x, int64_t M, const uint8_t *codes, const uint16_t *scales,
                     const uint16_t *zeros, int64_t N, int64_t K, int64_t G, void *y, int y_f32, int int8_act) {
    (void)int8_act; /* e4m3 codes always meet bf16 activations */
    return e4m3_linear(x, M, codes, scales, zeros, N, K, G, y, y_f32);
}

/* ---- Tiled 4-bit and int8 codes ------------------------------------------------------------ */

static int prepare_acts(const uint16_t *x, int64_t M, int64_t K, int64_t G, int offset, int int8_act, Acts *a) {
    const int64_t groups = K / G, nb = K / 32;
    memset(a, 0, sizeof(*a));
    a->xsum = (float *)malloc(sizeof(float) * M * groups);
    if (int8_act) {
        a->xq = (int8_t *)aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
        a->xd = (float *)malloc(sizeof(float) * M * nb);
        a->xc = (int32_t *)malloc(sizeof(int32_t) * M * nb);
    } else {
        a->xf = (float *)aligned_alloc(64, (size_t)((M * K * 4 + 63) / 64 * 64));
    }
    if (!a->xsum || (int8_act ? !a->xq || !a->xd || !a->xc : !a->xf)) return 2;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) s += bf16_to_f32(x[m * K + k]);
            a->xsum[m * groups + g] = s;
        }
        if (!int8_act) {
            for (int64_t k = 0; k < K; k++) a->xf[m * K + k] = bf16_to_f32(x[m * K + k]);
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            int32_t qsum;
            a->xd[m * nb + b] = quantize_block32(x + m * K + b * 32, a->xq + m * K + b * 32, &qsum);
            a->xc[m * nb + b] = -offset * qsum;
        }
    }
    return 0;
}

static void free_acts(Acts *a) { free(a->xf), free(a->xq), free(a->xd), free(a->xc), free(a->xsum); }

static inline __attribute__((always_inline)) int tiled_linear(
    const int bits, const uint16_t *x, int64_t M, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *zeros, int64_t N, int64_t K, int64_t G, void *y, int y_f32, int int8_act) {
    if (M < 1 || G % 32 != 0 || K % G != 0) return 1;
    const int64_t groups = K / G, tiles = (N + TR - 1) / TR, mblocks = (M + MAXM - 1) / MAXM;
    Acts a;
    if (prepare_acts(x, M, K, G, bits == 4 ? 8 : INT8_OFFSET, int8_act, &a) != 0) {
        free_acts(&a);
        return 2;
    }
    const int64_t cb = tile_code_bytes(bits, K);
#pragma omp parallel for schedule(static) if (N * K * mblocks >= quant_parallel_min)
    for (int64_t t = 0; t < mblocks * tiles; t++) {
        const int64_t m0 = t / tiles * MAXM, n0 = t % tiles * TR;
        const int64_t nr = N - n0 < TR ? N - n0 : TR;
        const uint8_t *tc = codes + t % tiles * cb;
        const uint16_t *ts = scales + t % tiles * groups * TR, *tz = zeros + t % tiles * groups * TR;
        float out[MAXM][TR];
        const int mr = M - m0 < MAXM ? (int)(M - m0) : MAXM;
#define QTILE(MR_)                                                                                  \
    (int8_act ? tile_block(bits, MR_, 1, &a, m0, tc, ts, tz, K, G, out)                            \
              : tile_block(bits, MR_, 0, &a, m0, tc, ts, tz, K, G, out))
        switch (mr) {
        case 1: QTILE(1); break;
        case 2: QTILE(2); break;
        case 3: QTILE(3); break;
        default: QTILE(4);
        }
#undef QTILE
        for (int m = 0; m < mr; m++)
            for (int64_t r = 0; r < nr; r++) {
                const int64_t i = (m0 + m) * N + n0 + r;
                if (y_f32)
                    ((float *)y)[i] = out[m][r];
                else
                    ((uint16_t *)y)[i] = f32_to_bf16(out[m][r]);
            }
    }
    free_acts(&a);
    return 0;
}

int int4_linear_bf16(const uint16_t *x, int64_t M, const uint8_t *codes, const uint16_t *scales,
                     const uint16_t *zeros, int64_t N, int64_t K, int64_t G, void *y, int y_f32, int int8_act) {
    return tiled_linear(4, x, M, codes, scales, zeros, N, K, G, y, y_f32, int8_act);
}

int int8_linear_bf16(const uint16_t *x, int64_t M, const uint8_t *codes, const uint16_t *scales,
                     const uint16_t *zeros, int64_t N, int64_t K, int64_t G, void *y, int y_f32, int int8_act) {
    return tiled_linear(8, x, M, codes, scales, zeros, N, K, G, y, y_f32, int8_act);
}

/* ---- w8a8: row-major int8 codes, int8 activations with one scale per row --------------------- */

/*
 * w8a8 (int8 weights, one fp32 scale per output row; int8 activations, one scale per row of x, dynamic):
 * y = x W^T as the torch path computes it (per-row quantization, torch._int_mm, then
 * float(acc) * d_row * s_out in that order, each product rounded to fp32), for any M (decode rows).
 * codes [N, K] int8 row-major (the layout _int_mm reads as codes^T); scales [N] fp32; wsum [N] int32,
 * sum_k codes[n, k] (AVX-512: the +128 of the activations comes off as 128 wsum, exactly in int32).
 * x and y both bf16 or both fp32 (f32). The int32 sums are exact, so y equals the torch path's to the bit.
 */
int w8a8_linear(const void *x, int64_t M, const int8_t *codes, const float *scales, const int32_t *wsum,
                int64_t N, int64_t K, void *y, int f32) {
    if (M < 1 || K < 1) return 1;
    const int64_t KP = (K + 63) / 64 * 64, es = f32 ? 4 : 2;
    uint8_t *xq = (uint8_t *)aligned_alloc(64, (size_t)(M * KP));
    float *d = (float *)malloc(sizeof(float) * M);
    if (!xq || !d) {
        free(xq), free(d);
        return 2;
    }
    for (int64_t m = 0; m < M; m++) d[m] = w8a8_quantize_row((const char *)x + m * K * es, f32, K, KP, xq + m * KP);
    const int64_t nblocks = (N + NR - 1) / NR, mblocks = (M + MAXM - 1) / MAXM;
#pragma omp parallel for schedule(static) if (N * K * mblocks >= quant_parallel_min)
    for (int64_t t = 0; t < mblocks * nblocks; t++) {
        const int64_t m0 = t / nblocks * MAXM, n0 = t % nblocks * NR;
        w8a8_tile(xq, KP, codes, scales, wsum, d, N, K, m0, M - m0 < MAXM ? (int)(M - m0) : MAXM, n0,
                  N - n0 < NR ? N - n0 : NR, y, f32);
    }
    free(xq), free(d);
    return 0;
}

/*
 * w8a8 batches (more rows than the kernel above takes) run torch._int_mm (oneDNN's int8 GEMM) between
 * these two passes, so that the torch formula's dozen elementwise ops around it (kernels.int8_dynamic_linear)
 * become two calls with the same numbers:
 *   w8a8_quantize_rows: x [M, K] (bf16 or fp32) to xq [M, K] int8 (signed, _int_mm's operand) and d [M],
 *                       each row as w8a8_quantize_row quantizes it;
 *   w8a8_scale_rows:    acc [M, N] int32 to y [M, N] = (float(acc) * d[m]) * scales[n], each product
 *                       rounded to fp32 as torch rounds it, stored in fp32 or rounded to bf16.
 */
int w8a8_quantize_rows(const void *x, int64_t M, int64_t K, int f32, int8_t *xq, float *d) {
    if (M < 1 || K < 1) return 1;
    const int64_t es = f32 ? 4 : 2, KP = (K + 63) / 64 * 64;
    int bad = 0;
#pragma omp parallel if (M * K >= (1 << 17))
    {
        uint8_t *row = (uint8_t *)aligned_alloc(64, (size_t)KP);
        if (row == NULL) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (row == NULL) continue;
            d[m] = w8a8_quantize_row((const char *)x + m * K * es, f32, K, KP, row);
            w8a8_row_to_signed(row, xq + m * K, K);
        }
        free(row);
    }
    return bad ? 2 : 0;
}

int w8a8_scale_rows(const int32_t *acc, int64_t M, int64_t N, const float *d, const float *scales, void *y, int f32) {
    if (M < 1 || N < 1) return 1;
#pragma omp parallel for schedule(static) if (M * N >= (1 << 16))
    for (int64_t m = 0; m < M; m++) w8a8_scale_row(acc + m * N, N, d[m], scales, y, m * N, f32);
    return 0;
}

/* Weights (times 4-row blocks of x) from which a product runs on every thread; returns the
 * previous value (benchmarks set it to compare one thread with several). */
int64_t quant_set_parallel_min(int64_t elems) {
    const int64_t old = quant_parallel_min;
    quant_parallel_min_ = elems;
    return old;
}

/* W [N, K] in bf16, or fp32 (w_f32), from the same layouts (for batches, where oneDNN's GEMM beats
 * a pass per 4 rows). */
int quant_dequant(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int64_t N,
                  int64_t K, int64_t G, void *w, int w_f32) {
    if (G % 32 != 0 || K % G != 0 || (bits != 4 && bits != 8 && bits != 3)) return 1;
    const lq_table_t sub_table = e4m3_table();
    const int64_t es = w_f32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (N * K >= quant_parallel_min)
    for (int64_t n = 0; n < N; n++) dequant_row(bits, codes, scales, zeros, n, K, G, (char *)w + n * K * es, w_f32, sub_table);
    return 0;
}

/* Rows ids[0..M) of W (a quantized embedding's lookup) into out [M, K], bf16 or fp32 (out_f32): the
 * values quant_dequant gives for those rows, bit for bit. Rows outside [0, N) come out as zeros. */
int quant_gather_rows(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int64_t N,
                      int64_t K, int64_t G, const int64_t *ids, int64_t M, void *out, int out_f32) {
    if (G % 32 != 0 || K % G != 0 || (bits != 4 && bits != 8 && bits != 3)) return 1;
    const lq_table_t sub_table = e4m3_table();
    const int64_t es = out_f32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (M * K >= quant_parallel_min)
    for (int64_t m = 0; m < M; m++) {
        char *row = (char *)out + m * K * es;
        if (ids[m] < 0 || ids[m] >= N)
            memset(row, 0, (size_t)(K * es));
        else
            dequant_row(bits, codes, scales, zeros, ids[m], K, G, row, out_f32, sub_table);
    }
    return 0;
}
#endif
