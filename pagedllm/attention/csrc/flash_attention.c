/*
 * Flash attention of one long prompt chunk on CPU, bfloat16 queries and bfloat16 KV cache, with
 * vdpbf16ps (AVX-512 BF16) for both Q K^T and P V, an online softmax in float32 and float32
 * accumulators. Keys and values are read from the paged cache through the block list.
 *
 * The chunk's query tokens sit at positions ctx0 .. seq_len - 1 (ctx0 = seq_len - query_len) and
 * see keys 0 .. their own position (and, with a sliding window, only keys > position - window).
 *
 * 1. Packing (parallel over KV heads x key tiles of KT = 64 keys): each tile of K is stored as
 *    kp[D/2][KT] 32-bit pairs (k[key][2i], k[key][2i+1]), so that one vdpbf16ps of a broadcast
 *    query pair against 16 consecutive pairs adds two terms of the scores of one query row
 *    against 16 keys, keys across lanes, no horizontal reduction. Each tile of V is stored as
 *    vp[KT/2][D] pairs (v[2t][d], v[2t+1][d]), so that one vdpbf16ps of a broadcast pair of
 *    probabilities against 16 pairs adds two keys' terms to 16 output columns. Padding keys are
 *    zeros.
 * 2. Attention (parallel over KV heads x query tiles, the longest tiles first): a query tile is
 *    TQ tokens x the G query heads sharing the KV head (rows token-major), so each packed K/V
 *    tile serves G heads. For every key tile the rows go 4 at a time: 4 x 64 scores in 16
 *    registers (each K load feeds 4 rows, each query broadcast 4 key vectors), scaled, masked
 *    only on tiles that cross a row's causal limit or window edge, online softmax (running max
 *    and sum per row, the float32 output rows rescaled when the max grows), then P rounded to
 *    bfloat16 and P V accumulated into the rows' float32 outputs. Key tiles wholly after the
 *    tile's last position (or before its window) are skipped.
 *
 * Precision: products of two bf16 are exact in float32, so the scores are the float32 dot
 * products of the bf16 inputs; the weights come from a degree-4 2^x (relative error < 5e-5) and
 * are rounded to bfloat16 (relative error <= 2^-9 per weight), and the softmax sum is taken over
 * the rounded weights, so the output is a convex combination of V rows with each weight within
 * 2 (2^-9 + 5e-5) (relative) of the exact one: |error| <= (2^-8 + 1e-4) max|v| before the final
 * rounding of the output to bfloat16.
 *
 * Layouts: q [*, H, D] (rows q_start .., q_stride elements apart: a view into a wider row is read in
 * place), out [query_len, H, D], k_cache, v_cache
 * [num_blocks, block_size, KVH, D], blocks [ceil(seq_len / block_size)] block ids.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define KT 64        /* keys per tile */
#define RB 4         /* query rows per register block */
#define ROWS_MAX 128 /* query rows (tokens x G) per work item */
#define NEG_BIG (-1e30f)

static void pack_tile(uint32_t *restrict kp, uint32_t *restrict vp, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int64_t *blocks, int64_t BS, int64_t stride, int64_t head_off, int64_t k0, int64_t seq_len,
                      int D) {
    const int P = D / 2;
    for (int j = 0; j < KT; j++) {
        const int64_t k = k0 + j;
        if (k >= seq_len) {
            for (int i = 0; i < P; i++) kp[i * KT + j] = 0;
            for (int d = 0; d < D; d++) ((uint16_t *)(vp + (j / 2) * D))[2 * d + (j & 1)] = 0;
            continue;
        }
        const int64_t off = (blocks[k / BS] * BS + k % BS) * stride + head_off;
        const uint32_t *kr = (const uint32_t *)(k_cache + off);
        for (int i = 0; i < P; i++) kp[i * KT + j] = kr[i];
        const uint16_t *vr = v_cache + off;
        uint16_t *dst = (uint16_t *)(vp + (j / 2) * D) + (j & 1);
        for (int d = 0; d < D; d++) dst[2 * d] = vr[d];
    }
}

/* 2^x for x <= 0 on 16 lanes, accurate enough for weights rounded to bfloat16: 2^n 2^r with
 * |r| <= 1/2 and a degree-4 Taylor polynomial of e^(r ln 2) (relative error below 5e-5, 40 times
 * under bfloat16's 2^-9); very negative x give 0. */
static inline __m512 exp2_bf16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.6181291e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* One key tile for RB rows: scores, online softmax, P V. qr: the rows' queries (bf16 pairs);
 * pos: their positions; o: their float32 outputs [RB][D]; m, l: running max and sum. */
