/* linear_quant.c's kernels on CPUs with AVX2, FMA and F16C but not AVX-512 BF16 (LQ_AVX2): the
 * layouts and int32 sums of linear_quant_avx512.h in 8-lane vectors (see linear_quant.c's opening
 * comment). Included by linear_quant.c after the definitions its two forms share. */

typedef int lq_table_t; /* e4m3 subnormals come from a conversion, no table */
static inline lq_table_t e4m3_table(void) { return 0; }
#define INT8_OFFSET 0 /* int8 tiles meet the activations as signed codes, the stored byte ^ 0x80 */

/* IEEE single-precision a / b and a * b, rounded to nearest, as written: -ffast-math may turn a
 * division by a constant into a product by its reciprocal and regroup products of products, which
 * would round differently from the torch path that w8a8 equals to the bit. */
static inline float div_rn(float a, float b) {
    __m128 r = _mm_set_ss(a);
    __asm__("vdivss %1, %0, %0" : "+x"(r) : "x"(_mm_set_ss(b)));
    return _mm_cvtss_f32(r);
}

static inline __m256 div_rn8(__m256 a, __m256 b) {
    __asm__("vdivps %1, %0, %0" : "+x"(a) : "x"(b));
    return a;
}

/* mul_rn8: bf16.h */

/* 16 e4m3 bytes as fp32, times 2^-8 (exact): an fp16 holding a byte's exponent and mantissa in its
 * own fields is the e4m3 value times 2^-8, normals and subnormals alike (the exponent biases are 15
 * and 7), so the bytes move into fp16 fields, the sign on top, and F16C widens them. The callers
 * fold E4M3_F16_SCALE into the scale (a power of two: the products round as the unscaled ones). */
#define E4M3_F16_SCALE 256.f
static inline void widen16_e4m3(const uint8_t *q, __m256 *lo, __m256 *hi) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* e4m3: y rows m0 .. m0+MR-1, output rows n0 .. n0+nr-1, one output row at a time (its bytes one
 * sequential stream; x's rows stay in L1), two accumulators per x row per group. */
static inline __attribute__((always_inline)) void quant_block(
    const int MR, const uint16_t *x, int64_t m0, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *zeros, const float *xsum, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t nr,
    lq_table_t table, void *y, int y_f32) {
    (void)table;
    const int64_t groups = K / G;
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *wr = codes + (n0 + r) * K;
        __m256 acc[MAXM];
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256 part[MAXM][2];
            for (int m = 0; m < MR; m++) part[m][0] = part[m][1] = _mm256_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                _mm_prefetch((const char *)(wr + k + 1024), _MM_HINT_T0);
                __m256 w0, w1;
                widen16_e4m3(wr + k, &w0, &w1);
                for (int m = 0; m < MR; m++) {
                    const uint16_t *xr = x + (m0 + m) * K + k;
                    part[m][0] = _mm256_fmadd_ps(w0, bf16x8_load(xr), part[m][0]);
                    part[m][1] = _mm256_fmadd_ps(w1, bf16x8_load(xr + 8), part[m][1]);
                }
            }
            const __m256 s = _mm256_set1_ps(bf16_to_f32(scales[(n0 + r) * groups + g]) * E4M3_F16_SCALE);
            for (int m = 0; m < MR; m++) acc[m] = _mm256_fmadd_ps(_mm256_add_ps(part[m][0], part[m][1]), s, acc[m]);
        }
        for (int m = 0; m < MR; m++) {
            float s = lane_sum8(acc[m]);
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
}

/* 32 int32 lanes (a, b, c, d in input order, each within [-128, 127]) as 32 int8 bytes, in order. */
static inline void store32_epi8(int8_t *q, __m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* One block of 32 bf16 activations as int8 (the int8 path): q = round(x / d), d = max|x| / 127;
 * returns d, and sum(q) in *qsum. */
static inline float quantize_block32(const uint16_t *x, int8_t *q, int32_t *qsum) {
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) {
        v[i] = bf16x8_load(x + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], abs_mask));
    }
    const float amax = lane_max8(mx);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)); /* nearest (even), |q| <= 127 */
    store32_epi8(q, qi[0], qi[1], qi[2], qi[3]);
    *qsum = lane_sum8_epi32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
    return amax / 127.f;
}

/* y rows m0 .. m0+MR-1 of one tile's TR output rows (MR, BITS and INT8 constant after inlining), as
 * two halves of 8 rows, each over all of K (the tile's codes stay in L1 for the second half). */
