/* Private to the compression kernels: float32 <-> bit pattern without type
 * punning (memcpy compiles to a register move), the pragma that keeps the compiler
 * from fusing a*b+c into one FMA, and the attribute that compiles each kernel for
 * several x86 SIMD levels.
 *
 * Why no FMA: the fused ring ops (decode_add, decode_add_encode) must equal the
 * composition of the plain ops bitwise, and the plain decode rounds q*scale to
 * float32 before the addition. A contracted a*b+c rounds once, so it would differ
 * in the last bit whenever the build targets an FMA machine (-march=native).
 */
#ifndef PIPESGD_COMPRESS_KERNEL_COMMON_H
#define PIPESGD_COMPRESS_KERNEL_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* The core library is built for baseline x86-64 (SSE2), where the 32-bit integer
 * max and the float -> int8 narrowing of quant8 take several instructions per
 * vector and a quant8 encode runs at about a third of memory bandwidth. Each kernel
 * is therefore also compiled for x86-64-v3 (AVX2) and x86-64-v4 (AVX-512), and the
 * loader picks the best one the CPU supports (GNU ifunc); the arithmetic is the same
 * IEEE operations in every version, so results do not depend on the machine.
 * Define PSG_NO_TARGET_CLONES to build only the baseline. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__ELF__) && \
    !defined(PSG_NO_TARGET_CLONES) && (defined(__clang__) || __GNUC__ >= 12)
#define PSG_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PSG_KERNEL
#endif

#define PSG_F32_ABS_MASK 0x7FFFFFFFu
#define PSG_F32_INF_BITS 0x7F800000u /* |x| bits above this are NaN, equal is Inf */

static inline uint32_t psg_f32_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

static inline float psg_f32_from_bits(uint32_t b) {
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

#endif /* PIPESGD_COMPRESS_KERNEL_COMMON_H */
