/* bf16.h's 16-lane forms (AVX-512): bf16 loads and stores, e^x, bf16 rounding, lane sums, a 16 x 16
 * transpose of 32-bit words and the packing of 16 rows built on it. Included by bf16.h where the
 * build has AVX-512F. */
#include <immintrin.h>

/* 16 bf16 values widened to float32 (exact). */
static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* e^x on 16 lanes: 2^n e^r with |r| <= ln2/2 and a degree-6 Taylor polynomial (relative error
 * below 2e-7, about one float32 ulp); inputs below -87 give about 1e-38. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* The bf16 value of each lane (round to nearest even, as f32_to_bf16), back in float32. */
static inline __m512 round_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

/* 16 float32 lanes to bf16 (f32_to_bf16 on each lane). */
static inline __m256i bf16x16_from_f32(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16));
}

/* The sum of a's 16 lanes, pairing them as lane_sums16 does: lanes i and i + 8, then i and i + 4 of
 * those sums, then i and i + 2, then the last two (the pairing of GCC's _mm512_reduce_add_ps,
 * written out so that -ffast-math cannot regroup it differently at different call sites). */
static inline __attribute__((always_inline)) float lane_sum(__m512 a) {
    const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 r = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

/* The lane sums of 16 accumulators at once: result lane t = lane_sum(a[t]), to the bit (the same
 * pairs added in the same order), by a tree of 128-bit and in-lane shuffles: 31 instructions
 * where 16 separate sums take about 130. */
static inline __attribute__((always_inline)) __m512 lane_sums16(const __m512 a[16]) {
    __m512 s[8], q[4], r[2];
    for (int p = 0; p < 8; p++) /* lanes i + i+8: a[2p] in lanes 0-7, a[2p+1] in 8-15 */
        s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int p = 0; p < 4; p++) /* + 4: 128-bit quarter u holds a[4p + u]'s four sums */
        q[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int p = 0; p < 2; p++) /* + 2, within each quarter */
        r[p] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * p], q[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(q[2 * p], q[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* + 1: lane 4u + e holds a[4e + u]'s sum; the permutation puts a[t]'s in lane t */
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), f);
}

/* r[0..15] (16 x 16 int32, r[i] lane j) transposed in place: r[j] lane i. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + c], 128-bit lane L: rows 4g .. 4g + 3 of column 4L + c */
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* 16 rows of KC * 64 bytes (row j at src + j * stride bytes for j < n; rows from n on read as
 * zeros) packed as the tile units' and vpdpbusd's second operand: per 64 bytes kc, 16 lines of 16
 * 32-bit words at dst + kc * 256, line p word j = row j's word p of those 64 bytes (a pair of bf16,
 * or 4 int8), every byte xor flip (0x80 turns the q + 128 of a quantized row into signed q). */
static inline void pack16_dwords(const void *src, int64_t stride, int64_t n, int64_t KC, char flip, int32_t *dst) {
    const __m512i f = _mm512_set1_epi8(flip);
    for (int64_t kc = 0; kc < KC; kc++) {
        __m512i r[16];
        for (int64_t j = 0; j < 16; j++)
            r[j] = j < n ? _mm512_xor_si512(_mm512_loadu_si512((const void *)((const char *)src + j * stride + kc * 64)), f)
                         : _mm512_setzero_si512();
        transpose16_epi32(r);
        for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(dst + kc * 256 + p * 16), r[p]);
    }
}
