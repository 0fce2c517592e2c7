/*
 * y[M, N] = x[M, K] W[N, K]^T (+ bias) for a few rows of x (decode steps), in float32 or bfloat16,
 * accumulating in float32; bf16 results are rounded once at the end, as torch's bf16 GEMMs do.
 *
 * A decode GEMM is a pass over W. Four W rows at a time are loaded once per 16 (float32) or 32
 * (bf16) columns and serve up to four x rows from 16 register accumulators (bf16 through AVX-512
 * BF16 dot products, vdpbf16ps: 32 products into 16 float32 lanes per instruction); further rows
 * reuse the same W block from L1. While the first rows of x run over a W block, the next block's
 * lines are prefetched, one per W row per step of K: with more than a row or two of x the tile's
 * arithmetic otherwise hides too few of its loads from the hardware prefetcher, and the pass over
 * W falls well below the memory's rate (bf16, 8 rows, this model's 30 layers streamed from
 * memory: 11.6 ms without, 6.5 ms with; 16 rows 14.0 -> 8.2 ms; 1 row 5.8 -> 5.6 ms). W row blocks
 * are split between the OpenMP threads; small GEMMs run on one thread (waking the team costs more
 * than reading a few hundred KB).
 *
 * Layouts: x [M, K], w [N, K], bias [N] or NULL, y [M, N], all of element type dt (0 float32,
 * 1 bf16 as uint16); K % 16 == 0 for float32, K % 32 == 0 for bf16. Also included by the fused
 * decode step (pagedllm/worker/csrc/llama_decode.c).
 */
#ifndef PAGEDLLM_SMALL_M_GEMM_C
#define PAGEDLLM_SMALL_M_GEMM_C
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "../../attention/csrc/bf16.h"

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

#define NR 4
#define MR 4
/* GEMMs with fewer weight elements than this run on one thread. */
#define GEMM_PARALLEL_MIN (1 << 16)

enum { LD_F32 = 0, LD_BF16 = 1 };

static inline float ld(const void *p, int64_t i, int dt) {
    return dt == LD_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void st(void *p, int64_t i, float v, int dt) {
    if (dt == LD_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = f32_to_bf16(v);
}

#if HAVE_AVX512
/* Rows n0 .. n0 + nr - 1 of y for x rows m0 .. m0 + mr - 1 (mr <= MR, nr <= NR); K % 16 == 0 for
 * float32, K % 32 == 0 for bf16 (the callers check). pf: the next W block's first row (NR rows of
 * K), prefetched line by line as this one is read, or NULL. */
static inline __attribute__((always_inline)) void gemm_tile_f32(const float *x, int64_t m0, int64_t mr, const float *w, int64_t n0, int64_t nr,
                                 int64_t N, int64_t K, const float *bias, float *y, const float *pf) {
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = _mm512_loadu_ps(w + (n0 + (r < nr ? r : 0)) * K + k);
        if (pf != NULL)
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(pf + r * K + k), _MM_HINT_T0);
        for (int64_t m = 0; m < mr; m++) {
            const __m512 xv = _mm512_loadu_ps(x + (m0 + m) * K + k);
            for (int r = 0; r < NR; r++) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
        }
    }
    for (int64_t m = 0; m < mr; m++)
        for (int64_t r = 0; r < nr; r++)
            y[(m0 + m) * N + n0 + r] = _mm512_reduce_add_ps(acc[m][r]) + (bias ? bias[n0 + r] : 0.0f);
}
#endif

#if HAVE_AVX512_BF16
static inline __attribute__((always_inline)) void gemm_tile_bf16(const uint16_t *x, int64_t m0, int64_t mr, const uint16_t *w, int64_t n0,
                                  int64_t nr, int64_t N, int64_t K, const uint16_t *bias, uint16_t *y,
                                  const uint16_t *pf) {
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = (__m512bh)_mm512_loadu_si512((const void *)(w + (n0 + (r < nr ? r : 0)) * K + k));
        if (pf != NULL)
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(pf + r * K + k), _MM_HINT_T0);
        for (int64_t m = 0; m < mr; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + m) * K + k));
            for (int r = 0; r < NR; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
    for (int64_t m = 0; m < mr; m++)
        for (int64_t r = 0; r < nr; r++) {
            float s = _mm512_reduce_add_ps(acc[m][r]);
            if (bias) s += bf16_to_f32(bias[n0 + r]);
            y[(m0 + m) * N + n0 + r] = f32_to_bf16(s);
        }
}
#endif

/* Rows [n_lo, n_hi) of y[M, N] = x[M, K] W[N, K]^T (+ bias), in dtype dt, on the calling thread.
 * Each element of y is its own dot product with the same order of sums whatever the row range, so
 * a GEMM split into row ranges gives the bits of the whole one. */
static void gemm_rows(const void *x, int64_t M, const void *w, const void *bias, int64_t N, int64_t K, void *y, int dt,
                      int64_t n_lo, int64_t n_hi) {
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR) {
        const int64_t nr = n_hi - n0 < NR ? n_hi - n0 : NR;
        /* The next block of this range: a whole one (a short last block is not prefetched). */
        const int64_t next = n0 + NR + NR <= n_hi ? n0 + NR : -1;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t mr = M - m0 < MR ? M - m0 : MR;
            const int64_t pf = m0 == 0 ? next : -1; /* later rows find this block in L1 */
/* A constant row count per call site, so that the accumulators stay in registers. */
#define TILE(fn, T, MR_)                                                                                   \
    fn((const T *)x, m0, MR_, (const T *)w, n0, nr, N, K, (const T *)bias, (T *)y,                       \
       pf < 0 ? NULL : (const T *)w + pf * K)
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
#if HAVE_AVX512
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

/* Bit 0: the float32 kernel is built (AVX-512); bit 1: the bf16 one (AVX-512 BF16). */
int small_m_available(void) { return (HAVE_AVX512 ? 1 : 0) | (HAVE_AVX512_BF16 ? 2 : 0); }

/* y = x W^T (+ bias): 0, or 1 for what it does not take (K not a multiple of its step, no kernel). */
int small_m_linear(const void *x, int64_t M, const void *w, const void *bias, int64_t N, int64_t K, void *y,
                   int64_t dt) {
    if (M < 1 || (dt != LD_F32 && dt != LD_BF16) || K % (dt == LD_F32 ? 16 : 32)) return 1;
    if (!(small_m_available() & (dt == LD_F32 ? 1 : 2))) return 1;
    gemm(x, M, w, bias, N, K, y, (int)dt);
    return 0;
}
#endif
