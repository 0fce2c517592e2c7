/* w8a8_linear on AMX tiles (CPUs with AMX-INT8; LQ_AVX512 builds): TDPBSSD (s8 x s8 -> s32) on the
 * row-major int8 codes as they lie in memory, from W8A8_AMX_MIN_ROWS rows of x. Included by
 * linear_quant.c after linear_quant_avx512.h, whose row quantization and scaling it shares.
 *
 * The first operand is 16 code rows x 64 inputs straight from the codes [N, K] (K bytes apart), so
 * w8a8 keeps its one copy of the codes; x is quantized once per call (w8a8_quantize_row, the torch
 * path's formula) and packed as the second operand: per 16 x rows and 64 inputs, 16 lines of 16
 * dwords, line p word j = q[j][4p .. 4p + 3], signed, zero past row M and input K. An output block
 * is up to 2 x 2 tiles of [16 code rows, 16 x rows] int32 sums (amx.h's amx_tile_block, the k-loop
 * of the bf16 GEMM's tiles too), x taken in chunks of 128 rows. The sums are exact (wrapping in
 * int32 as the vpdpbusd form's do), so they equal the VNNI form's sum((q + 128) c) - 128 sum(c)
 * bit for bit, and the same two fp32 products (w8a8_store_scaled) follow: y is the same to the bit
 * whichever form runs. */

#if HAVE_AMX_BF16 && defined(__AMX_INT8__)
#define HAVE_AMX_INT8 1
/* Rows of x from which w8a8_linear runs on the tiles. Up to 4 rows the vpdpbusd form (one block of
 * 4 x rows) reads the codes in one sequential stream at about the memory's rate, faster than the
 * tiles' 16 rows at a time (4 rows, out of cache: 47-50 against 55 us for gate_up 3072 x 576);
 * from 5 rows it passes over the codes twice and the tiles win on every layer of the default model
 * (5 rows: 56 against 89 us; docs/quantization.md "w8a8 on AMX tiles"). */
#define W8A8_AMX_MIN_ROWS 5
static int64_t w8a8_amx_from_rows = W8A8_AMX_MIN_ROWS;
/* x rows per chunk of a call (a multiple of 32) */
#define W8A8_AMX_CHUNK 128

/* linear_quant.c: x's rows quantized and stored as signed rows (xq) or as the packed operand (xp). */
static int w8a8_quantize_each(const void *x, int64_t M, int64_t K, int f32, float *d, int8_t *xq, int32_t *xp);

/* y[m0 + j][n0 + i] = (float(c[i][j]) * d[m0 + j]) * scales[n0 + i], j < mr, i < nr: one tile's sums
 * ([16 code rows, 16 x rows]), a column of it per row of y. */
static inline void w8a8_amx_store(const int32_t *c, int64_t m0, int64_t mr, int64_t n0, int64_t nr, int64_t N,
                                  const float *d, const float *scales, void *y, int f32) {
    if (mr <= 0 || nr <= 0) return;
    const __mmask16 rows = (__mmask16)((1u << nr) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(rows, scales + n0);
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    for (int64_t j = 0; j < mr; j++) {
        const __m512i v = _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32((int)j)), c, 4);
        w8a8_store_scaled(_mm512_cvtepi32_ps(v), d[m0 + j], s, y, (m0 + j) * N + n0, rows, f32);
    }
}

/* w8a8_linear's result on the tiles: 0, or 2 where scratch cannot be had (nothing written to y). */
static int w8a8_linear_amx(const void *x, int64_t M, const int8_t *codes, const float *scales, int64_t N, int64_t K,
                           void *y, int f32) {
    const int64_t KC = (K + 63) / 64, KP = KC * 64, MB = (M + 15) / 16, NB = (N + 31) / 32;
    int32_t *xp = (int32_t *)aligned_alloc(64, (size_t)(MB * KC * 1024));
    float *d = (float *)malloc(sizeof(float) * M);
    if (xp == NULL || d == NULL || w8a8_quantize_each(x, M, K, f32, d, NULL, xp) != 0) {
        free(xp), free(d);
        return 2;
    }
    /* The 16 rows that hold code row N - 1, when a tile load there would read past the codes (a short
     * block, or K % 64): copied into zero-padded rows of KP bytes. */
    const int64_t last = (N - 1) / 16 * 16;
    const int pad_last = N % 16 != 0 || K % 64 != 0;
    int8_t *pad = NULL;
    if (pad_last) {
        pad = (int8_t *)aligned_alloc(64, (size_t)(16 * KP));
        if (pad == NULL) {
            free(xp), free(d);
            return 2;
        }
        memset(pad, 0, (size_t)(16 * KP));
        for (int64_t r = last; r < N; r++) memcpy(pad + (r - last) * KP, codes + r * K, (size_t)K);
    }
#pragma omp parallel if (N * K >= quant_parallel_min)
    {
        amx_configure(); /* tmm0-3: [16 code rows, 16 x rows] int32 sums; tmm4-5: codes; tmm6-7: packed x */
        int32_t c[4][256] __attribute__((aligned(64)));
        /* x in chunks of W8A8_AMX_CHUNK x rows, so that a chunk's packed rows stay in the cache while
         * the thread's code rows (the same ones for every chunk) pass by */
        for (int64_t mc = 0; mc < MB; mc += W8A8_AMX_CHUNK / 16) {
        const int64_t mc_end = mc + W8A8_AMX_CHUNK / 16 < MB ? mc + W8A8_AMX_CHUNK / 16 : MB;
#pragma omp for schedule(static) nowait
        for (int64_t nb = 0; nb < NB; nb++) {
            const int64_t n0 = nb * 32, nr = N - n0 < 32 ? N - n0 : 32, nr0 = nr < 16 ? nr : 16, nr1 = nr - 16;
            const int two_n = nr > 16;
            const int8_t *w0 = codes + n0 * K, *w1 = w0 + 16 * K;
            int64_t s0 = K, s1 = K;
            if (pad_last && n0 == last) w0 = pad, s0 = KP;
            if (pad_last && two_n && n0 + 16 == last) w1 = pad, s1 = KP;
            for (int64_t mb = mc; mb < mc_end; mb += 2) {
                const int two_m = mb + 1 < mc_end;
                const int32_t *b0 = xp + mb * KC * 256, *b1 = b0 + KC * 256;
                amx_tile_block(1, w0, s0, w1, s1, b0, b1, KC, two_n, two_m);
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                _tile_stored(2, c[2], 64);
                _tile_stored(3, c[3], 64);
                const int64_t m0 = mb * 16, mr0 = M - m0 < 16 ? M - m0 : 16, mr1 = M - m0 - 16 < 16 ? M - m0 - 16 : 16;
                w8a8_amx_store(c[0], m0, mr0, n0, nr0, N, d, scales, y, f32);
                if (two_m) w8a8_amx_store(c[1], m0 + 16, mr1, n0, nr0, N, d, scales, y, f32);
                if (two_n) w8a8_amx_store(c[2], m0, mr0, n0 + 16, nr1, N, d, scales, y, f32);
                if (two_n && two_m) w8a8_amx_store(c[3], m0 + 16, mr1, n0 + 16, nr1, N, d, scales, y, f32);
            }
        }
        }
        _tile_release();
    }
    free(xp), free(d), free(pad);
    return 0;
}
#else
#define HAVE_AMX_INT8 0
#endif
