/* lora.c's block kernels in 16-lane form (AVX-512F): the shrink on bf16 dot products where rows
 * and A are bf16 and the CPU has AVX-512 BF16 (else float32 FMAs), the expand 32 columns at a time
 * then 16 under a mask, for 4 rows at once where a block has up to 4, else 8 (each load of B^T
 * serves all of them). Layers with K a multiple of 16 only (lora_blocks_take). Included by
 * lora.c where the build has AVX-512F (in place of lora_avx2.h). */
#define LORA_RB 8 /* rows of one slot handled together */
#define LORA_AVX512 1

/* Whether the block kernels take a layer of K inputs (lora_load_rows reads rows 16 at a time). */
static inline int lora_blocks_take(int64_t K) { return K % 16 == 0; }

/* 16 values from i (lanes outside mask k read as zero), widened to float32. */
static inline __m512 lora_ld16(const void *p, int dt, int64_t i, __mmask16 k) {
    if (dt)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(k, (const float *)p + i);
}

/* y[i:i+16] += v on the lanes of mask k, rounded to y's dtype. */
static inline void lora_add16(void *y, int dt, int64_t i, __m512 v, __mmask16 k) {
    if (dt) {
        uint16_t *yb = (uint16_t *)y + i;
        const __m512 s = _mm512_add_ps(lora_ld16(yb, 1, 0, k), v);
        _mm256_mask_storeu_epi16(yb, k, bf16x16_from_f32(s));
    } else {
        float *yf = (float *)y + i;
        _mm512_mask_storeu_ps(yf, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, yf), v));
    }
}

/* xf [LORA_RB][K] float32: the block's nb rows of x (rows ldx apart; K a multiple of 16), zeros past nb. */
static void lora_load_rows(const void *x, int64_t ldx, int x_dt, const int64_t *rows, int nb, int64_t K, float *xf) {
    const size_t xs = x_dt ? 2 : 4;
    for (int r = 0; r < LORA_RB; r++) {
        float *xr = xf + r * K;
        if (r >= nb) {
            memset(xr, 0, (size_t)K * sizeof(float));
            continue;
        }
        const char *xt = (const char *)x + (size_t)(rows[r] * ldx) * xs;
        for (int64_t i = 0; i < K; i += 16) _mm512_storeu_ps(xr + i, lora_ld16(xt, x_dt, i, 0xffff));
    }
}

#if defined(__AVX512BF16__)
#define LORA_DPBF16 1
/* h [4][n] = x A_s^T for 4 bf16 rows x (xr: 4 row pointers; rows past the block's may repeat one
 * of them, their h is not used) and the slot's bf16 A (as, [n, K], K a multiple of 32):
 * vdpbf16ps on pairs of inputs (the products exact in float32), 4 rows by 4 outputs at a time,
 * the 16 accumulators' lanes summed by lane_sums16 (lane_sum's pairing). */
static void lora_block_shrink_bf16(const uint16_t *const *xr, const uint16_t *as, int64_t n, int64_t K, float *h) {
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        __m512 acc[16];
        for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
        const uint16_t *a0 = as + k * K;
        for (int64_t i = 0; i < K; i += 32) {
            __m512bh av[4];
            for (int q = 0; q < 4; q++) av[q] = (__m512bh)_mm512_loadu_si512((const void *)(a0 + q * K + i));
            for (int r = 0; r < 4; r++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xr[r] + i));
                for (int q = 0; q < 4; q++) acc[r * 4 + q] = _mm512_dpbf16_ps(acc[r * 4 + q], xv, av[q]);
            }
        }
        float sums[16];
        _mm512_storeu_ps(sums, lane_sums16(acc));
        for (int r = 0; r < 4; r++)
            for (int q = 0; q < 4; q++) h[r * n + k + q] = sums[r * 4 + q];
    }
    for (; k < n; k++) {
        __m512 acc[4];
        for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < K; i += 32) {
            const __m512bh av = (__m512bh)_mm512_loadu_si512((const void *)(as + k * K + i));
            for (int r = 0; r < 4; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512((const void *)(xr[r] + i)), av);
        }
        for (int r = 0; r < 4; r++) h[r * n + k] = lane_sum(acc[r]);
    }
}
#endif

