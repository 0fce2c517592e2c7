/* elementwise_bf16.c's row functions on CPUs with AVX-512F: float32 and bf16. Included by
 * elementwise_bf16.c; elementwise_avx2.h and elementwise_scalar.h are the other CPUs' forms. */

/* The bf16 ops (written once, below) on 16 float32 lanes. */
typedef __m512 vbf;
#define BF_LANES 16
#define BF_LOAD(p) bf16x16_load(p)
#define BF_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), bf16x16_from_f32(v))
#define BF_ROUND(v) round_bf16(v)
#define BF_ADD _mm512_add_ps
#define BF_SUB _mm512_sub_ps
#define BF_MUL _mm512_mul_ps
#define BF_DIV _mm512_div_ps
#define BF_FMA _mm512_fmadd_ps
#define BF_SET1 _mm512_set1_ps
#define BF_ZERO _mm512_setzero_ps
#define BF_EXP exp512
#define BF_SUM lane_sum

/* ---- float32: the same three ops, one pass each (the torch formulas take 2-7 passes and as many
 * allocations). Products and sums are rounded one by one (no fused multiply-adds), as the torch
 * formulas round them; the RMSNorm statistics and exp differ from torch's in the last bits. */
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __mmask16 tail16(int64_t n, int64_t i) {
    return n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
}

/* One row of N: h = xr + add (written to hr) when add is given, else h = xr;
 * yr = w * (h * rsqrt(mean(h^2) + eps)). The fused decode step calls it on its rows too. */
static inline void rms_norm_f32_row(const float *xr, const float *add, float *hr, const float *w, int64_t N,
                                    float eps, float *yr) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < N; i += 16) {
        const __mmask16 k = tail16(N, i);
        __m512 h = _mm512_maskz_loadu_ps(k, xr + i);
        if (add) {
            h = _mm512_add_round_ps(h, _mm512_maskz_loadu_ps(k, add + i), RN);
            _mm512_mask_storeu_ps(hr + i, k, h);
        }
        ss = _mm512_fmadd_ps(h, h, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)N + eps));
    const float *src = add ? hr : xr;
    for (int64_t i = 0; i < N; i += 16) {
        const __mmask16 k = tail16(N, i);
        const __m512 n = _mm512_mul_round_ps(_mm512_maskz_loadu_ps(k, src + i), inv, RN);
        _mm512_mask_storeu_ps(yr + i, k, _mm512_mul_round_ps(_mm512_maskz_loadu_ps(k, w + i), n, RN));
    }
}

/* y[i] = silu(g[i]) * u[i] for i in [lo, hi), any range (the last lanes masked); the fused decode
 * step calls it on its threads' shares of the gate rows. */
static inline void silu_mul_f32_span(const float *g, const float *u, int64_t lo, int64_t hi, float *y) {
    for (int64_t i = lo; i < hi; i += 16) {
        const __mmask16 k = tail16(hi, i);
        const __m512 gv = _mm512_maskz_loadu_ps(k, g + i);
        const __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                          exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_round_ps(sv, _mm512_maskz_loadu_ps(k, u + i), RN));
    }
}

/* One row's W / hd heads of rotate-half RoPE in float32, read from xr and written to yr (may be
 * xr): y = x * cos + r * sin, r = [-x2, x1], each product rounded before the sum; c and s are
 * the position's table rows; (hd / 2) % 16 == 0. The fused decode step calls it on its rows too. */
static inline void rope_f32_row(const float *xr0, int64_t W, int64_t hd, const float *c, const float *s,
                                float *yr0) {
    const int64_t half = hd / 2;
    for (int64_t h0 = 0; h0 < W; h0 += hd) {
        const float *xr = xr0 + h0;
        float *yr = yr0 + h0;
        for (int64_t i = 0; i < half; i += 16) {
            const __m512 x1 = _mm512_loadu_ps(xr + i), x2 = _mm512_loadu_ps(xr + half + i);
            const __m512 lo = _mm512_add_round_ps(
                _mm512_mul_round_ps(x1, _mm512_loadu_ps(c + i), RN),
                _mm512_mul_round_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), _mm512_loadu_ps(s + i), RN), RN);
            const __m512 hi = _mm512_add_round_ps(
                _mm512_mul_round_ps(x2, _mm512_loadu_ps(c + half + i), RN),
                _mm512_mul_round_ps(x1, _mm512_loadu_ps(s + half + i), RN), RN);
            _mm512_storeu_ps(yr + i, lo);
            _mm512_storeu_ps(yr + half + i, hi);
        }
    }
}

#undef RN
#define ELEMENTWISE_F32 1
