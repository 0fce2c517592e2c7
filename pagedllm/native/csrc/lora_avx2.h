/* lora.c's block kernels in 8-lane form (AVX2 + FMA, no AVX-512): bf16 widened to float32 by
 * shifting (bf16_avx2.h), the shrink on float32 FMAs 8 inputs at a time (the last K % 8 inputs
 * under a mask, so any K), the expand 16 columns at a time, then 8, then the last columns of a
 * range one 8-lane vector padded with zeros: each lane is the same FMA chain whatever the vector
 * holds, so a column's value does not depend on which call or chunk covers it. Included by lora.c
 * where the build has AVX2 and FMA but not AVX-512F (in place of lora_avx512.h). */
#define LORA_RB 4 /* rows of one slot handled together */

/* The block kernels take any K (the last K % 8 inputs are read under a mask). */
static inline int lora_blocks_take(int64_t K) {
    (void)K;
    return 1;
}

/* The first n (0 to 8) lanes set. */
static inline __m256i lora_mask8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 8 values from i, widened to float32. */
static inline __m256 lora_ld8(const void *p, int dt, int64_t i) {
    if (dt) return bf16x8_load((const uint16_t *)p + i);
    return _mm256_loadu_ps((const float *)p + i);
}

/* The n < 8 values from i in the first lanes (only they are read), zeros in the others. */
static inline __m256 lora_ld8_tail(const void *p, int dt, int64_t i, int64_t n) {
    if (dt) {
        uint16_t b[8] = {0};
        memcpy(b, (const uint16_t *)p + i, (size_t)n * 2);
        return bf16x8_load(b);
    }
    return _mm256_maskload_ps((const float *)p + i, lora_mask8(n));
}

/* y[i:i+8] += v, rounded to y's dtype. */
static inline void lora_add8(void *y, int dt, int64_t i, __m256 v) {
    if (dt) {
        uint16_t *yb = (uint16_t *)y + i;
        _mm_storeu_si128((__m128i *)yb, bf16x8_from_f32(_mm256_add_ps(bf16x8_load(yb), v)));
    } else {
        float *yf = (float *)y + i;
        _mm256_storeu_ps(yf, _mm256_add_ps(_mm256_loadu_ps(yf), v));
    }
}

/* y[i:i+n] += the first n < 8 lanes of v (the same sum and rounding as lora_add8's lanes). */
static inline void lora_add8_tail(void *y, int dt, int64_t i, __m256 v, int64_t n) {
    if (dt) {
        uint16_t b[8] = {0}, *yb = (uint16_t *)y + i;
        memcpy(b, yb, (size_t)n * 2);
        _mm_storeu_si128((__m128i *)b, bf16x8_from_f32(_mm256_add_ps(bf16x8_load(b), v)));
        memcpy(yb, b, (size_t)n * 2);
    } else {
        float *yf = (float *)y + i;
        const __m256i k = lora_mask8(n);
        _mm256_maskstore_ps(yf, k, _mm256_add_ps(_mm256_maskload_ps(yf, k), v));
    }
}

/* xf [LORA_RB][K] float32: the block's nb rows of x (rows ldx apart), zeros past nb. */
static void lora_load_rows(const void *x, int64_t ldx, int x_dt, const int64_t *rows, int nb, int64_t K, float *xf) {
    const size_t xs = x_dt ? 2 : 4;
    for (int r = 0; r < LORA_RB; r++) {
        float *xr = xf + r * K;
        if (r >= nb) {
            memset(xr, 0, (size_t)K * sizeof(float));
            continue;
        }
        const char *xt = (const char *)x + (size_t)(rows[r] * ldx) * xs;
        int64_t i = 0;
        for (; i + 8 <= K; i += 8) _mm256_storeu_ps(xr + i, lora_ld8(xt, x_dt, i));
        for (; i < K; i++) xr[i] = lora_ld(xt, x_dt, i);
    }
}

/* Whether a bf16 dot-product shrink takes this layer: never in the 8-lane form. */
static inline int lora_bf16_shrink(int x_dt, int w_dt, int64_t K) {
    (void)x_dt, (void)w_dt, (void)K;
    return 0;
}

/* h [LORA_RB][n] = xf A_s^T for the slot's A (as, [n, K]): two outputs at a time (each its own
 * accumulators, so the pairing does not change a sum), the lanes summed by lane_sum8. */