/* Whether lora_block_shrink_bf16 takes this layer: bf16 rows and A, K a multiple of 32. */
static inline int lora_bf16_shrink(int x_dt, int w_dt, int64_t K) {
#if defined(LORA_DPBF16)
    return x_dt == 1 && w_dt == 1 && K % 32 == 0;
#else
    (void)x_dt, (void)w_dt, (void)K;
    return 0;
#endif
}

/* h [LORA_RB][n] of the block's rows (order[0:nb] of x, rows ldx apart) for the slot's A (as,
 * [n, K]): the bf16 dot products where lora_bf16_shrink, else float32 FMAs on the rows widened
 * into xf [LORA_RB][K]. */
static void lora_block_h(const void *x, int64_t ldx, int x_dt, const int64_t *order, int nb, const char *as, int w_dt,
                         int64_t n, int64_t K, float *xf, float *h);

/* h [rows][n] = xf A_s^T for the slot's A (as, [n, K]); rows 4 or 8 (a constant where inlined). */
static inline __attribute__((always_inline)) void lora_shrink_rows(const float *xf, const char *as, int w_dt, int64_t n,
                                                                   int64_t K, float *h, const int rows) {
    const size_t es = w_dt ? 2 : 4;
    for (int64_t k = 0; k < n; k++) {
        const char *ak = as + (size_t)(k * K) * es;
        __m512 acc[LORA_RB];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < K; i += 16) {
            const __m512 av = lora_ld16(ak, w_dt, i, 0xffff);
            for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + r * K + i), av, acc[r]);
        }
        for (int r = 0; r < rows; r++) h[r * n + k] = lane_sum(acc[r]);
    }
}

/* h [LORA_RB][n] = xf A_s^T for the nb rows of a block (rows past nb: up to 4, or 8). */
static void lora_block_shrink(const float *xf, int nb, const char *as, int w_dt, int64_t n, int64_t K, float *h) {
    if (nb <= 4)
        lora_shrink_rows(xf, as, w_dt, n, K, h, 4);
    else
        lora_shrink_rows(xf, as, w_dt, n, K, h, LORA_RB);
}

static void lora_block_h(const void *x, int64_t ldx, int x_dt, const int64_t *order, int nb, const char *as, int w_dt,
                         int64_t n, int64_t K, float *xf, float *h) {
#if defined(LORA_DPBF16)
    if (lora_bf16_shrink(x_dt, w_dt, K)) { /* 4 rows at a time (the last 4 repeat a row of theirs past nb) */
        for (int g = 0; g < nb; g += 4) {
            const uint16_t *xr[4];
            for (int r = 0; r < 4; r++) xr[r] = (const uint16_t *)x + order[g + r < nb ? g + r : g] * ldx;
            lora_block_shrink_bf16(xr, (const uint16_t *)as, n, K, h + g * n);
        }
        return;
    }
#endif
    lora_load_rows(x, ldx, x_dt, order, nb, K, xf);
    lora_block_shrink(xf, nb, as, w_dt, n, K, h);
}

/* The even lanes (w << 16) and odd lanes (w & 0xffff0000) of 32 bf16 values as float32: lanes i of
 * the two vectors hold values 2i and 2i + 1, exactly. */
