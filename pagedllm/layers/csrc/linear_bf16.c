/*
 * y = x W^T (+ b) in bfloat16 for a few rows of x (decode steps), with AVX-512 BF16 dot products
 * (vdpbf16ps: 32 bf16 products accumulated into 16 fp32 lanes per instruction), fp32 accumulation
 * and one rounding to bf16 at the end, as torch's bf16 GEMMs do.
 *
 * A decode GEMM is a pass over W: each W row block is loaded once and serves all M rows of x.
 * Four W rows at a time, up to four x rows: 16 accumulators stay in registers. Small layers run on
 * one thread (waking the team costs more than reading a few hundred KB).
 *
 * Layouts: x [M, K], w [N, K], bias [N] or NULL, y [M, N], all bf16 as uint16; K % 32 == 0.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "../../attention/csrc/bf16.h"

#define MAXM 4
#define NR 4
#define PARALLEL_MIN_ELEMS (1 << 20)

int linear_bf16_small_m(const uint16_t *x, int64_t M, const uint16_t *w, int64_t N, int64_t K,
                        const uint16_t *bias, uint16_t *y) {
    if (M < 1 || M > MAXM || K % 32 != 0) return 1;
    const int64_t nblocks = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_ELEMS)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NR;
        const int64_t nr = N - n0 < NR ? N - n0 : NR;
        __m512 acc[MAXM][NR];
        for (int m = 0; m < MAXM; m++)
            for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __m512bh wv[NR];
            for (int r = 0; r < NR; r++)
                wv[r] = (__m512bh)_mm512_loadu_si512((const void *)(w + (n0 + (r < nr ? r : 0)) * K + k));
            for (int64_t m = 0; m < M; m++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k));
                for (int r = 0; r < NR; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int64_t r = 0; r < nr; r++) {
                float s = _mm512_reduce_add_ps(acc[m][r]);
                if (bias) s += bf16_to_f32(bias[n0 + r]);
                y[m * N + n0 + r] = f32_to_bf16(s);
            }
    }
    return 0;
}
#endif
