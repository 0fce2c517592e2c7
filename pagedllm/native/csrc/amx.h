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
#else
#define HAVE_AMX_BF16 0
#endif
#endif
