/*
 * y[M, N] = x[M, K] W[N, K]^T (+ bias) for a few rows of x (decode steps), in float32 or bfloat16,
 * accumulating in float32; bf16 results are rounded once at the end, as torch's bf16 GEMMs do.
 *
 * A decode GEMM is a pass over W. Four W rows at a time are loaded once per 16 (float32) or 32
 * (bf16) columns and serve up to four x rows from 16 register accumulators (bf16 through AVX-512
 * BF16 dot products, vdpbf16ps: 32 products into 16 float32 lanes per instruction); further rows
 * reuse the same W block from L1. A whole 4 x 4 tile's 16 dot products are summed across their
 * lanes together, as one transpose-and-add tree over the 16 accumulators that yields one vector of
 * 16 results (a quarter of the instructions of 16 separate horizontal sums, which at K = 576 cost
 * nearly half as many instructions as the dot products themselves). Partial tiles sum each
 * accumulator alone with the same pairing of lanes, so that a row's result does not depend on
 * where it sits in the batch. While the rows of x run over a W block, the next block's lines are
 * prefetched, one per W row per step of K, each tile of x rows taking its share of the steps:
 * with more than a row or two of x the tile's arithmetic otherwise hides too few of its loads from
 * the hardware prefetcher, and the pass over W falls well below the memory's rate (bf16, 8 rows,
 * this model's 30 layers streamed from memory: 11.6 ms without, 6.5 ms with; 16 rows 14.0 -> 8.2
 * ms), while all of a block's prefetches in its first tile outrun the core's miss buffers (32 rows
 * 16.0 -> 11.4 ms, 64 rows 31.3 -> 22.0 ms with the tile sums, benchmarks/bench_small_m_gemm.py).
 * W row blocks are split between the OpenMP threads; small GEMMs run on one thread (waking the
 * team costs more than reading a few hundred KB). CPUs without AVX-512 but with AVX2 and FMA get
 * the kernel in 8-lane vectors (gemm_tile_avx2), bf16 and (with F16C) float16 widened to float32
 * in registers; CPUs with AVX-512 but not its BF16 dot products have no bf16 kernel, and AVX-512
 * builds no float16 one. On CPUs with AMX-BF16, bf16 GEMMs of 2 rows or more run on AMX tiles
 * instead (gemm_rows_amx): 16 W rows x 32 columns of K as the first operand straight from W, x
 * packed once per call as the second, 2 x 2 tiles of 16 x 16 float32 sums.
 *
 * Layouts: x [M, K], w [N, K], bias [N] or NULL, y [M, N], all of element type dt (0 float32,
 * 1 bf16 as uint16, 2 float16 as uint16); K % 16 == 0 for float32, K % 32 == 0 for bf16 and
 * float16. Also included by the fused decode step (pagedllm/worker/csrc/llama_decode.c).
 */
#ifndef PAGEDLLM_SMALL_M_GEMM_C
#define PAGEDLLM_SMALL_M_GEMM_C
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#else
#define HAVE_AVX512_BF16 0
#endif
/* CPUs with AVX2 and FMA but no AVX-512 (Zen 1-3, most client Intel parts): the kernel in 8-lane
 * float32 vectors, for float32, bf16 and (with F16C) float16 widened to float32. */
#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_F32 1
#else
#define HAVE_AVX2_F32 0
#endif
#if HAVE_AVX2_F32 && defined(__F16C__)
#define HAVE_AVX2_F16 1
#else
#define HAVE_AVX2_F16 0
#endif

/* AMX (Sapphire Rapids and later Xeons): bf16 GEMMs of AMX_MIN_ROWS rows or more run on the tile
 * unit (gemm_rows_amx), which multiplies 16 x 32 bf16 blocks at several times the rate of AVX-512
 * BF16 dot products. */
#include "amx.h"

#define NR 4
#define MR 4
_Static_assert(MR * NR == 16, "a whole tile's sums are one lane_sums16");
/* GEMMs with fewer weight elements than this run on one thread. */
#define GEMM_PARALLEL_MIN (1 << 16)

/* Element types: float32, bf16, float16 (the last only in the AVX2 + F16C form). */
enum { LD_F32 = 0, LD_BF16 = 1, LD_F16 = 2 };

