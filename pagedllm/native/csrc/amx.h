/*
 * AMX (Sapphire Rapids and later Xeons): what the kernels that multiply bf16 on the tile unit share.
 * HAVE_AMX_BF16 is 1 in builds for CPUs with AMX-TILE and AMX-BF16 (and AVX-512 BF16, which the
 * kernels use around the tiles). Linux lends the tile registers to a process that asks for them
 * once (amx_permitted); each thread loads a tile configuration before its first tile instruction
 * and releases the tiles when it is done (amx_configure, _tile_release).
 */
#ifndef PAGEDLLM_AMX_H
#define PAGEDLLM_AMX_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
long syscall(long number, ...);
#define HAVE_AMX_BF16 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use the AMX tile data (oneDNN makes the same request for its own AMX
 * kernels). The request is idempotent, so threads racing to make it first are harmless. */
static inline int amx_permitted(void) {
    static int state = -1;
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s;
}

/* Loads palette 1 with tiles 0-7 of rows[t] rows of colsb[t] bytes each on the calling thread. */
static inline void amx_configure_tiles(const uint8_t *rows, const uint16_t *colsb) {
    struct {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = colsb[t];
    }
    _tile_loadconfig(&cfg);
}

/* All eight tiles at their largest: 16 rows of 64 bytes (16 float32 sums, or 32 bf16 as 16
 * pairs, per row). */
static inline void amx_configure(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure_tiles(rows, colsb);
}

/* One tile product into tmm c from tmm a and b: TDPBSSD (signed bytes, int32 sums; s8, CPUs with
 * AMX-INT8) or TDPBF16PS (bf16 pairs, float32 sums). */
#ifdef __AMX_INT8__
#define AMX_DP(s8, c, a, b)                                                                                        \
    do {                                                                                                           \
        if (s8)                                                                                                    \
            _tile_dpbssd(c, a, b);                                                                                 \
        else                                                                                                       \
            _tile_dpbf16ps(c, a, b);                                                                               \
    } while (0)
#else
#define AMX_DP(s8, c, a, b) _tile_dpbf16ps(c, a, b)
#endif

/* The k-loop of one output block of up to 2 x 2 tiles, on tiles configured as amx_configure does:
 * 16 rows at a0 (and 16 at a1: two_n; sa0, sa1 bytes apart), 64 bytes of each per step, as the
 * first operand in tmm4 (tmm5); 16 lines of 64 bytes at b0 (and at b1: two_m), 1 KiB per step, as
 * the second in tmm6 (tmm7); KC steps; sums in tmm0 (a0 b0), tmm1 (a0 b1), tmm2 (a1 b0), tmm3
 * (a1 b1), zeroed first. s8: TDPBSSD, else TDPBF16PS (AMX_DP). */
static inline __attribute__((always_inline)) void amx_tile_loop(int s8, const char *w0, int64_t sa0, const char *w1,
                                                               int64_t sa1, const char *x0, const char *x1, int64_t KC,
                                                               int two_n, int two_m) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < KC; kc++) {
        _tile_loadd(4, w0 + kc * 64, sa0);
        if (two_n) _tile_loadd(5, w1 + kc * 64, sa1);
        _tile_loadd(6, x0 + kc * 1024, 64);
        if (two_m) _tile_loadd(7, x1 + kc * 1024, 64);
        AMX_DP(s8, 0, 4, 6);
        if (two_m) AMX_DP(s8, 1, 4, 7);
        if (two_n) AMX_DP(s8, 2, 5, 6);
        if (two_n && two_m) AMX_DP(s8, 3, 5, 7);
    }
}

static inline __attribute__((always_inline)) void amx_tile_block(int s8, const void *a0, int64_t sa0, const void *a1,
                                                                int64_t sa1, const void *b0, const void *b1,
                                                                int64_t KC, int two_n, int two_m) {
    const char *w0 = (const char *)a0, *w1 = (const char *)a1, *x0 = (const char *)b0, *x1 = (const char *)b1;
    if (two_n && two_m) /* one loop per shape, each with the flags constant */
        amx_tile_loop(s8, w0, sa0, w1, sa1, x0, x1, KC, 1, 1);
    else if (two_n)
        amx_tile_loop(s8, w0, sa0, w1, sa1, x0, x1, KC, 1, 0);
    else if (two_m)
        amx_tile_loop(s8, w0, sa0, w1, sa1, x0, x1, KC, 0, 1);
    else
        amx_tile_loop(s8, w0, sa0, w1, sa1, x0, x1, KC, 0, 0);
}
#else
#define HAVE_AMX_BF16 0
#endif
#endif