static inline __m512 lora_even(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
static inline __m512 lora_odd(__m512i w) {
    return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
}

/* y[o:o+32] += the columns held in even / odd order (ce: columns o + 2i, co: o + 2i + 1), each
 * rounded to y's dtype as lora_add16 rounds it. */
static inline void lora_add32_split(void *y, int dt, int64_t o, __m512 ce, __m512 co) {
    if (dt) {
        uint16_t *yb = (uint16_t *)y + o;
        const __m512i w = _mm512_loadu_si512((const void *)yb);
        const __m512i e = _mm512_castps_si512(round_bf16(_mm512_add_ps(lora_even(w), ce)));
        const __m512i d = _mm512_castps_si512(round_bf16(_mm512_add_ps(lora_odd(w), co)));
        _mm512_storeu_si512((void *)yb, _mm512_or_si512(_mm512_srli_epi32(e, 16),
                                                        _mm512_and_si512(d, _mm512_set1_epi32((int)0xffff0000u))));
    } else {
        const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        lora_add16(y, 0, o, _mm512_permutex2var_ps(ce, lo, co), 0xffff);
        lora_add16(y, 0, o + 16, _mm512_permutex2var_ps(ce, hi, co), 0xffff);
    }
}

/* lora_block_expand for `rows` rows at once (4 or 8, a constant where inlined), nb of them stored. */
static inline __attribute__((always_inline)) void lora_expand_rows(const float *h, int nb, const char *bs, int w_dt,
                                                                   int64_t num_slices, int64_t R, const int64_t *ranges,
                                                                   int64_t N, int64_t lo, int64_t hi, char *const *yt,
                                                                   int y_dt, const int rows) {
    const size_t es = w_dt ? 2 : 4;
    const int64_t n = num_slices * R;
    for (int64_t j = 0; j < num_slices; j++) {
        const int64_t a = ranges[2 * j] > lo ? ranges[2 * j] : lo, b = ranges[2 * j + 1] < hi ? ranges[2 * j + 1] : hi;
        const char *bj = bs + (size_t)(j * R * N) * es;
        const float *hj = h + j * R;
        int64_t o = a;
        if (w_dt) /* bf16 B^T: 32 columns from one load, split into even and odd columns (no widening) */
            for (; o + 32 <= b; o += 32) {
                __m512 ce[LORA_RB], co[LORA_RB];
                for (int r = 0; r < rows; r++) ce[r] = co[r] = _mm512_setzero_ps();
                for (int64_t k = 0; k < R; k++) {
                    const __m512i w = _mm512_loadu_si512((const void *)((const uint16_t *)bj + k * N + o));
                    const __m512 be = lora_even(w), bo = lora_odd(w);
                    for (int r = 0; r < rows; r++) {
                        const __m512 hv = _mm512_set1_ps(hj[r * n + k]);
                        ce[r] = _mm512_fmadd_ps(hv, be, ce[r]);
                        co[r] = _mm512_fmadd_ps(hv, bo, co[r]);
                    }
                }
                for (int r = 0; r < nb; r++) lora_add32_split(yt[r], y_dt, o, ce[r], co[r]);
            }
        for (; o + 32 <= b; o += 32) {
            __m512 c0[LORA_RB], c1[LORA_RB];
            for (int r = 0; r < rows; r++) c0[r] = c1[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < R; k++) {
                const char *row = bj + (size_t)(k * N) * es;
                const __m512 b0 = lora_ld16(row, w_dt, o, 0xffff), b1 = lora_ld16(row, w_dt, o + 16, 0xffff);
                for (int r = 0; r < rows; r++) {
                    const __m512 hv = _mm512_set1_ps(hj[r * n + k]);
                    c0[r] = _mm512_fmadd_ps(hv, b0, c0[r]);
                    c1[r] = _mm512_fmadd_ps(hv, b1, c1[r]);
                }
            }
            for (int r = 0; r < nb; r++) {
                lora_add16(yt[r], y_dt, o, c0[r], 0xffff);
                lora_add16(yt[r], y_dt, o + 16, c1[r], 0xffff);
            }
        }
        for (; o < b; o += 16) {
            const __mmask16 km = b - o >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (b - o)) - 1u);
            __m512 c0[LORA_RB];
            for (int r = 0; r < rows; r++) c0[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < R; k++) {
                const __m512 b0 = lora_ld16(bj + (size_t)(k * N) * es, w_dt, o, km);
                for (int r = 0; r < rows; r++) c0[r] = _mm512_fmadd_ps(_mm512_set1_ps(hj[r * n + k]), b0, c0[r]);
            }
            for (int r = 0; r < nb; r++) lora_add16(yt[r], y_dt, o, c0[r], km);
        }
    }
}

/* yt[r][o] += sum over k of h[r][j R + k] B_s^T[j R + k][o], for the nb rows of the block and
 * the columns o of each slice j within [lo, hi): one FMA chain per column, 32 columns at a time,
 * then 16 under a mask (a column's value does not depend on which call or chunk covers it, nor on
 * how many rows go together). */
static void lora_block_expand(const float *h, int nb, const char *bs, int w_dt, int64_t num_slices, int64_t R,
                              const int64_t *ranges, int64_t N, int64_t lo, int64_t hi, char *const *yt, int y_dt) {
    if (nb <= 4)
        lora_expand_rows(h, nb, bs, w_dt, num_slices, R, ranges, N, lo, hi, yt, y_dt, 4);
    else
        lora_expand_rows(h, nb, bs, w_dt, num_slices, R, ranges, N, lo, hi, yt, y_dt, LORA_RB);
}
