/*
 * Gemma 3's elementwise ops of the fused decode step (llama_decode.c includes this file after its
 * own ld / st / round_dt and elementwise_bf16.c): Gemma's RMSNorm and GELU-tanh * up, with the
 * rounding points of pagedllm's torch path (layers/gemma_norm.py, layers/activation.py).
 */

/* Gemma's RMSNorm: out[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * (1 + weight), in float32, rounded
 * to dtype once (pagedllm/layers/gemma_norm.py). */
static void gemma_rms_norm(const void *x, int64_t M, int64_t H, const void *weight, float eps, void *out, int dt) {
    for (int64_t m = 0; m < M; m++) {
        const float inv = inv_rms(x, m, H, eps, dt);
        for (int64_t i = 0; i < H; i++) st(out, m * H + i, ld(x, m * H + i, dt) * inv * (1.0f + ld(weight, i, dt)), dt);
    }
}

/* gelu_tanh(g), out of line: a loop the compiler vectorized would take the vector tanhf for some
 * elements and the scalar one for a range's tail, so an element's bits would depend on the range a
 * thread computes. */
__attribute__((noinline)) static float gelu_tanh(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

#if defined(ELEMENTWISE_BF16)
/* y[i] = bf16(bf16(gelu_tanh(g[i])) * u[i]) for i < n (n % BF_LANES == 0), as
 * x * sigmoid(2a) = 0.5 x (1 + tanh(a)), a = sqrt(2 / pi) (x + 0.044715 x^3): the SiLU kernel's
 * exp and division, lanes computed alike wherever a range starts. */
static inline void gelu_tanh_mul_bf16_span(const uint16_t *g, const uint16_t *u, int64_t n, uint16_t *y) {
    const vbf c = BF_SET1(-2.0f * 0.7978845608028654f), k = BF_SET1(0.044715f), one = BF_SET1(1.f);
    for (int64_t i = 0; i < n; i += BF_LANES) {
        const vbf x = BF_LOAD(g + i);
        const vbf a2 = BF_MUL(c, BF_ADD(x, BF_MUL(k, BF_MUL(x, BF_MUL(x, x)))));
        const vbf s = BF_ROUND(BF_DIV(x, BF_ADD(one, BF_EXP(a2))));
        BF_STORE(y + i, BF_MUL(s, BF_LOAD(u + i)));
    }
}
#endif

/* out[m, i] = gelu_tanh(gu[m, i]) * gu[m, I + i] for i in [lo, hi), each op rounded to dtype (Gemma's
 * GeGLU: GeluTanhAndMul): bf16 in 16- or 8-lane vectors, float32 in the scalar loop. */
static void gelu_tanh_mul(const void *gu, int64_t M, int64_t I, void *out, int dt, int64_t lo, int64_t hi) {
#if defined(ELEMENTWISE_BF16)
    if (dt == LD_BF16 && lo % BF_LANES == 0 && (hi - lo) % BF_LANES == 0) {
        for (int64_t m = 0; m < M; m++) {
            const uint16_t *g = (const uint16_t *)gu + m * 2 * I;
            gelu_tanh_mul_bf16_span(g + lo, g + I + lo, hi - lo, (uint16_t *)out + m * I + lo);
        }
        return;
    }
#endif
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = lo; i < hi; i++) {
            const float g = ld(gu, m * 2 * I + i, dt), u = ld(gu, m * 2 * I + I + i, dt);
            st(out, m * I + i, round_dt(gelu_tanh(g), dt) * u, dt);
        }
}
