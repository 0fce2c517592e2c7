/* What the native kernels share: bfloat16 <-> float32 conversions (bf16 is the top half of fp32),
 * and their vector forms and lane sums of accumulators: 16 lanes on AVX-512 (bf16_avx512.h), 8 on
 * AVX2 + FMA (bf16_avx2.h). */
#ifndef PAGEDLLM_BF16_H
#define PAGEDLLM_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__)
#include "bf16_avx512.h"
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include "bf16_avx2.h"
#endif
#endif
