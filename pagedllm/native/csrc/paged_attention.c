/*
 * Paged attention on CPU, reading K/V in place from the block-structured cache.
 *
 * Element types: queries/outputs in float32, bfloat16 or float16; the KV cache in those or in
 * one-byte fp8 codes (e4m3 / e5m2) decoded through a 256-entry table. Everything is converted
 * to float32 as it is loaded and accumulated in float32. A per-tensor K scale is folded into the
 * score scale and a per-tensor V scale into the output by the caller (v_scale below).
 *
 * Work is split into items (request, first query token, number of query tokens <= TILE) and
 * parallelized over items x KV heads (paged_attention_items runs a range of those on the calling
 * thread, for a caller that splits them over its own team: the fused decode step). Each item keeps TILE x G query rows (G query heads share
 * one KV head) and streams the keys it may see in runs of KB = 16 keys (within one cache block),
 * with an online softmax.
 *
 * Register blocking: with at least TRANSPOSE_MIN_ROWS query rows per KV head (prompt chunks),
 * each run of K is converted once into a transposed float32 tile kt[D][KB], so that the scores of
 * one query row against the 16 keys are one 16-lane vector built by D fused multiply-adds
 * (s[0:16] += q[d] * kt[d][0:16]) with no horizontal reduction; rows are taken RB at a time so
 * that each tile load feeds RB FMAs. V is converted once per run into vt[KB][D] and added as
 * p[j] * vt[j] over D.
 *
 * Decodes (fewer rows; head size 32, 64 or 128; AVX-512) take decode_rows() instead: up to 4 rows
 * of one KV head keep their output accumulators, running maxima and softmax sums in registers for
 * the whole key range. Each key's partial dot products (D / 16 FMAs in float32, or D / 32
 * vdpbf16ps when q and the cache are both bfloat16: products of two bf16 are exact in fp32) stay
 * 16-lane vectors, and the 16 keys of a run are summed together by one shuffle-and-add tree
 * (lane_sums16 in bf16.h: 31 instructions for 16 scores, instead of 16 horizontal sums). The
 * exponentials run on the 16-lane score vector, and V rows are loaded (bf16: widened in registers)
 * once per key and serve every row with fp32 FMAs. A batch of decodes reads its KV blocks from memory, scattered
 * over the cache: the next run's K and V rows are prefetched while the current run's PV sums run.
 * CPUs with AVX2 and FMA but no AVX-512 take an 8-lane form of decode_rows() (float32 rows, other
 * cache dtypes converted per run; 1.2-1.7x the generic loops on 128 and 64 decodes).
 *
 * Layouts: q [T, H, D] with ldq elements between tokens (>= H * D: q may be a view into a fused
 * projection's rows), out [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D];
 * block_tables [R, bt_stride]; query_start_loc [R + 1]; seq_lens [R]; work [W, 3].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define KB 16
#define RB 4
/* Query rows sharing a KV head from which the transposed K tile pays for its strided loads. */
#define TRANSPOSE_MIN_ROWS 8
#define PARALLEL_MIN_PAIRS 65536

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_FP8 = 3 };

/* dst[i] = value of element (off + i * stride) of src, for i < n. */
static inline void load_f32(float *restrict dst, const void *src, int64_t off, int64_t stride, int64_t n, int dt,
                            const float *restrict table) {
    switch (dt) {
    case DT_F32: {
        const float *s = (const float *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = s[i * stride];
        break;
    }
    case DT_BF16: {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i * stride]);
        break;
    }
    case DT_F16: {
        const _Float16 *s = (const _Float16 *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i * stride];
        break;
    }
    default: {
        const uint8_t *s = (const uint8_t *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = table[s[i * stride]];
        break;
    }
    }
}

static inline void store_f32(void *dst, int64_t off, const float *restrict src, float mul, int64_t n, int dt) {
    switch (dt) {
    case DT_F32: {
        float *d = (float *)dst + off;
        for (int64_t i = 0; i < n; i++) d[i] = src[i] * mul;
        break;
    }
    case DT_BF16: {
        uint16_t *d = (uint16_t *)dst + off;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i] * mul);
        break;
    }
    default: {
        _Float16 *d = (_Float16 *)dst + off;
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)(src[i] * mul);
        break;
    }
    }
}

static inline float dot_n(const float *restrict a, const float *restrict b, const int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Constant trip counts for the common head sizes (unrolled and vectorized once inlined). */
static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    if (d == 64) return dot_n(a, b, 64);
    if (d == 128) return dot_n(a, b, 128);
    return dot_n(a, b, d);
}

/* a[r][j] += sum_d q[r][d] * kt[d][j] for r < NR (in scores_rb: RB, a constant trip count the compiler
 * unrolls, or the nr rows of a last partial set). */
