/*
 * The sampler's native parts: the top-p cut of whole rows in O(V) a row, where sorting a row of the
 * vocabulary costs about 2 ms here (49,152 tokens) and a nucleus of a flat distribution (a model
 * unsure of its next token, at temperature near 1) can hold thousands of them; and the whole draw of
 * a row that has no top-k (temperature, top-p, min-p, inverse CDF) in a few passes over it.
 *
 * For a row of logits x (divided by the temperature; -inf where top-k or a mask took a token out),
 * the cut is the logit of the last token the nucleus keeps: walking the row's values in descending
 * order, equal values together, the first value at which the running probability reaches top_p.
 * The sampler keeps the logits at or above it (ties with the last token kept stay).
 *
 * One pass finds the row's maximum m; a second computes e_i = exp(x_i - m) (16 lanes at a time); a
 * third adds each e_i into a histogram bin keyed by the top 16 bits of its float32 pattern (sign 0,
 * so the keys order as the values do: 8 exponent and 7 mantissa bits, at most 0x3f80 for e <= 1)
 * and sums them. Scanning the bins from the top finds the bin where the running mass reaches top_p
 * times the total; only that bin's tokens (those within a factor of 1 + 2^-7 of each other) are
 * sorted, to find the value inside it. Sums are in double; the result can differ from a float32
 * cumsum over a sorted row only where the running mass lands within rounding of top_p.
 *
 * Layouts: x [S, V] float32, rows ldx floats apart; per-row settings [S]. Rows spread over the
 * OpenMP team, each with its own scratch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define KEY_MAX 0x3f81 /* one past the key of 1.0f (and of e_i a rounding step above it) */

typedef struct {
    float x, e;
} Token;

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static int by_value_desc(const void *a, const void *b) {
    const float u = ((const Token *)a)->x, v = ((const Token *)b)->x;
    return (u < v) - (u > v);
}

/* e[i] = exp(y[i] - m) for a row y of V values whose maximum is m (0 for -inf: tokens masked). */
static void row_exp(const float *y, int64_t V, float m, float *e) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m);
    for (; i + 16 <= V; i += 16) {
        const __m512 v = _mm512_loadu_ps(y + i);
        /* -inf lanes (masked tokens) are 0, not exp(-87) */
        const __mmask16 live = _mm512_cmpneq_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32((int)0xff800000u));
        _mm512_storeu_ps(e + i, _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(v, mv))));
    }
#endif
    for (; i < V; i++) e[i] = f32_bits(y[i]) == 0xff800000u ? 0.0f : expf(y[i] - m);
}

/* Whether v is a NaN, from the bits (-ffast-math may fold isnan and v != v). */
static int is_nan(float v) { return (f32_bits(v) & 0x7fffffffu) > 0x7f800000u; }

/* The row's maximum, or NaN where it holds a NaN. */
static float row_max(const float *y, int64_t V) {
    float m = -INFINITY;
    for (int64_t i = 0; i < V; i++) {
        if (is_nan(y[i])) return NAN;
        m = y[i] > m ? y[i] : m;
    }
    return m;
}

/* The top-p cut (see the file's comment) of a row y whose e[i] = exp(y[i] - max) are given;
 * hist: KEY_MAX doubles, bin: V tokens of scratch. -inf: keep the whole row. */
static float cut_from_probs(const float *y, const float *e, int64_t V, float top_p, double *hist, Token *bin) {
    const float neg_inf = -INFINITY;
    if (!(top_p < 1.0f)) return neg_inf;
    double total = 0.0;
    memset(hist, 0, KEY_MAX * sizeof(double));
    for (int64_t i = 0; i < V; i++) {
        uint32_t key = f32_bits(e[i]) >> 16;
        key = key < KEY_MAX ? key : KEY_MAX - 1;
        hist[key] += e[i];
        total += e[i];
    }
    const double target = (double)top_p * total;
    double above = 0.0; /* mass of the bins above the current one */
    int64_t kb = -1;
    for (int64_t key = KEY_MAX - 1; key > 0; key--) {
        if (above + hist[key] >= target && hist[key] > 0.0) {
            kb = key;
            break;
        }
        above += hist[key];
    }
    if (kb < 0) return neg_inf; /* rounding left the target above every bin: keep everything */
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++) {
        uint32_t key = f32_bits(e[i]) >> 16;
        key = key < KEY_MAX ? key : KEY_MAX - 1;
        if ((int64_t)key == kb) bin[n++] = (Token){y[i], e[i]};
    }
    qsort(bin, (size_t)n, sizeof(Token), by_value_desc);
    for (int64_t a = 0; a < n;) {
        int64_t b = a;
        while (b < n && bin[b].x == bin[a].x) above += bin[b++].e; /* a group of equal values */
        if (above >= target) return bin[a].x;
        a = b;
    }
    return bin[n - 1].x; /* rounding: the bin's mass fell just short of its histogram sum */
}

/* A thread's scratch for one row: y, e V floats, hist KEY_MAX doubles, bin V tokens. */
typedef struct {
    float *y, *e;
    double *hist;
    Token *bin;
} Scratch;

/* e = exp(y - max) of row y: 1, or 0 (e untouched) for a row with a NaN or nothing but -inf. */
static int row_probs(const float *y, int64_t V, float *e) {
    const float m = row_max(y, V);
    if (is_nan(m) || f32_bits(m) == 0xff800000u) return 0;
    row_exp(y, V, m, e);
    return 1;
}