static inline float ld(const void *p, int64_t i, int dt) {
#if HAVE_AVX2_F16
    if (dt == LD_F16) return _cvtsh_ss(((const uint16_t *)p)[i]);
#endif
    return dt == LD_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void st(void *p, int64_t i, float v, int dt) {
#if HAVE_AVX2_F16
    if (dt == LD_F16) {
        ((uint16_t *)p)[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
        return;
    }
#endif
    if (dt == LD_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = f32_to_bf16(v);
}

#if HAVE_AVX512
/* y rows m0 .. m0 + 3, columns n0 .. n0 + 3 from the sums of a whole tile's accumulators
 * (acc[m][r] for x row m0 + m and W row n0 + r), the bias added in float32, stored in dtype dt. */
static inline __attribute__((always_inline)) void store_tile(const __m512 acc[4][4], int64_t m0, int64_t n0, int64_t N,
                                                            const void *bias, void *y, int dt) {
    __m512 v = lane_sums16(&acc[0][0]);
    if (bias != NULL) {
        const __m128 b = dt == LD_F32 ? _mm_loadu_ps((const float *)bias + n0)
                                      : _mm_castsi128_ps(_mm_slli_epi32(
                                            _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)((const uint16_t *)bias + n0))), 16));
        v = _mm512_add_ps(v, _mm512_broadcast_f32x4(b));
    }
    if (dt == LD_F32) {
        for (int m = 0; m < 4; m++)
            _mm_storeu_ps((float *)y + (m0 + m) * N + n0, _mm512_extractf32x4_ps(v, m));
        return;
    }
    const __m256i h = bf16x16_from_f32(v);
    const __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
    _mm_storel_epi64((__m128i *)((uint16_t *)y + m0 * N + n0), lo);
    _mm_storel_epi64((__m128i *)((uint16_t *)y + (m0 + 1) * N + n0), _mm_unpackhi_epi64(lo, lo));
    _mm_storel_epi64((__m128i *)((uint16_t *)y + (m0 + 2) * N + n0), hi);
    _mm_storel_epi64((__m128i *)((uint16_t *)y + (m0 + 3) * N + n0), _mm_unpackhi_epi64(hi, hi));
}

/* Rows n0 .. n0 + nr - 1 of y for x rows m0 .. m0 + mr - 1 (mr <= MR, nr <= NR); K % 16 == 0 for
 * float32, K % 32 == 0 for bf16 (the callers check). pf: the next W block's first row (NR rows of
 * K), or NULL; its lines are prefetched at steps pf_phase, pf_phase + pf_every, ... of K. */
static inline __attribute__((always_inline)) void gemm_tile_f32(const float *x, int64_t m0, int64_t mr, const float *w, int64_t n0, int64_t nr,
                                 int64_t N, int64_t K, const float *bias, float *y, const float *pf, int64_t pf_phase, int64_t pf_every) {
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = _mm512_loadu_ps(w + (n0 + (r < nr ? r : 0)) * K + k);
        if (pf != NULL && pf_phase-- == 0) {
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(pf + r * K + k), _MM_HINT_T0);
            pf_phase = pf_every - 1;
        }
        for (int64_t m = 0; m < mr; m++) {
            const __m512 xv = _mm512_loadu_ps(x + (m0 + m) * K + k);
            for (int r = 0; r < NR; r++) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
        }
    }
    if (mr == MR && nr == NR) {
        store_tile((const __m512(*)[NR])acc, m0, n0, N, bias, y, LD_F32);
        return;
    }
    for (int64_t m = 0; m < mr; m++)
        for (int64_t r = 0; r < nr; r++)
            y[(m0 + m) * N + n0 + r] = lane_sum(acc[m][r]) + (bias ? bias[n0 + r] : 0.0f);
}
#endif

#if HAVE_AVX2_F32
/* Where an AVX2 pass over a W block reads it: float32 W; 16-bit W (bf16 or float16) widened in
 * registers; 16-bit W widened and also stored to the block's float32 panel; the panel. */
enum { W_F32 = 0, W_WIDEN = 1, W_WIDEN_FILL = 2, W_PANEL = 3 };

