/* small_m_gemm.c's bf16 GEMM on AMX tiles (CPUs with AMX-BF16): gemm_rows_amx, which gemm_rows
 * calls from AMX_MIN_ROWS rows. Included by small_m_gemm.c after the AVX-512 tiles. */

/* Rows of x from which a bf16 GEMM runs on AMX tiles. With one row the pass over W is bound by
 * memory and the AVX-512 BF16 form reads W as fast; from 2 to 4 rows both run at the memory's rate,
 * from 5 rows the tiles are faster (30 layers of the default model, 2-core Xeon: 5 rows 8.8 against
 * 11.4 ms, 8 rows 9.3 against 16.7, 64 rows 19.2 against 72.2; benchmarks/bench_small_m_gemm.py).
 * From 2 rows on, then, a row of x gives the same bits in any batch.
 *
 * The tile unit does not sum as the AVX-512 BF16 dot products do, nor as any sequence of float32
 * additions: in one tile product (K = 32) of random bf16 data, two nonzero products give their
 * exact sum rounded once, but from three on neither the exact sum rounded once nor the pairs' sums
 * added in turn (to nearest or toward zero) give the tile's bits, and no order of VDPBF16PS does
 * over K = 576, so no AVX-512 form gives a row the bits the tiles give it. A caller that needs a
 * step of several rows to give each row the bits it has alone (speculative decoding: one request's
 * verification rows against the single row it decodes without proposals) raises the threshold for
 * that step (small_m_amx_from). */
#define AMX_MIN_ROWS 2
/* The rows from which gemm_rows takes the tiles now (small_m_amx_from). One setting per library,
 * read by every thread of a team. */
static int64_t amx_from_rows = AMX_MIN_ROWS;
static __thread uint32_t *amx_xp;
static __thread int64_t amx_xp_words;
static __thread uint16_t *amx_wpad;
static __thread int64_t amx_wpad_elems;

/* Packed x of one block of rows stays within this many bytes (an L2's share), so that every W block
 * of the call passes over it from L2: x blocks of at most AMX_X_BYTES / (2 K) rows, in 32s. */
#define AMX_X_BYTES (384 * 1024)

/* Rows [m_lo, m_lo + Mb) of x [M, K] bf16 as TDPBF16PS's second operand: for each block of 16 x
 * rows (mb) and 32 columns of K (kc), 16 lines of 16 32-bit words, line p word j = x[m_lo + mb * 16 +
 * j][kc * 32 + 2p, + 2p + 1] (zero past row M): pack16_dwords of each 16 rows. */
static void amx_pack_x(const uint16_t *x, int64_t m_lo, int64_t Mb, int64_t K, uint32_t *xp) {
    const int64_t KC = K / 32;
    for (int64_t mb = 0; mb < (Mb + 15) / 16; mb++)
        pack16_dwords(x + (m_lo + mb * 16) * K, K * 2, Mb - mb * 16, KC, 0, (int32_t *)xp + mb * KC * 256);
}

/* 16 W rows x 32 K columns times 16 x rows into accumulators: the k-loop of one output block of up
 * to 2 x 2 tiles (two_n: a second 16 W rows at w1; two_m: a second 16 x rows at b1; amx.h). */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *w0, const uint16_t *w1, int64_t ws,
                                                           const uint32_t *b0, const uint32_t *b1, int64_t KC,
                                                           int two_n, int two_m) {
    amx_tile_block(0, w0, ws, w1, ws, b0, b1, KC, two_n, two_m);
}

/* y[m0 .. m0 + mr - 1][n0 .. n0 + nr - 1] from a [16 W rows, 16 x rows] float32 tile c: transposed
 * to rows of y, the bias added in float32 and each sum rounded once to bf16 (as f32_to_bf16). */
static inline void amx_store(const float *c, int64_t m0, int64_t mr, int64_t n0, int64_t nr, int64_t N,
                             const uint16_t *bias, uint16_t *y) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512((const void *)(c + i * 16));
    transpose16_epi32(r);
    const __mmask16 cols = (__mmask16)((1u << nr) - 1);
    const __m512 b = bias != NULL ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, bias + n0)), 16))
                                  : _mm512_setzero_ps();
    for (int64_t j = 0; j < mr; j++) {
        __m512 v = _mm512_castsi512_ps(r[j]);
        if (bias != NULL) v = _mm512_add_ps(v, b);
        _mm256_mask_storeu_epi16(y + (m0 + j) * N + n0, cols, bf16x16_from_f32(v));
    }
}

