/* bf16.h's 8-lane forms (AVX2 + FMA): bf16 loads and stores, e^x, bf16 rounding and lane sums and
 * maxima. Included by bf16.h where the build has AVX2 and FMA (an AVX-512 build has both forms). */
#include <immintrin.h>

/* 8 bf16 values widened to float32 (exact). */
static inline __m256 bf16x8_load(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The sum of a's 8 lanes: lanes i and i + 4, then i and i + 2 of those sums, then the last two
 * (written out, so that -ffast-math cannot regroup it differently at different call sites). */
static inline __attribute__((always_inline)) float lane_sum8(__m256 a) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 r = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

/* The largest of a's 8 lanes. */
static inline float lane_max8(__m256 a) {
    __m128 q = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    q = _mm_max_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

/* e^x on 8 lanes, exp512's method (2^n e^r, degree-6 polynomial), 2^n built in the exponent bits;
 * inputs are clamped to [-87, 88]. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* a * b on 8 lanes, rounded as written: the compiler cannot contract it with a later add into an
 * FMA (-ffast-math allows that for _mm256_mul_ps), so callers keep torch's rounding points. */
static inline __m256 mul_rn8(__m256 a, __m256 b) {
    __asm__("vmulps %1, %0, %0" : "+x"(a) : "x"(b));
    return a;
}

/* The bf16 value of each lane (round to nearest even, as f32_to_bf16), back in float32. */
static inline __m256 round_bf16_8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

/* 8 float32 lanes to bf16 (f32_to_bf16 on each lane). */
static inline __m128i bf16x8_from_f32(__m256 v) {
    const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(v)), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

/* The sum of a's 8 int32 lanes (exact, wrapping as int32 does). */
static inline int32_t lane_sum8_epi32(__m256i a) {
    __m128i q = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    q = _mm_add_epi32(q, _mm_unpackhi_epi64(q, q));
    return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 1)));
}
