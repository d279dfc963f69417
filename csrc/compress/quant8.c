/* quant8 kernels: symmetric signed 8-bit quantisation with one float32 scale per block.
 *
 * Wire layout of a block of n elements: [float32 scale][n x int8 q], 4 + n bytes,
 * host byte order (every rank of a ring shares one architecture). Decoding gives
 * q * scale.
 *
 * Scale: max|x| / 127 rounded *up* to a float32 (one ulp above the nearest value
 * at most). Rounding up guarantees |x / scale| <= 127, so no element is ever
 * clamped and |x - q * scale| <= scale / 2 holds for every element, including
 * blocks whose maximum is denormal: there max/127 would round to a much smaller
 * scale (or to 0) and the largest elements would be clamped far outside the bound.
 * The one exception is max|x| within 127 ulps of FLT_MAX, where 127 * scale would
 * overflow: there the scale is rounded down, and the largest |x| / scale exceeds 127
 * by a few ulps only, so q = 127 still decodes within scale / 2.
 *
 * q = round(x * (1 / scale)): a multiplication is several times cheaper than a
 * division and the quotient stays within 2 float32 roundings of x / scale, well
 * inside the slack the bound allows. A subnormal scale has a reciprocal that
 * overflows to Inf, so for those blocks x and scale are first multiplied by 2^64,
 * which is exact for both (|x| <= 127 scale < 2^-119) and leaves the quotient as is.
 *
 * Special blocks: all zeros -> scale 0, q = 0, decodes to zeros. Any NaN or Inf
 * (including a sum that overflows in a fused op) -> scale = quiet NaN, q = 0, so the
 * whole block decodes to NaN instead of silently wrong numbers.
 *
 * Fused decode_add_encode needs max|decode(in) + local| before it can quantise.
 * It makes two passes over the inputs and recomputes the sum in the second one:
 * re-reading in (1 B) and local (4 B) per element moves less memory than writing
 * the sum to scratch and reading it back (4 B written, 4 B for the write-allocate
 * read, 4 B read back), so the caller's scratch stays untouched. Recomputation is
 * bitwise identical because the sum is one IEEE addition of the same operands
 * (kernel_common.h disables FMA contraction).
 */
#include <float.h>

#include "kernel_common.h"
#include "kernels.h"

#define Q8_MAX 127
#define Q8_SUBNORMAL_PRE_SCALE 18446744073709551616.0f /* 2^64 */
#define Q8_HEADER_BYTES 4
#define Q8_QNAN_BITS 0x7FC00000u
/* 1.5 * 2^23: adding it to |v| <= 2^22 leaves v rounded to the nearest integer
 * (ties to even, the current rounding mode) in the low mantissa bits, as two's
 * complement. Unlike lrintf this vectorises on every SIMD level. */
#define Q8_ROUND_MAGIC 12582912.0f
#define Q8_ROUND_MAGIC_BITS 0x4B400000

static inline float q8_read_scale(const void* wire) {
    float s;
    memcpy(&s, wire, sizeof s);
    return s;
}

static inline void q8_write_scale(void* wire, float s) { memcpy(wire, &s, sizeof s); }

/* Scale of a block whose largest |x| has the bit pattern max_abs_bits
 * (non-negative floats order like their bit patterns). */
static float q8_scale_of_max(uint32_t max_abs_bits) {
    if (max_abs_bits >= PSG_F32_INF_BITS) return psg_f32_from_bits(Q8_QNAN_BITS);
    if (max_abs_bits == 0) return 0.0f;
    float max_abs = psg_f32_from_bits(max_abs_bits);
    float scale = (float)((double)max_abs / Q8_MAX);
    /* float * 127 is exact in double (24 + 7 bits), so this test is exact; the
     * conversion above gave one of the two floats around max/127: take the upper. */
    if ((double)scale * Q8_MAX < (double)max_abs) scale = psg_f32_from_bits(psg_f32_bits(scale) + 1);
    /* Near FLT_MAX, 127 * scale would decode to Inf: take the float below instead. */
    if ((double)scale * Q8_MAX > FLT_MAX) scale = psg_f32_from_bits(psg_f32_bits(scale) - 1);
    return scale;
}

static inline uint32_t max_u32(uint32_t a, uint32_t b) { return a > b ? a : b; }

static inline int8_t q8_round(float v) {
    /* The bits of v + 1.5 * 2^23 are those of 1.5 * 2^23 plus round(v). */
    return (int8_t)((int32_t)psg_f32_bits(v + Q8_ROUND_MAGIC) - Q8_ROUND_MAGIC_BITS);
}

