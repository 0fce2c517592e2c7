/* The decode path for CPUs with AVX2 and FMA but no AVX-512: decode_rows() in 8-lane vectors.
 * 16 ymm registers cannot hold the rows' output accumulators beside a run's key sums, so a run is
 * two phases: each row's scores against the run's keys (8 keys' partial dot products summed by one
 * tree, lane_sums8), its online softmax, then P V column block by column block, the rows' output
 * vectors loaded once per block and every V vector serving all rows.
 * Included by paged_attention.c in place of paged_attention_avx512.h. */
#include <immintrin.h>
#define FAST_DECODE 1
#define DEC_ROWS 4
#define NEG_BIG (-1e30f)

enum { KM_F32 = 0, KM_BF16DP = 1, KM_CONV = 2 };

/* exp256: bf16.h */

/* Lane t of the result = the sum of a[t]'s 8 lanes, ((0+1)+(2+3)) + ((4+5)+(6+7)). */
static inline __attribute__((always_inline)) __m256 lane_sums8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* decode_rows() of the AVX-512 path (same arguments; KM_F32 and KM_CONV; qb and qscale unused). */
static inline __attribute__((always_inline)) void decode_rows(
    const int R, const int D, const int mode, const float *restrict qf, const uint16_t *restrict qb, const float qscale,
    const void *k_cache, const void *v_cache, const int kv_dt, const float *table, const int64_t *bt, const int64_t BS,
    const int64_t head_off, const int64_t stride, const int64_t *pos, const int64_t first, const int64_t last,
    const int64_t window, float *restrict acc_out, float *restrict l_out, float *restrict kbuf, float *restrict vbuf) {
    (void)qb, (void)qscale;
    const int C = D / 8;
    __m256 lv[DEC_ROWS];
    float m[DEC_ROWS];
    for (int r = 0; r < R; r++) {
        for (int d = 0; d < D; d++) acc_out[r * D + d] = 0.f;
        lv[r] = _mm256_setzero_ps();
        m[r] = NEG_BIG;
    }
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t k0 = first, kn; k0 <= last; k0 += kn) {
        const float *kf, *vf;
        int64_t kst, vst;
        key_run(k0, last, bt, BS, stride, head_off, mode == KM_CONV, k_cache, v_cache, kv_dt, table, D, kbuf, vbuf,
                &kn, &kf, &vf, &kst, &vst);
        float p[DEC_ROWS][KB];
        for (int r = 0; r < R; r++) {
            __m256 s[KB / 8];
            __m256i vis[KB / 8];
            int any = 0;
            const __m256i pr = _mm256_set1_epi32((int)pos[r]);
            const __m256i lim = _mm256_set1_epi32((int)(k0 + kn)); /* keys past the run are hidden */
            for (int h = 0; h < KB / 8; h++) {
                const __m256i keys = _mm256_add_epi32(iota, _mm256_set1_epi32((int)(k0 + 8 * h)));
                /* visible: key <= pos, key < k0 + kn, and inside the window when there is one */
                __m256i v = _mm256_andnot_si256(_mm256_cmpgt_epi32(keys, pr), _mm256_cmpgt_epi32(lim, keys));
                if (window > 0)
                    v = _mm256_and_si256(v, _mm256_cmpgt_epi32(keys, _mm256_sub_epi32(pr, _mm256_set1_epi32((int)window))));
                vis[h] = v;
                s[h] = _mm256_set1_ps(NEG_BIG);
                if (8 * h >= kn || _mm256_testz_si256(v, v)) continue;
                any = 1;
                __m256 a[8];
                for (int j = 0; j < 8; j++) {
                    a[j] = _mm256_setzero_ps();
                    if (8 * h + j >= kn) continue;
                    const float *kr = kf + (8 * h + j) * kst;
                    for (int c = 0; c < C; c++)
                        a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * D + 8 * c), _mm256_loadu_ps(kr + 8 * c), a[j]);
                }
                s[h] = _mm256_blendv_ps(_mm256_set1_ps(NEG_BIG), lane_sums8(a), _mm256_castsi256_ps(v));
            }
            if (!any) {
                for (int j = 0; j < KB; j++) p[r][j] = 0.f;
                continue;
            }
            __m256 smax = s[0];
            for (int h = 1; h < KB / 8; h++) smax = _mm256_max_ps(smax, s[h]);
            const float mx = lane_max8(smax);
            if (mx > m[r]) {
                const float alpha = expf(m[r] - mx); /* 0 on the first visible run */
                const __m256 av = _mm256_set1_ps(alpha);
                for (int c = 0; c < C; c++)
                    _mm256_storeu_ps(acc_out + r * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc_out + r * D + 8 * c), av));
                lv[r] = _mm256_mul_ps(lv[r], av);
                m[r] = mx;
            }
            const __m256 mv = _mm256_set1_ps(m[r]);
            for (int h = 0; h < KB / 8; h++) {
                const __m256 pv = _mm256_and_ps(exp256(_mm256_sub_ps(s[h], mv)), _mm256_castsi256_ps(vis[h]));
                lv[r] = _mm256_add_ps(lv[r], pv);
                _mm256_storeu_ps(p[r] + 8 * h, pv);
            }
        }
        /* The next run's K and V rows (another block, at a random place of the cache) are fetched
         * while this run's PV sums run. */
        const int64_t k1 = k0 + kn;
        if (k1 <= last) {
            const int64_t esz = kv_dt == DT_F32 ? 4 : kv_dt == DT_FP8 ? 1 : 2;
            const int64_t noff = k1 % BS, nbase = (bt[k1 / BS] * BS + noff) * stride + head_off;
            const int64_t nn = BS - noff < KB ? BS - noff : KB;
            const char *nk = (const char *)k_cache + nbase * esz, *nv = (const char *)v_cache + nbase * esz;
            for (int64_t j = 0; j < nn; j++)
                for (int64_t b = 0; b < D * esz; b += 64) {
                    _mm_prefetch(nk + j * stride * esz + b, _MM_HINT_T0);
                    _mm_prefetch(nv + j * stride * esz + b, _MM_HINT_T0);
                }
        }
        for (int c = 0; c < C; c++) {
            __m256 o[DEC_ROWS];
            for (int r = 0; r < R; r++) o[r] = _mm256_loadu_ps(acc_out + r * D + 8 * c);
            for (int64_t j = 0; j < kn; j++) {
                const __m256 vv = _mm256_loadu_ps(vf + j * vst + 8 * c);
                for (int r = 0; r < R; r++) o[r] = _mm256_fmadd_ps(_mm256_set1_ps(p[r][j]), vv, o[r]);
            }
            for (int r = 0; r < R; r++) _mm256_storeu_ps(acc_out + r * D + 8 * c, o[r]);
        }
    }
    for (int r = 0; r < R; r++) l_out[r] = lane_sum8(lv[r]);
}

