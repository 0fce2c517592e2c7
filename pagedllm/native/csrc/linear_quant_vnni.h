/* w8a8_linear's batches in the vpdpbusd form (LQ_AVX512 builds, where AMX tiles do not run): from
 * W8A8_VNNI_MIN_ROWS rows of x, in place of torch._int_mm. Included by linear_quant.c after
 * linear_quant_amx.h.
 *
 * The row form (w8a8_tile) reads every code row once per 4 rows of x and sums each dot product
 * across a register at the end; for batches this form keeps a panel of 16 code rows in the L1 cache
 * and passes every 16 rows of x over it. x is quantized once per call (w8a8_quantize_row) and packed
 * unsigned (q + 128) 16 rows at a time by a transpose (w8a8_quantize_pack16), in the layout of the
 * AMX form's packed x (linear_quant_amx.h): per 4 inputs, one 64-byte vector holds the 16 rows' 4 bytes. Each of the
 * panel's code rows meets it as one dword broadcast to every lane (vpdpbusd's
 * signed operand), so register r's lane j sums (q[j] + 128) c[r] over K: 16 x rows x 16 code rows in
 * 16 registers, no sums across lanes. A 16 x 16 transpose turns them into 16 outputs per row of y,
 * the +128 comes off as 128 wsum[n] (exact in int32, as in the row form), and the same two fp32
 * products (w8a8_store_scaled) follow: y is the row form's and the torch path's to the bit.
 *
 * The inputs run in whole dwords up to K rounded down to 4; the last 1-3 inputs meet code bytes
 * copied into a zero-padded dword, so that no input past K contributes (its x byte is 128, not 0). */

/* Rows of x from which w8a8_linear runs this form (on CPUs where the tiles do not run). Up to 4
 * rows the row form reads the codes in one pass at about the memory's rate; docs/quantization.md
 * "w8a8 batches in the vpdpbusd form" has the per-layer times that set it. */
#define W8A8_VNNI_MIN_ROWS 5
static int64_t w8a8_vnni_from_rows = W8A8_VNNI_MIN_ROWS;
/* x rows per chunk of a call (a multiple of 16): a chunk's packed rows stay in the L2 cache while
 * the code panels pass over them */
#define W8A8_VNNI_CHUNK 256

/* The int32 sums of 16 code rows (w, K bytes apart) with 16 packed x rows (xb) over K, acc[r] lane j
 * for code row r and x row j; next: the next panel's codes to prefetch, or NULL. The 16 sums are named registers, and a step is one vpdpbusd with the
 * code dword as its broadcast memory operand, in inline assembly: written as the intrinsic over an
 * array, the compiler copied every accumulator to another register on every step and spilled two. */
static void w8a8_vnni_sums(const int32_t *xb, const int8_t *w, int64_t K, const int32_t *tail, const int8_t *next,
                           __m512i acc[16]) {
#define W8A8_16(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)
#define W8A8_ACC(r) __m512i a##r = _mm512_setzero_si512();
#define W8A8_MAIN(r) \
    __asm__("vpdpbusd %[m]%{1to16%}, %[x], %[a]" \
            : [a] "+v"(a##r) \
            : [x] "v"(xv), [m] "m"(*(const int32_t *)(wp + r * K)));
#define W8A8_TAIL(r) a##r = _mm512_dpbusd_epi32(a##r, xv, _mm512_set1_epi32(tail[r]));
#define W8A8_OUT(r) acc[r] = a##r;
    W8A8_16(W8A8_ACC)
    const int64_t K4 = K / 4;
    /* A panel's 16 code rows are 16 K contiguous bytes, one 64-byte line per step of the k loop:
     * while the first x block runs, the next panel is asked for a line a step, one sequential
     * stream (its 16 rows read side by side are streams the hardware prefetcher does not follow
     * well: a block of 5 x rows read gate_up 3072 x 576 from memory at about 8 GB/s without). */
    for (int64_t p = 0; p < K4; p++) {
        if (next != NULL) _mm_prefetch((const char *)(next + p * 64), _MM_HINT_T1);
        const __m512i xv = _mm512_load_si512((const void *)(xb + p * 16));
        const int8_t *wp = w + p * 4;
        W8A8_16(W8A8_MAIN)
    }
    if (K % 4) {
        const __m512i xv = _mm512_load_si512((const void *)(xb + K4 * 16));
        W8A8_16(W8A8_TAIL)
    }
    W8A8_16(W8A8_OUT)
#undef W8A8_16
#undef W8A8_ACC
#undef W8A8_MAIN
#undef W8A8_TAIL
#undef W8A8_OUT
}

/* Output rows n0 .. n0 + nr - 1 (the codes from w, 16 rows K bytes apart; rows past nr are any
 * readable rows) of x rows m0 .. m0 + mr - 1 (packed at xb): the sums, transposed to rows of y, the
 * +128 taken off (off: 128 wsum of the 16 code rows), then (float(acc) * d) * s. */
static inline void w8a8_vnni_block(const int32_t *xb, const int8_t *w, int64_t K, const int32_t *tail,
                                   const int8_t *next, int64_t m0, int64_t mr, int64_t n0, int64_t nr, int64_t N,
                                   const float *d, __m512i off, __m512 s, void *y, int f32) {
    __m512i acc[16];
    w8a8_vnni_sums(xb, w, K, tail, next, acc);
    transpose16_epi32(acc);
    const __mmask16 rows = (__mmask16)((1u << nr) - 1);
    for (int64_t j = 0; j < mr; j++)
        w8a8_store_scaled(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[j], off)), d[m0 + j], s, y, (m0 + j) * N + n0, rows,
                          f32);
}

