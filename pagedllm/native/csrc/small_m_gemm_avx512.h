/* small_m_gemm.c's tiles on CPUs with AVX-512F and AVX512BW: float32 FMAs, bf16 dot products
 * where the CPU has AVX-512 BF16, and float16 widened to float32 (vcvtph2ps) where it has F16C.
 * Included by small_m_gemm.c; small_m_gemm_avx2.h is the AVX2 + FMA form of the same tile
 * functions. */

/* 16 float32 lanes rounded to nearest even in dt's 16-bit type (bf16, or float16 where the build
 * has F16C), as st does one value. */
static inline __attribute__((always_inline)) __m256i half16_from_f32(__m512 v, int dt) {
#if HAVE_AVX512_F16
    if (dt == LD_F16) return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    (void)dt;
    return bf16x16_from_f32(v);
}

/* y rows m0 .. m0 + 3, columns n0 .. n0 + 3 from the sums of a whole tile's accumulators
 * (acc[m][r] for x row m0 + m and W row n0 + r), the bias added in float32, stored in dtype dt
 * (16-bit results rounded to nearest even, as st does). */
static inline __attribute__((always_inline)) void store_tile(const __m512 acc[4][4], int64_t m0, int64_t n0, int64_t N,
                                                            const void *bias, void *y, int dt) {
    __m512 v = lane_sums16(&acc[0][0]);
    if (bias != NULL) {
        const __m128i b16 = _mm_loadl_epi64((const __m128i *)((const uint16_t *)bias + n0));
        const __m128 b = dt == LD_F32   ? _mm_loadu_ps((const float *)bias + n0)
#if HAVE_AVX512_F16
                         : dt == LD_F16 ? _mm_cvtph_ps(b16)
#endif
                                        : _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(b16), 16));
        v = _mm512_add_ps(v, _mm512_broadcast_f32x4(b));
    }
    if (dt == LD_F32) {
        for (int m = 0; m < 4; m++)
            _mm_storeu_ps((float *)y + (m0 + m) * N + n0, _mm512_extractf32x4_ps(v, m));
        return;
    }
    const __m256i h = half16_from_f32(v, dt);
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
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(pf + r * K + k), _MM_HINT_T1);
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
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(pf + r * K + k), _MM_HINT_T1);
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

#if HAVE_AVX512_F16
/* The float16 tile: x float32 (widened by the caller, once per GEMM), each W block's 32 float16
 * values per step of K widened to float32 in registers (vcvtph2ps, exact) and multiplied by float32
 * FMAs into the same 16 accumulators as the float32 tile, so lane j sums the products at k = j
 * (mod 16) in order of k. float16 products summed in float16 (AVX-512 FP16's vfmadd*ph) would
 * lose bits at every step; this keeps float32 accumulation, like torch's float16 GEMMs. K % 32 ==
 * 0 (the callers check); pf, pf_phase and pf_every as for the float32 tile, one 64-byte line of
 * each W row per step. */
static inline __attribute__((always_inline)) void gemm_tile_f16(const float *x, int64_t m0, int64_t mr, const uint16_t *w,
                                                               int64_t n0, int64_t nr, int64_t N, int64_t K,
                                                               const uint16_t *bias, uint16_t *y, const uint16_t *pf,
                                                               int64_t pf_phase, int64_t pf_every) {
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512 wlo[NR], whi[NR];
        for (int r = 0; r < NR; r++) {
            const __m512i v = _mm512_loadu_si512((const void *)(w + (n0 + (r < nr ? r : 0)) * K + k));
            wlo[r] = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
            whi[r] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
        }
        if (pf != NULL && pf_phase-- == 0) {
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(pf + r * K + k), _MM_HINT_T1);
            pf_phase = pf_every - 1;
        }
        for (int64_t m = 0; m < mr; m++) {
            const __m512 xlo = _mm512_loadu_ps(x + (m0 + m) * K + k);
            for (int r = 0; r < NR; r++) acc[m][r] = _mm512_fmadd_ps(xlo, wlo[r], acc[m][r]);
            const __m512 xhi = _mm512_loadu_ps(x + (m0 + m) * K + k + 16);
            for (int r = 0; r < NR; r++) acc[m][r] = _mm512_fmadd_ps(xhi, whi[r], acc[m][r]);
        }
    }
    if (mr == MR && nr == NR) {
        store_tile((const __m512(*)[NR])acc, m0, n0, N, bias, y, LD_F16);
        return;
    }
    for (int64_t m = 0; m < mr; m++)
        for (int64_t r = 0; r < nr; r++) {
            float s = lane_sum(acc[m][r]);
            if (bias) s += ld(bias, n0 + r, LD_F16);
            st(y, (m0 + m) * N + n0 + r, s, LD_F16);
        }
}
#endif

