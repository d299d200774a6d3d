/* GELU followed by dropout on the CPU, in one pass: the kernel behind lra/model/gelu_dropout.py
 * (float32), the encoder's FFN activation (Linear, GELU, Dropout, Linear):
 *
 *     out[i] = gelu(x[i]) keep(i) scale,  gelu(x) = x Phi(x),  Phi the standard normal CDF,
 *     dx[i] = dout[i] keep(i) scale gelu'(x[i]),  gelu'(x) = Phi(x) + x phi(x),
 *
 * keep and scale those of dropout_cpu.c (the same hash of (seed, i): the same mask as the dropout
 * kernel after a separate GELU; threshold 0 and scale 1 keep every element, GELU alone). Apart, the
 * two passes each read and write the [B N, FFN] activations, and the backward a third time.
 *
 * Phi(x) = erfc(-x / sqrt 2) / 2, with erfc(z) = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) e^(-z^2),
 * t = 1 / (1 + p z) for z >= 0 (Abramowitz and Stegun 7.1.26; |error| <= 1.5e-7 in erf, so in
 * gelu at most 7.5e-8 |x|), and erfc(-z) = 2 - erfc(z): for x < 0, Phi is the small erfc itself,
 * with no cancellation of 1 + erf(x / sqrt 2) near -1. Each block of elements is made whole and
 * then masked while it is in the L1 cache.
 */
#include <math.h>
#include <stdint.h>

#include "blocks.h"
#include "dropout_cpu.c"

/* elements per block: a task's share and the span the mask pass rereads from L1 */
#define GELU_BLOCK 4096

#define AS_P 0.3275911f
#define AS_A1 0.254829592f
#define AS_A2 -0.284496736f
#define AS_A3 1.421413741f
#define AS_A4 -1.453152027f
#define AS_A5 1.061405429f
#define RSQRT2 0.70710678118654752f
#define RSQRT2PI 0.39894228040143268f

/* Phi(x) and e^(-x^2 / 2) */
static inline float normal_cdf(float x, float *gauss) {
    const float z = fabsf(x) * RSQRT2;
    const float t = 1.0f / (1.0f + AS_P * z);
    const float e = exp_nonpos(-z * z);
    const float half_erfc = 0.5f * t * (AS_A1 + t * (AS_A2 + t * (AS_A3 + t * (AS_A4 + t * AS_A5)))) * e;
    *gauss = e;
    return x >= 0.0f ? 1.0f - half_erfc : half_erfc;
}

static inline float gelu(float x) {
    float e;
    return x * normal_cdf(x, &e);
}

static inline float gelu_grad(float x) {
    float e;
    const float cdf = normal_cdf(x, &e);
    return cdf + x * RSQRT2PI * e;
}

/* out = dropout(gelu(x)) over n elements (threshold 0, scale 1: gelu(x)); the seed as dropout_apply's */
void gelu_dropout_forward(const float *x, float *out, int64_t n, uint64_t seed, uint32_t threshold, float scale,
                          int64_t threads) {
    const uint32_t s0 = (uint32_t)seed, s1 = (uint32_t)(seed >> 32);
    const int64_t blocks = (n + GELU_BLOCK - 1) / GELU_BLOCK;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (blocks > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * GELU_BLOCK, last = first + GELU_BLOCK < n ? first + GELU_BLOCK : n;
        for (int64_t i = first; i < last; i++) out[i] = gelu(x[i]);
        if (threshold > 0) apply_range(out, out, first, last, s0, s1, threshold, scale);
    }
}

/* dx = dout * mask * scale * gelu'(x) over n elements: the gradient of gelu_dropout_forward */
void gelu_dropout_backward(const float *dout, const float *x, float *dx, int64_t n, uint64_t seed,
                           uint32_t threshold, float scale, int64_t threads) {
    const uint32_t s0 = (uint32_t)seed, s1 = (uint32_t)(seed >> 32);
    const int64_t blocks = (n + GELU_BLOCK - 1) / GELU_BLOCK;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (blocks > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * GELU_BLOCK, last = first + GELU_BLOCK < n ? first + GELU_BLOCK : n;
        for (int64_t i = first; i < last; i++) dx[i] = dout[i] * gelu_grad(x[i]);
        if (threshold > 0) apply_range(dx, dx, first, last, s0, s1, threshold, scale);
    }
}
