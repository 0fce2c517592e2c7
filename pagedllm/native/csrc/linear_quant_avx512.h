/* linear_quant.c's kernels on CPUs with AVX-512 BF16 (LQ_AVX512): 16-lane vectors, VNNI dot products
 * for int8 activations, vdpbf16ps for bf16 ones. Included by linear_quant.c after the definitions
 * its two forms share (tiles, Acts, the threading threshold); linear_quant_avx2.h defines the same
 * functions for AVX2 + FMA. */

typedef __m512i lq_table_t;
#define e4m3_table e4m3_subnormal_table
#define INT8_OFFSET 128 /* int8 tiles meet the activations as unsigned bytes, code + 128 */

/* bf16 bit patterns of the e4m3 subnormals m * 2^-9, m = 0..7 (lanes 8..31 unused). */
static inline __m512i e4m3_subnormal_table(void) {
    uint16_t t[32] = {0};
    for (int m = 1; m < 8; m++) t[m] = f32_to_bf16((float)m / 512.0f);
    return _mm512_loadu_si512((const void *)t);
}

/* 32 e4m3 bytes as 32 bf16 values (exact: e4m3's 3-bit mantissa and exponent range fit bf16;
 * the NaN code is not produced by the quantizer). */
static inline __m512bh widen32_e4m3(const uint8_t *q, __m512i sub_table) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)q));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
    const __m512i v = _mm512_mask_permutexvar_epi16(normal, sub, mag, sub_table);
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8);
    return (__m512bh)_mm512_or_si512(v, sign);
}

/* y rows m0 .. m0+MR-1, output rows n0 .. n0+nr-1 (MR and BITS constant after inlining: the
 * accumulators of a 1-row decode take 8 registers, not 32). */
static inline __attribute__((always_inline)) void quant_block(
    const int MR, const uint16_t *x, int64_t m0, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *zeros, const float *xsum, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t nr,
    lq_table_t table, void *y, int y_f32) {
    const int64_t groups = K / G;
    __m512 acc[MAXM][NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 part[MAXM][NR];
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < NR; r++) part[m][r] = _mm512_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            __m512bh wv[NR];
            for (int r = 0; r < NR; r++) {
                const int64_t row = n0 + (r < nr ? r : 0);
                wv[r] = widen32_e4m3(codes + row * K + k, table);
            }
            for (int m = 0; m < MR; m++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + m) * K + k));
                for (int r = 0; r < NR; r++) part[m][r] = _mm512_dpbf16_ps(part[m][r], xv, wv[r]);
            }
        }
        for (int r = 0; r < NR; r++) {
            const __m512 s = _mm512_set1_ps(bf16_to_f32(scales[(n0 + (r < nr ? r : 0)) * groups + g]));
            for (int m = 0; m < MR; m++) acc[m][r] = _mm512_fmadd_ps(part[m][r], s, acc[m][r]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int64_t r = 0; r < nr; r++) {
            float s = _mm512_reduce_add_ps(acc[m][r]);
            const uint16_t *z = zeros + (n0 + r) * groups;
            const float *xs = xsum + (m0 + m) * groups;
            for (int64_t g = 0; g < groups; g++) s += bf16_to_f32(z[g]) * xs[g];
            const int64_t i = (m0 + m) * N + n0 + r;
            if (y_f32)
                ((float *)y)[i] = s;
            else
                ((uint16_t *)y)[i] = f32_to_bf16(s);
        }
}

/* One block of 32 bf16 activations as int8 (the int8 path): q = round(x / d), d = max|x| / 127;
 * returns d, and sum(q) in *qsum. */
static inline float quantize_block32(const uint16_t *x, int8_t *q, int32_t *qsum) {
    const __m512 lo = bf16x16_load(x), hi = bf16x16_load(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    /* round to nearest (even), |q| <= 127 */
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qh));
    *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
    return amax / 127.f;
}

