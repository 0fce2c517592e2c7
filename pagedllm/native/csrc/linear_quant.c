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
 * of x to int8 with one scale per row, as the torch path does; see there. On CPUs with AMX-INT8 it
 * runs on AMX tiles from 5 rows (TDPBSSD on the same codes, linear_quant_amx.h), the same bits.
 *
 * CPUs with AVX2 and FMA but not AVX-512 BF16 run the same layouts and the same arithmetic in 8-lane
 * vectors (LQ_AVX2, linear_quant_avx2.h): each tile as two halves of 8 output rows (bytes 0-31 and 32-63 of each
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
#define LQ_HAVE_KERNELS 1 /* the kernels are compiled (llama_decode.c asks) */
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
#include "linear_quant_avx512.h"
#include "amx.h"
#include "linear_quant_amx.h"
#include "linear_quant_vnni.h"
#elif defined(LQ_AVX2)
#include "linear_quant_avx2.h"
#endif
#ifndef HAVE_AMX_INT8
#define HAVE_AMX_INT8 0
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
#if HAVE_AMX_INT8
    if (M >= w8a8_amx_from_rows && amx_permitted()) return w8a8_linear_amx(x, M, codes, scales, N, K, y, f32);
#endif
#if defined(LQ_AVX512)
    if (M >= w8a8_vnni_from_rows) return w8a8_linear_vnni(x, M, codes, scales, wsum, N, K, y, f32);
#endif
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

/* Rows of x from which w8a8_linear runs on AMX tiles now (W8A8_AMX_MIN_ROWS unless w8a8_amx_from set
 * another); 0 where it never does (a build without AMX-INT8, or an OS that does not lend this process
 * the tile registers). */
int64_t w8a8_amx_rows(void) {
#if HAVE_AMX_INT8
    return amx_permitted() ? w8a8_amx_from_rows : 0;
#else
    return 0;
#endif
}

/* w8a8_linear calls of `rows` rows of x or more run on AMX tiles from now on (rows <= 0:
 * W8A8_AMX_MIN_ROWS, the default), fewer in the vpdpbusd forms (the same bits either way; tests and
 * benchmarks compare the two). This library's setting, for every later call. Returns w8a8_amx_rows(). */
int64_t w8a8_amx_from(int64_t rows) {
#if HAVE_AMX_INT8
    w8a8_amx_from_rows = rows > 0 ? rows : W8A8_AMX_MIN_ROWS;
#else
    (void)rows;
#endif
    return w8a8_amx_rows();
}

/* Rows of x from which w8a8_linear runs its vpdpbusd batch form (linear_quant_vnni.h) where the AMX
 * tiles do not take the call (W8A8_VNNI_MIN_ROWS unless w8a8_vnni_from set another); 0 in builds
 * without it (the AVX2 form, whose batches run outside the kernel). */
int64_t w8a8_vnni_rows(void) {
#if defined(LQ_AVX512)
    return w8a8_vnni_from_rows;
#else
    return 0;
#endif
}

/* w8a8_linear calls of `rows` rows of x or more (and not on AMX tiles) run the vpdpbusd batch form
 * from now on (rows <= 0: W8A8_VNNI_MIN_ROWS, the default), fewer the row form (the same bits either
 * way). This library's setting, for every later call. Returns w8a8_vnni_rows(). */
int64_t w8a8_vnni_from(int64_t rows) {
#if defined(LQ_AVX512)
    w8a8_vnni_from_rows = rows > 0 ? rows : W8A8_VNNI_MIN_ROWS;
#else
    (void)rows;
#endif
    return w8a8_vnni_rows();
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
/* Each row of x [M, K] (bf16 or fp32) quantized by w8a8_quantize_row, d[m] its scale, stored as signed
 * int8: rows of K bytes at xq, or, with xp (AMX-INT8 builds), TDPBSSD's packed second operand
 * (w8a8_quantize_pack16, 16 rows at a time), zero rows up to a multiple of 16. 2 where a thread's
 * scratch cannot be had. */
static int w8a8_quantize_each(const void *x, int64_t M, int64_t K, int f32, float *d, int8_t *xq, int32_t *xp) {
    const int64_t es = f32 ? 4 : 2, KP = (K + 63) / 64 * 64;
    const int64_t units = xp != NULL ? (M + 15) / 16 : M, scratch = xp != NULL ? 16 * KP : KP;
    int bad = 0;
#pragma omp parallel if (M * K >= (1 << 17))
    {
        uint8_t *row = (uint8_t *)aligned_alloc(64, (size_t)scratch);
        if (row == NULL) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (row == NULL) continue;
#if HAVE_AMX_INT8
            if (xp != NULL) {
                w8a8_quantize_pack16(x, M, K, f32, u, d, row, (char)0x80, xp + u * (KP / 64) * 256);
                continue;
            }
#endif
            d[u] = w8a8_quantize_row((const char *)x + u * K * es, f32, K, KP, row);
            w8a8_row_to_signed(row, xq + u * K, K);
        }
        free(row);
    }
    return bad ? 2 : 0;
}

int w8a8_quantize_rows(const void *x, int64_t M, int64_t K, int f32, int8_t *xq, float *d) {
    if (M < 1 || K < 1) return 1;
    return w8a8_quantize_each(x, M, K, f32, d, xq, NULL);
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

/* The host's rate of the int8 products the kernels above use, for benchmarks (`pagedllm bench kernels
 * quant --int8-peak`): each thread OpenMP gives runs `iters` rounds of independent
 * multiply-accumulate chains on registers only, with no memory traffic: 16 of vpdpbusd on 64 bytes
 * (AVX-512 VNNI builds) or 12 of the AVX2 form's vpmaddubsw + vpmaddwd + vpaddd on 32 bytes (its 16
 * registers hold 12 chains and their operands), each chain's bytes its own running sums there, so
 * that no product can leave the loop. The chains are named registers and each step is written in
 * inline assembly (the AVX-512 one a single instruction, as in the batch form's loop):
 * over an array, the compiler copies every register and spills two on every round. Returns the int8
 * multiplies made by all threads together (the caller times the call), or 0 for iters < 1. */
static volatile int64_t int8_dot_peak_sink; /* the chains' sums land here, so none can be dropped */
int64_t int8_dot_peak(int64_t iters) {
    if (iters < 1) return 0;
    int64_t total = 0, sink = 0;
#define PEAK_12(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
#define PEAK_16(F) PEAK_12(F) F(12) F(13) F(14) F(15)
#if defined(LQ_AVX512)
#define PEAK_CHAINS PEAK_16
#define PEAK_BYTES (16 * 64) /* int8 products per round and thread */
#define PEAK_INIT(j) __m512i c##j = _mm512_set1_epi32(j);
#define PEAK_STEP(j) __asm__("vpdpbusd %[b], %[a], %[c]" : [c] "+v"(c##j) : [a] "v"(a), [b] "v"(b));
#define PEAK_SUM(j) sink += _mm512_reduce_add_epi32(c##j);
#else
#define PEAK_CHAINS PEAK_12
#define PEAK_BYTES (12 * 32)
#define PEAK_INIT(j) __m256i c##j = _mm256_set1_epi32(j);
#define PEAK_STEP(j) { __m256i t; \
        __asm__("vpmaddubsw %[b], %[c], %[t]\n\tvpmaddwd %[o], %[t], %[t]\n\tvpaddd %[t], %[c], %[c]" \
                : [c] "+x"(c##j), [t] "=&x"(t) : [b] "x"(b), [o] "x"(ones)); }
#define PEAK_SUM(j) { const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(c##j), _mm256_extracti128_si256(c##j, 1)); \
        sink += _mm_cvtsi128_si32(h) + _mm_extract_epi32(h, 1) + _mm_extract_epi32(h, 2) + _mm_extract_epi32(h, 3); }
#endif
#pragma omp parallel reduction(+ : total, sink)
    {
#if defined(LQ_AVX512)
        const __m512i a = _mm512_set1_epi8((char)(1 + (iters & 7))), b = _mm512_set1_epi8((char)(3 - (iters & 1)));
#else
        const __m256i b = _mm256_set1_epi8((char)(3 - (iters & 1))), ones = _mm256_set1_epi16(1);
#endif
        PEAK_CHAINS(PEAK_INIT)
        for (int64_t i = 0; i < iters; i++) {
            PEAK_CHAINS(PEAK_STEP)
        }
        PEAK_CHAINS(PEAK_SUM)
        total += iters * PEAK_BYTES;
    }
#undef PEAK_12
#undef PEAK_16
#undef PEAK_CHAINS
#undef PEAK_BYTES
#undef PEAK_INIT
#undef PEAK_STEP
#undef PEAK_SUM
    int8_dot_peak_sink = sink;
    return total;
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
