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

/* The tiles of the block functions, for adapters of rank R and blocks of m rows (8 or 16), in
 * one of two shapes: the shrink's (LORA_AMX_SHRINK) tmm0-3: [m rows, 16 outputs] float32 sums,
 * tmm4 and tmm6: m rows of 32 bf16 of x, tmm5 and tmm7: 16 lines of 16 pairs of A; the expand's
 * (LORA_AMX_EXPAND) tmm0-3 the same sums, tmm6: m rows of kk bf16 of h, tmm4, tmm5 and tmm7: kk / 2
 * lines of 16 pairs of B^T. Consecutive tile loads go to different tiles, so that a load does not
 * wait for the product that reads the tile before it (the tiles are not renamed). lora_amx_rows
 * loads a shape where the calling thread has another loaded (or none: lora_amx_cfg 0),
 * lora_amx_done releases the tiles after a thread's blocks. A tile product's entries do not
 * depend on how many rows the tiles hold, nor on which tiles hold its operands. */
#define LORA_AMX_SHRINK 0
#define LORA_AMX_EXPAND 1
static __thread int lora_amx_cfg;
static inline int lora_amx_rows(int64_t R, int nb, int shape) {
    const int m = nb <= 8 ? 8 : 16;
    const int64_t kk = lora_amx_kk(R);
    const int cfg = 1 + m * 2 + shape + (int)kk * 64;
    if (cfg != lora_amx_cfg) {
        const uint8_t um = (uint8_t)m, lb = shape == LORA_AMX_SHRINK ? 16 : (uint8_t)(kk / 2);
        const uint8_t rows[8] = {um, um, um, um, shape == LORA_AMX_SHRINK ? um : lb, lb, um, lb};
        const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, shape == LORA_AMX_SHRINK ? 64 : (uint16_t)(kk * 2), 64};
        amx_configure_tiles(rows, colsb);
        lora_amx_cfg = cfg;
    }
    return m;
}
static inline void lora_amx_done(void) {
    if (lora_amx_cfg) _tile_release();
    lora_amx_cfg = 0;
}

/* The slots' packed A and B^T are read once a step, in short runs (a slot's A, each slice's columns
 * of its B^T), which the hardware prefetcher does not follow from one to the next and into which
 * it ramps up too slowly. A LoraAmxPf lists the runs a thread reads next, in the order it reads
 * them; each round of tile loads advances it by the bytes the round read, prefetching the lines
 * LORA_AMX_LEAD bytes ahead, across the ends of runs and blocks. Prefetches change no result;
 * runs past LORA_AMX_PF_RUNS are not prefetched. */
#define LORA_AMX_LEAD 4096
#define LORA_AMX_PF_RUNS 96
typedef struct {
    const char *ptr[LORA_AMX_PF_RUNS];
    int64_t len[LORA_AMX_PF_RUNS];
    int n, i;
    int64_t off;
} LoraAmxPf;
static inline void lora_amx_pf_init(LoraAmxPf *pf) { pf->n = pf->i = 0, pf->off = 0; }
static inline void lora_amx_pf_run(LoraAmxPf *pf, const void *p, int64_t bytes) {
    if (pf->n < LORA_AMX_PF_RUNS && bytes > 0) pf->ptr[pf->n] = (const char *)p, pf->len[pf->n++] = bytes;
}
static inline void lora_amx_pf_advance(LoraAmxPf *pf, int64_t bytes) {
    if (pf == NULL) return;
    while (bytes > 0 && pf->i < pf->n) {
        const int64_t left = pf->len[pf->i] - pf->off, take = bytes < left ? bytes : left;
        for (int64_t o = 0; o < take; o += 64) _mm_prefetch(pf->ptr[pf->i] + pf->off + o, _MM_HINT_T0);
        pf->off += take, bytes -= take;
        if (pf->off >= pf->len[pf->i]) pf->i++, pf->off = 0;
    }
}
/* The runs of one slot's packed A (ap: n outputs, K inputs), and of its packed B^T (bp) that
 * lora_amx_block_expand reads for columns [lo, hi). */
static inline void lora_amx_pf_a(LoraAmxPf *pf, const uint16_t *ap, int64_t n, int64_t K) {
    lora_amx_pf_run(pf, ap, lora_amx_a_elems(n, K) * 2);
}
static inline void lora_amx_pf_b(LoraAmxPf *pf, const uint16_t *bp, int64_t num_slices, int64_t R,
                                 const int64_t *ranges, int64_t N, int64_t lo, int64_t hi) {
    const int64_t RP = lora_amx_rp(R), NB = (N + 15) / 16;
    for (int64_t i = 0; i < num_slices; i++) {
        const int64_t a = ranges[2 * i] > lo ? ranges[2 * i] : lo, b = ranges[2 * i + 1] < hi ? ranges[2 * i + 1] : hi;
        if (a < b) lora_amx_pf_run(pf, bp + (i * NB + a / 16) * RP * 16, ((b + 15) / 16 - a / 16) * RP * 32);
    }
}