/* y rows m0 .. m0+MR-1 of one tile's TR output rows (MR, BITS and INT8 constant after inlining). */
static inline __attribute__((always_inline)) void tile_block(
    const int bits, const int MR, const int int8_act, const Acts *a, int64_t m0, const uint8_t *tc,
    const uint16_t *ts, const uint16_t *tz, int64_t K, int64_t G, float out[MAXM][TR]) {
    const int64_t groups = K / G, nb = K / 32;
    const __m512i nib = _mm512_set1_epi8(0x0f), byte = _mm512_set1_epi32(0xff);
    __m512 acc[MAXM];
    for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 part[MAXM];
        for (int m = 0; m < MR; m++) part[m] = _mm512_setzero_ps();
        for (int64_t kb = g * G; kb < (g + 1) * G; kb += 32) {
            if (int8_act) {
                __m512i ia[MAXM], ib[MAXM];
                for (int m = 0; m < MR; m++) {
                    ia[m] = _mm512_set1_epi32(a->xc[(m0 + m) * nb + kb / 32]);
                    ib[m] = _mm512_setzero_si512();
                }
                for (int c = 0; c < (bits == 4 ? 4 : 8); c++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(tc + (bits == 4 ? (kb + 8 * c) * 8 : (kb + 4 * c) * 16)));
                    for (int m = 0; m < MR; m++) {
                        const int8_t *q = a->xq + (m0 + m) * K + kb;
                        int32_t q0, q1;
                        if (bits == 4) {
                            memcpy(&q0, q + 8 * c, 4), memcpy(&q1, q + 8 * c + 4, 4);
                            ia[m] = _mm512_dpbusd_epi32(ia[m], _mm512_and_si512(v, nib), _mm512_set1_epi32(q0));
                            ib[m] = _mm512_dpbusd_epi32(ib[m], _mm512_and_si512(_mm512_srli_epi16(v, 4), nib),
                                                        _mm512_set1_epi32(q1));
                        } else {
                            memcpy(&q0, q + 4 * c, 4);
                            if (c & 1)
                                ib[m] = _mm512_dpbusd_epi32(ib[m], v, _mm512_set1_epi32(q0));
                            else
                                ia[m] = _mm512_dpbusd_epi32(ia[m], v, _mm512_set1_epi32(q0));
                        }
                    }
                }
                for (int m = 0; m < MR; m++)
                    part[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia[m], ib[m])),
                                              _mm512_set1_ps(a->xd[(m0 + m) * nb + kb / 32]), part[m]);
            } else {
                /* sum of u x in fp32 (u the stored code, exact in fp32); the offset goes to the zero term */
                for (int c = 0; c < (bits == 4 ? 4 : 8); c++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(tc + (bits == 4 ? (kb + 8 * c) * 8 : (kb + 4 * c) * 16)));
                    const __m512i halves[2] = {bits == 4 ? _mm512_and_si512(v, nib) : v,
                                               _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)};
                    for (int h = 0; h < (bits == 4 ? 2 : 1); h++)
                        for (int i = 0; i < 4; i++) {
                            const __m512 w = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(halves[h], 8 * i), byte));
                            const int64_t k = kb + (bits == 4 ? 8 * c + 4 * h : 4 * c) + i;
                            for (int m = 0; m < MR; m++)
                                part[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(a->xf[(m0 + m) * K + k]), part[m]);
                        }
                }
            }
        }
        const __m512 s = bf16x16_load(ts + g * TR);
        __m512 z = bf16x16_load(tz + g * TR);
        /* the float path's sum(u x) carries offset * sum(x): zero' - offset * scale */
        if (!int8_act) z = _mm512_fnmadd_ps(s, _mm512_set1_ps(bits == 4 ? 8.f : 128.f), z);
        for (int m = 0; m < MR; m++) {
            acc[m] = _mm512_fmadd_ps(part[m], s, acc[m]);
            acc[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(a->xsum[(m0 + m) * groups + g]), acc[m]);
        }
    }
    for (int m = 0; m < MR; m++) _mm512_storeu_ps(out[m], acc[m]);
}

/* IEEE single-precision a / b rounded to nearest: the explicit-rounding form is kept as written
 * under -ffast-math (no reciprocal), so it rounds as torch's division does (the products below
 * take the same explicit rounding, so that they are not reassociated). */
static inline float div_rn(float a, float b) {
    return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(a), _mm_set_ss(b), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* 16 values of a row of x (bf16 or fp32) from k, zeros past K. */
static inline __m512 load16_x(const void *x, int x_f32, int64_t k, int64_t K) {
    const __mmask16 mk = K - k >= 16 ? (__mmask16)0xffff : k >= K ? 0 : (__mmask16)((1u << (K - k)) - 1);
    if (x_f32) return _mm512_maskz_loadu_ps(mk, (const float *)x + k);
    const __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One activation row as the torch path quantizes it (kernels.int8_dynamic_linear): d = max(max|x| / 127,
 * 1e-12), q = clamp(rint(x / d), -127, 127) with an IEEE division; stored as q + 128 (u8, the unsigned
 * operand of vpdpbusd), KP >= K bytes, the padding 128 (q = 0). Returns d. */
static float w8a8_quantize_row(const void *x, int x_f32, int64_t K, int64_t KP, uint8_t *q) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16_x(x, x_f32, k, K)));
    float d = div_rn(_mm512_reduce_max_ps(mx), 127.f);
    const float dmin = (float)1e-12;
    d = d < dmin ? dmin : d;
    const __m512 dv = _mm512_set1_ps(d);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < KP; k += 16) {
        const __m512 r = _mm512_div_round_ps(load16_x(x, x_f32, k, K), dv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i i = _mm512_cvt_roundps_epi32(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        i = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(i, lo), hi), off);
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(i));
    }
    return d;
}

