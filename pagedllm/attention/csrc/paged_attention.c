/*
 * Paged attention for float32 on CPU, reading K/V in place from the block-structured cache.
 *
 * Work is split into items (request, first query token, number of query tokens <= TILE) and
 * parallelized over items x KV heads. Each item keeps TILE x G query rows (G query heads share
 * one KV head) and streams the keys it may see in runs of KB keys, with an online softmax:
 * for each run, scores -> running max -> rescale accumulators -> add p * V. Every K/V vector
 * loaded serves all of the item's query rows.
 *
 * Layouts: q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D];
 * block_tables [R, bt_stride]; query_start_loc [R + 1]; seq_lens [R]; work [W, 3].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KB 16

static inline float dot_n(const float *restrict a, const float *restrict b, const int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy_n(float *restrict y, float a, const float *restrict x, const int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* The common head sizes get constant trip counts (fully unrolled and vectorized once inlined). */
static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    if (d == 64) return dot_n(a, b, 64);
    if (d == 128) return dot_n(a, b, 128);
    return dot_n(a, b, d);
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int64_t d) {
    if (d == 64) axpy_n(y, a, x, 64);
    else if (d == 128) axpy_n(y, a, x, 128);
    else axpy_n(y, a, x, d);
}

static inline void scal(float *restrict y, float a, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; i++) y[i] *= a;
}

void paged_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int64_t *block_tables, int64_t bt_stride, const int64_t *query_start_loc,
                         const int64_t *seq_lens, const int64_t *work, int64_t num_work, float *out, int64_t H,
                         int64_t KVH, int64_t D, int64_t BS, float scale, int64_t window) {
    const int64_t G = H / KVH;
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (int64_t w = 0; w < num_work; w++) {
        for (int64_t kh = 0; kh < KVH; kh++) {
            const int64_t r = work[3 * w], t0 = work[3 * w + 1], nt = work[3 * w + 2];
            const int64_t qs = query_start_loc[r];
            const int64_t qlen = query_start_loc[r + 1] - qs;
            const int64_t ctx0 = seq_lens[r] - qlen; /* position of the request's first query token */
            const int64_t *bt = block_tables + r * bt_stride;
            const int64_t rows = nt * G;
            float m[rows], l[rows], s[rows * KB];
            float acc[rows * D];
            const float *qp[rows];
            int64_t pos[rows];
            const float *kp[KB], *vp[KB];
            for (int64_t i = 0; i < nt; i++) {
                for (int64_t g = 0; g < G; g++) {
                    const int64_t row = i * G + g;
                    qp[row] = q + ((qs + t0 + i) * H + kh * G + g) * D;
                    pos[row] = ctx0 + t0 + i;
                    m[row] = -INFINITY;
                    l[row] = 0.f;
                }
            }
            memset(acc, 0, sizeof(float) * rows * D);
            const int64_t last = ctx0 + t0 + nt - 1;
            int64_t first = 0;
            if (window > 0 && ctx0 + t0 - window + 1 > 0) first = ctx0 + t0 - window + 1;
            const int64_t stride = KVH * D; /* between consecutive slots of a block */
            for (int64_t k0 = first, kn; k0 <= last; k0 += kn) {
                /* A run of keys inside one cache block: consecutive slots. */
                const int64_t off = k0 % BS;
                kn = BS - off;
                if (kn > KB) kn = KB;
                if (kn > last + 1 - k0) kn = last + 1 - k0;
                const int64_t base = ((bt[k0 / BS] * BS + off) * KVH + kh) * D;
                for (int64_t j = 0; j < kn; j++) {
                    kp[j] = k_cache + base + j * stride;
                    vp[j] = v_cache + base + j * stride;
                }
                for (int64_t row = 0; row < rows; row++) {
                    float *sr = s + row * KB;
                    float mx = -INFINITY;
                    for (int64_t j = 0; j < kn; j++) {
                        const int64_t key = k0 + j;
                        const int visible = key <= pos[row] && (window <= 0 || key > pos[row] - window);
                        sr[j] = visible ? dot(qp[row], kp[j], D) * scale : -INFINITY;
                        if (sr[j] > mx) mx = sr[j];
                    }
                    if (mx == -INFINITY) continue;
                    float *ar = acc + row * D;
                    if (mx > m[row]) {
                        const float alpha = expf(m[row] - mx); /* 0 on the first run */
                        l[row] *= alpha;
                        scal(ar, alpha, D);
                        m[row] = mx;
                    }
                    /* exp over the whole run at once (vectorized); hidden keys give exactly 0. */
                    float p[KB];
                    const float mr = m[row];
#pragma omp simd
                    for (int64_t j = 0; j < kn; j++) p[j] = expf(sr[j] - mr);
                    for (int64_t j = 0; j < kn; j++) {
                        l[row] += p[j];
                        axpy(ar, p[j], vp[j], D);
                    }
                }
            }
            for (int64_t i = 0; i < nt; i++) {
                for (int64_t g = 0; g < G; g++) {
                    const int64_t row = i * G + g;
                    float *o = out + ((qs + t0 + i) * H + kh * G + g) * D;
                    const float inv = l[row] > 0.f ? 1.f / l[row] : 0.f;
                    for (int64_t d = 0; d < D; d++) o[d] = acc[row * D + d] * inv;
                }
            }
        }
    }
}