static void lora_block_shrink(const float *xf, const char *as, int w_dt, int64_t n, int64_t K, float *h) {
    const size_t es = w_dt ? 2 : 4;
    const int64_t K8 = K / 8 * 8;
    const __m256i km = lora_mask8(K - K8);
    int64_t k = 0;
    for (; k + 2 <= n; k += 2) {
        const char *a0 = as + (size_t)(k * K) * es, *a1 = a0 + (size_t)K * es;
        __m256 c0[LORA_RB], c1[LORA_RB];
        for (int r = 0; r < LORA_RB; r++) c0[r] = c1[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < K8; i += 8) {
            const __m256 v0 = lora_ld8(a0, w_dt, i), v1 = lora_ld8(a1, w_dt, i);
            for (int r = 0; r < LORA_RB; r++) {
                const __m256 xv = _mm256_loadu_ps(xf + r * K + i);
                c0[r] = _mm256_fmadd_ps(xv, v0, c0[r]);
                c1[r] = _mm256_fmadd_ps(xv, v1, c1[r]);
            }
        }
        if (K8 < K) {
            const __m256 v0 = lora_ld8_tail(a0, w_dt, K8, K - K8), v1 = lora_ld8_tail(a1, w_dt, K8, K - K8);
            for (int r = 0; r < LORA_RB; r++) {
                const __m256 xv = _mm256_maskload_ps(xf + r * K + K8, km);
                c0[r] = _mm256_fmadd_ps(xv, v0, c0[r]);
                c1[r] = _mm256_fmadd_ps(xv, v1, c1[r]);
            }
        }
        for (int r = 0; r < LORA_RB; r++) {
            h[r * n + k] = lane_sum8(c0[r]);
            h[r * n + k + 1] = lane_sum8(c1[r]);
        }
    }
    for (; k < n; k++) {
        const char *a0 = as + (size_t)(k * K) * es;
        __m256 c0[LORA_RB];
        for (int r = 0; r < LORA_RB; r++) c0[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < K8; i += 8) {
            const __m256 v0 = lora_ld8(a0, w_dt, i);
            for (int r = 0; r < LORA_RB; r++) c0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + r * K + i), v0, c0[r]);
        }
        if (K8 < K) {
            const __m256 v0 = lora_ld8_tail(a0, w_dt, K8, K - K8);
            for (int r = 0; r < LORA_RB; r++)
                c0[r] = _mm256_fmadd_ps(_mm256_maskload_ps(xf + r * K + K8, km), v0, c0[r]);
        }
        for (int r = 0; r < LORA_RB; r++) h[r * n + k] = lane_sum8(c0[r]);
    }
}

/* h [LORA_RB][n] of the block's rows (order[0:nb] of x, rows ldx apart) for the slot's A (as,
 * [n, K]): float32 FMAs on the rows widened into xf [LORA_RB][K]. */
static void lora_block_h(const void *x, int64_t ldx, int x_dt, const int64_t *order, int nb, const char *as, int w_dt,
                         int64_t n, int64_t K, float *xf, float *h) {
    lora_load_rows(x, ldx, x_dt, order, nb, K, xf);
    lora_block_shrink(xf, as, w_dt, n, K, h);
}

/* yt[r][o] += sum over k of h[r][j R + k] B_s^T[j R + k][o], for the nb rows of the block and
 * the columns o of each slice j within [lo, hi): one FMA chain per column, 16 columns at a time,
 * then 8, then the last ones in a zero-padded vector (a column's value does not depend on which
 * call or chunk covers it). */
static void lora_block_expand(const float *h, int nb, const char *bs, int w_dt, int64_t num_slices, int64_t R,
                              const int64_t *ranges, int64_t N, int64_t lo, int64_t hi, char *const *yt, int y_dt) {
    const size_t es = w_dt ? 2 : 4;
    const int64_t n = num_slices * R;
    for (int64_t j = 0; j < num_slices; j++) {
        const int64_t a = ranges[2 * j] > lo ? ranges[2 * j] : lo, b = ranges[2 * j + 1] < hi ? ranges[2 * j + 1] : hi;
        const char *bj = bs + (size_t)(j * R * N) * es;
        const float *hj = h + j * R;
        int64_t o = a;
        for (; o + 16 <= b; o += 16) {
            __m256 c0[LORA_RB], c1[LORA_RB];
            for (int r = 0; r < LORA_RB; r++) c0[r] = c1[r] = _mm256_setzero_ps();
            for (int64_t k = 0; k < R; k++) {
                const char *row = bj + (size_t)(k * N) * es;
                const __m256 b0 = lora_ld8(row, w_dt, o), b1 = lora_ld8(row, w_dt, o + 8);
                for (int r = 0; r < LORA_RB; r++) {
                    const __m256 hv = _mm256_broadcast_ss(hj + r * n + k);
                    c0[r] = _mm256_fmadd_ps(hv, b0, c0[r]);
                    c1[r] = _mm256_fmadd_ps(hv, b1, c1[r]);
                }
            }
            for (int r = 0; r < nb; r++) {
                lora_add8(yt[r], y_dt, o, c0[r]);
                lora_add8(yt[r], y_dt, o + 8, c1[r]);
            }
        }
        for (; o < b; o += 8) {
            const int64_t w = b - o < 8 ? b - o : 8;
            __m256 c0[LORA_RB];
            for (int r = 0; r < LORA_RB; r++) c0[r] = _mm256_setzero_ps();
            for (int64_t k = 0; k < R; k++) {
                const char *row = bj + (size_t)(k * N) * es;
                const __m256 b0 = w == 8 ? lora_ld8(row, w_dt, o) : lora_ld8_tail(row, w_dt, o, w);
                for (int r = 0; r < LORA_RB; r++) c0[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(hj + r * n + k), b0, c0[r]);
            }
            for (int r = 0; r < nb; r++) {
                if (w == 8) lora_add8(yt[r], y_dt, o, c0[r]);
                else lora_add8_tail(yt[r], y_dt, o, c0[r], w);
            }
        }
    }
}
