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
/* acc + a b over the PK elements of each 32-bit word, lane by lane. */
static inline __attribute__((always_inline)) __m512 madd(__m512 acc, __m512i a, __m512i b, const int PK) {
#if defined(__AVX512BF16__)
    if (PK == 2) return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#endif
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
}

/* 2^x for x <= 0 on 16 lanes: 2^n 2^r with |r| <= 1/2 and a Taylor polynomial of e^(r ln 2), of
 * degree 4 for weights rounded to bfloat16 (relative error below 5e-5, 40 times under bfloat16's
 * 2^-9) and of degree 7 for float32 (below 1e-8); very negative x give 0. */
static inline __attribute__((always_inline)) __m512 exp2_weights(__m512 x, const int PK) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p;
    if (PK == 2) {
        p = _mm512_set1_ps(9.6181291e-3f);
    } else {
        p = _mm512_set1_ps(1.5252734e-5f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.5403530e-4f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));
    }
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

_Static_assert(KT == 64, "softmax_row takes a tile's scores as four vectors");

/* The online softmax of one row's KT scores s0..s3 (keys k0 ..): its weights P into pw (KT / PK words;
 * bf16 pairs of adjacent keys for PK = 2), its running max *m (log2 domain) and sum *l updated;
 * returns the factor alpha its earlier outputs are to be scaled by (1 where the max did not grow).
 * The scores come by value: an array passed by address would keep the caller's score registers in
 * memory through its whole Q K^T loop (float32 flash 218 -> 314 ms a layer on a 2,048-token prompt). */
static inline __attribute__((always_inline)) float softmax_row(const int PK, const __m512 s0, const __m512 s1,
                                                             const __m512 s2, const __m512 s3, const int64_t pos,
                                                             const int64_t k0, const int masked, const int64_t window,
                                                             const float scale2, float *m, float *l, uint32_t *pw) {
    const __m512 sr[KT / 16] = {s0, s1, s2, s3};
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 vis[KT / 16];
    __m512 mx = _mm512_set1_ps(NEG_BIG);
    int any = 0;
    for (int v = 0; v < KT / 16; v++) {
        vis[v] = 0xffff;
        if (masked) {
            const __m512i keys = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(k0 + 16 * v)));
            const __m512i pr = _mm512_set1_epi32((int)pos);
            vis[v] = _mm512_cmple_epi32_mask(keys, pr);
            if (window > 0)
                vis[v] &= _mm512_cmpgt_epi32_mask(keys, _mm512_sub_epi32(pr, _mm512_set1_epi32((int)window)));
        }
        any |= vis[v];
        mx = _mm512_mask_max_ps(mx, vis[v], mx, sr[v]);
    }
    float alpha = 1.f;
    if (!any) {
        memset(pw, 0, (size_t)KT / PK * 4);
        return alpha;
    }
    /* Scores in the log2 domain: x = s * scale * log2(e); m is the running max of x. */
    const float tmax = _mm512_reduce_max_ps(mx) * scale2;
    if (tmax > *m) {
        alpha = exp2f(*m - tmax); /* 0 on the first visible tile (m = NEG_BIG) */
        *m = tmax;
    }
    const __m512 mr = _mm512_set1_ps(*m), sc = _mm512_set1_ps(scale2);
    __m512 sum = _mm512_setzero_ps();
    if (PK == 2) {
#if defined(__AVX512BF16__)
        const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80); /* bf16 1.0 */
        for (int v = 0; v < KT / 32; v++) {
            /* 32 weights rounded to bf16 in key order (pairs of adjacent keys), summed by one
             * vdpbf16ps against ones. */
            const __m512 p0 = _mm512_maskz_mov_ps(vis[2 * v], exp2_weights(_mm512_fmsub_ps(sr[2 * v], sc, mr), 2));
            const __m512 p1 =
                _mm512_maskz_mov_ps(vis[2 * v + 1], exp2_weights(_mm512_fmsub_ps(sr[2 * v + 1], sc, mr), 2));
            const __m512bh pbf = _mm512_cvtne2ps_pbh(p1, p0);
            _mm512_store_si512((void *)(pw + 16 * v), (__m512i)pbf);
            sum = _mm512_dpbf16_ps(sum, pbf, ones);
        }
#endif
    } else {
        for (int v = 0; v < KT / 16; v++) {
            const __m512 p = _mm512_maskz_mov_ps(vis[v], exp2_weights(_mm512_fmsub_ps(sr[v], sc, mr), 1));
            _mm512_store_ps((float *)pw + 16 * v, p);
            sum = _mm512_add_ps(sum, p);
        }
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    return alpha;
}

/* One key tile for RB rows: scores, online softmax, P V. qr: the rows' queries (words); pos: their
 * positions; o: their float32 outputs [RB][D]; m, l: running max and sum. */