#define SCORES_ACC(NR)                                                                                             \
    for (int64_t d = 0; d < D; d++) {                                                                              \
        const float *k = kt + d * KB;                                                                              \
        for (int64_t r = 0; r < (NR); r++) {                                                                       \
            const float qd = q[r * D + d];                                                                         \
            _Pragma("omp simd") for (int j = 0; j < KB; j++) a[r][j] += qd * k[j];                                 \
        }                                                                                                          \
    }

/* Scores of up to RB rows against the run's KB keys: s[r][j] = sum_d q[r][d] * kt[d][j]. */
static inline void scores_rb(float *restrict s, const float *restrict q, int64_t nr, const float *restrict kt,
                             int64_t D) {
    float a[RB][KB];
    for (int r = 0; r < RB; r++)
        for (int j = 0; j < KB; j++) a[r][j] = 0.f;
    if (nr == RB) {
        SCORES_ACC(RB)
    } else {
        SCORES_ACC(nr)
    }
    for (int64_t r = 0; r < nr; r++) memcpy(s + r * KB, a[r], sizeof(float) * KB);
}
#undef SCORES_ACC

/* The run of keys from k0 that decode_rows() takes next: inside one cache block, at most KB keys
 * and none past last; its length in *kn. Its K and V rows as float32 start at *kf and *vf, *kst and
 * *vst elements apart: in the cache itself, or (conv: a cache not in float32) converted into
 * kbuf and vbuf [KB][D]. Returns the element offset of its first row in the cache. */
static inline __attribute__((always_inline)) int64_t key_run(
    int64_t k0, int64_t last, const int64_t *bt, int64_t BS, int64_t stride, int64_t head_off, int conv,
    const void *k_cache, const void *v_cache, int kv_dt, const float *table, int64_t D, float *kbuf, float *vbuf,
    int64_t *kn, const float **kf, const float **vf, int64_t *kst, int64_t *vst) {
    const int64_t off = k0 % BS;
    int64_t n = BS - off;
    if (n > KB) n = KB;
    if (n > last + 1 - k0) n = last + 1 - k0;
    *kn = n;
    const int64_t base = (bt[k0 / BS] * BS + off) * stride + head_off;
    *kf = (const float *)k_cache + base, *vf = (const float *)v_cache + base;
    *kst = *vst = stride;
    if (conv) {
        for (int64_t j = 0; j < n; j++) {
            load_f32(kbuf + j * D, k_cache, base + j * stride, 1, D, kv_dt, table);
            load_f32(vbuf + j * D, v_cache, base + j * stride, 1, D, kv_dt, table);
        }
        *kf = kbuf, *vf = vbuf, *kst = *vst = D;
    }
    return base;
}

#if defined(__AVX512F__)
#include "paged_attention_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "paged_attention_avx2.h"
#endif

#ifdef FAST_DECODE
#define DEC_ARGS qf, qb, qscale, k_cache, v_cache, kv_dt, table, bt, BS, head_off, stride, pos, first, last, window, \
                 acc_out, l_out, kbuf, vbuf
#define DEC_R(MODE, DD)                                                                                             \
    switch (R) {                                                                                                    \
    case 1: decode_rows(1, DD, MODE, DEC_ARGS); break;                                                              \
    case 2: decode_rows(2, DD, MODE, DEC_ARGS); break;                                                              \
    case 3: decode_rows(3, DD, MODE, DEC_ARGS); break;                                                              \
    default: decode_rows(4, DD, MODE, DEC_ARGS); break;                                                             \
    }
#define DEC_D(MODE)                                                                                                 \
    switch (D) {                                                                                                    \
    case 32: DEC_R(MODE, 32); break;                                                                                \
    case 64: DEC_R(MODE, 64); break;                                                                                \
    default: DEC_R(MODE, 128); break;                                                                               \
    }

/* decode_rows() with constant R (1..DEC_ROWS), D (32, 64, 128) and mode. */
static void decode_dispatch(int R, int64_t D, int mode, const float *qf, const uint16_t *qb, float qscale,
                            const void *k_cache, const void *v_cache, int kv_dt, const float *table, const int64_t *bt,
                            int64_t BS, int64_t head_off, int64_t stride, const int64_t *pos, int64_t first, int64_t last,
                            int64_t window, float *acc_out, float *l_out, float *kbuf, float *vbuf) {
    switch (mode) {
    case KM_F32: DEC_D(KM_F32); break;
#if defined(__AVX512BF16__)
    case KM_BF16DP: DEC_D(KM_BF16DP); break;
#endif
    default: DEC_D(KM_CONV); break;
    }
}
#endif