/* Rows [n_lo, n_hi) of bf16 y[M, N] = x[M, K] W[N, K]^T (+ bias) on AMX tiles, on the calling
 * thread (K % 32 == 0). W's rows are the tiles' first operand as they lie in memory (16 rows, 64
 * bytes of each, K * 2 bytes apart); x is packed block by block of rows (amx_pack_x), and each x
 * block meets every W block of the range before the next is packed. A short last block of W rows
 * is copied into zero-padded rows, so that every element of y is the same sequence of tile
 * products whatever the split of rows between threads and of x into blocks. 1 where the scratch
 * cannot be had (the caller runs the AVX-512 form). */
static int gemm_rows_amx(const uint16_t *x, int64_t M, const uint16_t *w, const uint16_t *bias, int64_t N, int64_t K,
                         uint16_t *y, int64_t n_lo, int64_t n_hi) {
    if (n_lo >= n_hi) return 0;
    const int64_t KC = K / 32;
    int64_t mblk = AMX_X_BYTES / (K * 2) / 32 * 32;
    if (mblk < 32) mblk = 32;
    if (mblk > M) mblk = M;
    const int64_t MBmax = (mblk + 15) / 16;
    if (amx_xp_words < MBmax * KC * 256) {
        free(amx_xp);
        amx_xp = aligned_alloc(64, (size_t)(MBmax * KC * 256 * 4));
        amx_xp_words = amx_xp != NULL ? MBmax * KC * 256 : 0;
        if (amx_xp == NULL) return 1;
    }
    if ((n_hi - n_lo) % 16 != 0 && amx_wpad_elems < 16 * K) {
        free(amx_wpad);
        amx_wpad = aligned_alloc(64, (size_t)(16 * K * 2));
        amx_wpad_elems = amx_wpad != NULL ? 16 * K : 0;
        if (amx_wpad == NULL) return 1;
    }
    uint32_t *xp = amx_xp;
    amx_configure(); /* tmm0-3: [16 W rows, 16 x rows] float32 sums; tmm4-5: W; tmm6-7: packed x */
    float c[4][256] __attribute__((aligned(64)));
    for (int64_t m_lo = 0; m_lo < M; m_lo += mblk) {
        const int64_t Mb = M - m_lo < mblk ? M - m_lo : mblk, MB = (Mb + 15) / 16;
        amx_pack_x(x, m_lo, Mb, K, xp);
        for (int64_t n0 = n_lo; n0 < n_hi; n0 += 32) {
            const int64_t nr = n_hi - n0 < 32 ? n_hi - n0 : 32;
            const int two_n = nr > 16;
            const uint16_t *w0 = w + n0 * K, *w1 = w0 + 16 * K;
            const int64_t ws = K * 2;
            if (nr < 32 && nr % 16 != 0) { /* the short last block: its rows, then zeros */
                const int64_t full = nr / 16 * 16, rest = nr - full;
                memcpy(amx_wpad, w + (n0 + full) * K, (size_t)(rest * K * 2));
                memset(amx_wpad + rest * K, 0, (size_t)((16 - rest) * K * 2));
                if (full == 0)
                    w0 = amx_wpad;
                else
                    w1 = amx_wpad;
            }
            for (int64_t mb = 0; mb < MB; mb += 2) {
                const int two_m = mb + 1 < MB;
                const uint32_t *b0 = xp + mb * KC * 256, *b1 = b0 + KC * 256;
                amx_block(w0, w1, ws, b0, b1, KC, two_n, two_m);
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                _tile_stored(2, c[2], 64);
                _tile_stored(3, c[3], 64);
                /* x rows and W rows each tile holds: the first 16 and the rest (two_m, two_n) */
                const int64_t m0 = m_lo + mb * 16, left = m_lo + Mb - m0;
                const int64_t mr0 = left < 16 ? left : 16, mr1 = left - 16 < 16 ? left - 16 : 16;
                const int64_t nr0 = nr < 16 ? nr : 16, nr1 = nr - 16;
                amx_store(c[0], m0, mr0, n0, nr0, N, bias, y);
                if (two_m) amx_store(c[1], m0 + 16, mr1, n0, nr0, N, bias, y);
                if (two_n) amx_store(c[2], m0, mr0, n0 + 16, nr1, N, bias, y);
                if (two_n && two_m) amx_store(c[3], m0 + 16, mr1, n0 + 16, nr1, N, bias, y);
            }
        }
    }
    _tile_release();
    return 0;
}
