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
 * vector, and quant8 encodes fall far below memory bandwidth (bench/kernels.py on a
 * core built with -DPSG_NO_TARGET_CLONES). Each kernel
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

/* Helpers that take a pass as a function pointer must be inlined into each kernel, so
 * the pointer is a constant there and the pass is compiled for that kernel's SIMD level:
 * an out-of-line helper is compiled once, for the baseline, and calls the pass
 * indirectly (quant8's quantise passes ran as SSE2 that way). */
#if defined(__GNUC__)
#define PSG_ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define PSG_ALWAYS_INLINE static inline
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

/* ---- Traversal ----
 * One sequential stream per array leaves read bandwidth unused: the hardware
 * prefetcher keeps too few lines in flight for it. Walking PSG_STREAMS far-apart
 * parts of the array in turn, one chunk at a time, keeps more misses outstanding.
 * Two streams were best for the two-pass quant8 ops, which need it most (compare
 * bench/kernels.py with the core built with -DPSG_STREAMS=1, 2 or 4). A leading
 * partial chunk first brings the given pointer to a 64-byte boundary: numpy's large
 * arrays start 16 bytes past one, and 64-byte vector stores that straddle two cache
 * lines slow a float-writing loop markedly. Results do not depend on the visiting
 * order: every pass is elementwise or an integer max. */
#ifndef PSG_STREAMS
#define PSG_STREAMS 2
#endif
#ifndef PSG_CHUNK
#define PSG_CHUNK 256 /* elements per visit; 1 KiB of float32 */
#endif
#define PSG_ALIGN 64

/* One pass over elements [begin, begin + count); returns max(acc, whatever the
 * pass reduces), or acc for passes without reduction. */
typedef uint32_t (*psg_range_fn)(const void* ctx, size_t begin, size_t count, uint32_t acc);

/* Number of leading elements of size elem_size after which p is PSG_ALIGN-aligned
 * (n if the array ends first, 0 if p is not even element-aligned). */
static inline size_t psg_head_to_align(const void* p, size_t elem_size, size_t n) {
    size_t misalign = (size_t)((uintptr_t)p % PSG_ALIGN);
    if (misalign == 0 || misalign % elem_size != 0) return 0;
    size_t head = (PSG_ALIGN - misalign) / elem_size;
    return head < n ? head : n;
}

/* fn over [0, n): `head` elements, then PSG_STREAMS interleaved parts, then the
 * tail. Returns the max of fn's reductions (0 for an empty range). */
PSG_ALWAYS_INLINE uint32_t psg_run_streams(const void* ctx, size_t n, size_t head, psg_range_fn fn) {
    uint32_t acc = fn(ctx, 0, head, 0);
    size_t per_stream = (n - head) / PSG_STREAMS / PSG_CHUNK * PSG_CHUNK;
    uint32_t stream_acc[PSG_STREAMS] = {0};
    for (size_t c = 0; c < per_stream; c += PSG_CHUNK) {
        for (size_t s = 0; s < PSG_STREAMS; ++s) {
            stream_acc[s] = fn(ctx, head + s * per_stream + c, PSG_CHUNK, stream_acc[s]);
        }
    }
    size_t tail = head + PSG_STREAMS * per_stream;
    acc = fn(ctx, tail, n - tail, acc);
    for (size_t s = 0; s < PSG_STREAMS; ++s) acc = acc > stream_acc[s] ? acc : stream_acc[s];
    return acc;
}

#endif /* PIPESGD_COMPRESS_KERNEL_COMMON_H */