/* Work item w of the call (arguments as paged_attention below) for KV head kh, on the calling thread. */
static void attend_item(const void *q, int q_dt, int64_t ldq, const void *k_cache, const void *v_cache, int kv_dt,
                        const float *fp8_table, const int64_t *block_tables, int64_t bt_stride,
                        const int64_t *query_start_loc, const int64_t *seq_lens, const int64_t *work, int64_t w,
                        int64_t kh, void *out, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale,
                        float v_scale, int64_t window) {
    const int64_t G = H / KVH;
    const int64_t r = work[3 * w], t0 = work[3 * w + 1], nt = work[3 * w + 2];
    const int64_t qs = query_start_loc[r];
    const int64_t qlen = query_start_loc[r + 1] - qs;
    const int64_t ctx0 = seq_lens[r] - qlen; /* position of the request's first query token */
    const int64_t *bt = block_tables + r * bt_stride;
    const int64_t rows = nt * G;
    float m[rows], l[rows], s[rows * KB];
    float acc[rows * D], qf[rows * D];
    float kt[D * KB], vt[KB * D];
    int64_t pos[rows];
    for (int64_t i = 0; i < nt; i++) {
        for (int64_t g = 0; g < G; g++) {
            const int64_t row = i * G + g;
            /* Scaled once here, so scores come out of the FMAs ready for the softmax. */
            load_f32(qf + row * D, q, (qs + t0 + i) * ldq + (kh * G + g) * D, 1, D, q_dt, NULL);
            for (int64_t d = 0; d < D; d++) qf[row * D + d] *= scale;
            pos[row] = ctx0 + t0 + i;
            m[row] = -INFINITY;
            l[row] = 0.f;
        }
    }
    memset(acc, 0, sizeof(float) * rows * D);
    const int64_t last = ctx0 + t0 + nt - 1;
    int64_t first = 0;
    if (window > 0 && ctx0 + t0 - window + 1 > 0) first = ctx0 + t0 - window + 1;
    const int64_t stride = KVH * D; /* elements between consecutive slots of a block */
    int done = 0;
#ifdef FAST_DECODE
    if (rows < TRANSPOSE_MIN_ROWS && (D == 32 || D == 64 || D == 128)) {
        int mode = kv_dt == DT_F32 ? KM_F32 : KM_CONV;
        uint16_t qb[rows * D];
#if defined(__AVX512BF16__)
        if (kv_dt == DT_BF16 && q_dt == DT_BF16) {
            mode = KM_BF16DP;
            for (int64_t row = 0; row < rows; row++)
                memcpy(qb + row * D, (const uint16_t *)q + (qs + t0 + row / G) * ldq + (kh * G + row % G) * D,
                       sizeof(uint16_t) * D);
        }
#endif
        for (int64_t r0 = 0; r0 < rows; r0 += DEC_ROWS) {
            const int nr = rows - r0 < DEC_ROWS ? (int)(rows - r0) : DEC_ROWS;
            decode_dispatch(nr, D, mode, qf + r0 * D, qb + r0 * D, scale, k_cache, v_cache, kv_dt, fp8_table, bt,
                            BS, kh * D, stride, pos + r0, first, last, window, acc + r0 * D, l + r0, kt, vt);
        }
        done = 1;
    }
#endif
    for (int64_t k0 = first, kn; !done && k0 <= last; k0 += kn) {
        /* A run of keys inside one cache block: consecutive slots. */
        const int64_t off = k0 % BS;
        kn = BS - off;
        if (kn > KB) kn = KB;
        if (kn > last + 1 - k0) kn = last + 1 - k0;
        const int64_t base = ((bt[k0 / BS] * BS + off) * KVH + kh) * D;
        for (int64_t j = 0; j < kn; j++) load_f32(vt + j * D, v_cache, base + j * stride, 1, D, kv_dt, fp8_table);
        if (rows >= TRANSPOSE_MIN_ROWS) {
            /* kt[d][j] = K[key j][d]: one strided load per d; keys past the run are 0. */
            for (int64_t d = 0; d < D; d++) {
                load_f32(kt + d * KB, k_cache, base + d, stride, kn, kv_dt, fp8_table);
                for (int64_t j = kn; j < KB; j++) kt[d * KB + j] = 0.f;
            }
            for (int64_t r0 = 0; r0 < rows; r0 += RB) {
                const int64_t nr = rows - r0 < RB ? rows - r0 : RB;
                scores_rb(s + r0 * KB, qf + r0 * D, nr, kt, D);
            }
        } else {
            /* Few rows (a decode): the transpose would not pay; contiguous rows, dot each. */
            for (int64_t j = 0; j < kn; j++) load_f32(kt + j * D, k_cache, base + j * stride, 1, D, kv_dt, fp8_table);
            for (int64_t row = 0; row < rows; row++)
                for (int64_t j = 0; j < kn; j++) s[row * KB + j] = dot(qf + row * D, kt + j * D, D);
        }
        for (int64_t row = 0; row < rows; row++) {
            float *sr = s + row * KB;
            float mx = -INFINITY;
            for (int64_t j = 0; j < kn; j++) {
                const int64_t key = k0 + j;
                const int visible = key <= pos[row] && (window <= 0 || key > pos[row] - window);
                if (!visible) sr[j] = -INFINITY;
                if (sr[j] > mx) mx = sr[j];
            }
            if (mx == -INFINITY) continue;
            float *ar = acc + row * D;
            if (mx > m[row]) {
                const float alpha = expf(m[row] - mx); /* 0 on the first run */
                l[row] *= alpha;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ar[d] *= alpha;
                m[row] = mx;
            }
            /* exp over the whole run at once (vectorized); hidden keys give exactly 0. */
            float p[KB];
            const float mr = m[row];
#pragma omp simd
            for (int64_t j = 0; j < kn; j++) p[j] = expf(sr[j] - mr);
            for (int64_t j = 0; j < kn; j++) {
                l[row] += p[j];
                const float pj = p[j];
                const float *vj = vt + j * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ar[d] += pj * vj[d];
            }
        }
    }
    for (int64_t i = 0; i < nt; i++) {
        for (int64_t g = 0; g < G; g++) {
            const int64_t row = i * G + g;
            const float inv = l[row] > 0.f ? v_scale / l[row] : 0.f;
            store_f32(out, ((qs + t0 + i) * H + kh * G + g) * D, acc + row * D, inv, D, q_dt);
        }
    }
}