/* Floats of scratch lora_amx_block_h needs: 16 rows of K bf16, then 16 rows of n float32 sums. */
static inline int64_t lora_amx_scratch(int64_t n, int64_t K) { return 8 * K + 16 * ((n + 15) / 16) * 16; }
/* Floats of one block's h (16 rows of num_slices * RP bf16). */
static inline int64_t lora_amx_h_floats(int64_t num_slices, int64_t R) { return 8 * num_slices * lora_amx_rp(R); }

/* One step of K (32 inputs) of lora_amx_block_h's outputs: x in tile X, A's blocks of 16 outputs
 * in tiles A0 and A1 in turn. */
#define LORA_AMX_SHRINK_STEP(X, A0, A1)                                                                           \
    do {                                                                                                           \
        _tile_loadd(X, xb + kc * 32, xstride);                                                                     \
        _tile_loadd(A0, ak, 64);                                                                                   \
        _tile_dpbf16ps(0, X, A0);                                                                                  \
        if (nob > 1) {                                                                                             \
            _tile_loadd(A1, ak + 512, 64);                                                                         \
            _tile_dpbf16ps(1, X, A1);                                                                              \
        }                                                                                                          \
        if (nob > 2) {                                                                                             \
            _tile_loadd(A0, ak + 1024, 64);                                                                        \
            _tile_dpbf16ps(2, X, A0);                                                                              \
        }                                                                                                          \
        if (nob > 3) {                                                                                             \
            _tile_loadd(A1, ak + 1536, 64);                                                                        \
            _tile_dpbf16ps(3, X, A1);                                                                              \
        }                                                                                                          \
    } while (0)

/* hb [16][num_slices * RP] bf16 (ranks R..RP of each slice zero) = the block's rows of x A_s^T,
 * rows[0:nb] of x (T rows, ldx apart) and the slot's packed A (ap). The rows are read in place
 * where they are nb consecutive rows with 16 rows of x from the first, else copied into scratch
 * (the rows past nb of the tiles then hold whatever the scratch held: their h is not used). */
static void lora_amx_block_h(const uint16_t *x, int64_t ldx, int64_t T, const int64_t *rows, int nb,
                             const uint16_t *ap, int64_t num_slices, int64_t R, int64_t K, float *scratch,
                             uint16_t *hb, LoraAmxPf *pf) {
    const int64_t n = num_slices * R, OB = (n + 15) / 16, KC = K / 32, RP = lora_amx_rp(R);
    uint16_t *xs = (uint16_t *)scratch;
    float *hf = scratch + 8 * K;
    const int m = lora_amx_rows(R, nb, LORA_AMX_SHRINK);
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
            lora_amx_pf_advance(pf, nob * 1024);
            if (kc & 1)
                LORA_AMX_SHRINK_STEP(6, 7, 5);
            else
                LORA_AMX_SHRINK_STEP(4, 5, 7);
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
            for (int64_t k = 0; k < RP; k += 16) { /* f32_to_bf16 of ranks < R, zeros from R on */
                const __mmask16 km = R - k >= 16 ? (__mmask16)0xffff : R > k ? (__mmask16)((1u << (R - k)) - 1u) : 0;
                _mm256_storeu_si256((__m256i *)(hr + k), bf16x16_from_f32(_mm512_maskz_loadu_ps(km, fr + k)));
            }
        }
}

/* yt[r][o] += h[r] B_s^T[:, o] for the nb rows of the block (hb from lora_amx_block_h) and the
 * columns o of each slice i within [lo, hi), B_s^T packed (bp): 4 blocks of 16 columns at a time. */
static void lora_amx_block_expand(const uint16_t *hb, int nb, const uint16_t *bp, int64_t num_slices, int64_t R,
                                  const int64_t *ranges, int64_t N, int64_t lo, int64_t hi, char *const *yt,
                                  int y_dt, LoraAmxPf *pf) {
    const int64_t kk = lora_amx_kk(R), RP = lora_amx_rp(R), RC = RP / kk, NB = (N + 15) / 16;
    const int64_t hstride = num_slices * RP * 2;
    lora_amx_rows(R, nb, LORA_AMX_EXPAND);
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
            lora_amx_pf_advance(pf, ncb * RP * 32);
            for (int64_t rc = 0; rc < RC; rc++) {
                const uint16_t *b0 = bi + (cb0 * RC + rc) * kk * 16, *bs = b0;
                const int64_t step = RC * kk * 16; /* elements from one column block to the next */
                _tile_loadd(6, hi_ + rc * kk, hstride);
                _tile_loadd(7, bs, 64);
                _tile_dpbf16ps(0, 6, 7);
                if (ncb > 1) {
                    _tile_loadd(5, bs + step, 64);
                    _tile_dpbf16ps(1, 6, 5);
                }
                if (ncb > 2) {
                    _tile_loadd(4, bs + 2 * step, 64);
                    _tile_dpbf16ps(2, 6, 4);
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
