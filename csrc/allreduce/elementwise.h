// Element-wise reductions on the local dtype. 16-bit types are widened to
// float32, combined, and rounded back to nearest even.
#pragma once

#include <cstddef>

#include "dtype.h"

namespace pipesgd {

// dst[i] += src[i]
void add_into(DType dtype, void* dst, const void* src, std::size_t n);
// dst[i] /= divisor (one rounding, in float32 for 16-bit types)
void divide_by(DType dtype, void* dst, std::size_t n, int divisor);

}  // namespace pipesgd