/* w8a8_linear's result in this form: 0, or 2 where scratch cannot be had (nothing written to y).
 * One parallel region: each thread quantizes and packs its share of x's 16-row blocks, then (after
 * the barrier) computes its share of every chunk's code panels. */
static int w8a8_linear_vnni(const void *x, int64_t M, const int8_t *codes, const float *scales, const int32_t *wsum,
                            int64_t N, int64_t K, void *y, int f32) {
    const int64_t KC = (K + 63) / 64, KP = KC * 64, MB = (M + 15) / 16, NB = (N + 15) / 16;
    int32_t *xp = (int32_t *)aligned_alloc(64, (size_t)(MB * KC * 1024));
    float *d = (float *)malloc(sizeof(float) * M);
    /* the 16 code rows of the last panel where it is short: rows past N read as zeros */
    int8_t *pad = (int8_t *)calloc((size_t)(16 * K), 1);
    if (xp == NULL || d == NULL || pad == NULL) {
        free(xp), free(d), free(pad);
        return 2;
    }
    const int64_t last = (N - 1) / 16 * 16;
    if (N % 16) memcpy(pad, codes + last * K, (size_t)((N - last) * K));
    int bad = 0;
#pragma omp parallel if (N * K * MB >= quant_parallel_min)
    {
        uint8_t *blk = (uint8_t *)aligned_alloc(64, (size_t)(16 * KP));
        if (blk == NULL) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp for schedule(static)
        for (int64_t mb = 0; mb < MB; mb++) {
            if (blk == NULL) continue;
            w8a8_quantize_pack16(x, M, K, f32, mb, d, blk, 0, xp + mb * KC * 256);
        }
        free(blk);
        int failed;
#pragma omp atomic read
        failed = bad;
        for (int64_t mc = 0; mc < MB && !failed; mc += W8A8_VNNI_CHUNK / 16) {
            const int64_t mc_end = mc + W8A8_VNNI_CHUNK / 16 < MB ? mc + W8A8_VNNI_CHUNK / 16 : MB;
#pragma omp for schedule(static) nowait
            for (int64_t nb = 0; nb < NB; nb++) {
                const int64_t n0 = nb * 16, nr = N - n0 < 16 ? N - n0 : 16;
                const int8_t *w = nr < 16 ? pad : codes + n0 * K;
                int32_t tail[16] = {0};
                for (int r = 0; r < 16 && K % 4; r++) memcpy(&tail[r], w + r * K + K / 4 * 4, (size_t)(K % 4));
                const __mmask16 rows = (__mmask16)((1u << nr) - 1);
                const __m512i off = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(rows, wsum + n0), 7);
                const __m512 s = _mm512_maskz_loadu_ps(rows, scales + n0);
                /* the next panel, prefetched during the first x block (a short last one reads pad) */
                const int8_t *next = nb + 1 < NB && n0 + 32 <= N ? codes + (n0 + 16) * K : NULL;
                for (int64_t mb = mc; mb < mc_end; mb++) {
                    const int64_t m0 = mb * 16;
                    w8a8_vnni_block(xp + mb * KC * 256, w, K, tail, mb == mc ? next : NULL, m0,
                                    M - m0 < 16 ? M - m0 : 16, n0, nr, N, d, off, s, y, f32);
                }
            }
        }
    }
    free(xp), free(d), free(pad);
    return bad ? 2 : 0;
}
