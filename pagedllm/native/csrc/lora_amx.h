/* lora.c's block kernels on AMX tiles (CPUs with AMX-BF16; amx.h), for bf16 rows and bf16
 * adapters with K a multiple of 32 (lora_amx_take): up to LORA_AMX_RB rows of one slot at a time.
 * The rows are the tiles' first operand, the slot's A and B^T the second, from a copy of each in
 * the tiles' pair-interleaved layout that the caller keeps beside the row-major one (filled when
 * an adapter is copied into its slot; pagedllm/lora/layers.py packs it):
 *
 *   ap [slots][K / 32][OB][16][16][2]: ap[s][kc][ob][p][j][e] = A_s[ob * 16 + j][kc * 32 + 2p + e]
 *       (OB = ceil(n / 16) blocks of 16 outputs, zeros past n)
 *   bp [slots][slices][NB][RP / kk][kk / 2][16][2]: bp[s][i][cb][rc][p][c][e] =
 *       B_s^T[i R + rc kk + 2p + e][cb * 16 + c] (NB = ceil(N / 16) blocks of 16 columns; zeros
 *       at ranks R..RP and columns past N; kk and RP: lora_amx_kk, lora_amx_rp)
 *
 * The shrink sums each of h's entries over K on the tiles in float32 and rounds it to bf16 (as the
 * torch form's bf16 GEMM rounds its h); the expand multiplies those bf16 h by B^T on the tiles,
 * one tile product per column and kk ranks, and adds the float32 sum to y rounded once (lora_add16).
 * Every entry is the same sequence of tile products whatever rows or columns share its tiles, so
 * a row's delta is the same bits in any block, in any call and over any split of the columns.
 * The block functions load the tiles for their rows (lora_amx_rows); the caller releases them
 * after its blocks (lora_amx_done). */
#define LORA_AMX_RB 16 /* rows of one slot handled together on the tiles */

/* Ranks per tile product of the expand (16 or 32) and R padded to a multiple of it. */
static inline int64_t lora_amx_kk(int64_t R) { return R <= 16 ? 16 : 32; }
static inline int64_t lora_amx_rp(int64_t R) { return (R + lora_amx_kk(R) - 1) / lora_amx_kk(R) * lora_amx_kk(R); }
/* Elements of one slot's ap and bp. */
static inline int64_t lora_amx_a_elems(int64_t n, int64_t K) { return K / 32 * ((n + 15) / 16) * 512; }
static inline int64_t lora_amx_b_elems(int64_t num_slices, int64_t R, int64_t N) {
    return num_slices * ((N + 15) / 16) * lora_amx_rp(R) * 16;
}

/* Whether a layer's deltas run on the tiles: its packed copies given, bf16 rows and adapters, K a
 * multiple of 32, and the tile registers lent to this process. */
static inline int lora_amx_take(const void *ap, const void *bp, int x_dt, int w_dt, int64_t K) {
    return ap != NULL && bp != NULL && x_dt == 1 && w_dt == 1 && K % 32 == 0 && amx_permitted();
}

/* The tiles both block functions use, for adapters of rank R and blocks of m rows (8 or 16):
 * tmm0-3: [m rows, 16 outputs] float32 sums; tmm4-5: the shrink's m rows of 32 bf16 of x and 16
 * lines of 16 pairs of A; tmm6-7: the expand's m rows of kk bf16 of h and kk / 2 lines of 16 pairs
 * of B^T. lora_amx_rows loads them where the calling thread has them loaded for other rows (or
 * none: lora_amx_m 0), lora_amx_done releases them after a thread's blocks. A tile product's
 * entries do not depend on how many rows the tiles hold. */
static __thread int lora_amx_m;
static inline int lora_amx_rows(int64_t R, int nb) {
    const int m = nb <= 8 ? 8 : 16;
    if (m != lora_amx_m) {
        const int64_t kk = lora_amx_kk(R);
        const uint8_t rows[8] = {(uint8_t)m, (uint8_t)m, (uint8_t)m, (uint8_t)m, (uint8_t)m, 16, (uint8_t)m,
                                 (uint8_t)(kk / 2)};
        const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, (uint16_t)(kk * 2), 64};
        amx_configure_tiles(rows, colsb);
        lora_amx_m = m;
    }
    return m;
}
static inline void lora_amx_done(void) {
    if (lora_amx_m) _tile_release();
    lora_amx_m = 0;
}

/* Floats of scratch lora_amx_block_h needs: 16 rows of K bf16, then 16 rows of n float32 sums. */
static inline int64_t lora_amx_scratch(int64_t n, int64_t K) { return 8 * K + 16 * ((n + 15) / 16) * 16; }
/* Floats of one block's h (16 rows of num_slices * RP bf16). */
static inline int64_t lora_amx_h_floats(int64_t num_slices, int64_t R) { return 8 * num_slices * lora_amx_rp(R); }

/* hb [16][num_slices * RP] bf16 (ranks R..RP of each slice zero) = the block's rows of x A_s^T,
 * rows[0:nb] of x (T rows, ldx apart) and the slot's packed A (ap). The rows are read in place
 * where they are nb consecutive rows with 16 rows of x from the first, else copied into scratch
 * (the rows past nb of the tiles then hold whatever the scratch held: their h is not used). */