/* Operands of one pass; each pass below reads only the fields it needs. */
typedef struct {
    const float* x;      /* encode: the input */
    const int8_t* q_in;  /* fused ops: the incoming block ... */
    float scale_in;      /* ... and its scale */
    const float* local;  /* fused ops: this rank's values */
    float scale;         /* the outgoing scale, */
    float pre_scale;     /* ... q = round((value * pre_scale) * inv_scale), */
    float inv_scale;     /* ... inv_scale = 1 / (scale * pre_scale) */
    int8_t* q_out;       /* encodes: the outgoing block */
    float* out;          /* decodes: the result, */
    float factor;        /* ... times this (1: a plain decode) */
} q8_pass;

/* The float32 value the fused ops quantise (or return): decode(in) + local, rounded
 * exactly like the composition decode-then-add. */
static inline float q8_sum(int8_t q_in, float scale_in, float local) {
    float decoded = (float)q_in * scale_in;
    return decoded + local;
}

static uint32_t q8_max_abs_x(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const float* x = ((const q8_pass*)ctx)->x + begin;
    for (size_t i = 0; i < count; ++i) acc = max_u32(acc, psg_f32_bits(x[i]) & PSG_F32_ABS_MASK);
    return acc;
}

static uint32_t q8_quantise_x(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const q8_pass* p = ctx;
    const float* x = p->x + begin;
    int8_t* q = p->q_out + begin;
    float pre = p->pre_scale, inv = p->inv_scale;
    for (size_t i = 0; i < count; ++i) q[i] = q8_round((x[i] * pre) * inv);
    return acc;
}

static uint32_t q8_max_abs_sum(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const q8_pass* p = ctx;
    const int8_t* q_in = p->q_in + begin;
    const float* local = p->local + begin;
    float scale_in = p->scale_in;
    for (size_t i = 0; i < count; ++i) {
        float sum = q8_sum(q_in[i], scale_in, local[i]);
        acc = max_u32(acc, psg_f32_bits(sum) & PSG_F32_ABS_MASK);
    }
    return acc;
}

static uint32_t q8_quantise_sum(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const q8_pass* p = ctx;
    const int8_t* q_in = p->q_in + begin;
    const float* local = p->local + begin;
    int8_t* q_out = p->q_out + begin;
    float scale_in = p->scale_in;
    float pre = p->pre_scale, inv = p->inv_scale;
    for (size_t i = 0; i < count; ++i) {
        q_out[i] = q8_round((q8_sum(q_in[i], scale_in, local[i]) * pre) * inv);
    }
    return acc;
}

static uint32_t q8_dequantise(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const q8_pass* p = ctx;
    const int8_t* q = p->q_in + begin;
    float* out = p->out + begin;
    float scale = p->scale_in, factor = p->factor;
    for (size_t i = 0; i < count; ++i) out[i] = ((float)q[i] * scale) * factor;
    return acc;
}

static uint32_t q8_dequantise_add(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const q8_pass* p = ctx;
    const int8_t* q_in = p->q_in + begin;
    const float* local = p->local + begin;
    float* out = p->out + begin;
    float scale_in = p->scale_in;
    for (size_t i = 0; i < count; ++i) out[i] = q8_sum(q_in[i], scale_in, local[i]);
    return acc;
}

/* The owner's pass 1: out = decode(in) + out (out holds this rank's values), and the
 * max |sum|. One pointer reads and writes, so the loop vectorises without alias checks. */
static uint32_t q8_store_sum_max(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const q8_pass* p = ctx;
    const int8_t* q_in = p->q_in + begin;
    float* v = p->out + begin;
    float scale_in = p->scale_in;
    for (size_t i = 0; i < count; ++i) {
        float sum = q8_sum(q_in[i], scale_in, v[i]);
        v[i] = sum;
        acc = max_u32(acc, psg_f32_bits(sum) & PSG_F32_ABS_MASK);
    }
    return acc;
}

/* The owner's pass 2: q_out = quantise(out), then out = decode(q_out) * factor. */
static uint32_t q8_quantise_decode(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const q8_pass* p = ctx;
    float* v = p->out + begin;
    int8_t* q_out = p->q_out + begin;
    float pre = p->pre_scale, inv = p->inv_scale, scale = p->scale, factor = p->factor;
    for (size_t i = 0; i < count; ++i) {
        /* As q8_round; m - magic is round(t) exactly, i.e. (float)q without converting
         * the narrowed integer back. */
        float m = (v[i] * pre) * inv + Q8_ROUND_MAGIC;
        q_out[i] = (int8_t)((int32_t)psg_f32_bits(m) - Q8_ROUND_MAGIC_BITS);
        v[i] = ((m - Q8_ROUND_MAGIC) * scale) * factor;
    }
    return acc;
}