static inline __attribute__((always_inline)) void tile_block(
    const int bits, const int MR, const int int8_act, const Acts *a, int64_t m0, const uint8_t *tc,
    const uint16_t *ts, const uint16_t *tz, int64_t K, int64_t G, float out[MAXM][TR]) {
    const int64_t groups = K / G, nb = K / 32;
    const __m256i nib = _mm256_set1_epi8(0x0f), byte = _mm256_set1_epi32(0xff), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        const uint8_t *th = tc + 32 * h;
        __m256 acc[MAXM];
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256 part[MAXM];
            for (int m = 0; m < MR; m++) part[m] = _mm256_setzero_ps();
            for (int64_t kb = g * G; kb < (g + 1) * G; kb += 32) {
                if (int8_act) {
                    __m256i ia[MAXM];
                    if (bits == 4) {
                        __m256i s16[MAXM]; /* the block's pair sums, in int16 (|sum| <= 8 * 2 * 15 * 127) */
                        for (int m = 0; m < MR; m++) s16[m] = _mm256_setzero_si256();
                        for (int c = 0; c < 4; c++) {
                            const __m256i v = _mm256_loadu_si256((const __m256i *)(th + (kb + 8 * c) * 8));
                            const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                            for (int m = 0; m < MR; m++) {
                                const int8_t *q = a->xq + (m0 + m) * K + kb + 8 * c;
                                int32_t q0, q1;
                                memcpy(&q0, q, 4), memcpy(&q1, q + 4, 4);
                                s16[m] = _mm256_add_epi16(s16[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(q0)),
                                                                                   _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q1))));
                            }
                        }
                        for (int m = 0; m < MR; m++)
                            ia[m] = _mm256_add_epi32(_mm256_madd_epi16(s16[m], ones), _mm256_set1_epi32(a->xc[(m0 + m) * nb + kb / 32]));
                    } else {
                        for (int m = 0; m < MR; m++) ia[m] = _mm256_set1_epi32(a->xc[(m0 + m) * nb + kb / 32]);
                        for (int c = 0; c < 8; c++) {
                            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(th + (kb + 4 * c) * 16)),
                                                               _mm256_set1_epi8((char)0x80));
                            const __m256i aw = _mm256_abs_epi8(w);
                            for (int m = 0; m < MR; m++) {
                                int32_t q0;
                                memcpy(&q0, a->xq + (m0 + m) * K + kb + 4 * c, 4);
                                const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(q0), w));
                                ia[m] = _mm256_add_epi32(ia[m], _mm256_madd_epi16(p, ones));
                            }
                        }
                    }
                    for (int m = 0; m < MR; m++)
                        part[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m]), _mm256_set1_ps(a->xd[(m0 + m) * nb + kb / 32]), part[m]);
                } else {
                    /* sum of u x in fp32 (u the stored code, exact in fp32); the offset goes to the zero term */
                    for (int c = 0; c < (bits == 4 ? 4 : 8); c++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(th + (bits == 4 ? (kb + 8 * c) * 8 : (kb + 4 * c) * 16)));
                        const __m256i halves[2] = {bits == 4 ? _mm256_and_si256(v, nib) : v,
                                                   _mm256_and_si256(_mm256_srli_epi16(v, 4), nib)};
                        for (int hh = 0; hh < (bits == 4 ? 2 : 1); hh++)
                            for (int i = 0; i < 4; i++) {
                                const __m256 w = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(halves[hh], 8 * i), byte));
                                const int64_t k = kb + (bits == 4 ? 8 * c + 4 * hh : 4 * c) + i;
                                for (int m = 0; m < MR; m++)
                                    part[m] = _mm256_fmadd_ps(w, _mm256_set1_ps(a->xf[(m0 + m) * K + k]), part[m]);
                            }
                    }
                }
            }
            const __m256 s = bf16x8_load(ts + g * TR + 8 * h);
            __m256 z = bf16x8_load(tz + g * TR + 8 * h);
            /* the float path's sum(u x) carries offset * sum(x): zero' - offset * scale */
            if (!int8_act) z = _mm256_fnmadd_ps(s, _mm256_set1_ps(bits == 4 ? 8.f : 128.f), z);
            for (int m = 0; m < MR; m++) {
                acc[m] = _mm256_fmadd_ps(part[m], s, acc[m]);
                acc[m] = _mm256_fmadd_ps(z, _mm256_set1_ps(a->xsum[(m0 + m) * groups + g]), acc[m]);
            }
        }
        for (int m = 0; m < MR; m++) _mm256_storeu_ps(out[m] + 8 * h, acc[m]);
    }
}

