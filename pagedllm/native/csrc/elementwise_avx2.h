/* float32 on CPUs with AVX2 + FMA and no AVX-512: the same three ops on 8 lanes, with the rounding
 * points of the AVX-512 forms (each product through mul_rn8, so none is contracted into an FMA with
 * the sum after it). RMSNorm and SiLU rows whose length is not a multiple of 8 finish in scalar
 * code; RoPE rows come with (hd / 2) % 16 == 0, as for the AVX-512 form (both callers check it).
 * Included by elementwise_bf16.c in place of elementwise_avx512.h. */

/* exp256: bf16.h */

static inline void rms_norm_f32_row(const float *xr, const float *add, float *hr, const float *w, int64_t N,
                                    float eps, float *yr) {
    __m256 ss = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= N; i += 8) {
        __m256 h = _mm256_loadu_ps(xr + i);
        if (add) {
            h = _mm256_add_ps(h, _mm256_loadu_ps(add + i));
            _mm256_storeu_ps(hr + i, h);
        }
        ss = _mm256_fmadd_ps(h, h, ss);
    }
    float tail = 0.f;
    for (int64_t j = i; j < N; j++) {
        const float h = add ? (hr[j] = xr[j] + add[j]) : xr[j];
        tail += h * h;
    }
    const float inv = 1.f / sqrtf((lane_sum8(ss) + tail) / (float)N + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    const float *src = add ? hr : xr;
    for (i = 0; i + 8 <= N; i += 8)
        _mm256_storeu_ps(yr + i, mul_rn8(_mm256_loadu_ps(w + i), mul_rn8(_mm256_loadu_ps(src + i), iv)));
    for (; i < N; i++) {
        const __m256 n = mul_rn8(_mm256_set1_ps(src[i]), iv);
        yr[i] = _mm256_cvtss_f32(mul_rn8(_mm256_set1_ps(w[i]), n));
    }
}

/* silu(g) = g / (1 + e^-g) on 8 lanes. */
static inline __m256 silu8(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

static inline void silu_mul_f32_span(const float *g, const float *u, int64_t lo, int64_t hi, float *y) {
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8)
        _mm256_storeu_ps(y + i, mul_rn8(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
    for (; i < hi; i++) y[i] = _mm256_cvtss_f32(mul_rn8(silu8(_mm256_set1_ps(g[i])), _mm256_set1_ps(u[i])));
}

static inline void rope_f32_row(const float *xr0, int64_t W, int64_t hd, const float *c, const float *s,
                                float *yr0) {
    const int64_t half = hd / 2;
    for (int64_t h0 = 0; h0 < W; h0 += hd) {
        const float *xr = xr0 + h0;
        float *yr = yr0 + h0;
        for (int64_t i = 0; i < half; i += 8) {
            const __m256 x1 = _mm256_loadu_ps(xr + i), x2 = _mm256_loadu_ps(xr + half + i);
            const __m256 lo = _mm256_add_ps(mul_rn8(x1, _mm256_loadu_ps(c + i)),
                                            mul_rn8(_mm256_sub_ps(_mm256_setzero_ps(), x2), _mm256_loadu_ps(s + i)));
            const __m256 hi = _mm256_add_ps(mul_rn8(x2, _mm256_loadu_ps(c + half + i)),
                                            mul_rn8(x1, _mm256_loadu_ps(s + half + i)));
            _mm256_storeu_ps(yr + i, lo);
            _mm256_storeu_ps(yr + half + i, hi);
        }
    }
}

/* The bf16 ops (written once, below) on 8 float32 lanes. */
typedef __m256 vbf;
#define BF_LANES 8
#define BF_LOAD(p) bf16x8_load(p)
#define BF_STORE(p, v) _mm_storeu_si128((__m128i *)(p), bf16x8_from_f32(v))
#define BF_ROUND(v) round_bf16_8(v)
#define BF_ADD _mm256_add_ps
#define BF_SUB _mm256_sub_ps
#define BF_MUL _mm256_mul_ps
#define BF_DIV _mm256_div_ps
#define BF_FMA _mm256_fmadd_ps
#define BF_SET1 _mm256_set1_ps
#define BF_ZERO _mm256_setzero_ps
#define BF_EXP exp256
#define BF_SUM lane_sum8
#define ELEMENTWISE_F32 1