/* One row of x (a single decode stream): y[n] for W rows n_lo .. n_hi - 1, read one W row after
 * another, each row's dot product its own accumulator over K in the order of k, as the tiles' acc[m][r]
 * (the same instructions in the same order, so a row of x gets the bits it gets in a batch). A
 * block of 16 W rows is read front to back, one sequential stream, where a tile reads 4 rows side by
 * side; with short rows the one stream comes from memory faster (Zen 4 class, 2 threads, bf16 W on
 * huge pages, GB/s tiles -> rows: K = 640, 262,144 rows, 26.5 -> 32.4; K = 1536 37.2 -> 39.4; K = 2048
 * 36.7 -> 38.8; software prefetches ahead of the stream were slower, as were two rows interleaved).
 * The out-of-order core overlaps one row's chain of sums with the next rows' loads; small_m_gemm.c's
 * ROW1_MAX_K bounds the rows read this way.
 * The 16 sums of a whole block are one lane_sums16 and one store. x is float32 for float16 W
 * (widened by the caller), dt's own type otherwise. */
static inline __attribute__((always_inline)) __m512 row_dot(const void *x, const void *wr, int64_t K, int dt) {
    __m512 a = _mm512_setzero_ps();
#if HAVE_AVX512_BF16
    if (dt == LD_BF16) {
        for (int64_t k = 0; k < K; k += 32)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const uint16_t *)x + k),
                                 (__m512bh)_mm512_loadu_si512((const uint16_t *)wr + k));
        return a;
    }
#endif
#if HAVE_AVX512_F16
    if (dt == LD_F16) {
        for (int64_t k = 0; k < K; k += 32) {
            const __m512i v = _mm512_loadu_si512((const uint16_t *)wr + k);
            a = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)x + k), _mm512_cvtph_ps(_mm512_castsi512_si256(v)), a);
            a = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)x + k + 16),
                                _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)), a);
        }
        return a;
    }
#endif
    for (int64_t k = 0; k < K; k += 16)
        a = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)x + k), _mm512_loadu_ps((const float *)wr + k), a);
    return a;
}

static inline __attribute__((always_inline)) void gemm_row1_dt(const void *x, const void *w, const void *bias, int64_t K,
                                                              void *y, int dt, int64_t n_lo, int64_t n_hi) {
    const int64_t es = dt == LD_F32 ? 4 : 2;
    int64_t n0 = n_lo;
    for (; n0 + 16 <= n_hi; n0 += 16) {
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = row_dot(x, (const char *)w + (n0 + r) * K * es, K, dt);
        __m512 v = lane_sums16(acc);
        if (bias != NULL) {
            const __m256i b16 = _mm256_loadu_si256((const __m256i *)((const uint16_t *)bias + n0));
            v = _mm512_add_ps(v, dt == LD_F32   ? _mm512_loadu_ps((const float *)bias + n0)
#if HAVE_AVX512_F16
                                 : dt == LD_F16 ? _mm512_cvtph_ps(b16)
#endif
                                                : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b16), 16)));
        }
        if (dt == LD_F32)
            _mm512_storeu_ps((float *)y + n0, v);
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + n0), half16_from_f32(v, dt));
    }
    for (; n0 < n_hi; n0++) {
        float s = lane_sum(row_dot(x, (const char *)w + n0 * K * es, K, dt));
        if (bias != NULL) s += ld(bias, n0, dt);
        st(y, n0, s, dt);
    }
}

/* gemm_row1_dt with dt a constant in each branch; 1 where this build has no kernel for dt. */
static int gemm_row1(const void *x, const void *w, const void *bias, int64_t K, void *y, int dt, int64_t n_lo,
                     int64_t n_hi) {
    if (dt == LD_F32) {
        gemm_row1_dt(x, w, bias, K, y, LD_F32, n_lo, n_hi);
        return 0;
    }
#if HAVE_AVX512_BF16
    if (dt == LD_BF16) {
        gemm_row1_dt(x, w, bias, K, y, LD_BF16, n_lo, n_hi);
        return 0;
    }
#endif
#if HAVE_AVX512_F16
    if (dt == LD_F16) {
        gemm_row1_dt(x, w, bias, K, y, LD_F16, n_lo, n_hi);
        return 0;
    }
#endif
    return 1;
}