/* Encodes q_out from the pass `quantise` once the block's max |value| is known. */
PSG_ALWAYS_INLINE float q8_finish_encode(q8_pass* p, size_t n, size_t head,
                                        uint32_t max_abs_bits, psg_range_fn quantise) {
    p->scale = q8_scale_of_max(max_abs_bits);
    if (max_abs_bits == 0 || max_abs_bits >= PSG_F32_INF_BITS) {
        memset(p->q_out, 0, n); /* zeros decode to zeros, or to NaN * 0 = NaN */
    } else {
        p->pre_scale = p->scale < FLT_MIN ? Q8_SUBNORMAL_PRE_SCALE : 1.0f;
        p->inv_scale = 1.0f / (p->scale * p->pre_scale);
        psg_run_streams(p, n, head, quantise);
    }
    return p->scale;
}

size_t psg_quant8_wire_bytes(size_t n) { return Q8_HEADER_BYTES + n; }

PSG_KERNEL
void psg_quant8_encode(const float* x, size_t n, void* wire) {
    q8_pass p = {.x = x, .q_out = (int8_t*)((unsigned char*)wire + Q8_HEADER_BYTES)};
    size_t head = psg_head_to_align(x, sizeof *x, n);
    uint32_t max_bits = psg_run_streams(&p, n, head, q8_max_abs_x);
    q8_write_scale(wire, q8_finish_encode(&p, n, head, max_bits, q8_quantise_x));
}

PSG_KERNEL
void psg_quant8_decode_scaled(const void* wire, size_t n, float factor, float* out) {
    q8_pass p = {.q_in = (const int8_t*)((const unsigned char*)wire + Q8_HEADER_BYTES),
                 .scale_in = q8_read_scale(wire),
                 .out = out,
                 .factor = factor};
    psg_run_streams(&p, n, psg_head_to_align(out, sizeof *out, n), q8_dequantise);
}

void psg_quant8_decode(const void* wire, size_t n, float* out) {
    psg_quant8_decode_scaled(wire, n, 1.0f, out);
}

PSG_KERNEL
void psg_quant8_decode_add_encode(const void* in_wire, const float* local, size_t n,
                                  float* scratch, void* out_wire) {
    (void)scratch; /* see the file comment: recomputing moves less memory */
    q8_pass p = {.q_in = (const int8_t*)((const unsigned char*)in_wire + Q8_HEADER_BYTES),
                 .scale_in = q8_read_scale(in_wire),
                 .local = local,
                 .q_out = (int8_t*)((unsigned char*)out_wire + Q8_HEADER_BYTES)};
    size_t head = psg_head_to_align(local, sizeof *local, n);
    uint32_t max_bits = psg_run_streams(&p, n, head, q8_max_abs_sum);
    /* The scale is written last, so in_wire == out_wire (requantising in place) works. */
    q8_write_scale(out_wire, q8_finish_encode(&p, n, head, max_bits, q8_quantise_sum));
}

PSG_KERNEL
void psg_quant8_decode_add(const void* in_wire, const float* local, size_t n, float* out) {
    q8_pass p = {.q_in = (const int8_t*)((const unsigned char*)in_wire + Q8_HEADER_BYTES),
                 .scale_in = q8_read_scale(in_wire),
                 .local = local,
                 .out = out};
    psg_run_streams(&p, n, psg_head_to_align(out, sizeof *out, n), q8_dequantise_add);
}

PSG_KERNEL
void psg_quant8_decode_add_encode_decode(const void* in_wire, float* local, size_t n,
                                         float factor, void* out_wire) {
    q8_pass p = {.q_in = (const int8_t*)((const unsigned char*)in_wire + Q8_HEADER_BYTES),
                 .scale_in = q8_read_scale(in_wire),
                 .out = local,
                 .factor = factor,
                 .q_out = (int8_t*)((unsigned char*)out_wire + Q8_HEADER_BYTES)};
    size_t head = psg_head_to_align(local, sizeof *local, n);
    uint32_t max_bits = psg_run_streams(&p, n, head, q8_store_sum_max);
    float scale = q8_finish_encode(&p, n, head, max_bits, q8_quantise_decode);
    if (max_bits == 0 || max_bits >= PSG_F32_INF_BITS) {
        /* zeroed q_out: decode it like any block (zeros, or NaN from the NaN scale) */
        p.q_in = p.q_out;
        p.scale_in = scale;
        psg_run_streams(&p, n, head, q8_dequantise);
    }
    q8_write_scale(out_wire, scale);
}