/* 8 values of a row of x (bf16 or fp32) from k, zeros past K. */
static inline __m256 load8_x(const void *x, int x_f32, int64_t k, int64_t K) {
    if (K - k >= 8) return x_f32 ? _mm256_loadu_ps((const float *)x + k) : bf16x8_load((const uint16_t *)x + k);
    float t[8] = {0};
    for (int64_t i = k; i < K; i++) t[i - k] = x_f32 ? ((const float *)x)[i] : bf16_to_f32(((const uint16_t *)x)[i]);
    return _mm256_loadu_ps(t);
}

/* One activation row as the torch path quantizes it (kernels.int8_dynamic_linear): d = max(max|x| / 127,
 * 1e-12), q = clamp(rint(x / d), -127, 127) with an IEEE division; stored as signed q, KP >= K bytes
 * (KP % 32 == 0), the padding 0. Returns d. */
static float w8a8_quantize_row(const void *x, int x_f32, int64_t K, int64_t KP, uint8_t *q) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load8_x(x, x_f32, k, K), abs_mask));
    float d = div_rn(lane_max8(mx), 127.f);
    const float dmin = (float)1e-12;
    d = d < dmin ? dmin : d;
    const __m256 dv = _mm256_set1_ps(d);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (int64_t k = 0; k < KP; k += 32) {
        __m256i i[4];
        for (int j = 0; j < 4; j++) { /* MXCSR's default rounding: nearest, ties to even */
            i[j] = _mm256_cvtps_epi32(div_rn8(load8_x(x, x_f32, k + 8 * j, K), dv));
            i[j] = _mm256_min_epi32(_mm256_max_epi32(i[j], lo), hi);
        }
        store32_epi8((int8_t *)q + k, i[0], i[1], i[2], i[3]);
    }
    return d;
}

/* y rows m0 .. m0+MR-1, output rows n0 .. n0+NR-1 (past N: the last row again): int32 sums of q c over
 * K, |c| x sign(q, c) per 32 inputs, one code row at a time (one sequential stream, prefetched 2 KB
 * ahead); the last 32 inputs copied where K % 32 (q is 0 past K). */
static inline __attribute__((always_inline)) void w8a8_block(
    const int MR, const uint8_t *xq, int64_t KP, const int8_t *codes, int64_t N, int64_t K, int64_t n0,
    int32_t out[MAXM][NR]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < NR; r++) {
        const int8_t *wr = codes + (n0 + r < N ? n0 + r : N - 1) * K;
        __m256i acc[MAXM];
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_si256();
        for (int64_t k = 0; k < K; k += 32) {
            _mm_prefetch((const char *)(wr + k + 2048), _MM_HINT_T0);
            __m256i w;
            if (K - k >= 32) {
                w = _mm256_loadu_si256((const __m256i *)(wr + k));
            } else {
                int8_t t[32] = {0};
                memcpy(t, wr + k, (size_t)(K - k));
                w = _mm256_loadu_si256((const __m256i *)t);
            }
            const __m256i aw = _mm256_abs_epi8(w);
            for (int m = 0; m < MR; m++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(xq + m * KP + k));
                acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(q, w)), ones));
            }
        }
        for (int m = 0; m < MR; m++) out[m][r] = lane_sum8_epi32(acc[m]);
    }
}

/* (float(acc) * d) * s, each product rounded to fp32 as torch rounds it, stored in fp32 or bf16. */
static inline void w8a8_store1(int32_t acc, float d, float s, void *y, int64_t i, int f32) {
    const float v = _mm_cvtss_f32(_mm256_castps256_ps128(
        mul_rn8(mul_rn8(_mm256_set1_ps((float)acc), _mm256_set1_ps(d)), _mm256_set1_ps(s))));
    if (f32)
        ((float *)y)[i] = v;
    else
        ((uint16_t *)y)[i] = f32_to_bf16(v);
}

