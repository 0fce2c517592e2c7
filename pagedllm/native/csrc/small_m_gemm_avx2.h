/* small_m_gemm.c's tiles on CPUs with AVX2 + FMA but no AVX-512: 8-lane float32 FMAs, bf16 and
 * float16 (F16C) widened to float32. Included by small_m_gemm.c in place of small_m_gemm_avx512.h. */

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
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)pf + (r * K + k) * es, _MM_HINT_T1);
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
 * each tile of x rows taking its share of the steps as in the AVX-512 kernel, into L2 as there
 * (small_m_gemm.c says why). */
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