/* The four sums of a0 .. a3's 16 int32 lanes, as one 128-bit vector. */
static inline __m128i hsum4_epi32(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    const __m256i v = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

/* y rows m0 .. m0+MR-1, output rows n0 .. n0+NR-1 (past N: the last row again): int32 sums of
 * (q + 128) c over K, one vpdpbusd per 64 inputs per (x row, code row); the last 64 inputs masked
 * where K % 64 (codes past K read as 0). The code rows are read one after another by one load, so
 * that the weight is one sequential stream of constant stride, and prefetched 2 KB ahead. Per call
 * on 30 distinct 3072 x 576 weights (out of cache), one thread, with the int8 tiles at 56-65 us in
 * the same runs: this order 64-66 us; without the prefetch 72-83; two loads (two chains) per 128
 * bytes 102-105; four rows interleaved per 64 bytes 101-116; and an all-ones masked load per 64
 * bytes instead of a plain one tripled the time. */
static inline __attribute__((always_inline)) void w8a8_block(
    const int MR, const uint8_t *xq, int64_t KP, const int8_t *codes, int64_t N, int64_t K, int64_t n0,
    __m128i out[MAXM]) {
    __m512i acc[MAXM][NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_si512();
    for (int r = 0; r < NR; r++) {
        const int8_t *wr = codes + (n0 + r < N ? n0 + r : N - 1) * K;
        for (int64_t k = 0; k < K; k += 64) {
            const __mmask64 mk = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
            _mm_prefetch((const char *)(wr + k + 2048), _MM_HINT_T0);
            const __m512i w = K - k >= 64 ? _mm512_loadu_si512((const void *)(wr + k)) : _mm512_maskz_loadu_epi8(mk, wr + k);
            for (int m = 0; m < MR; m++)
                acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], _mm512_loadu_si512((const void *)(xq + m * KP + k)), w);
        }
    }
    for (int m = 0; m < MR; m++) out[m] = hsum4_epi32(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
}

/* Up to 16 outputs of one row: y[i..] = (acc * d) * s, each product rounded to fp32 as torch rounds
 * it (kept as written under -ffast-math), stored in fp32 or rounded to bf16; lanes past mk untouched. */
static inline void w8a8_store_scaled(__m512 acc, float d, __m512 s, void *y, int64_t i, __mmask16 mk, int f32) {
    const __m512 v = _mm512_mul_round_ps(_mm512_mul_round_ps(acc, _mm512_set1_ps(d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                         s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (f32)
        _mm512_mask_storeu_ps((float *)y + i, mk, v);
    else
        _mm256_mask_storeu_epi16((uint16_t *)y + i, mk, (__m256i)_mm512_cvtneps_pbh(v));
}

/* Outputs n0 .. n0+nr-1 of x rows m0 .. m0+mr-1 (w8a8_linear's unit of work): the int32 sums, the
 * +128 of the activations taken off as 128 wsum, then (float(acc) * d) * s, the four outputs of a
 * row at once. */
static inline void w8a8_tile(const uint8_t *xq, int64_t KP, const int8_t *codes, const float *scales, const int32_t *wsum,
                             const float *d, int64_t N, int64_t K, int64_t m0, int mr, int64_t n0, int64_t nr, void *y,
                             int f32) {
    __m128i sums[MAXM];
    const uint8_t *xb = xq + m0 * KP;
    switch (mr) {
    case 1: w8a8_block(1, xb, KP, codes, N, K, n0, sums); break;
    case 2: w8a8_block(2, xb, KP, codes, N, K, n0, sums); break;
    case 3: w8a8_block(3, xb, KP, codes, N, K, n0, sums); break;
    default: w8a8_block(4, xb, KP, codes, N, K, n0, sums);
    }
    const __mmask16 rows = (__mmask16)((1u << nr) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(rows, scales + n0);
    const __m512i off = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(rows, wsum + n0), 7);
    for (int m = 0; m < mr; m++)
        w8a8_store_scaled(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_zextsi128_si512(sums[m]), off)), d[m0 + m], s, y,
                          (m0 + m) * N + n0, rows, f32);
}

/* x rows mb * 16 .. mb * 16 + 15 of M quantized by w8a8_quantize_row into blk (16 rows of KP
 * bytes, q + 128; rows past M q = 0, no d) and packed 16 rows at a time into xb (pack16_dwords, KP / 64
 * KiB): signed q for the AMX tiles' TDPBSSD (flip 0x80), q + 128 for vpdpbusd (flip 0). */
static inline void w8a8_quantize_pack16(const void *x, int64_t M, int64_t K, int f32, int64_t mb, float *d,
                                        uint8_t *blk, char flip, int32_t *xb) {
    const int64_t KP = (K + 63) / 64 * 64, es = f32 ? 4 : 2;
    for (int64_t j = 0; j < 16; j++) {
        const int64_t m = mb * 16 + j;
        if (m < M)
            d[m] = w8a8_quantize_row((const char *)x + m * K * es, f32, K, KP, blk + j * KP);
        else
            memset(blk + j * KP, 128, (size_t)KP); /* q = 0 */
    }
    pack16_dwords(blk, KP, 16, KP / 64, flip, xb);
}

/* A row quantized by w8a8_quantize_row (q + 128, KP bytes) as signed int8 q, K bytes: the top bit flipped. */
static inline void w8a8_row_to_signed(const uint8_t *row, int8_t *q, int64_t K) {
    for (int64_t k = 0; k < K; k += 64) {
        const __mmask64 mk = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        const __m512i v = _mm512_xor_si512(_mm512_load_si512((const void *)(row + k)), _mm512_set1_epi8((char)0x80));
        _mm512_mask_storeu_epi8(q + k, mk, v);
    }
}

/* One row of w8a8_scale_rows: y[n] = (float(acc[n]) * d) * scales[n]. */
static inline void w8a8_scale_row(const int32_t *acc, int64_t N, float d, const float *scales, void *y, int64_t i0,
                                  int f32) {
    for (int64_t n = 0; n < N; n += 16) {
        const __mmask16 mk = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
        w8a8_store_scaled(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mk, acc + n)), d, _mm512_maskz_loadu_ps(mk, scales + n),
                          y, i0 + n, mk, f32);
    }
}

