/* flash_attention.c's tile functions on CPUs with AVX-512F (FLASH_LANES 16): float32 FMAs, bf16
 * dot products with AVX-512 BF16, and the AMX tile path where the CPU has it. Included by
 * flash_attention.c after pack_tile; flash_attention_avx2.h defines the same functions on 8 lanes. */

/* acc + a b over the PK elements of each 32-bit word, lane by lane. */
static inline __attribute__((always_inline)) __m512 madd(__m512 acc, __m512i a, __m512i b, const int PK) {
#if defined(__AVX512BF16__)
    if (PK == 2) return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#endif
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
}

/* 2^x for x <= 0 on 16 lanes: 2^n 2^r with |r| <= 1/2 and a Taylor polynomial of e^(r ln 2), of
 * degree 4 for weights rounded to bfloat16 (relative error below 5e-5, 40 times under bfloat16's
 * 2^-9) and of degree 7 for float32 (below 1e-8); very negative x give 0. */
static inline __attribute__((always_inline)) __m512 exp2_weights(__m512 x, const int PK) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p;
    if (PK == 2) {
        p = _mm512_set1_ps(9.6181291e-3f);
    } else {
        p = _mm512_set1_ps(1.5252734e-5f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.5403530e-4f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));
    }
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

_Static_assert(KT == 64, "softmax_row takes a tile's scores as four vectors");

/* The online softmax of one row's KT scores s0..s3 (keys k0 ..): its weights P into pw (KT / PK words;
 * bf16 pairs of adjacent keys for PK = 2), its running max *m (log2 domain) and sum *l updated;
 * returns the factor alpha its earlier outputs are to be scaled by (1 where the max did not grow).
 * The scores come by value: an array passed by address would keep the caller's score registers in
 * memory through its whole Q K^T loop (float32 flash 218 -> 314 ms a layer on a 2,048-token prompt). */
static inline __attribute__((always_inline)) float softmax_row(const int PK, const __m512 s0, const __m512 s1,
                                                             const __m512 s2, const __m512 s3, const int64_t pos,
                                                             const int64_t k0, const int masked, const int64_t window,
                                                             const float scale2, float *m, float *l, uint32_t *pw) {
    const __m512 sr[KT / 16] = {s0, s1, s2, s3};
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 vis[KT / 16];
    __m512 mx = _mm512_set1_ps(NEG_BIG);
    int any = 0;
    for (int v = 0; v < KT / 16; v++) {
        vis[v] = 0xffff;
        if (masked) {
            const __m512i keys = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(k0 + 16 * v)));
            const __m512i pr = _mm512_set1_epi32((int)pos);
            vis[v] = _mm512_cmple_epi32_mask(keys, pr);
            if (window > 0)
                vis[v] &= _mm512_cmpgt_epi32_mask(keys, _mm512_sub_epi32(pr, _mm512_set1_epi32((int)window)));
        }
        any |= vis[v];
        mx = _mm512_mask_max_ps(mx, vis[v], mx, sr[v]);
    }
    float alpha = 1.f;
    if (!any) {
        memset(pw, 0, (size_t)KT / PK * 4);
        return alpha;
    }
    /* Scores in the log2 domain: x = s * scale * log2(e); m is the running max of x. */
    const float tmax = _mm512_reduce_max_ps(mx) * scale2;
    if (tmax > *m) {
        alpha = exp2f(*m - tmax); /* 0 on the first visible tile (m = NEG_BIG) */
        *m = tmax;
    }
    const __m512 mr = _mm512_set1_ps(*m), sc = _mm512_set1_ps(scale2);
    __m512 sum = _mm512_setzero_ps();
    if (PK == 2) {
#if defined(__AVX512BF16__)
        const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80); /* bf16 1.0 */
        for (int v = 0; v < KT / 32; v++) {
            /* 32 weights rounded to bf16 in key order (pairs of adjacent keys), summed by one
             * vdpbf16ps against ones. */
            const __m512 p0 = _mm512_maskz_mov_ps(vis[2 * v], exp2_weights(_mm512_fmsub_ps(sr[2 * v], sc, mr), 2));
            const __m512 p1 =
                _mm512_maskz_mov_ps(vis[2 * v + 1], exp2_weights(_mm512_fmsub_ps(sr[2 * v + 1], sc, mr), 2));
            const __m512bh pbf = _mm512_cvtne2ps_pbh(p1, p0);
            _mm512_store_si512((void *)(pw + 16 * v), (__m512i)pbf);
            sum = _mm512_dpbf16_ps(sum, pbf, ones);
        }
#endif
    } else {
        for (int v = 0; v < KT / 16; v++) {
            const __m512 p = _mm512_maskz_mov_ps(vis[v], exp2_weights(_mm512_fmsub_ps(sr[v], sc, mr), 1));
            _mm512_store_ps((float *)pw + 16 * v, p);
            sum = _mm512_add_ps(sum, p);
        }
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    return alpha;
}

/* One key tile for RB rows: scores, online softmax, P V. qr: the rows' queries (words); pos: their
 * positions; o: their float32 outputs [RB][D]; m, l: running max and sum. */
