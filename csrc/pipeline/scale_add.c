/* See scale_add.h. */
#include "pipeline/scale_add.h"

#include "compress/kernel_common.h" /* PSG_KERNEL (one clone per SIMD level), no FMA */

PSG_KERNEL
void psg_scale_add_f32(float* restrict y, const float* restrict x, size_t n, float a, float b) {
    for (size_t i = 0; i < n; ++i) y[i] = a * y[i] + b * x[i];
}
