/*
 * Flash attention of one long prompt chunk on CPU, reading keys and values from the paged cache
 * through the block list, with an online softmax in float32 and float32 accumulators. Two element
 * types share the code, as 32-bit words of PK elements each:
 *   bfloat16 queries and cache (PK = 2, AVX-512 BF16): a word is a pair of bf16, and one vdpbf16ps
 *     of a broadcast word against 16 words adds two products per lane;
 *   float32 queries and cache (PK = 1, AVX-512F): a word is one float, and one vfmadd231ps of a
 *     broadcast float against 16 floats adds one product per lane;
 *   float32 on CPUs with AVX2 + FMA only: the same with 8 lanes, key tiles of KT = 32 and register
 *     blocks of 3 rows (see below); the packing, the work items and the order of every row's sums
 *     over key tiles are shared;
 *   bfloat16 queries and cache on CPUs without AVX-512 BF16 (AVX2 + FMA, or AVX-512F alone): the
 *     float32 form (PK = 1) on bf16 widened exactly to float32, K and V as the tiles are packed and
 *     each work item's query rows once into a float32 buffer; the output is rounded once to bf16.
 *
 * The chunk's query tokens sit at positions ctx0 .. seq_len - 1 (ctx0 = seq_len - query_len) and
 * see keys 0 .. their own position (and, with a sliding window, only keys > position - window).
 *
 * 1. Packing (parallel over KV heads x key tiles of KT = 64 keys, 32 on AVX2): each tile of K is
 *    stored as kp[D/PK][KT] words (word i of key j: k[j][PK i .. PK i + PK - 1]), so that one multiply-add
 *    of a broadcast query word against 16 consecutive words adds PK terms of the scores of one
 *    query row against 16 keys, keys across lanes, no horizontal reduction. Each tile of V is
 *    stored as vp[KT/PK][D] words (word d of key group t: v[PK t .. PK t + PK - 1][d]), so that
 *    one multiply-add of a broadcast word of probabilities against 16 words adds PK keys' terms
 *    to 16 output columns. Padding keys are zeros.
 * 2. Attention (parallel over KV heads x query tiles, the longest tiles first): a query tile is
 *    TQ tokens x the G query heads sharing the KV head (rows token-major), so each packed K/V
 *    tile serves G heads. For every key tile the rows go 4 at a time: 4 x 64 scores in 16
 *    registers (each K load feeds 4 rows, each query broadcast 4 key vectors; AVX2: 3 rows x 32
 *    keys in 12), scaled, masked only on tiles that cross a row's causal limit or window edge,
 *    online softmax (running max and sum per row, the float32 output rows rescaled when the max
 *    grows), then P (rounded to bfloat16 for PK = 2) and P V accumulated into the rows' float32
 *    outputs. Key tiles wholly
 *    after the tile's last position (or before its window) are skipped. Each row's result depends
 *    on its own query, position and the keys only, not on the other rows of the call.
 *
 * 3. On CPUs with AMX-BF16 (bf16, head size a multiple of 32), the rows of a work item go 16 at a
 *    time through the tile unit instead (tile_rows_amx): the packed layouts above are already the
 *    tiles' second operand (kp: 16 words of dimension pairs x 16 keys; vp: 16 words of key pairs x
 *    16 columns), so Q K^T is four 16 x 16 tiles of float32 scores from the rows' queries (copied
 *    once per work item into 16-row tiles of 32 dimensions) against kp, and P V adds the bf16
 *    weights' tiles times vp into the float32 outputs loaded as tiles. The softmax between them is
 *    the AVX-512 form's (softmax_row), on the scores stored from the tiles. Each element of S and
 *    of the output is the same sequence of tile products whichever rows share its block, so a row's
 *    result still depends only on its own query, position and the keys.
 *
 * Precision, bfloat16: products of two bf16 are exact in float32, so the scores are the float32
 * dot products of the bf16 inputs; the weights come from a degree-4 2^x (relative error < 5e-5)
 * and are rounded to bfloat16 (relative error <= 2^-9 per weight), and the softmax sum is taken
 * over the rounded weights, so the output is a convex combination of V rows with each weight
 * within 2 (2^-9 + 5e-5) (relative) of the exact one: |error| <= (2^-8 + 1e-4) max|v| before the
 * final rounding of the output to bfloat16.
 * Precision, float32: float32 sums in another order than a dense reference, a degree-7 2^x
 * (relative error < 1e-8, under the float32 rounding of its result) and no rounding of P: the
 * error is that of float32 arithmetic on D-term dot products and key-count-term sums.
 * The widened bf16 form has the float32 form's error on the bf16 inputs, then the output's rounding
 * to bf16 (half an ulp, 2^-9 relative).
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
#include "amx.h"

/* Register blocking per ISA: AVX-512 keeps RB x KT / 16 = 16 score vectors of 16 lanes; AVX2 + FMA
 * (float32 only: PK = 1) keeps 3 rows x 4 vectors of 8 lanes, 12 of its 16 ymm registers, beside
 * the 4 key vectors of the step (one of which the compiler may read as a memory operand). */