static void lora_amx_block_h(const uint16_t *x, int64_t ldx, int64_t T, const int64_t *rows, int nb,
                             const uint16_t *ap, int64_t num_slices, int64_t R, int64_t K, float *scratch,
                             uint16_t *hb) {
    const int64_t n = num_slices * R, OB = (n + 15) / 16, KC = K / 32, RP = lora_amx_rp(R);
    uint16_t *xs = (uint16_t *)scratch;
    float *hf = scratch + 8 * K;
    const int m = lora_amx_rows(R, nb);
    int inplace = rows[0] + m <= T;
    for (int r = 1; r < nb && inplace; r++) inplace = rows[r] == rows[0] + r;
    const uint16_t *xb = xs;
    int64_t xstride = K * 2;
    if (inplace) {
        xb = x + rows[0] * ldx, xstride = ldx * 2;
    } else {
        for (int r = 0; r < nb; r++) memcpy(xs + r * K, x + rows[r] * ldx, (size_t)K * 2);
    }
    for (int64_t ob0 = 0; ob0 < OB; ob0 += 4) {
        const int64_t nob = OB - ob0 < 4 ? OB - ob0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t *a0 = ap + ob0 * 512;
        for (int64_t kc = 0; kc < KC; kc++) {
            const uint16_t *ak = a0 + kc * OB * 512;
            _tile_loadd(4, xb + kc * 32, xstride);
            _tile_loadd(5, ak, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nob > 1) {
                _tile_loadd(5, ak + 512, 64);
                _tile_dpbf16ps(1, 4, 5);
            }
            if (nob > 2) {
                _tile_loadd(5, ak + 1024, 64);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (nob > 3) {
                _tile_loadd(5, ak + 1536, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        const int64_t hs = OB * 64; /* bytes between rows of hf [16][OB * 16] */
        _tile_stored(0, hf + ob0 * 16, hs);
        if (nob > 1) _tile_stored(1, hf + (ob0 + 1) * 16, hs);
        if (nob > 2) _tile_stored(2, hf + (ob0 + 2) * 16, hs);
        if (nob > 3) _tile_stored(3, hf + (ob0 + 3) * 16, hs);
    }
    for (int r = 0; r < m; r++)
        for (int64_t i = 0; i < num_slices; i++) {
            uint16_t *hr = hb + (r * num_slices + i) * RP;
            const float *fr = hf + r * OB * 16 + i * R;
            for (int64_t k = 0; k < R; k++) hr[k] = f32_to_bf16(fr[k]);
            for (int64_t k = R; k < RP; k++) hr[k] = 0;
        }
}

/* yt[r][o] += h[r] B_s^T[:, o] for the nb rows of the block (hb from lora_amx_block_h) and the
 * columns o of each slice i within [lo, hi), B_s^T packed (bp): 4 blocks of 16 columns at a time. */
static void lora_amx_block_expand(const uint16_t *hb, int nb, const uint16_t *bp, int64_t num_slices, int64_t R,
                                  const int64_t *ranges, int64_t N, int64_t lo, int64_t hi, char *const *yt,
                                  int y_dt) {
    const int64_t kk = lora_amx_kk(R), RP = lora_amx_rp(R), RC = RP / kk, NB = (N + 15) / 16;
    const int64_t hstride = num_slices * RP * 2;
    lora_amx_rows(R, nb);
    float c[4][256] __attribute__((aligned(64)));
    for (int64_t i = 0; i < num_slices; i++) {
        const int64_t a = ranges[2 * i] > lo ? ranges[2 * i] : lo, b = ranges[2 * i + 1] < hi ? ranges[2 * i + 1] : hi;
        if (a >= b) continue;
        const uint16_t *bi = bp + i * NB * RP * 16, *hi_ = hb + i * RP;
        const int64_t cb_end = (b + 15) / 16;
        for (int64_t cb0 = a / 16; cb0 < cb_end; cb0 += 4) {
            const int64_t ncb = cb_end - cb0 < 4 ? cb_end - cb0 : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t rc = 0; rc < RC; rc++) {
                const uint16_t *b0 = bi + (cb0 * RC + rc) * kk * 16, *bs = b0;
                const int64_t step = RC * kk * 16; /* elements from one column block to the next */
                _tile_loadd(6, hi_ + rc * kk, hstride);
                _tile_loadd(7, bs, 64);
                _tile_dpbf16ps(0, 6, 7);
                if (ncb > 1) {
                    _tile_loadd(7, bs + step, 64);
                    _tile_dpbf16ps(1, 6, 7);
                }
                if (ncb > 2) {
                    _tile_loadd(7, bs + 2 * step, 64);
                    _tile_dpbf16ps(2, 6, 7);
                }
                if (ncb > 3) {
                    _tile_loadd(7, bs + 3 * step, 64);
                    _tile_dpbf16ps(3, 6, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            if (ncb > 1) _tile_stored(1, c[1], 64);
            if (ncb > 2) _tile_stored(2, c[2], 64);
            if (ncb > 3) _tile_stored(3, c[3], 64);
            for (int64_t t = 0; t < ncb; t++) {
                const int64_t o = (cb0 + t) * 16;
                const int64_t s0 = a > o ? a - o : 0, s1 = b - o < 16 ? b - o : 16;
                const __mmask16 km = (__mmask16)(((1u << s1) - 1u) & ~((1u << s0) - 1u));
                for (int r = 0; r < nb; r++) lora_add16(yt[r], y_dt, o, _mm512_load_ps(c[t] + r * 16), km);
            }
        }
    }
}