#define ATTEND_ARGS q, q_dt, ldq, k_cache, v_cache, kv_dt, fp8_table, block_tables, bt_stride, query_start_loc, seq_lens, \
                    work

void paged_attention(const void *q, int q_dt, int64_t ldq, const void *k_cache, const void *v_cache, int kv_dt,
                     const float *fp8_table, const int64_t *block_tables, int64_t bt_stride,
                     const int64_t *query_start_loc, const int64_t *seq_lens, const int64_t *work, int64_t num_work,
                     void *out, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale, float v_scale,
                     int64_t window) {
    /* Query-row x key pairs of the call: below PARALLEL_MIN_PAIRS (a few hundred microseconds of
     * work, e.g. one decode) one thread does it all, as waking the team would cost more. */
    int64_t pairs = 0;
    for (int64_t w = 0; w < num_work; w++) pairs += work[3 * w + 2] * seq_lens[work[3 * w]];
    pairs *= H;
#pragma omp parallel for schedule(dynamic, 1) collapse(2) if (pairs >= PARALLEL_MIN_PAIRS)
    for (int64_t w = 0; w < num_work; w++)
        for (int64_t kh = 0; kh < KVH; kh++)
            attend_item(ATTEND_ARGS, w, kh, out, H, KVH, D, BS, scale, v_scale, window);
}

/* Work items x KV heads [lo, hi) of the call (item w, KV head kh is number w * KVH + kh), on the
 * calling thread: for callers that split the items over their own OpenMP team. */
void paged_attention_items(const void *q, int q_dt, int64_t ldq, const void *k_cache, const void *v_cache, int kv_dt,
                           const float *fp8_table, const int64_t *block_tables, int64_t bt_stride,
                           const int64_t *query_start_loc, const int64_t *seq_lens, const int64_t *work, int64_t lo,
                           int64_t hi, void *out, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale,
                           float v_scale, int64_t window) {
    for (int64_t i = lo; i < hi; i++)
        attend_item(ATTEND_ARGS, i / KVH, i % KVH, out, H, KVH, D, BS, scale, v_scale, window);
}

/*
 * The KV cache write of a step: T rows of K and of V (row_bytes each, row strides ldk and ldv in
 * bytes) copied to their slots of the cache halves kc and vc (num_slots rows of row_bytes), as
 * index_copy_ does, in one call instead of two. Returns 2, writing nothing, when a slot is outside
 * [0, num_slots). Split over the threads from 64 KiB on: a block's first write faults its pages in,
 * which costs far more than the copy, and both threads fault in parallel.
 */
int kv_cache_write(void *kc, void *vc, const void *k, int64_t ldk, const void *v, int64_t ldv, const int64_t *slots,
                   int64_t T, int64_t row_bytes, int64_t num_slots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 2;
#pragma omp parallel for schedule(static) if (T * row_bytes >= (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        memcpy((char *)kc + slots[t] * row_bytes, (const char *)k + t * ldk, (size_t)row_bytes);
        memcpy((char *)vc + slots[t] * row_bytes, (const char *)v + t * ldv, (size_t)row_bytes);
    }
    return 0;
}