#if defined(__AVX512F__)
#define FLASH_LANES 16
#define KT 64 /* keys per tile */
#define RB 4  /* query rows per register block */
#elif defined(__AVX2__) && defined(__FMA__)
#define FLASH_LANES 8
#define KT 32
#define RB 3
#endif

#if defined(FLASH_LANES)
#include <immintrin.h>

#define ROWS_MAX 128 /* query rows (tokens x G) per work item */
#define NEG_BIG (-1e30f)

/* widen: a bf16 cache packed as float32 words (PK = 1). */
static inline __attribute__((always_inline)) void pack_tile(
    uint32_t *restrict kp, uint32_t *restrict vp, const void *k_cache, const void *v_cache, const int64_t *blocks,
    int64_t BS, int64_t stride, int64_t head_off, int64_t k0, int64_t seq_len, int D, const int PK, const int widen) {
    const int P = D / PK;
    for (int j = 0; j < KT; j++) {
        const int64_t k = k0 + j;
        const int live = k < seq_len;
        const int64_t off = live ? ((blocks[k / BS] * BS + k % BS) * stride + head_off) * (widen ? 2 : 4 / PK) : 0; /* bytes */
        if (widen) {
            const uint16_t *kr = (const uint16_t *)((const char *)k_cache + off);
            const uint16_t *vr = (const uint16_t *)((const char *)v_cache + off);
            for (int i = 0; i < D; i++) kp[i * KT + j] = live ? (uint32_t)kr[i] << 16 : 0;
            for (int d = 0; d < D; d++) vp[j * D + d] = live ? (uint32_t)vr[d] << 16 : 0;
            continue;
        }
        const uint32_t *kr = (const uint32_t *)((const char *)k_cache + off);
        for (int i = 0; i < P; i++) kp[i * KT + j] = live ? kr[i] : 0;
        if (PK == 2) {
            const uint16_t *vr = (const uint16_t *)((const char *)v_cache + off);
            uint16_t *dst = (uint16_t *)(vp + (j / 2) * D) + (j & 1);
            for (int d = 0; d < D; d++) dst[2 * d] = live ? vr[d] : 0;
        } else if (live) {
            memcpy(vp + j * D, (const char *)v_cache + off, (size_t)D * 4);
        } else {
            memset(vp + j * D, 0, (size_t)D * 4);
        }
    }
}

#if defined(__AVX512F__)
#include "flash_attention_avx512.h"
#else
#include "flash_attention_avx2.h"
#endif

/* The rows a work item's rows go in, and are padded to: a register block (RB), or a tile's 16 rows
 * on the tile unit (amx). */
static inline int row_block(const int amx) {
#if HAVE_AMX_BF16
    return amx ? AMX_ROWS : RB;
#else
    (void)amx;
    return RB;
#endif
}

/* Key tiles are visited for the work item's rows [0, nrows) (a multiple of row_block(amx)); on the
 * tile unit (amx) the rows' queries are packed in qa [nrows][D]. */