/* Store 16 fp32 weights of a row at w (bf16 or fp32). */
static inline void store16(void *w, int64_t i, __m512 v, int w_f32) {
    if (w_f32)
        _mm512_storeu_ps((float *)w + i, v);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)w + i), (__m256i)_mm512_cvtneps_pbh(v));
}

/* Row n of W ([K] values at w, bf16 or fp32 (w_f32)) from the layouts of linear_quant.c. */
static inline void dequant_row(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                               int64_t n, int64_t K, int64_t G, void *w, int w_f32, lq_table_t sub_table) {
    const int64_t groups = K / G, t = n / TR, r = n % TR;
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t si = bits == 3 ? n * groups + k / G : (t * groups + k / G) * TR + r;
        const __m512 s = _mm512_set1_ps(bf16_to_f32(scales[si]));
        const __m512 z = _mm512_set1_ps(bf16_to_f32(zeros[si]));
        __m512 v;
        if (bits == 3) {
            if (k % 32) continue;
            const __m512i e = (__m512i)widen32_e4m3(codes + n * K + k, sub_table);
            const __m512 lo = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(e));
            const __m512 hi = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(e, 1));
            store16(w, k, _mm512_fmadd_ps(lo, s, z), w_f32);
            store16(w, k + 16, _mm512_fmadd_ps(hi, s, z), w_f32);
            continue;
        }
        const uint8_t *tc = codes + t * tile_code_bytes(bits, K);
        uint32_t d[4];
        if (bits == 4) {
            /* 16 inputs: two 8-input chunks; dword r of a chunk holds inputs 0-3 (low nibbles), 4-7 */
            for (int c = 0; c < 2; c++) memcpy(&d[c], tc + (k + 8 * c) * 8 + r * 4, 4);
            const __m128i b = _mm_set_epi32(0, 0, (int)d[1], (int)d[0]);
            const __m128i m4 = _mm_set1_epi8(0x0f);
            const __m128i codes16 = _mm_unpacklo_epi32(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));
            v = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes16)), _mm512_set1_ps(8.f));
        } else {
            for (int c = 0; c < 4; c++) memcpy(&d[c], tc + (k + 4 * c) * 16 + r * 4, 4);
            const __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)d), _mm_set1_epi8((char)0x80));
            v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
        }
        store16(w, k, _mm512_fmadd_ps(v, s, z), w_f32);
    }
}