/* 8 bf16 or float16 (dt) values widened to float32 (exact). */
static inline __attribute__((always_inline)) __m256 half8_load(const uint16_t *p, int dt) {
#if HAVE_AVX2_F16
    if (dt == LD_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
    (void)dt;
    return bf16x8_load(p);
}

/* One pass of mm (1 or 2) x rows (float32, from xr) over the W block n0 .. n0 + nr - 1 read as
 * `mode` says (a constant at each call site), into acc. */
static inline __attribute__((always_inline)) void avx2_pass(const float *xr, int64_t mm, const void *w, int64_t n0,
                                                           int64_t nr, int64_t K, float *panel, __m256 acc[2][NR],
                                                           const void *pf, int64_t *pf_phase, int64_t pf_every,
                                                           int mode, int dt) {
    const int64_t line = mode == W_F32 ? 16 : 32, es = mode == W_F32 ? 4 : 2; /* W elements per 64-byte line */
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[NR];
        for (int r = 0; r < NR; r++) {
            const int64_t row = n0 + (r < nr ? r : 0);
            if (mode == W_F32)
                wv[r] = _mm256_loadu_ps((const float *)w + row * K + k);
            else if (mode == W_PANEL)
                wv[r] = _mm256_loadu_ps(panel + r * K + k);
            else
                wv[r] = half8_load((const uint16_t *)w + row * K + k, dt);
            if (mode == W_WIDEN_FILL) _mm256_storeu_ps(panel + r * K + k, wv[r]);
        }
        if (pf != NULL && (k & (line - 1)) == 0 && (*pf_phase)-- == 0) {
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)pf + (r * K + k) * es, _MM_HINT_T0);
            *pf_phase = pf_every - 1;
        }
        for (int64_t m = 0; m < mm; m++) {
            const __m256 xv = _mm256_loadu_ps(xr + m * K + k);
            for (int r = 0; r < NR; r++) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
        }
    }
}

/* The tile for AVX2 + FMA: 16 ymm registers hold 2 x rows by NR W rows of accumulators (8), the NR
 * W vectors and one x vector, so a tile of up to MR x rows runs as passes of two rows over its W
 * block. x is float32 (16-bit x widened by the caller, once per GEMM). A float32 block is reread
 * from L1 by the later passes. A bf16 or float16 block is widened to float32 in registers (exact)
 * and multiplied in float32: on CPUs without 16-bit dot products nothing is faster, and the pass
 * over W reads half the bytes of float32. Where more than one pass runs over such a block (panel
 * not NULL), the first pass of the first tile (fill) also stores the widened block to the float32
 * panel (NR x K) and every later pass reads that, so each element is widened once. Each output is
 * one 8-lane accumulator over K summed by lane_sum8, whatever the tile, so a row's result does not
 * depend on where it sits in the batch; the bias is added in float32 and a 16-bit result rounded
 * once. The next block's lines are prefetched in the first pass, one per W row per 64-byte line,
 * each tile of x rows taking its share of the steps as in the AVX-512 kernel. */
static inline __attribute__((always_inline)) void gemm_tile_avx2(const float *x, int64_t m0, int64_t mr, const void *w,
                                                                int64_t n0, int64_t nr, int64_t N, int64_t K,
                                                                const void *bias, void *y, const void *pf,
                                                                int64_t pf_phase, int64_t pf_every, int dt,
                                                                float *panel, int fill) {
    for (int64_t mp = 0; mp < mr; mp += 2) {
        const int64_t mm = mr - mp < 2 ? mr - mp : 2;
        __m256 acc[2][NR];
        for (int m = 0; m < 2; m++)
            for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();
        const float *xr = x + (m0 + mp) * K;
        const void *pfp = mp == 0 ? pf : NULL;
        if (dt == LD_F32)
            avx2_pass(xr, mm, w, n0, nr, K, NULL, acc, pfp, &pf_phase, pf_every, W_F32, dt);
        else if (panel == NULL)
            avx2_pass(xr, mm, w, n0, nr, K, NULL, acc, pfp, &pf_phase, pf_every, W_WIDEN, dt);
        else if (fill && mp == 0)
            avx2_pass(xr, mm, w, n0, nr, K, panel, acc, pfp, &pf_phase, pf_every, W_WIDEN_FILL, dt);
        else
            avx2_pass(xr, mm, w, n0, nr, K, panel, acc, pfp, &pf_phase, pf_every, W_PANEL, dt);
        for (int64_t m = 0; m < mm; m++)
            for (int64_t r = 0; r < nr; r++)
                st(y, (m0 + mp + m) * N + n0 + r, lane_sum8(acc[m][r]) + (bias ? ld(bias, n0 + r, dt) : 0.0f), dt);
    }
}

