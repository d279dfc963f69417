/* Compression kernels fused into the ring-AllReduce (Pipe-SGD §3.2).
 *
 * Plain C, no allocation, loops the compiler can vectorise. A "block" is one
 * ring segment: the unit that travels in one message.
 *
 * trunc16: each float32 keeps its upper 16 bits (sign, 8 exponent bits,
 *          7 mantissa bits), truncated toward zero; decoding shifts back.
 *          Wire size: 2 bytes per element. NaN stays NaN (every NaN becomes the
 *          quiet NaN 0x7FC0), +-Inf stays +-Inf.
 * quant8:  symmetric signed 8-bit, one float32 scale per block:
 *          scale = max|x| / 127, q = round_to_nearest(x / scale) in [-127, 127].
 *          Wire layout of a block of n elements: float32 scale, then n int8.
 *          A block of zeros has scale 0 and decodes to zeros. A block holding
 *          any NaN or Inf is encoded with scale NaN and decodes to all NaN.
 *          The scale is max|x| / 127 rounded up to float32 (rounded down only
 *          when 127 * scale would overflow), so |x - q * scale| <= scale / 2 up
 *          to float32 rounding (< 382 * 2^-24 * scale), denormal blocks included.
 *
 * Fused ops are bitwise equal to the composition of the plain ones. Pointers
 * need only their element's alignment. Block sizes n >= 0.
 */
#ifndef PIPESGD_COMPRESS_KERNELS_H
#define PIPESGD_COMPRESS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- trunc16 ---- */
size_t psg_trunc16_wire_bytes(size_t n);
void psg_trunc16_encode(const float* x, size_t n, uint16_t* wire);
void psg_trunc16_decode(const uint16_t* wire, size_t n, float* out);
/* out = decode(wire) * factor, rounded twice like the two steps: the ring's average
 * saves a pass over the buffer by decoding with factor = 1 / p. */
void psg_trunc16_decode_scaled(const uint16_t* wire, size_t n, float factor, float* out);
/* out_wire = encode(decode(in_wire) + local); in_wire may equal out_wire. */
void psg_trunc16_decode_add_encode(const uint16_t* in_wire, const float* local, size_t n,
                                   uint16_t* out_wire);
/* out = decode(in_wire) + local; out may alias local. */
void psg_trunc16_decode_add(const uint16_t* in_wire, const float* local, size_t n, float* out);
/* The owner of a chunk finishes it in one pass: out_wire = encode(decode(in_wire) + local),
 * then local = decode(out_wire) * factor. Bitwise equal to decode_add, encode and
 * decode_scaled in turn. in_wire may equal out_wire; local must not overlap either. */
void psg_trunc16_decode_add_encode_decode(const uint16_t* in_wire, float* local, size_t n,
                                          float factor, uint16_t* out_wire);

/* ---- quant8 ---- */
size_t psg_quant8_wire_bytes(size_t n); /* 4 + n */
void psg_quant8_encode(const float* x, size_t n, void* wire);
void psg_quant8_decode(const void* wire, size_t n, float* out);
/* out = decode(wire) * factor (see psg_trunc16_decode_scaled). */
void psg_quant8_decode_scaled(const void* wire, size_t n, float factor, float* out);
/* out_wire = encode(decode(in_wire) + local); scratch holds n floats (caller-owned,
 * so the ring allocates nothing per call; the current kernel recomputes the sum
 * instead of storing it and leaves scratch untouched). in_wire may equal out_wire. */
void psg_quant8_decode_add_encode(const void* in_wire, const float* local, size_t n,
                                  float* scratch, void* out_wire);
/* out = decode(in_wire) + local; out may alias local. */
void psg_quant8_decode_add(const void* in_wire, const float* local, size_t n, float* out);
/* As psg_trunc16_decode_add_encode_decode, in two passes over the block (the max comes
 * first) instead of the four of the composition. */
void psg_quant8_decode_add_encode_decode(const void* in_wire, float* local, size_t n,
                                         float factor, void* out_wire);

#ifdef __cplusplus
}
#endif

#endif /* PIPESGD_COMPRESS_KERNELS_H */
