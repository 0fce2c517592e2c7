/* Neither AVX-512 nor AVX2 + FMA: the float32 row functions the fused decode step calls, as plain
 * loops the compiler vectorizes (expf through the vector math library under -ffast-math). Same
 * formulas as the other forms; nothing is exported, so the torch path keeps torch's ops on these CPUs.
 * Included by elementwise_bf16.c in place of elementwise_avx512.h. */
static inline void rms_norm_f32_row(const float *xr, const float *add, float *hr, const float *w, int64_t N,
                                    float eps, float *yr) {
    const float *src = xr;
    if (add) {
        for (int64_t i = 0; i < N; i++) hr[i] = xr[i] + add[i];
        src = hr;
    }
    float ss = 0.f;
    for (int64_t i = 0; i < N; i++) ss += src[i] * src[i];
    const float inv = 1.f / sqrtf(ss / (float)N + eps);
    for (int64_t i = 0; i < N; i++) yr[i] = w[i] * (src[i] * inv);
}

static inline void silu_mul_f32_span(const float *g, const float *u, int64_t lo, int64_t hi, float *y) {
    for (int64_t i = lo; i < hi; i++) y[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

static inline void rope_f32_row(const float *xr0, int64_t W, int64_t hd, const float *c, const float *s,
                                float *yr0) {
    const int64_t half = hd / 2;
    for (int64_t h0 = 0; h0 < W; h0 += hd) {
        const float *xr = xr0 + h0;
        float *yr = yr0 + h0;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = xr[i], x2 = xr[half + i];
            yr[i] = x1 * c[i] + (-x2) * s[i];
            yr[half + i] = x2 * c[half + i] + x1 * s[half + i];
        }
    }
}