static inline __attribute__((always_inline)) void tile_rows(
    const int D, const int PK, const uint32_t *const *qr, const int64_t *pos, const uint32_t *restrict kp,
    const uint32_t *restrict vp, const int64_t k0, const int masked, const int64_t window, const float scale2,
    float *restrict o, float *restrict m, float *restrict l) {
    __m512 s[RB][KT / 16];
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < KT / 16; v++) s[r][v] = _mm512_setzero_ps();
    for (int i = 0; i < D / PK; i++) {
        __m512i b[KT / 16];
        for (int v = 0; v < KT / 16; v++) b[v] = _mm512_loadu_si512((const void *)(kp + i * KT + 16 * v));
        for (int r = 0; r < RB; r++) {
            const __m512i a = _mm512_set1_epi32((int)qr[r][i]);
            for (int v = 0; v < KT / 16; v++) s[r][v] = madd(s[r][v], a, b[v], PK);
        }
    }
    uint32_t pw[RB][KT] __attribute__((aligned(64))); /* P as words: KT / PK per row */
    float alpha[RB];
    for (int r = 0; r < RB; r++)
        alpha[r] = softmax_row(PK, s[r][0], s[r][1], s[r][2], s[r][3], pos[r], k0, masked, window, scale2, m + r, l + r,
                               pw[r]);
    for (int c0 = 0; c0 < D; c0 += 64) {
        const int CV = (D - c0 >= 64 ? 64 : D - c0) / 16;
        __m512 acc[RB][4];
        for (int r = 0; r < RB; r++) {
            const __m512 al = _mm512_set1_ps(alpha[r]);
            for (int v = 0; v < CV; v++) {
                acc[r][v] = _mm512_loadu_ps(o + r * D + c0 + 16 * v);
                if (alpha[r] != 1.f) acc[r][v] = _mm512_mul_ps(acc[r][v], al);
            }
        }
        for (int t = 0; t < KT / PK; t++) {
            __m512i b[4];
            for (int v = 0; v < CV; v++) b[v] = _mm512_loadu_si512((const void *)(vp + t * D + c0 + 16 * v));
            for (int r = 0; r < RB; r++) {
                const __m512i a = _mm512_set1_epi32((int)pw[r][t]);
                for (int v = 0; v < CV; v++) acc[r][v] = madd(acc[r][v], a, b[v], PK);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int v = 0; v < CV; v++) _mm512_storeu_ps(o + r * D + c0 + 16 * v, acc[r][v]);
    }
}

#if HAVE_AMX_BF16
#define AMX_ROWS 16 /* query rows per tile block on AMX */

/* P V into the float32 outputs o[16][D] for the 64 output columns from c0 (CV of 16: 4, or 2 at
 * the end of a D that is an odd multiple of 32): the outputs' tiles loaded, KT keys' weights
 * (pw: 16 rows of KT bf16, 32 keys per tile) times the packed V (16 pairs of keys x 16 columns per
 * tile) added, and stored back. */
static inline __attribute__((always_inline)) void amx_pv(const int D, const int c0, const int CV, const uint32_t *pw,
                                                        const uint32_t *restrict vp, float *restrict o) {
    _tile_loadd(0, o + c0, D * 4);
    _tile_loadd(1, o + c0 + 16, D * 4);
    if (CV == 4) {
        _tile_loadd(2, o + c0 + 32, D * 4);
        _tile_loadd(3, o + c0 + 48, D * 4);
    }
    for (int k = 0; k < KT / 32; k++) {
        const uint32_t *vk = vp + 16 * k * D + c0;
        _tile_loadd(4, (const char *)pw + 64 * k, KT * 2);
        _tile_loadd(5, vk, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, vk + 16, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        if (CV == 4) {
            _tile_loadd(7, vk + 32, D * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, vk + 48, D * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, o + c0, D * 4);
    _tile_stored(1, o + c0 + 16, D * 4);
    if (CV == 4) {
        _tile_stored(2, o + c0 + 32, D * 4);
        _tile_stored(3, o + c0 + 48, D * 4);
    }
}

/* One key tile for AMX_ROWS rows of bf16 (PK = 2), as tile_rows on the tile unit: the 16 x KT
 * scores as four tiles of 16 x 16 float32 sums (the rows' queries qa [16][D], 32 columns a tile,
 * times the packed K, whose 16 words of dimension pairs x 16 keys are a tile as they lie), the
 * same online softmax per row, then P V (amx_pv). D % 32 == 0. */
static inline __attribute__((always_inline)) void tile_rows_amx(
    const int D, const uint16_t *restrict qa, const int64_t *pos, const uint32_t *restrict kp,
    const uint32_t *restrict vp, const int64_t k0, const int masked, const int64_t window, const float scale2,
    float *restrict o, float *restrict m, float *restrict l) {
    float s[AMX_ROWS][KT] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < D / 32; c++) {
        const uint32_t *kc = kp + 16 * c * KT;
        _tile_loadd(4, qa + 32 * c, D * 2);
        _tile_loadd(5, kc, KT * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, kc + 16, KT * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, kc + 32, KT * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, kc + 48, KT * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, &s[0][0], KT * 4);
    _tile_stored(1, &s[0][16], KT * 4);
    _tile_stored(2, &s[0][32], KT * 4);
    _tile_stored(3, &s[0][48], KT * 4);
    uint32_t pw[AMX_ROWS][KT / 2] __attribute__((aligned(64)));
    for (int r = 0; r < AMX_ROWS; r++) {
        const float alpha = softmax_row(2, _mm512_load_ps(&s[r][0]), _mm512_load_ps(&s[r][16]), _mm512_load_ps(&s[r][32]),
                                        _mm512_load_ps(&s[r][48]), pos[r], k0, masked, window, scale2, m + r, l + r, pw[r]);
        if (alpha != 1.f) {
            const __m512 al = _mm512_set1_ps(alpha);
            for (int d = 0; d < D; d += 16) _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), al));
        }
    }
    for (int c0 = 0; c0 < D; c0 += 64) {
        if (D - c0 >= 64)
            amx_pv(D, c0, 4, &pw[0][0], vp, o);
        else
            amx_pv(D, c0, 2, &pw[0][0], vp, o);
    }
}

#endif

