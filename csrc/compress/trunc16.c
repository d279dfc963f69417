/* trunc16 kernels: float32 -> its upper 16 bits (bfloat16 by truncation) and back.
 *
 * Truncation (not rounding) as in Pipe-SGD §3.2: the kept value has the same sign
 * and a magnitude at most 2^-7 relatively smaller (2^-133 absolute for denormals).
 * Inf keeps its pattern (0x7F80 / 0xFF80). A NaN whose payload sits only in the low
 * 16 bits would truncate to Inf, so every NaN becomes the canonical quiet NaN 0x7FC0;
 * a canonical pattern also keeps fused and composed ops bitwise equal, whatever NaN
 * payload the hardware's addition propagates.
 */
#include "kernel_common.h"
#include "kernels.h"

#define TRUNC16_QNAN ((uint16_t)0x7FC0u)

static inline uint16_t trunc16_of(float x) {
    uint32_t b = psg_f32_bits(x);
    /* As signed integers |x| > Inf <=> NaN; signed compares vectorise on every SIMD level. */
    int32_t mag = (int32_t)(b & PSG_F32_ABS_MASK);
    uint16_t hi = (uint16_t)(b >> 16);
    return mag > (int32_t)PSG_F32_INF_BITS ? TRUNC16_QNAN : hi;
}

static inline float float_of_trunc16(uint16_t h) { return psg_f32_from_bits((uint32_t)h << 16); }

/* Operands of one pass; each pass reads only the fields it needs. */
typedef struct {
    const float* x;         /* encode: the input */
    const uint16_t* in;     /* decodes and fused ops: the incoming block */
    const float* local;     /* fused ops: this rank's values */
    uint16_t* wire;         /* encodes: the outgoing block */
    float* out;             /* decodes: the result, */
    float factor;           /* ... times this (1: a plain decode) */
} t16_pass;

static uint32_t t16_encode(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const t16_pass* p = ctx;
    const float* x = p->x + begin;
    uint16_t* wire = p->wire + begin;
    for (size_t i = 0; i < count; ++i) wire[i] = trunc16_of(x[i]);
    return acc;
}

static uint32_t t16_decode(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const t16_pass* p = ctx;
    const uint16_t* in = p->in + begin;
    float* out = p->out + begin;
    for (size_t i = 0; i < count; ++i) out[i] = float_of_trunc16(in[i]);
    return acc;
}

static uint32_t t16_decode_scaled(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const t16_pass* p = ctx;
    const uint16_t* in = p->in + begin;
    float* out = p->out + begin;
    float factor = p->factor;
    for (size_t i = 0; i < count; ++i) out[i] = float_of_trunc16(in[i]) * factor;
    return acc;
}

static uint32_t t16_decode_add_encode(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const t16_pass* p = ctx;
    const uint16_t* in = p->in + begin;
    const float* local = p->local + begin;
    uint16_t* wire = p->wire + begin;
    for (size_t i = 0; i < count; ++i) {
        float sum = float_of_trunc16(in[i]) + local[i];
        wire[i] = trunc16_of(sum);
    }
    return acc;
}

static uint32_t t16_decode_add(const void* ctx, size_t begin, size_t count, uint32_t acc) {
    const t16_pass* p = ctx;
    const uint16_t* in = p->in + begin;
    const float* local = p->local + begin;
    float* out = p->out + begin;
    for (size_t i = 0; i < count; ++i) out[i] = float_of_trunc16(in[i]) + local[i];
    return acc;
}

/* The owner's step: wire = encode(decode(in) + out), then out = decode(wire) (a shift, as
 * the plain decode) or decode(wire) * factor. */
static uint32_t t16_decode_add_encode_decode(const void* ctx, size_t begin, size_t count,
                                             uint32_t acc) {
    const t16_pass* p = ctx;
    const uint16_t* in = p->in + begin;
    float* v = p->out + begin;
    uint16_t* wire = p->wire + begin;
    for (size_t i = 0; i < count; ++i) {
        uint16_t h = trunc16_of(float_of_trunc16(in[i]) + v[i]);
        wire[i] = h;
        v[i] = float_of_trunc16(h);
    }
    return acc;
}

static uint32_t t16_decode_add_encode_decode_scaled(const void* ctx, size_t begin,
                                                    size_t count, uint32_t acc) {
    const t16_pass* p = ctx;
    const uint16_t* in = p->in + begin;
    float* v = p->out + begin;
    uint16_t* wire = p->wire + begin;
    float factor = p->factor;
    for (size_t i = 0; i < count; ++i) {
        uint16_t h = trunc16_of(float_of_trunc16(in[i]) + v[i]);
        wire[i] = h;
        v[i] = float_of_trunc16(h) * factor;
    }
    return acc;
}

size_t psg_trunc16_wire_bytes(size_t n) { return 2 * n; }

PSG_KERNEL
void psg_trunc16_encode(const float* x, size_t n, uint16_t* wire) {
    t16_pass p = {.x = x, .wire = wire};
    psg_run_streams(&p, n, psg_head_to_align(x, sizeof *x, n), t16_encode);
}

PSG_KERNEL
void psg_trunc16_decode_scaled(const uint16_t* wire, size_t n, float factor, float* out) {
    t16_pass p = {.in = wire, .out = out, .factor = factor};
    /* A plain decode stays a bit shift for every input (a multiply would quiet a
     * signalling NaN that arrived from elsewhere). */
    size_t head = psg_head_to_align(out, sizeof *out, n);
    if (factor == 1.0f) {
        psg_run_streams(&p, n, head, t16_decode);
    } else {
        psg_run_streams(&p, n, head, t16_decode_scaled);
    }
}

void psg_trunc16_decode(const uint16_t* wire, size_t n, float* out) {
    psg_trunc16_decode_scaled(wire, n, 1.0f, out);
}

PSG_KERNEL
void psg_trunc16_decode_add_encode(const uint16_t* in_wire, const float* local, size_t n,
                                   uint16_t* out_wire) {
    t16_pass p = {.in = in_wire, .local = local, .wire = out_wire};
    psg_run_streams(&p, n, psg_head_to_align(local, sizeof *local, n), t16_decode_add_encode);
}

PSG_KERNEL
void psg_trunc16_decode_add(const uint16_t* in_wire, const float* local, size_t n, float* out) {
    t16_pass p = {.in = in_wire, .local = local, .out = out};
    psg_run_streams(&p, n, psg_head_to_align(out, sizeof *out, n), t16_decode_add);
}

PSG_KERNEL
void psg_trunc16_decode_add_encode_decode(const uint16_t* in_wire, float* local, size_t n,
                                          float factor, uint16_t* out_wire) {
    t16_pass p = {.in = in_wire, .out = local, .wire = out_wire, .factor = factor};
    size_t head = psg_head_to_align(local, sizeof *local, n);
    if (factor == 1.0f) {
        psg_run_streams(&p, n, head, t16_decode_add_encode_decode);
    } else {
        psg_run_streams(&p, n, head, t16_decode_add_encode_decode_scaled);
    }
}