static inline __attribute__((always_inline)) void tile_rows(
    const int D, const int PK, const uint32_t *const *qr, const int64_t *pos, const uint32_t *restrict kp,
    const uint32_t *restrict vp, const int64_t k0, const int masked, const int64_t window, const float scale2,
    float *restrict o, float *restrict m, float *restrict l) {
    __m512 s[RB][KT / 16];
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < KT / 16; v++) s[r][v] = _mm512_setzero_ps();
    for (int i = 0; i < D / PK; i++) {
        __m512i b[KT / 16];
        for (int v = 0; v < KT / 16; v++) b[v] = _mm512_loadu_si512((const void *)(kp + i * KT + 16 * v));
        for (int r = 0; r < RB; r++) {
            const __m512i a = _mm512_set1_epi32((int)qr[r][i]);
            for (int v = 0; v < KT / 16; v++) s[r][v] = madd(s[r][v], a, b[v], PK);
        }
    }
    uint32_t pw[RB][KT] __attribute__((aligned(64))); /* P as words: KT / PK per row */
    float alpha[RB];
    for (int r = 0; r < RB; r++)
        alpha[r] = softmax_row(PK, s[r][0], s[r][1], s[r][2], s[r][3], pos[r], k0, masked, window, scale2, m + r, l + r,
                               pw[r]);
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
        for (int t = 0; t < KT / PK; t++) {
            __m512i b[4];
            for (int v = 0; v < CV; v++) b[v] = _mm512_loadu_si512((const void *)(vp + t * D + c0 + 16 * v));
            for (int r = 0; r < RB; r++) {
                const __m512i a = _mm512_set1_epi32((int)pw[r][t]);
                for (int v = 0; v < CV; v++) acc[r][v] = madd(acc[r][v], a, b[v], PK);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int v = 0; v < CV; v++) _mm512_storeu_ps(o + r * D + c0 + 16 * v, acc[r][v]);
    }
}

#if HAVE_AMX_BF16
#define AMX_ROWS 16 /* query rows per tile block on AMX */

/* P V into the float32 outputs o[16][D] for the 64 output columns from c0 (CV of 16: 4, or 2 at
 * the end of a D that is an odd multiple of 32): the outputs' tiles loaded, KT keys' weights
 * (pw: 16 rows of KT bf16, 32 keys per tile) times the packed V (16 pairs of keys x 16 columns per
 * tile) added, and stored back. */
static inline __attribute__((always_inline)) void amx_pv(const int D, const int c0, const int CV, const uint32_t *pw,
                                                        const uint32_t *restrict vp, float *restrict o) {
    _tile_loadd(0, o + c0, D * 4);
    _tile_loadd(1, o + c0 + 16, D * 4);
    if (CV == 4) {
        _tile_loadd(2, o + c0 + 32, D * 4);
        _tile_loadd(3, o + c0 + 48, D * 4);
    }
    for (int k = 0; k < KT / 32; k++) {
        const uint32_t *vk = vp + 16 * k * D + c0;
        _tile_loadd(4, (const char *)pw + 64 * k, KT * 2);
        _tile_loadd(5, vk, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, vk + 16, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        if (CV == 4) {
            _tile_loadd(7, vk + 32, D * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, vk + 48, D * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, o + c0, D * 4);
    _tile_stored(1, o + c0 + 16, D * 4);
    if (CV == 4) {
        _tile_stored(2, o + c0 + 32, D * 4);
        _tile_stored(3, o + c0 + 48, D * 4);
    }
}

/* One key tile for AMX_ROWS rows of bf16 (PK = 2), as tile_rows on the tile unit: the 16 x KT
 * scores as four tiles of 16 x 16 float32 sums (the rows' queries qa [16][D], 32 columns a tile,
 * times the packed K, whose 16 words of dimension pairs x 16 keys are a tile as they lie), the
 * same online softmax per row, then P V (amx_pv). D % 32 == 0. */
static inline __attribute__((always_inline)) void tile_rows_amx(
    const int D, const uint16_t *restrict qa, const int64_t *pos, const uint32_t *restrict kp,
    const uint32_t *restrict vp, const int64_t k0, const int masked, const int64_t window, const float scale2,
    float *restrict o, float *restrict m, float *restrict l) {
    float s[AMX_ROWS][KT] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < D / 32; c++) {
        const uint32_t *kc = kp + 16 * c * KT;
        _tile_loadd(4, qa + 32 * c, D * 2);
        _tile_loadd(5, kc, KT * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, kc + 16, KT * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, kc + 32, KT * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, kc + 48, KT * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, &s[0][0], KT * 4);
    _tile_stored(1, &s[0][16], KT * 4);
    _tile_stored(2, &s[0][32], KT * 4);
    _tile_stored(3, &s[0][48], KT * 4);
    uint32_t pw[AMX_ROWS][KT / 2] __attribute__((aligned(64)));
    for (int r = 0; r < AMX_ROWS; r++) {
        const float alpha = softmax_row(2, _mm512_load_ps(&s[r][0]), _mm512_load_ps(&s[r][16]), _mm512_load_ps(&s[r][32]),
                                        _mm512_load_ps(&s[r][48]), pos[r], k0, masked, window, scale2, m + r, l + r, pw[r]);
        if (alpha != 1.f) {
            const __m512 al = _mm512_set1_ps(alpha);
            for (int d = 0; d < D; d += 16) _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), al));
        }
    }
    for (int c0 = 0; c0 < D; c0 += 64) {
        if (D - c0 >= 64)
            amx_pv(D, c0, 4, &pw[0][0], vp, o);
        else
            amx_pv(D, c0, 2, &pw[0][0], vp, o);
    }
}