/* Outputs n0 .. n0+nr-1 of x rows m0 .. m0+mr-1 (w8a8_linear's unit of work). */
static inline void w8a8_tile(const uint8_t *xq, int64_t KP, const int8_t *codes, const float *scales, const int32_t *wsum,
                             const float *d, int64_t N, int64_t K, int64_t m0, int mr, int64_t n0, int64_t nr, void *y,
                             int f32) {
    (void)wsum; /* q is signed here: no offset to take off */
    int32_t sums[MAXM][NR];
    const uint8_t *xb = xq + m0 * KP;
    switch (mr) {
    case 1: w8a8_block(1, xb, KP, codes, N, K, n0, sums); break;
    case 2: w8a8_block(2, xb, KP, codes, N, K, n0, sums); break;
    case 3: w8a8_block(3, xb, KP, codes, N, K, n0, sums); break;
    default: w8a8_block(4, xb, KP, codes, N, K, n0, sums);
    }
    for (int m = 0; m < mr; m++)
        for (int64_t r = 0; r < nr; r++) w8a8_store1(sums[m][r], d[m0 + m], scales[n0 + r], y, (m0 + m) * N + n0 + r, f32);
}

/* A row quantized by w8a8_quantize_row (already signed) into q, K bytes. */
static inline void w8a8_row_to_signed(const uint8_t *row, int8_t *q, int64_t K) { memcpy(q, row, (size_t)K); }

/* One row of w8a8_scale_rows: y[n] = (float(acc[n]) * d) * scales[n]. */
static inline void w8a8_scale_row(const int32_t *acc, int64_t N, float d, const float *scales, void *y, int64_t i0,
                                  int f32) {
    const __m256 dv = _mm256_set1_ps(d);
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
        const __m256 v = mul_rn8(mul_rn8(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(acc + n))), dv),
                                 _mm256_loadu_ps(scales + n));
        if (f32) {
            _mm256_storeu_ps((float *)y + i0 + n, v);
        } else {
            float t[8];
            _mm256_storeu_ps(t, v);
            for (int j = 0; j < 8; j++) ((uint16_t *)y)[i0 + n + j] = f32_to_bf16(t[j]);
        }
    }
    for (; n < N; n++) w8a8_store1(acc[n], d, scales[n], y, i0 + n, f32);
}

/* Store 8 fp32 weights of a row at w (bf16, rounded to nearest even, or fp32). */
static inline void store8(void *w, int64_t i, __m256 v, int w_f32) {
    if (w_f32) {
        _mm256_storeu_ps((float *)w + i, v);
        return;
    }
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    _mm_storeu_si128((__m128i *)((uint16_t *)w + i), _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}

/* Row n of W ([K] values at w, bf16 or fp32 (w_f32)) from the layouts of linear_quant.c, 8 inputs at a time. */
static inline void dequant_row(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                               int64_t n, int64_t K, int64_t G, void *w, int w_f32, lq_table_t sub_table) {
    (void)sub_table;
    const int64_t groups = K / G, t = n / TR, r = n % TR;
    const uint8_t *tc = codes + t * tile_code_bytes(bits == 3 ? 8 : bits, K);
    for (int64_t k = 0; k < K; k += 8) {
        const int64_t si = bits == 3 ? n * groups + k / G : (t * groups + k / G) * TR + r;
        const __m256 s = _mm256_set1_ps(bf16_to_f32(scales[si]));
        const __m256 z = _mm256_set1_ps(bf16_to_f32(zeros[si]));
        __m256 v;
        if (bits == 3) {
            if (k % 16) continue; /* 16 inputs at a time, in one group (G % 32 == 0) */
            __m256 lo, hi;
            widen16_e4m3(codes + n * K + k, &lo, &hi);
            const __m256 s8 = _mm256_mul_ps(s, _mm256_set1_ps(E4M3_F16_SCALE));
            store8(w, k, _mm256_fmadd_ps(lo, s8, z), w_f32);
            store8(w, k + 8, _mm256_fmadd_ps(hi, s8, z), w_f32);
            continue;
        } else if (bits == 4) {
            /* one dword of the 8-input chunk: inputs 0-3 in the low nibbles, 4-7 in the high ones */
            int32_t d;
            memcpy(&d, tc + k * 8 + r * 4, 4);
            const __m128i b = _mm_cvtsi32_si128(d), m4 = _mm_set1_epi8(0x0f);
            const __m128i c8 = _mm_unpacklo_epi32(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));
            v = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c8)), _mm256_set1_ps(8.f));
        } else {
            int32_t d[2];
            memcpy(&d[0], tc + k * 16 + r * 4, 4), memcpy(&d[1], tc + (k + 4) * 16 + r * 4, 4);
            const __m128i b = _mm_xor_si128(_mm_loadl_epi64((const __m128i *)d), _mm_set1_epi8((char)0x80));
            v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        }
        store8(w, k, _mm256_fmadd_ps(v, s, z), w_f32);
    }
}
