// Element types the engine reduces, and the 16-bit <-> float32 conversions
// used to accumulate float16/bfloat16 in float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>

namespace pipesgd {

enum class DType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };
enum class ReduceOp : int { kSum = 0, kAverage = 1 };
enum class Compression : int { kNone = 0, kTrunc16 = 1, kQuant8 = 2 };

std::size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* reduce_op_name(ReduceOp op);
const char* compression_name(Compression c);
DType parse_dtype(const std::string& name);
ReduceOp parse_reduce_op(const std::string& name);
Compression parse_compression(const std::string& name);

inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// IEEE binary16 <-> binary32, round to nearest even (after M. Dukhan's FP16 library).
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
  const std::uint32_t sign = w & 0x80000000u;
  const std::uint32_t two_w = w + w;
  const float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const std::uint32_t magnitude =
      two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized);
  return bits_float(sign | magnitude);
}

inline std::uint16_t float_to_half(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const std::uint32_t w = float_bits(f);
  const std::uint32_t shl1_w = w + w;
  const std::uint32_t sign = w & 0x80000000u;
  std::uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const std::uint32_t bits = float_bits(base);
  const std::uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const std::uint32_t mantissa_bits = bits & 0x00000FFFu;
  const std::uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<std::uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bfloat_to_float(std::uint16_t b) { return bits_float(static_cast<std::uint32_t>(b) << 16); }

inline std::uint16_t float_to_bfloat(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  const std::uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

}  // namespace pipesgd