static inline __attribute__((always_inline)) void tile_rows(
    const int D, const uint32_t *const *qr, const int64_t *pos, const uint32_t *restrict kp,
    const uint32_t *restrict vp, const int64_t k0, const int masked, const int64_t window, const float scale2,
    float *restrict o, float *restrict m, float *restrict l) {
    __m512 s[RB][KT / 16];
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < KT / 16; v++) s[r][v] = _mm512_setzero_ps();
    for (int i = 0; i < D / 2; i++) {
        __m512bh b[KT / 16];
        for (int v = 0; v < KT / 16; v++) b[v] = (__m512bh)_mm512_loadu_si512((const void *)(kp + i * KT + 16 * v));
        for (int r = 0; r < RB; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)qr[r][i]);
            for (int v = 0; v < KT / 16; v++) s[r][v] = _mm512_dpbf16_ps(s[r][v], a, b[v]);
        }
    }
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80); /* bf16 1.0 */
    uint32_t pb[RB][KT / 2] __attribute__((aligned(64)));
    float alpha[RB];
    for (int r = 0; r < RB; r++) {
        __mmask16 vis[KT / 16];
        __m512 mx = _mm512_set1_ps(NEG_BIG);
        int any = 0;
        for (int v = 0; v < KT / 16; v++) {
            vis[v] = 0xffff;
            if (masked) {
                const __m512i keys = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(k0 + 16 * v)));
                const __m512i pr = _mm512_set1_epi32((int)pos[r]);
                vis[v] = _mm512_cmple_epi32_mask(keys, pr);
                if (window > 0)
                    vis[v] &= _mm512_cmpgt_epi32_mask(keys, _mm512_sub_epi32(pr, _mm512_set1_epi32((int)window)));
            }
            any |= vis[v];
            mx = _mm512_mask_max_ps(mx, vis[v], mx, s[r][v]);
        }
        alpha[r] = 1.f;
        if (!any) {
            memset(pb[r], 0, sizeof(pb[r]));
            continue;
        }
        /* Scores in the log2 domain: x = s * scale * log2(e); m is the running max of x. */
        const float tmax = _mm512_reduce_max_ps(mx) * scale2;
        if (tmax > m[r]) {
            alpha[r] = exp2f(m[r] - tmax); /* 0 on the first visible tile (m = NEG_BIG) */
            m[r] = tmax;
        }
        const __m512 mr = _mm512_set1_ps(m[r]), sc = _mm512_set1_ps(scale2);
        __m512 sum = _mm512_setzero_ps();
        for (int v = 0; v < KT / 32; v++) {
            /* 32 weights rounded to bf16 in key order (pairs of adjacent keys), summed by one
             * vdpbf16ps against ones. */
            const __m512 p0 = _mm512_maskz_mov_ps(vis[2 * v], exp2_bf16(_mm512_fmsub_ps(s[r][2 * v], sc, mr)));
            const __m512 p1 = _mm512_maskz_mov_ps(vis[2 * v + 1], exp2_bf16(_mm512_fmsub_ps(s[r][2 * v + 1], sc, mr)));
            const __m512bh pbf = _mm512_cvtne2ps_pbh(p1, p0);
            _mm512_store_si512((void *)(pb[r] + 16 * v), (__m512i)pbf);
            sum = _mm512_dpbf16_ps(sum, pbf, ones);
        }
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    for (int c0 = 0; c0 < D; c0 += 64) {
        const int CV = (D - c0 >= 64 ? 64 : D - c0) / 16;
        __m512 acc[RB][4];
        for (int r = 0; r < RB; r++) {
            const __m512 al = _mm512_set1_ps(alpha[r]);
            for (int v = 0; v < CV; v++) {
                acc[r][v] = _mm512_loadu_ps(o + r * D + c0 + 16 * v);
                if (alpha[r] != 1.f) acc[r][v] = _mm512_mul_ps(acc[r][v], al);
            }
        }
        for (int t = 0; t < KT / 2; t++) {
            __m512bh b[4];
            for (int v = 0; v < CV; v++) b[v] = (__m512bh)_mm512_loadu_si512((const void *)(vp + t * D + c0 + 16 * v));
            for (int r = 0; r < RB; r++) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pb[r][t]);
                for (int v = 0; v < CV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int v = 0; v < CV; v++) _mm512_storeu_ps(o + r * D + c0 + 16 * v, acc[r][v]);
    }
}