static inline __attribute__((always_inline)) void work_item(
    const int D, const int PK, const uint32_t *const *qrow, const uint16_t *qa, const int64_t *pos, int nrows,
    const uint32_t *kp_head, const uint32_t *vp_head, int64_t ntiles, int64_t window, float scale, float *o, float *m,
    float *l, const int amx) {
#if !HAVE_AMX_BF16
    (void)qa;
#endif
    const int rb = row_block(amx);
    const int64_t pmin = pos[0], pmax = pos[nrows - 1];
    int64_t t_first = 0;
    if (window > 0 && pmin - window + 1 > 0) t_first = (pmin - window + 1) / KT;
    int64_t t_last = pmax / KT;
    if (t_last >= ntiles) t_last = ntiles - 1;
    for (int64_t t = t_first; t <= t_last; t++) {
        const int64_t k0 = t * KT;
        const uint32_t *kp = kp_head + t * (int64_t)KT * (D / PK);
        const uint32_t *vp = vp_head + t * (int64_t)KT * (D / PK);
        for (int r0 = 0; r0 < nrows; r0 += rb) {
            const int64_t lo = pos[r0], hi = pos[r0 + rb - 1];
            if (k0 > hi || (window > 0 && k0 + KT - 1 <= lo - window)) continue; /* nothing visible */
            const int masked = k0 + KT - 1 > lo || (window > 0 && k0 <= hi - window);
#if HAVE_AMX_BF16
            if (amx) {
                tile_rows_amx(D, qa + r0 * D, pos + r0, kp, vp, k0, masked, window, scale * 1.44269504088896341f,
                              o + r0 * D, m + r0, l + r0);
                continue;
            }
#endif
            tile_rows(D, PK, qrow + r0, pos + r0, kp, vp, k0, masked, window, scale * 1.44269504088896341f,
                      o + r0 * D, m + r0, l + r0);
        }
    }
}

/* A row's output: its float32 sums times 1 / l, stored as float32 (PK = 1) or bfloat16 (PK = 2, or
 * widen). */
static inline __attribute__((always_inline)) void finish_row(const float *o, float inv, void *dst, int64_t D,
                                                             const int PK, const int widen) {
    if (widen) {
        for (int64_t d = 0; d < D; d++) ((uint16_t *)dst)[d] = f32_to_bf16(o[d] * inv);
        return;
    }
    if (PK == 1) {
        for (int64_t d = 0; d < D; d++) ((float *)dst)[d] = o[d] * inv;
        return;
    }
#if defined(__AVX512BF16__)
    for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)dst + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(inv))));
#endif
}

/* The whole call for elements of 4 / PK bytes (q, k_cache, v_cache and out of that type), or of bf16
 * computed in float32 (widen, PK = 1). */
static inline __attribute__((always_inline)) int flash_prefill(
    const void *q, int64_t q_start, int64_t q_stride, int64_t query_len, int64_t seq_len, const void *k_cache,
    const void *v_cache, const int64_t *blocks, int64_t BS, int64_t H, int64_t KVH, int64_t D, float scale,
    int64_t window, void *out, const int PK, const int widen) {
    const int64_t G = H / KVH, ctx0 = seq_len - query_len, stride = KVH * D, esize = widen ? 2 : 4 / PK;
    const int64_t ntiles = (seq_len + KT - 1) / KT, tile_elems = (int64_t)KT * D / PK;
    uint32_t *kp = aligned_alloc(64, (size_t)(KVH * ntiles * tile_elems * 4));
    uint32_t *vp = aligned_alloc(64, (size_t)(KVH * ntiles * tile_elems * 4));
    if (!kp || !vp) {
        free(kp), free(vp);
        return 1;
    }
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t h = 0; h < KVH; h++)
        for (int64_t t = 0; t < ntiles; t++)
            pack_tile(kp + (h * ntiles + t) * tile_elems, vp + (h * ntiles + t) * tile_elems, k_cache, v_cache,
                      blocks, BS, stride, h * D, t * KT, seq_len, (int)D, PK, widen);

#if HAVE_AMX_BF16
    const int amx = PK == 2 && !widen && D % 32 == 0 && amx_permitted();
#else
    const int amx = 0;
#endif
    const int rb = row_block(amx);
    int64_t tq = ROWS_MAX / G;
    if (tq < 1) tq = 1;
    const int64_t nqt = (query_len + tq - 1) / tq;
    int failed = 0;
