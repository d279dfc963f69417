/* The pipeline's elementwise kernel: PipeMare's discrepancy correction (T2) keeps the
 * backward's weights u up to date around every optimizer step with two passes of
 * u <- a*u + b*w (pipesgd/pipeline/pipemare.py). Torch does a*u + b*w as two ops (a
 * multiply, then an add), each a pass over u; one fused pass halves the traffic.
 *
 * Plain C, no allocation; y and x must not overlap. Each product is rounded to float32
 * before the sum (no FMA), so every build gives the same bits. */
#ifndef PIPESGD_PIPELINE_SCALE_ADD_H
#define PIPESGD_PIPELINE_SCALE_ADD_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y[i] = a * y[i] + b * x[i] for i in [0, n). */
void psg_scale_add_f32(float* y, const float* x, size_t n, float a, float b);

#ifdef __cplusplus
}
#endif

#endif /* PIPESGD_PIPELINE_SCALE_ADD_H */
