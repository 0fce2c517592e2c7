/* flash_attention.c's tile functions on CPUs with AVX2 + FMA but no AVX-512 (FLASH_LANES 8,
 * float32 only; bf16 caches are widened by pack_tile). Included by flash_attention.c in place of
 * flash_attention_avx512.h. */

/* 2^x for x <= 0 on 8 lanes, float32 weights: 2^n 2^r with |r| <= 1/2 and the degree-7 polynomial
 * of the AVX-512 form (relative error below 1e-8); 2^n is built in the exponent field, and x below
 * -126.5 gives 0 (those weights are under 2^-126 of the row's largest). */
static inline __attribute__((always_inline)) __m256 exp2_weights8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-127.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5252734e-5f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.5403530e-4f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3333558e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e)); /* n = -127: a zero exponent field, 0 */
}

/* One key tile for RB rows, float32 (PK = 1), as the AVX-512 form: scores with keys across lanes,
 * online softmax, P V; visibility as all-ones lanes. */
static inline __attribute__((always_inline)) void tile_rows(
    const int D, const int PK, const uint32_t *const *qr, const int64_t *pos, const uint32_t *restrict kp,
    const uint32_t *restrict vp, const int64_t k0, const int masked, const int64_t window, const float scale2,
    float *restrict o, float *restrict m, float *restrict l) {
    (void)PK;
    __m256 s[RB][KT / 8];
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < KT / 8; v++) s[r][v] = _mm256_setzero_ps();
    for (int i = 0; i < D; i++) {
        __m256 b[KT / 8];
        for (int v = 0; v < KT / 8; v++) b[v] = _mm256_loadu_ps((const float *)(kp + i * KT + 8 * v));
        for (int r = 0; r < RB; r++) {
            const __m256 a = _mm256_broadcast_ss((const float *)qr[r] + i);
            for (int v = 0; v < KT / 8; v++) s[r][v] = _mm256_fmadd_ps(a, b[v], s[r][v]);
        }
    }
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 neg = _mm256_set1_ps(NEG_BIG);
    float pw[RB][KT] __attribute__((aligned(32)));
    float alpha[RB];
    for (int r = 0; r < RB; r++) {
        __m256 vis[KT / 8];
        __m256 mx = neg;
        int any = 0;
        for (int v = 0; v < KT / 8; v++) {
            vis[v] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            if (masked) {
                const __m256i keys = _mm256_add_epi32(iota, _mm256_set1_epi32((int)(k0 + 8 * v)));
                const __m256i pr = _mm256_set1_epi32((int)pos[r]);
                __m256i hidden = _mm256_cmpgt_epi32(keys, pr);
                if (window > 0) /* keys <= pos - window are outside the window */
                    hidden = _mm256_or_si256(
                        hidden, _mm256_cmpgt_epi32(_mm256_sub_epi32(pr, _mm256_set1_epi32((int)window - 1)), keys));
                vis[v] = _mm256_castsi256_ps(_mm256_xor_si256(hidden, _mm256_set1_epi32(-1)));
            }
            any |= _mm256_movemask_ps(vis[v]);
            mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg, s[r][v], vis[v]));
        }
        alpha[r] = 1.f;
        if (!any) {
            memset(pw[r], 0, sizeof(pw[r]));
            continue;
        }
        const float tmax = lane_max8(mx) * scale2;
        if (tmax > m[r]) {
            alpha[r] = exp2f(m[r] - tmax);
            m[r] = tmax;
        }
        const __m256 mr = _mm256_set1_ps(m[r]), sc = _mm256_set1_ps(scale2);
        __m256 sum = _mm256_setzero_ps();
        for (int v = 0; v < KT / 8; v++) {
            const __m256 p = _mm256_and_ps(vis[v], exp2_weights8(_mm256_fmsub_ps(s[r][v], sc, mr)));
            _mm256_store_ps(pw[r] + 8 * v, p);
            sum = _mm256_add_ps(sum, p);
        }
        l[r] = l[r] * alpha[r] + lane_sum8(sum);
    }
    for (int c0 = 0; c0 < D; c0 += 32) {
        const int CV = (D - c0 >= 32 ? 32 : D - c0) / 8;
        __m256 acc[RB][4];
        for (int r = 0; r < RB; r++) {
            const __m256 al = _mm256_set1_ps(alpha[r]);
            for (int v = 0; v < CV; v++) {
                acc[r][v] = _mm256_loadu_ps(o + r * D + c0 + 8 * v);
                if (alpha[r] != 1.f) acc[r][v] = _mm256_mul_ps(acc[r][v], al);
            }
        }
        for (int t = 0; t < KT; t++) {
            __m256 b[4];
            for (int v = 0; v < CV; v++) b[v] = _mm256_loadu_ps((const float *)(vp + t * D + c0 + 8 * v));
            for (int r = 0; r < RB; r++) {
                const __m256 a = _mm256_broadcast_ss(pw[r] + t);
                for (int v = 0; v < CV; v++) acc[r][v] = _mm256_fmadd_ps(a, b[v], acc[r][v]);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int v = 0; v < CV; v++) _mm256_storeu_ps(o + r * D + c0 + 8 * v, acc[r][v]);
    }
}
