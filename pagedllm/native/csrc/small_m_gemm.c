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
 * Both forms prefetch into L2 (_MM_HINT_T1), not L1. At K = 2048 a block of 4 bf16 W rows is
 * 16 KB (32 KB in float32, and the AVX2 form's float32 panel of a 16-bit block is 32 KB too), so the
 * block being read and the one prefetched into L1 filled a 32 KB L1; the default model's K of
 * 576-1536 gains as well, so prefetches into L1 cost more than that eviction alone (Zen 4 class, 2
 * threads, alternating rounds of `pagedllm bench latency` in one sitting, one stream, L1 -> L2: the
 * Llama-3.2-1B shape in bf16 93.1 / 88.2 -> 60.0 / 77.1 ms a token, its one-row GEMMs alone 90-99 ->
 * 78-85 ms, in float32 156.2 / 154.7 -> 147.9 / 141.7 ms; the default model in bf16 15.0 / 15.2 ->
 * 10.7 / 11.9 ms. The AVX2 form built on the same host with AVX-512 off, the 1B shape's GEMMs: bf16
 * 84.3 -> 72.3 ms one row, 254.8 -> 225.3 ms 8 rows; float32 160.4 -> 144.9 ms one row;
 * docs/perf-history.md, round 8). Results are the same bits either way.
 * A single row of x (one stream's decode step) with W rows of at most ROW1_MAX_K reads W row after
 * row instead on AMD CPUs (gemm_row1 in the AVX-512 form, row1_reads): one sequential stream per
 * thread, which short rows get from memory faster there than 4 streams side by side (on Intel's the
 * reverse), with each row's sums in the tiles' order.
 * W row blocks are split between the OpenMP threads; small GEMMs run on one thread (waking the
 * team costs more than reading a few hundred KB). CPUs without AVX-512 but with AVX2 and FMA get
 * the kernel in 8-lane vectors (gemm_tile_avx2), bf16 and (with F16C) float16 widened to float32
 * in registers; CPUs with AVX-512 but not its BF16 dot products have no bf16 kernel. float16 in
 * AVX-512 builds is widened too (gemm_tile_f16: x once per GEMM, W in registers by vcvtph2ps,
 * float32 FMAs); AVX-512 FP16's float16 FMAs would sum in float16. On CPUs with AMX-BF16, bf16 GEMMs of 2 rows or more run on AMX tiles
 * instead (gemm_rows_amx; a caller can raise that for a while: small_m_amx_from): 16 W rows x 32
 * columns of K as the first operand straight from W, x packed once per call as the second, 2 x 2
 * tiles of 16 x 16 float32 sums.
 *
 * Layouts: x [M, K], w [N, K], bias [N] or NULL, y [M, N], all of element type dt (0 float32,
 * 1 bf16 as uint16, 2 float16 as uint16); K % 16 == 0 for float32, K % 32 == 0 for bf16 and
 * float16. Also included by the fused decode step (llama_decode.c).
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
/* float16 in the AVX-512 form (every AVX-512 CPU has F16C): widened by vcvtph2ps, float32 FMAs. */
#if HAVE_AVX512 && defined(__F16C__)
#define HAVE_AVX512_F16 1
#else
#define HAVE_AVX512_F16 0
#endif
#define HAVE_F16 (HAVE_AVX2_F16 || HAVE_AVX512_F16)

/* AMX (Sapphire Rapids and later Xeons): bf16 GEMMs of AMX_MIN_ROWS rows or more run on the tile
 * unit (gemm_rows_amx), which multiplies 16 x 32 bf16 blocks at several times the rate of AVX-512
 * BF16 dot products. */
#include "amx.h"

#define NR 4
#define MR 4
_Static_assert(MR * NR == 16, "a whole tile's sums are one lane_sums16");
/* A single row of x reads W row after row (gemm_row1, AVX-512 builds) where W rows are at most this
 * long. With longer rows the tiles were faster: one row's chain of sums then spans more of the
 * core's out-of-order window than the next rows can overlap (Zen 4 class, 2 threads, one row, GB/s
 * tiles -> row by row: float16 K = 4096 34.5 -> 29.7, K = 8192 54.8 -> 24.7; float32 K = 4096 31.3
 * -> 27.1; bf16 level from K = 4096). Either gives the same bits. */
#define ROW1_MAX_K 2048
/* Whether a single row of x reads W row after row (gemm_row1) in this library: by default on AMD
 * CPUs only. On the 2-core Xeon with AMX (AVX-512 BF16 rows) the tiles' four rows side by side read
 * W faster than one row after the other (the default model, one stream, bf16: 13.9 against 19.2 ms
 * a token; docs/perf-history.md, round 10), the reverse of the Zen 4 class host. Both give the same
 * bits. Set when the library loads; small_m_row1 changes it. */
static int row1_reads;

__attribute__((constructor)) static void row1_default(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    row1_reads = __builtin_cpu_is("amd") ? 1 : 0;
#endif
}

/* GEMMs with fewer weight elements than this run on one thread. */
#define GEMM_PARALLEL_MIN (1 << 16)

/* Element types: float32, bf16, float16 (the last where the build has F16C: HAVE_F16). */
enum { LD_F32 = 0, LD_BF16 = 1, LD_F16 = 2 };

static inline float ld(const void *p, int64_t i, int dt) {
#if HAVE_F16
    if (dt == LD_F16) return _cvtsh_ss(((const uint16_t *)p)[i]);
#endif
    return dt == LD_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void st(void *p, int64_t i, float v, int dt) {
#if HAVE_F16
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
#include "small_m_gemm_avx512.h"
#elif HAVE_AVX2_F32
#include "small_m_gemm_avx2.h"
#endif

#if HAVE_AMX_BF16
#include "small_m_gemm_amx.h"
#endif

/* Rows [n_lo, n_hi) of y[M, N] = x[M, K] W[N, K]^T (+ bias), in dtype dt, on the calling thread.
 * Each element of y is its own dot product with the same order of sums whatever the row range, so
 * a GEMM split into row ranges gives the bits of the whole one. */
static void gemm_rows(const void *x, int64_t M, const void *w, const void *bias, int64_t N, int64_t K, void *y, int dt,
                      int64_t n_lo, int64_t n_hi) {
#if HAVE_AMX_BF16
    if (dt == LD_BF16 && M >= amx_from_rows && amx_permitted() &&
        gemm_rows_amx((const uint16_t *)x, M, (const uint16_t *)w, (const uint16_t *)bias, N, K, (uint16_t *)y, n_lo,
                      n_hi) == 0)
        return;
#endif
    const int64_t tiles = (M + MR - 1) / MR;
#if HAVE_AVX512_F16
    /* float16 on AVX-512: x widened once (where the buffer cannot be had, the scalar loop below). */
    float *xf = NULL;
    if (dt == LD_F16 && n_lo < n_hi) {
        xf = aligned_alloc(64, (size_t)((M * K * 4 + 63) / 64 * 64));
        if (xf != NULL)
            for (int64_t i = 0; i < M * K; i += 16)
                _mm512_store_ps(xf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))));
    }
    if (M == 1 && K <= ROW1_MAX_K && row1_reads && (dt != LD_F16 || xf != NULL) && gemm_row1(dt == LD_F16 ? xf : x, w, bias, K, y, dt, n_lo, n_hi) == 0) {
        free(xf);
        return;
    }
#elif HAVE_AVX512
    if (M == 1 && K <= ROW1_MAX_K && row1_reads && gemm_row1(x, w, bias, K, y, dt, n_lo, n_hi) == 0) return;
#endif
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
#if HAVE_AVX512_F16
            if (dt == LD_F16 && xf != NULL) {
#define TILE_H(MR_)                                                                                        \
    gemm_tile_f16(xf, m0, MR_, (const uint16_t *)w, n0, nr, N, K, (const uint16_t *)bias, (uint16_t *)y,   \
                  next < 0 ? NULL : (const uint16_t *)w + next * K, m0 / MR, tiles)
                switch (mr) {
                case 1: TILE_H(1); break;
                case 2: TILE_H(2); break;
                case 3: TILE_H(3); break;
                default: TILE_H(4); break;
                }
#undef TILE_H
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
#elif HAVE_AVX512_F16
    free(xf);
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
 * float16 one (AVX-512 or AVX2 + FMA, with F16C; widening to float32 in both); bit 4: the float16
 * one is the AVX-512 form. */
int small_m_available(void) {
    return (HAVE_AVX512 || HAVE_AVX2_F32 ? 1 : 0) | (HAVE_AVX512_BF16 || HAVE_AVX2_F32 ? 2 : 0) |
           (HAVE_AVX2_F32 ? 4 : 0) | (HAVE_F16 ? 8 : 0) | (HAVE_AVX512_F16 ? 16 : 0);
}

/* The fewest rows of x a bf16 GEMM runs on AMX tiles with now (AMX_MIN_ROWS unless
 * small_m_amx_from set another); 0 where it never does (a build without AMX-BF16, or an OS that does
 * not lend this process the tile registers). */
int64_t small_m_amx_rows(void) {
#if HAVE_AMX_BF16
    return amx_permitted() ? amx_from_rows : 0;
#else
    return 0;
#endif
}

/* bf16 GEMMs of `rows` rows of x or more run on AMX tiles from now on (rows <= 0: AMX_MIN_ROWS, the
 * default), fewer in the AVX-512 BF16 form, each of whose rows gives the bits it gives alone. This
 * library's setting, for every later call. Returns small_m_amx_rows(). */
int64_t small_m_amx_from(int64_t rows) {
#if HAVE_AMX_BF16
    amx_from_rows = rows > 0 ? rows : AMX_MIN_ROWS;
#else
    (void)rows;
#endif
    return small_m_amx_rows();
}

/* Whether a single row of x reads W row after row (1) or in the tiles' 4-row blocks (0) from now on
 * (on < 0: leave it). Only AVX-512 builds have the row-after-row form; 0 elsewhere. Returns the
 * setting in force. */
int64_t small_m_row1(int64_t on) {
#if HAVE_AVX512
    if (on >= 0) row1_reads = on ? 1 : 0;
    return row1_reads;
#else
    (void)on;
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