#pragma omp parallel
    {
        const int64_t cap = tq * G + rb;
        float *o = aligned_alloc(64, (size_t)(cap * D * 4));
        float *m = malloc((size_t)cap * 4), *l = malloc((size_t)cap * 4);
        const uint32_t **qrow = malloc((size_t)cap * sizeof(*qrow));
        int64_t *pos = malloc((size_t)cap * 8);
        float *qf = widen ? malloc((size_t)(cap * D * 4)) : NULL; /* the query rows widened */
        uint16_t *qa = amx ? aligned_alloc(64, (size_t)(cap * D * 2)) : NULL; /* the query rows packed (AMX) */
        if (!o || !m || !l || !qrow || !pos || (widen && !qf) || (amx && !qa)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier /* every thread sees every thread's allocation before deciding */
        int any_failed;
#pragma omp atomic read
        any_failed = failed;
#if HAVE_AMX_BF16
        if (!any_failed && amx) amx_configure();
#endif
        if (!any_failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < KVH * nqt; w++) {
                const int64_t h = w % KVH, qt = nqt - 1 - w / KVH; /* the longest tiles first */
                const int64_t t0 = qt * tq, tn = query_len - t0 < tq ? query_len - t0 : tq;
                int nrows = (int)(tn * G);
                for (int r = 0; r < nrows; r++) {
                    const int64_t tok = t0 + r / G, head = h * G + r % G;
                    qrow[r] = (const uint32_t *)((const char *)q + ((q_start + tok) * q_stride + head * D) * esize);
                    if (widen) {
                        for (int64_t d = 0; d < D; d++) qf[r * D + d] = bf16_to_f32(((const uint16_t *)qrow[r])[d]);
                        qrow[r] = (const uint32_t *)(qf + r * D);
                    }
                    pos[r] = ctx0 + tok;
                }
                for (; nrows % rb; nrows++) qrow[nrows] = qrow[nrows - 1], pos[nrows] = pos[nrows - 1];
                memset(o, 0, (size_t)nrows * D * 4);
                for (int r = 0; r < nrows; r++) m[r] = NEG_BIG, l[r] = 0.f;
                const uint32_t *kh = kp + h * ntiles * tile_elems, *vh = vp + h * ntiles * tile_elems;
                if (amx)
                    for (int r = 0; r < nrows; r++) memcpy(qa + r * D, qrow[r], (size_t)D * 2);
                if (D == 64)
                    work_item(64, PK, qrow, qa, pos, nrows, kh, vh, ntiles, window, scale, o, m, l, amx);
                else if (D == 128)
                    work_item(128, PK, qrow, qa, pos, nrows, kh, vh, ntiles, window, scale, o, m, l, amx);
                else
                    work_item((int)D, PK, qrow, qa, pos, nrows, kh, vh, ntiles, window, scale, o, m, l, amx);
                for (int r = 0; r < (int)(tn * G); r++) {
                    const int64_t tok = t0 + r / G, head = h * G + r % G;
                    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
                    finish_row(o + r * D, inv, (char *)out + (tok * H + head) * D * esize, D, PK, widen);
                }
            }
        }
#if HAVE_AMX_BF16
        if (!any_failed && amx) _tile_release();
#endif
        free(o), free(m), free(l), free(qrow), free(pos), free(qf), free(qa);
    }
    free(kp), free(vp);
    return failed;
}

/* The float32 lanes of this build's form: 16 (AVX-512) or 8 (AVX2 + FMA). */
int flash_lanes(void) { return FLASH_LANES; }

/* 0, or 1 where a buffer could not be allocated (out is then not written). */
int flash_prefill_f32(const float *q, int64_t q_start, int64_t q_stride, int64_t query_len, int64_t seq_len,
                       const float *k_cache, const float *v_cache, const int64_t *blocks, int64_t BS, int64_t H,
                       int64_t KVH, int64_t D, float scale, int64_t window, float *out) {
    return flash_prefill(q, q_start, q_stride, query_len, seq_len, k_cache, v_cache, blocks, BS, H, KVH, D, scale,
                         window, out, 1, 0);
}

/* Whether flash_prefill_bf16 is the widened form (1: computes in float32) or bf16 dot products (0). */
int flash_bf16_widened(void) {
#if defined(__AVX512BF16__)
    return 0;
#else
    return 1;
#endif
}

/* Whether bf16 chunks (head size a multiple of 32) run on AMX tiles (tile_rows_amx). */
int flash_bf16_amx(void) {
#if HAVE_AMX_BF16
    return amx_permitted();
#else
    return 0;
#endif
}

int flash_prefill_bf16(const uint16_t *q, int64_t q_start, int64_t q_stride, int64_t query_len, int64_t seq_len,
                        const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *blocks, int64_t BS,
                        int64_t H, int64_t KVH, int64_t D, float scale, int64_t window, uint16_t *out) {
#if defined(__AVX512BF16__)
    return flash_prefill(q, q_start, q_stride, query_len, seq_len, k_cache, v_cache, blocks, BS, H, KVH, D, scale,
                         window, out, 2, 0);
#else
    return flash_prefill(q, q_start, q_stride, query_len, seq_len, k_cache, v_cache, blocks, BS, H, KVH, D, scale,
                         window, out, 1, 1);
#endif
}
#endif