/* Key tiles are visited for the work item's rows [0, nrows) (a multiple of RB). */
static inline __attribute__((always_inline)) void work_item(
    const int D, const uint32_t *const *qrow, const int64_t *pos, int nrows, const uint32_t *kp_head,
    const uint32_t *vp_head, int64_t ntiles, int64_t window, float scale, float *o, float *m, float *l) {
    const int64_t pmin = pos[0], pmax = pos[nrows - 1];
    int64_t t_first = 0;
    if (window > 0 && pmin - window + 1 > 0) t_first = (pmin - window + 1) / KT;
    int64_t t_last = pmax / KT;
    if (t_last >= ntiles) t_last = ntiles - 1;
    for (int64_t t = t_first; t <= t_last; t++) {
        const int64_t k0 = t * KT;
        const uint32_t *kp = kp_head + t * (int64_t)KT * (D / 2);
        const uint32_t *vp = vp_head + t * (int64_t)KT * (D / 2);
        for (int r0 = 0; r0 < nrows; r0 += RB) {
            const int64_t lo = pos[r0], hi = pos[r0 + RB - 1];
            if (k0 > hi || (window > 0 && k0 + KT - 1 <= lo - window)) continue; /* nothing visible */
            const int masked = k0 + KT - 1 > lo || (window > 0 && k0 <= hi - window);
            tile_rows(D, qrow + r0, pos + r0, kp, vp, k0, masked, window, scale * 1.44269504088896341f, o + r0 * D,
                      m + r0, l + r0);
        }
    }
}

void flash_prefill_bf16(const uint16_t *q, int64_t q_start, int64_t q_stride, int64_t query_len, int64_t seq_len,
                        const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *blocks, int64_t BS,
                        int64_t H, int64_t KVH, int64_t D, float scale, int64_t window, uint16_t *out) {
    const int64_t G = H / KVH, ctx0 = seq_len - query_len, stride = KVH * D;
    const int64_t ntiles = (seq_len + KT - 1) / KT, tile_elems = (int64_t)KT * D / 2;
    uint32_t *kp = aligned_alloc(64, (size_t)(KVH * ntiles * tile_elems * 4));
    uint32_t *vp = aligned_alloc(64, (size_t)(KVH * ntiles * tile_elems * 4));
    if (!kp || !vp) {
        free(kp), free(vp);
        return;
    }
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t h = 0; h < KVH; h++)
        for (int64_t t = 0; t < ntiles; t++)
            pack_tile(kp + (h * ntiles + t) * tile_elems, vp + (h * ntiles + t) * tile_elems, k_cache, v_cache,
                      blocks, BS, stride, h * D, t * KT, seq_len, (int)D);

    int64_t tq = ROWS_MAX / G;
    if (tq < 1) tq = 1;
    const int64_t nqt = (query_len + tq - 1) / tq;
#pragma omp parallel
    {
        const int64_t cap = tq * G + RB;
        float *o = aligned_alloc(64, (size_t)(cap * D * 4));
        float *m = malloc((size_t)cap * 4), *l = malloc((size_t)cap * 4);
        const uint32_t **qrow = malloc((size_t)cap * sizeof(*qrow));
        int64_t *pos = malloc((size_t)cap * 8);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < KVH * nqt; w++) {
            const int64_t h = w % KVH, qt = nqt - 1 - w / KVH; /* the longest tiles first */
            const int64_t t0 = qt * tq, tn = query_len - t0 < tq ? query_len - t0 : tq;
            int nrows = (int)(tn * G);
            for (int r = 0; r < nrows; r++) {
                const int64_t tok = t0 + r / G, head = h * G + r % G;
                qrow[r] = (const uint32_t *)(q + (q_start + tok) * q_stride + head * D);
                pos[r] = ctx0 + tok;
            }
            for (; nrows % RB; nrows++) qrow[nrows] = qrow[nrows - 1], pos[nrows] = pos[nrows - 1];
            memset(o, 0, (size_t)nrows * D * 4);
            for (int r = 0; r < nrows; r++) m[r] = NEG_BIG, l[r] = 0.f;
            const uint32_t *kh = kp + h * ntiles * tile_elems, *vh = vp + h * ntiles * tile_elems;
            if (D == 64)
                work_item(64, qrow, pos, nrows, kh, vh, ntiles, window, scale, o, m, l);
            else if (D == 128)
                work_item(128, qrow, pos, nrows, kh, vh, ntiles, window, scale, o, m, l);
            else
                work_item((int)D, qrow, pos, nrows, kh, vh, ntiles, window, scale, o, m, l);
            for (int r = 0; r < (int)(tn * G); r++) {
                const int64_t tok = t0 + r / G, head = h * G + r % G;
                uint16_t *dst = out + (tok * H + head) * D;
                const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);
                for (int64_t d = 0; d < D; d += 16)
                    _mm256_storeu_si256((__m256i *)(dst + d),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv)));
            }
        }
        free(o), free(m), free(l), free(qrow), free(pos);
    }
    free(kp), free(vp);
}
#endif
