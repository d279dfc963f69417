/* See t2_kernels.h. */
#include "pipeline/t2_kernels.h"

#include "compress/kernel_common.h" /* PSG_KERNEL (one clone per SIMD level), no FMA */

PSG_KERNEL
void psg_scale_add_f32(float* restrict y, const float* restrict x, size_t n, float a, float b) {
    for (size_t i = 0; i < n; ++i) y[i] = a * y[i] + b * x[i];
}

/* The step's arithmetic follows torch's foreach SGD op by op (d = g + wd*w, buf = mu*buf,
 * buf += (1 - dampening)*d, w += -lr*d), each product rounded before its sum. */
#define PSG_SGD_T2_LOOP(UPDATE_D)                                                       \
    for (size_t i = 0; i < n; ++i) {                                                     \
        const float w_old = w[i];                                                        \
        float d = wd != 0.0f ? g[i] + wd * w_old : g[i];                                 \
        UPDATE_D;                                                                        \
        const float w_new = w_old + neg_lr * d;                                          \
        w[i] = w_new;                                                                    \
        u[i] = (us * u[i] + wo * w_old) + wn * w_new;                                    \
    }

PSG_KERNEL
void psg_sgd_t2_step_f32(float* restrict w, const float* restrict g, float* restrict buf,
                         float* restrict u, size_t n, const struct psg_sgd_t2* s) {
    const float neg_lr = -s->lr, wd = s->weight_decay, mu = s->momentum;
    const float keep = 1.0f - s->dampening;
    const float us = s->u_scale, wo = s->w_old_scale, wn = s->w_new_scale;
    if (mu == 0.0f || buf == NULL) {
        PSG_SGD_T2_LOOP((void)0)
    } else if (s->first) {
        PSG_SGD_T2_LOOP(buf[i] = d)
    } else {
        PSG_SGD_T2_LOOP(d = buf[i] = mu * buf[i] + keep * d)
    }
}
