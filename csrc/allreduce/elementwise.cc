#include "allreduce/elementwise.h"

#include <cstdint>

namespace pipesgd {
namespace {

template <typename T>
void add_native(T* __restrict dst, const T* __restrict src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] += src[i];
}

// float32 sums are the ring's hot loop. Built for the baseline x86-64 they run in
// 128-bit registers; inside the ring (1 MiB segments, 8 MiB at p = 2) the AVX-512
// clone added a segment in 29-30 us against 34. The loader picks the clone the
// CPU supports, so one build still runs everywhere.
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define PIPESGD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef PIPESGD_CLONES
#define PIPESGD_CLONES
#endif

PIPESGD_CLONES void add_f32(float* __restrict dst, const float* __restrict src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] += src[i];
}

// Division is several times slower than multiplication; by a power of two the
// reciprocal is exact and the product equals the quotient bit for bit.
bool has_exact_reciprocal(int divisor) { return (divisor & (divisor - 1)) == 0; }

template <typename T>
void divide_native(T* dst, std::size_t n, int divisor) {
  if (has_exact_reciprocal(divisor)) {
    const T reciprocal = T(1) / static_cast<T>(divisor);
    for (std::size_t i = 0; i < n; ++i) dst[i] *= reciprocal;
    return;
  }
  const T d = static_cast<T>(divisor);
  for (std::size_t i = 0; i < n; ++i) dst[i] /= d;
}

template <float (*ToFloat)(std::uint16_t), std::uint16_t (*FromFloat)(float)>
void add_16(std::uint16_t* __restrict dst, const std::uint16_t* __restrict src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = FromFloat(ToFloat(dst[i]) + ToFloat(src[i]));
}

template <float (*ToFloat)(std::uint16_t), std::uint16_t (*FromFloat)(float)>
void divide_16(std::uint16_t* dst, std::size_t n, int divisor) {
  if (has_exact_reciprocal(divisor)) {
    const float reciprocal = 1.0f / static_cast<float>(divisor);
    for (std::size_t i = 0; i < n; ++i) dst[i] = FromFloat(ToFloat(dst[i]) * reciprocal);
    return;
  }
  const float d = static_cast<float>(divisor);
  for (std::size_t i = 0; i < n; ++i) dst[i] = FromFloat(ToFloat(dst[i]) / d);
}

}  // namespace

void add_into(DType dtype, void* dst, const void* src, std::size_t n) {
  switch (dtype) {
    case DType::kFloat32:
      add_f32(static_cast<float*>(dst), static_cast<const float*>(src), n);
      return;
    case DType::kFloat64:
      add_native(static_cast<double*>(dst), static_cast<const double*>(src), n);
      return;
    case DType::kFloat16:
      add_16<half_to_float, float_to_half>(static_cast<std::uint16_t*>(dst),
                                           static_cast<const std::uint16_t*>(src), n);
      return;
    case DType::kBFloat16:
      add_16<bfloat_to_float, float_to_bfloat>(static_cast<std::uint16_t*>(dst),
                                               static_cast<const std::uint16_t*>(src), n);
      return;
  }
}

void divide_by(DType dtype, void* dst, std::size_t n, int divisor) {
  switch (dtype) {
    case DType::kFloat32:
      divide_native(static_cast<float*>(dst), n, divisor);
      return;
    case DType::kFloat64:
      divide_native(static_cast<double*>(dst), n, divisor);
      return;
    case DType::kFloat16:
      divide_16<half_to_float, float_to_half>(static_cast<std::uint16_t*>(dst), n, divisor);
      return;
    case DType::kBFloat16:
      divide_16<bfloat_to_float, float_to_bfloat>(static_cast<std::uint16_t*>(dst), n, divisor);
      return;
  }
}

}  // namespace pipesgd
