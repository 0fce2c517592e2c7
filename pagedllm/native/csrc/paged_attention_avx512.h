/* paged_attention.c's decode path on CPUs with AVX-512F: decode_rows() and its helpers on 16 lanes.
 * Included by paged_attention.c after the scalar helpers it uses; paged_attention_avx2.h is the
 * AVX2 + FMA form with the same entry points (FAST_DECODE). */

#include <immintrin.h>
#define FAST_DECODE 1
#define DEC_ROWS 4
#define NEG_BIG (-1e30f)

/* Keys in the run that starts at key k (runs end at a block's end and hold at most KB keys). */
static inline int64_t run_len(int64_t k, int64_t BS) { return BS - k % BS < KB ? BS - k % BS : KB; }

/* How decode_rows() reads K: float32 rows (the cache itself or a converted copy), or bf16 rows
 * dotted with bf16 queries by vdpbf16ps. */
enum { KM_F32 = 0, KM_BF16DP = 1, KM_CONV = 2 };

/* Online-softmax attention of R <= DEC_ROWS query rows sharing one KV head over keys
 * [first, last]: acc_out[R][D] (unnormalized) and l_out[R] (softmax sums). Row r sees key k when
 * k <= pos[r] and, with a window, k > pos[r] - window. qf: rows scaled, float32 (KM_F32,
 * KM_CONV); qb: raw bf16 rows and qscale the score scale (KM_BF16DP). kbuf, vbuf: [KB][D] scratch
 * for KM_CONV. R, D and mode are constants at every call site, so the loops unroll and the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void decode_rows(
    const int R, const int D, const int mode, const float *restrict qf, const uint16_t *restrict qb, const float qscale,
    const void *k_cache, const void *v_cache, const int kv_dt, const float *table, const int64_t *bt, const int64_t BS,
    const int64_t head_off, const int64_t stride, const int64_t *pos, const int64_t first, const int64_t last,
    const int64_t window, float *restrict acc_out, float *restrict l_out, float *restrict kbuf, float *restrict vbuf) {
    const int C = D / 16;
    __m512 acc[DEC_ROWS][8], lv[DEC_ROWS];
    float m[DEC_ROWS];
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
        lv[r] = _mm512_setzero_ps();
        m[r] = NEG_BIG;
    }
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t k0 = first, kn; k0 <= last; k0 += kn) {
        const float *kf, *vf;
        int64_t kst, vst;
        const int64_t base = key_run(k0, last, bt, BS, stride, head_off, mode == KM_CONV, k_cache, v_cache, kv_dt,
                                     table, D, kbuf, vbuf, &kn, &kf, &vf, &kst, &vst);
        const uint16_t *kb = (const uint16_t *)k_cache + base, *vb = (const uint16_t *)v_cache + base;
        const __m512i keys = _mm512_add_epi32(iota, _mm512_set1_epi32((int)k0));
        const __mmask16 in_run = (__mmask16)((1u << kn) - 1u);
        float p[DEC_ROWS][KB];
        for (int r = 0; r < R; r++) {
            __m512 a[KB];
            for (int j = 0; j < KB; j++) {
                a[j] = _mm512_setzero_ps();
                if (j >= kn) continue;
#if defined(__AVX512BF16__)
                if (mode == KM_BF16DP) {
                    for (int c = 0; c < D / 32; c++)
                        a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512((const void *)(qb + r * D + 32 * c)),
                                                (__m512bh)_mm512_loadu_si512((const void *)(kb + j * kst + 32 * c)));
                    continue;
                }
#endif
                for (int c = 0; c < C; c++)
                    a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + r * D + 16 * c), _mm512_loadu_ps(kf + j * kst + 16 * c), a[j]);
            }
            __m512 s = lane_sums16(a);
            if (mode == KM_BF16DP) s = _mm512_mul_ps(s, _mm512_set1_ps(qscale));
            const __m512i pr = _mm512_set1_epi32((int)pos[r]);
            __mmask16 vis = in_run & _mm512_cmple_epi32_mask(keys, pr);
            if (window > 0) vis &= _mm512_cmpgt_epi32_mask(keys, _mm512_sub_epi32(pr, _mm512_set1_epi32((int)window)));
            if (!vis) {
                _mm512_storeu_ps(p[r], _mm512_setzero_ps());
                continue;
            }
            s = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_BIG), vis, s);
            const float mx = _mm512_reduce_max_ps(s);
            if (mx > m[r]) {
                const __m512 alpha = _mm512_set1_ps(expf(m[r] - mx)); /* 0 on the first visible run */
                for (int c = 0; c < C; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], alpha);
                lv[r] = _mm512_mul_ps(lv[r], alpha);
                m[r] = mx;
            }
            const __m512 pv = _mm512_maskz_mov_ps(vis, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m[r]))));
            lv[r] = _mm512_add_ps(lv[r], pv);
            _mm512_storeu_ps(p[r], pv);
        }
        /* The K and V rows of the run after the next one (another block, at a random place of the
         * cache) are fetched while this run's PV sums run: with only the next run in flight the
         * core's outstanding misses stall the loop (128 decodes of 512 tokens, bf16, 2-core Xeon:
         * the fused step 133 -> 118 ms; fetching the first two runs before the loop as well was
         * slower, 124 ms). */
        const int64_t k1 = k0 + kn, k2 = k1 + run_len(k1, BS);
        const char *nk = NULL, *nv = NULL;
        int64_t esz = kv_dt == DT_F32 ? 4 : kv_dt == DT_FP8 ? 1 : 2, nn = 0;
        if (k2 <= last) {
            const int64_t noff = k2 % BS, nbase = (bt[k2 / BS] * BS + noff) * stride + head_off;
            nn = run_len(k2, BS);
            nk = (const char *)k_cache + nbase * esz, nv = (const char *)v_cache + nbase * esz;
        }
        for (int64_t j = 0; j < kn; j++) {
            if (j < nn)
                for (int64_t b = 0; b < D * esz; b += 64) {
                    _mm_prefetch(nk + j * stride * esz + b, _MM_HINT_T0);
                    _mm_prefetch(nv + j * stride * esz + b, _MM_HINT_T0);
                }
            __m512 vv[8];
            for (int c = 0; c < C; c++)
                vv[c] = mode == KM_BF16DP ? bf16x16_load(vb + j * vst + 16 * c) : _mm512_loadu_ps(vf + j * vst + 16 * c);
            for (int r = 0; r < R; r++) {
                const __m512 pj = _mm512_set1_ps(p[r][j]);
                for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(pj, vv[c], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        l_out[r] = _mm512_reduce_add_ps(lv[r]);
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc_out + r * D + 16 * c, acc[r][c]);
    }
}

