/* The pipeline's kernels for PipeMare's discrepancy correction (T2): the backward's
 * weights u are kept up to date around every optimizer step (pipesgd/pipeline/pipemare.py)
 * as u <- gamma*u + (c - gamma)*w_t + (1 - c)*w_{t+1}.
 *
 * - scale_add, y <- a*y + b*x: each half of that update in one pass, around any
 *   optimizer's step (torch needs two ops for a*y + b*x).
 * - sgd_t2_step: the step of torch.optim.SGD and the whole update of u in one pass,
 *   where two passes of T2 and the step's own would each stream the weights again.
 *
 * Plain C, no allocation; the arrays must not overlap. Products are rounded to float32
 * before they are summed (no FMA), so every build gives the same bits. */
#ifndef PIPESGD_PIPELINE_T2_KERNELS_H
#define PIPESGD_PIPELINE_T2_KERNELS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y[i] = a * y[i] + b * x[i] for i in [0, n). */
void psg_scale_add_f32(float* y, const float* x, size_t n, float a, float b);

/* torch.optim.SGD's step (not nesterov, not maximize) on weights w with gradient g:
 *   d = g + weight_decay * w
 *   momentum != 0: buf = first ? d : momentum * buf + (1 - dampening) * d; d = buf
 *   w' = w - lr * d
 * then u = u_scale * u + w_old_scale * w + w_new_scale * w'. buf may be NULL when
 * momentum is 0. */
struct psg_sgd_t2 {
    float lr, weight_decay, momentum, dampening;
    int first; /* the momentum buffer is new: it takes d as it is */
    float u_scale, w_old_scale, w_new_scale;
};
void psg_sgd_t2_step_f32(float* w, const float* g, float* buf, float* u, size_t n,
                         const struct psg_sgd_t2* s);

#ifdef __cplusplus
}
#endif

#endif /* PIPESGD_PIPELINE_T2_KERNELS_H */