static inline __attribute__((always_inline)) void gemm_tile_f32(const float *x, int64_t m0, int64_t mr, const float *w, int64_t n0, int64_t nr,
                                 int64_t N, int64_t K, const float *bias, float *y, const float *pf, int64_t pf_phase, int64_t pf_every) {
    gemm_tile_avx2(x, m0, mr, w, n0, nr, N, K, bias, y, pf, pf_phase, pf_every, LD_F32, NULL, 0);
}
#endif

#if HAVE_AVX512_BF16
static inline __attribute__((always_inline)) void gemm_tile_bf16(const uint16_t *x, int64_t m0, int64_t mr, const uint16_t *w, int64_t n0,
                                  int64_t nr, int64_t N, int64_t K, const uint16_t *bias, uint16_t *y,
                                  const uint16_t *pf, int64_t pf_phase, int64_t pf_every) {
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = (__m512bh)_mm512_loadu_si512((const void *)(w + (n0 + (r < nr ? r : 0)) * K + k));
        if (pf != NULL && pf_phase-- == 0) {
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(pf + r * K + k), _MM_HINT_T0);
            pf_phase = pf_every - 1;
        }
        for (int64_t m = 0; m < mr; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + m) * K + k));
            for (int r = 0; r < NR; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
    if (mr == MR && nr == NR) {
        store_tile((const __m512(*)[NR])acc, m0, n0, N, bias, y, LD_BF16);
        return;
    }
    for (int64_t m = 0; m < mr; m++)
        for (int64_t r = 0; r < nr; r++) {
            float s = lane_sum(acc[m][r]);
            if (bias) s += bf16_to_f32(bias[n0 + r]);
            y[(m0 + m) * N + n0 + r] = f32_to_bf16(s);
        }
}
#endif

#if HAVE_AMX_BF16
/* Rows of x from which a bf16 GEMM runs on AMX tiles. With one row the pass over W is bound by
 * memory and the AVX-512 BF16 form reads W as fast; from 2 to 4 rows both run at the memory's rate,
 * from 5 rows the tiles are faster (30 layers of the default model, 2-core Xeon: 5 rows 8.8 against
 * 11.4 ms, 8 rows 9.3 against 16.7, 64 rows 19.2 against 72.2; benchmarks/bench_small_m_gemm.py).
 * From 2 rows on, then, a row of x gives the same bits in any batch. */
#define AMX_MIN_ROWS 2
/* Per-thread scratch of the packed x (kept between calls: a step's GEMMs reuse it). */
static __thread uint32_t *amx_xp;
static __thread int64_t amx_xp_words;
static __thread uint16_t *amx_wpad;
static __thread int64_t amx_wpad_elems;

/* x [M, K] bf16 as TDPBF16PS's second operand: for each block of 16 x rows (mb) and 32 columns of
 * K (kc), 16 lines of 16 32-bit words, line p word j = x[mb * 16 + j][kc * 32 + 2p, + 2p + 1]
 * (zero past row M): the 16 x 16 transpose of the block's 32-bit pairs. */
static void amx_pack_x(const uint16_t *x, int64_t M, int64_t K, uint32_t *xp) {
    const int64_t KC = K / 32, MB = (M + 15) / 16;
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    for (int64_t mb = 0; mb < MB; mb++)
        for (int64_t kc = 0; kc < KC; kc++) {
            uint32_t *t = xp + (mb * KC + kc) * 256;
            for (int64_t j = 0; j < 16; j++) {
                const int64_t m = mb * 16 + j;
                const __m512i v = m < M ? _mm512_loadu_si512((const void *)(x + m * K + kc * 32)) : _mm512_setzero_si512();
                _mm512_i32scatter_epi32(t + j, idx, v, 4);
            }
        }
}