#endif

#else
/* 2^x for x <= 0 on 8 lanes, float32 weights: 2^n 2^r with |r| <= 1/2 and the degree-7 polynomial
 * of the AVX-512 form (relative error below 1e-8); 2^n is built in the exponent field, and x below
 * -126.5 gives 0 (those weights are under 2^-126 of the row's largest). */
static inline __attribute__((always_inline)) __m256 exp2_weights8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-127.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5252734e-5f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.5403530e-4f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3333558e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e)); /* n = -127: a zero exponent field, 0 */
}

/* One key tile for RB rows, float32 (PK = 1), as the AVX-512 form: scores with keys across lanes,
 * online softmax, P V; visibility as all-ones lanes. */
static inline __attribute__((always_inline)) void tile_rows(
    const int D, const int PK, const uint32_t *const *qr, const int64_t *pos, const uint32_t *restrict kp,
    const uint32_t *restrict vp, const int64_t k0, const int masked, const int64_t window, const float scale2,
    float *restrict o, float *restrict m, float *restrict l) {
    (void)PK;
    __m256 s[RB][KT / 8];
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < KT / 8; v++) s[r][v] = _mm256_setzero_ps();
    for (int i = 0; i < D; i++) {
        __m256 b[KT / 8];
        for (int v = 0; v < KT / 8; v++) b[v] = _mm256_loadu_ps((const float *)(kp + i * KT + 8 * v));
        for (int r = 0; r < RB; r++) {
            const __m256 a = _mm256_broadcast_ss((const float *)qr[r] + i);
            for (int v = 0; v < KT / 8; v++) s[r][v] = _mm256_fmadd_ps(a, b[v], s[r][v]);
        }
    }
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 neg = _mm256_set1_ps(NEG_BIG);
    float pw[RB][KT] __attribute__((aligned(32)));
    float alpha[RB];
    for (int r = 0; r < RB; r++) {
        __m256 vis[KT / 8];
        __m256 mx = neg;
        int any = 0;
        for (int v = 0; v < KT / 8; v++) {
            vis[v] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            if (masked) {
                const __m256i keys = _mm256_add_epi32(iota, _mm256_set1_epi32((int)(k0 + 8 * v)));
                const __m256i pr = _mm256_set1_epi32((int)pos[r]);
                __m256i hidden = _mm256_cmpgt_epi32(keys, pr);
                if (window > 0) /* keys <= pos - window are outside the window */
                    hidden = _mm256_or_si256(
                        hidden, _mm256_cmpgt_epi32(_mm256_sub_epi32(pr, _mm256_set1_epi32((int)window - 1)), keys));
                vis[v] = _mm256_castsi256_ps(_mm256_xor_si256(hidden, _mm256_set1_epi32(-1)));
            }
            any |= _mm256_movemask_ps(vis[v]);
            mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg, s[r][v], vis[v]));
        }
        alpha[r] = 1.f;
        if (!any) {
            memset(pw[r], 0, sizeof(pw[r]));
            continue;
        }
        const float tmax = lane_max8(mx) * scale2;
        if (tmax > m[r]) {
            alpha[r] = exp2f(m[r] - tmax);
            m[r] = tmax;
        }
        const __m256 mr = _mm256_set1_ps(m[r]), sc = _mm256_set1_ps(scale2);
        __m256 sum = _mm256_setzero_ps();
        for (int v = 0; v < KT / 8; v++) {
            const __m256 p = _mm256_and_ps(vis[v], exp2_weights8(_mm256_fmsub_ps(s[r][v], sc, mr)));
            _mm256_store_ps(pw[r] + 8 * v, p);
            sum = _mm256_add_ps(sum, p);
        }
        l[r] = l[r] * alpha[r] + lane_sum8(sum);
    }
    for (int c0 = 0; c0 < D; c0 += 32) {
        const int CV = (D - c0 >= 32 ? 32 : D - c0) / 8;
        __m256 acc[RB][4];
        for (int r = 0; r < RB; r++) {
            const __m256 al = _mm256_set1_ps(alpha[r]);
            for (int v = 0; v < CV; v++) {
                acc[r][v] = _mm256_loadu_ps(o + r * D + c0 + 8 * v);
                if (alpha[r] != 1.f) acc[r][v] = _mm256_mul_ps(acc[r][v], al);
            }
        }
        for (int t = 0; t < KT; t++) {
            __m256 b[4];
            for (int v = 0; v < CV; v++) b[v] = _mm256_loadu_ps((const float *)(vp + t * D + c0 + 8 * v));
            for (int r = 0; r < RB; r++) {
                const __m256 a = _mm256_broadcast_ss(pw[r] + t);
                for (int v = 0; v < CV; v++) acc[r][v] = _mm256_fmadd_ps(a, b[v], acc[r][v]);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int v = 0; v < CV; v++) _mm256_storeu_ps(o + r * D + c0 + 8 * v, acc[r][v]);
    }
}
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