/* The top-p cut of row x (-inf: keep the whole row, also for a NaN or a fully masked row). */
static float row_cut(const float *x, int64_t V, float top_p, Scratch *w) {
    if (!(top_p < 1.0f) || !row_probs(x, V, w->e)) return -INFINITY;
    return cut_from_probs(x, w->e, V, top_p, w->hist, w->bin);
}

/* One token of row x divided by temperature t, cut at top_p, then at min_p times the largest
 * probability, drawn with u in [0, 1): the first token in vocabulary order whose running sum of
 * kept probabilities exceeds u times their total. A row with a NaN gives the first NaN's index, a
 * row with nothing to draw its last token (as pick_from_probs). */
static int64_t row_sample(const float *x, int64_t V, float t, float top_p, float min_p, double u, Scratch *w) {
    float *y = w->y, *e = w->e;
    for (int64_t i = 0; i < V; i++) y[i] = x[i] / t;
    if (!row_probs(y, V, e)) {
        for (int64_t i = 0; i < V; i++)
            if (is_nan(y[i])) return i;
        return V - 1;
    }
    const float cut = cut_from_probs(y, e, V, top_p, w->hist, w->bin);
    double total = 0.0;
    for (int64_t i = 0; i < V; i++) {
        if (!(y[i] >= cut && e[i] >= min_p)) e[i] = 0.0f; /* cut off */
        total += e[i];
    }
    const double target = u * total;
    double acc = 0.0;
    int64_t last = V - 1;
    for (int64_t i = 0; i < V; i++) {
        if (e[i] <= 0.0f) continue;
        acc += e[i];
        last = i;
        if (acc > target) return i;
    }
    return last; /* rounding: the running sum ended at the target */
}

/* row(s, scratch, args) for every s in [0, S), rows spread over the OpenMP team, each thread with
 * its own scratch for rows of V: 0, or 1 (nothing done) for an empty row or scratch not allocated. */
static int over_rows(int64_t S, int64_t V, void (*row)(int64_t, Scratch *, const void *), const void *args) {
    if (V < 1 || S < 0) return 1;
    int failed = 0;
#pragma omp parallel if (S > 1 && S * V >= (1 << 16))
    {
        Scratch w = {malloc((size_t)V * sizeof(float)), malloc((size_t)V * sizeof(float)),
                     malloc(KEY_MAX * sizeof(double)), malloc((size_t)V * sizeof(Token))};
        if (w.y == NULL || w.e == NULL || w.hist == NULL || w.bin == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 4)
            for (int64_t s = 0; s < S; s++) row(s, &w, args);
        }
        free(w.y), free(w.e), free(w.hist), free(w.bin);
    }
    return failed;
}

typedef struct {
    const float *x;
    int64_t ldx, V;
    const float *temperature, *top_p, *min_p;
    const double *u;
    float *cut;
    int64_t *tokens;
} Rows;

static void cut_row(int64_t s, Scratch *w, const void *args) {
    const Rows *r = args;
    r->cut[s] = row_cut(r->x + s * r->ldx, r->V, r->top_p[s], w);
}

static void sample_row(int64_t s, Scratch *w, const void *args) {
    const Rows *r = args;
    r->tokens[s] = row_sample(r->x + s * r->ldx, r->V, r->temperature[s], r->top_p[s], r->min_p[s], r->u[s], w);
}

/* The top-p cut of each row of x [S, V] (rows ldx apart): 0, or 1 (nothing written). */
int top_p_cuts(const float *x, int64_t ldx, int64_t S, int64_t V, const float *top_p, float *cut) {
    const Rows r = {.x = x, .ldx = ldx, .V = V, .top_p = top_p, .cut = cut};
    return over_rows(S, V, cut_row, &r);
}

/* tokens[s] for each row of x [S, V] (rows ldx apart), divided by temperature[s], cut at top_p[s]
 * (1: none) and min_p[s] (0: none), drawn with u[s] (row_sample): 0, or 1 (nothing written). */
int sample_rows(const float *x, int64_t ldx, int64_t S, int64_t V, const float *temperature, const float *top_p,
                const float *min_p, const double *u, int64_t *tokens) {
    const Rows r = {.x = x, .ldx = ldx, .V = V, .temperature = temperature, .top_p = top_p, .min_p = min_p, .u = u,
                    .tokens = tokens};
    return over_rows(S, V, sample_row, &r);
}

/*
 * Structured output's token bitmask on the logits, in place: for each i, every token t of row
 * x[logit_rows[i]] whose bit (bit t % 32 of word t / 32) is clear in mask[mask_rows[i]] becomes
 * -inf. Words with every bit set (most of a row while a JSON string is open) are skipped whole.
 * x: float32 rows ldx floats apart; mask: int32 words, rows ldm words apart.
 */
int apply_token_bitmask(float *x, int64_t ldx, int64_t V, const int32_t *mask, int64_t ldm,
                        const int64_t *logit_rows, const int64_t *mask_rows, int64_t R) {
    const float neg_inf = -INFINITY;
    for (int64_t i = 0; i < R; i++) {
        float *row = x + logit_rows[i] * ldx;
        const uint32_t *m = (const uint32_t *)(mask + mask_rows[i] * ldm);
        int64_t words = (V + 31) / 32;
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = m[w];
            if (bits == 0xffffffffu)
                continue;
            int64_t base = w * 32, end = base + 32 < V ? base + 32 : V;
            if (bits == 0) {
                for (int64_t t = base; t < end; t++)
                    row[t] = neg_inf;
                continue;
            }
            for (int64_t t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u))
                    row[t] = neg_inf;
        }
    }
    return 0;
}