/* 16 W rows x 32 K columns times 16 x rows into accumulators: the k-loop of one output block of up
 * to 2 x 2 tiles (two_n: a second 16 W rows at w1; two_m: a second 16 x rows at b1). */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *w0, const uint16_t *w1, int64_t ws,
                                                           const uint32_t *b0, const uint32_t *b1, int64_t KC,
                                                           int two_n, int two_m) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (two_n && two_m) {
        for (int64_t kc = 0; kc < KC; kc++) {
            _tile_loadd(4, w0 + kc * 32, ws);
            _tile_loadd(5, w1 + kc * 32, ws);
            _tile_loadd(6, b0 + kc * 256, 64);
            _tile_loadd(7, b1 + kc * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else if (two_n) {
        for (int64_t kc = 0; kc < KC; kc++) {
            _tile_loadd(4, w0 + kc * 32, ws);
            _tile_loadd(5, w1 + kc * 32, ws);
            _tile_loadd(6, b0 + kc * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
        }
    } else if (two_m) {
        for (int64_t kc = 0; kc < KC; kc++) {
            _tile_loadd(4, w0 + kc * 32, ws);
            _tile_loadd(6, b0 + kc * 256, 64);
            _tile_loadd(7, b1 + kc * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    } else {
        for (int64_t kc = 0; kc < KC; kc++) {
            _tile_loadd(4, w0 + kc * 32, ws);
            _tile_loadd(6, b0 + kc * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
        }
    }
}

/* y[m0 .. m0 + mr - 1][n0 .. n0 + nr - 1] from a [16 W rows, 16 x rows] float32 tile c, the bias
 * added in float32 and the sum rounded once to bf16. */
static inline void amx_store(const float *c, int64_t m0, int64_t mr, int64_t n0, int64_t nr, int64_t N,
                             const uint16_t *bias, uint16_t *y) {
    for (int64_t j = 0; j < mr; j++)
        for (int64_t i = 0; i < nr; i++) {
            float s = c[i * 16 + j];
            if (bias) s += bf16_to_f32(bias[n0 + i]);
            y[(m0 + j) * N + n0 + i] = f32_to_bf16(s);
        }
}

/* Rows [n_lo, n_hi) of bf16 y[M, N] = x[M, K] W[N, K]^T (+ bias) on AMX tiles, on the calling
 * thread (K % 32 == 0). W's rows are the tiles' first operand as they lie in memory (16 rows, 64
 * bytes of each, K * 2 bytes apart); x is packed once per call (amx_pack_x). A short last block of
 * W rows is copied into zero-padded rows, so that every element of y is the same sequence of tile
 * products whatever the split of rows between threads. 1 where the scratch cannot be had (the
 * caller runs the AVX-512 form). */
static int gemm_rows_amx(const uint16_t *x, int64_t M, const uint16_t *w, const uint16_t *bias, int64_t N, int64_t K,
                         uint16_t *y, int64_t n_lo, int64_t n_hi) {
    if (n_lo >= n_hi) return 0;
    const int64_t KC = K / 32, MB = (M + 15) / 16;
    if (amx_xp_words < MB * KC * 256) {
        free(amx_xp);
        amx_xp = aligned_alloc(64, (size_t)(MB * KC * 256 * 4));
        amx_xp_words = amx_xp != NULL ? MB * KC * 256 : 0;
        if (amx_xp == NULL) return 1;
    }
    if ((n_hi - n_lo) % 16 != 0 && amx_wpad_elems < 16 * K) {
        free(amx_wpad);
        amx_wpad = aligned_alloc(64, (size_t)(16 * K * 2));
        amx_wpad_elems = amx_wpad != NULL ? 16 * K : 0;
        if (amx_wpad == NULL) return 1;
    }
    uint32_t *xp = amx_xp;
    amx_pack_x(x, M, K, xp);
    amx_configure(); /* tmm0-3: [16 W rows, 16 x rows] float32 sums; tmm4-5: W; tmm6-7: packed x */
    float c[4][256] __attribute__((aligned(64)));
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += 32) {
        const int64_t nr = n_hi - n0 < 32 ? n_hi - n0 : 32;
        const int two_n = nr > 16;
        const uint16_t *w0 = w + n0 * K, *w1 = w0 + 16 * K;
        const int64_t ws = K * 2;
        if (nr < 32 && nr % 16 != 0) { /* the short last block: its rows, then zeros */
            const int64_t full = nr / 16 * 16, rest = nr - full;
            memcpy(amx_wpad, w + (n0 + full) * K, (size_t)(rest * K * 2));
            memset(amx_wpad + rest * K, 0, (size_t)((16 - rest) * K * 2));
            if (full == 0)
                w0 = amx_wpad;
            else
                w1 = amx_wpad;
        }
        for (int64_t mb = 0; mb < MB; mb += 2) {
            const int two_m = mb + 1 < MB;
            const uint32_t *b0 = xp + mb * KC * 256, *b1 = b0 + KC * 256;
            amx_block(w0, w1, ws, b0, b1, KC, two_n, two_m);
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            /* x rows and W rows each tile holds: the first 16 and the rest (two_m, two_n) */
            const int64_t m0 = mb * 16, mr0 = M - m0 < 16 ? M - m0 : 16, mr1 = M - m0 - 16 < 16 ? M - m0 - 16 : 16;
            const int64_t nr0 = nr < 16 ? nr : 16, nr1 = nr - 16;
            amx_store(c[0], m0, mr0, n0, nr0, N, bias, y);
            if (two_m) amx_store(c[1], m0 + 16, mr1, n0, nr0, N, bias, y);
            if (two_n) amx_store(c[2], m0, mr0, n0 + 16, nr1, N, bias, y);
            if (two_n && two_m) amx_store(c[3], m0 + 16, mr1, n0 + 16, nr1, N, bias, y);
        }
    }
    _tile_release();
    return 0;
}
#endif

/* Rows [n_lo, n_hi) of y[M, N] = x[M, K] W[N, K]^T (+ bias), in dtype dt, on the calling thread.
 * Each element of y is its own dot product with the same order of sums whatever the row range, so
 * a GEMM split into row ranges gives the bits of the whole one. */
static void gemm_rows(const void *x, int64_t M, const void *w, const void *bias, int64_t N, int64_t K, void *y, int dt,
                      int64_t n_lo, int64_t n_hi) {
#if HAVE_AMX_BF16
    if (dt == LD_BF16 && M >= AMX_MIN_ROWS && amx_permitted() &&
        gemm_rows_amx((const uint16_t *)x, M, (const uint16_t *)w, (const uint16_t *)bias, N, K, (uint16_t *)y, n_lo,
                      n_hi) == 0)
        return;
#endif
    const int64_t tiles = (M + MR - 1) / MR;
#if HAVE_AVX2_F32
    /* bf16 and float16 on AVX2: x widened once, and a float32 panel of the W block where passes
     * repeat (where the buffers cannot be had, the scalar loop below, or passes that widen W in
     * registers). */
    float *xf = NULL, *panel = NULL;
    if (dt != LD_F32 && n_lo < n_hi) {
        xf = aligned_alloc(64, (size_t)((M * K * 4 + 63) / 64 * 64));
        if (xf != NULL)
            for (int64_t i = 0; i < M * K; i += 8) _mm256_store_ps(xf + i, half8_load((const uint16_t *)x + i, dt));
        if (M > 2) panel = aligned_alloc(64, (size_t)(NR * K * 4));
    }
#endif
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR) {
        const int64_t nr = n_hi - n0 < NR ? n_hi - n0 : NR;
        /* The next block of this range: a whole one (a short last block is not prefetched). Every
         * tile of x rows takes its share of its lines: one K step in `tiles`, from step m0 / MR on. */
        const int64_t next = n0 + NR + NR <= n_hi ? n0 + NR : -1;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t mr = M - m0 < MR ? M - m0 : MR;
/* A constant row count per call site, so that the accumulators stay in registers. */
#define TILE(fn, T, MR_)                                                                                   \
    fn((const T *)x, m0, MR_, (const T *)w, n0, nr, N, K, (const T *)bias, (T *)y,                       \
       next < 0 ? NULL : (const T *)w + next * K, m0 / MR, tiles)
#define TILES(fn, T)                                                                                       \
    switch (mr) {                                                                                          \
    case 1: TILE(fn, T, 1); break;                                                                         \
    case 2: TILE(fn, T, 2); break;                                                                         \
    case 3: TILE(fn, T, 3); break;                                                                         \
    default: TILE(fn, T, 4); break;                                                                        \
    }
#if HAVE_AVX512_BF16
            if (dt == LD_BF16) {
                TILES(gemm_tile_bf16, uint16_t)
                continue;
            }
#endif
#if HAVE_AVX2_F32
            if (dt != LD_F32 && xf != NULL) {
#define TILE_W(MR_, DT_)                                                                                   \
    gemm_tile_avx2(xf, m0, MR_, w, n0, nr, N, K, bias, y, next < 0 ? NULL : (const uint16_t *)w + next * K, \
                   m0 / MR, tiles, DT_, panel, m0 == 0)
#define TILES_W(DT_)                                                                                       \
    switch (mr) {                                                                                          \
    case 1: TILE_W(1, DT_); break;                                                                         \
    case 2: TILE_W(2, DT_); break;                                                                         \
    case 3: TILE_W(3, DT_); break;                                                                         \
    default: TILE_W(4, DT_); break;                                                                        \
    }
                if (dt == LD_BF16) {
                    TILES_W(LD_BF16)
                } else {
                    TILES_W(LD_F16)
                }
#undef TILES_W
#undef TILE_W
                continue;
            }
#endif
#if HAVE_AVX512 || HAVE_AVX2_F32
            if (dt == LD_F32) {
                TILES(gemm_tile_f32, float)
                continue;
            }
#endif
            for (int64_t m = m0; m < m0 + mr; m++)
                for (int64_t n = n0; n < n0 + nr; n++) {
                    float s = 0.0f;
                    for (int64_t k = 0; k < K; k++) s += ld(x, m * K + k, dt) * ld(w, n * K + k, dt);
                    if (bias) s += ld(bias, n, dt);
                    st(y, m * N + n, s, dt);
                }
        }
    }
#if HAVE_AVX2_F32
    free(xf);
    free(panel);
#endif
}

/* The share [*lo, *hi) of n items that thread t of nth takes: whole units of `unit` items, as equal
 * in number as they can be (the last unit may be short). */
static inline void team_share(int64_t n, int64_t unit, int t, int nth, int64_t *lo, int64_t *hi) {
    const int64_t units = (n + unit - 1) / unit;
    const int64_t a = units * t / nth * unit, b = units * (t + 1) / nth * unit;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
}

/* y[M, N] = x[M, K] W[N, K]^T (+ bias), in dtype dt: row blocks split evenly over the OpenMP team. */
static void gemm(const void *x, int64_t M, const void *w, const void *bias, int64_t N, int64_t K, void *y, int dt) {
#pragma omp parallel if (N * K >= GEMM_PARALLEL_MIN)
    {
        int64_t lo, hi;
        team_share(N, NR, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        gemm_rows(x, M, w, bias, N, K, y, dt, lo, hi);
    }
}

/* Bit 0: the float32 kernel is built (AVX-512, or AVX2 + FMA); bit 1: the bf16 one (AVX-512 BF16, or
 * AVX2 + FMA widening bf16 to float32); bit 2: the bf16 one is the widening form; bit 3: the
 * float16 one (AVX2 + FMA + F16C, widening). */
int small_m_available(void) {
    return (HAVE_AVX512 || HAVE_AVX2_F32 ? 1 : 0) | (HAVE_AVX512_BF16 || HAVE_AVX2_F32 ? 2 : 0) |
           (HAVE_AVX2_F32 ? 4 : 0) | (HAVE_AVX2_F16 ? 8 : 0);
}

/* The fewest rows of x a bf16 GEMM runs on AMX tiles with; 0 where it never does (a build without
 * AMX-BF16, or an OS that does not lend this process the tile registers). */
int small_m_amx_rows(void) {
#if HAVE_AMX_BF16
    return amx_permitted() ? AMX_MIN_ROWS : 0;
#else
    return 0;
#endif
}

/* y = x W^T (+ bias): 0, or 1 for what it does not take (K not a multiple of its step, no kernel). */
int small_m_linear(const void *x, int64_t M, const void *w, const void *bias, int64_t N, int64_t K, void *y,
                   int64_t dt) {
    if (M < 1 || (dt != LD_F32 && dt != LD_BF16 && dt != LD_F16) || K % (dt == LD_F32 ? 16 : 32)) return 1;
    if (!(small_m_available() & (dt == LD_F32 ? 1 : dt == LD_BF16 ? 2 : 8))) return 1;
    gemm(x, M, w, bias, N, K, y, (int)dt);
    return 0;
}
#endif
