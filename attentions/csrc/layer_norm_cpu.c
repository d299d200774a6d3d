/* Layer normalisation on the CPU: the kernel behind lra/model/layer_norm.py (float32), over the last
 * dimension C of R rows:
 *
 *     mean = sum_j x_j / C,  var = sum_j (x_j - mean)^2 / C,  rstd = 1 / sqrt(var + eps),
 *     y_j = (x_j - mean) rstd gamma_j + beta_j;
 *
 * the backward, with xhat_j = (x_j - mean) rstd and g_j = dy_j gamma_j,
 *
 *     dx_j = rstd (g_j - sum_i g_i / C - xhat_j sum_i g_i xhat_i / C),
 *     dgamma_j = sum over rows of dy_j xhat_j,  dbeta_j = sum over rows of dy_j.
 *
 * A row (the model's width, 64 floats at LRA's settings) stays in registers or L1 between its passes;
 * the forward writes y, mean and rstd in one pass over x, the backward dx and its share of dgamma,
 * dbeta in one pass over dy and x. (torch's CPU kernels take 4-5 times as long at [8192, 64]: the
 * forward and backward of the encoder's five layer norms took 3.7 ms of a 40 ms training step.)
 * dgamma and dbeta are summed per block of BLOCK rows, then the blocks in order: the same bits for
 * any thread count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"

/* rows per block of the backward's dgamma and dbeta sums */
#define BLOCK 256

static void forward_row(const float *x, const float *gamma, const float *beta, float *y, float *mean, float *rstd,
                        int64_t C, float eps) {
    const float mu = sum_of(x, C) / (float)C;
    vf lanes = splatv(0.0f);
    int64_t j = 0;
    for (; j + VW <= C; j += VW) {
        const vf c = loadv(x + j) - mu;
        lanes += c * c;
    }
    float var = sumv(lanes);
    for (; j < C; j++) var += (x[j] - mu) * (x[j] - mu);
    const float r = 1.0f / sqrtf(var / (float)C + eps);
    j = 0;
    for (; j + VW <= C; j += VW) storev(y + j, (loadv(x + j) - mu) * r * loadv(gamma + j) + loadv(beta + j));
    for (; j < C; j++) y[j] = (x[j] - mu) * r * gamma[j] + beta[j];
    *mean = mu, *rstd = r;
}

void layer_norm_forward(const float *x, const float *gamma, const float *beta, float *y, float *mean, float *rstd,
                        int64_t R, int64_t C, float eps, int64_t threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (R > BLOCK)
    for (int64_t r = 0; r < R; r++) forward_row(x + r * C, gamma, beta, y + r * C, mean + r, rstd + r, C, eps);
}

/* Rows [first, last): dx, and their dgamma, dbeta sums into dg, db [C] (set here) */
static void backward_rows(const float *dy, const float *x, const float *mean, const float *rstd, const float *gamma,
                          float *dx, float *dg, float *db, int64_t first, int64_t last, int64_t C) {
    memset(dg, 0, sizeof(float) * C);
    memset(db, 0, sizeof(float) * C);
    for (int64_t r = first; r < last; r++) {
        const float *dyr = dy + r * C, *xr = x + r * C;
        float *dxr = dx + r * C;
        const float mu = mean[r], rs = rstd[r];
        vf sg = splatv(0.0f), sgx = splatv(0.0f);
        int64_t j = 0;
        for (; j + VW <= C; j += VW) {
            const vf d = loadv(dyr + j), xhat = (loadv(xr + j) - mu) * rs, g = d * loadv(gamma + j);
            sg += g, sgx += g * xhat;
            storev(dg + j, loadv(dg + j) + d * xhat);
            storev(db + j, loadv(db + j) + d);
        }
        float a = sumv(sg), b = sumv(sgx);
        for (int64_t i = j; i < C; i++) {
            const float xhat = (xr[i] - mu) * rs, g = dyr[i] * gamma[i];
            a += g, b += g * xhat;
            dg[i] += dyr[i] * xhat, db[i] += dyr[i];
        }
        a /= (float)C, b /= (float)C;
        j = 0;
        for (; j + VW <= C; j += VW) {
            const vf xhat = (loadv(xr + j) - mu) * rs;
            storev(dxr + j, (loadv(dyr + j) * loadv(gamma + j) - a - xhat * b) * rs);
        }
        for (; j < C; j++) dxr[j] = (dyr[j] * gamma[j] - a - (xr[j] - mu) * rs * b) * rs;
    }
}

/* dx [R, C]; dgamma, dbeta [C]; partial: 2 C ceil(R / BLOCK) floats of scratch (each block's sums) */
void layer_norm_backward(const float *dy, const float *x, const float *mean, const float *rstd, const float *gamma,
                         float *dx, float *dgamma, float *dbeta, float *partial, int64_t R, int64_t C,
                         int64_t threads) {
    const int64_t blocks = (R + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (blocks > 1)
    for (int64_t k = 0; k < blocks; k++) {
        const int64_t last = (k + 1) * BLOCK < R ? (k + 1) * BLOCK : R;
        backward_rows(dy, x, mean, rstd, gamma, dx, partial + 2 * k * C, partial + (2 * k + 1) * C, k * BLOCK, last,
                      C);
    }
    memset(dgamma, 0, sizeof(float) * C);
    memset(dbeta, 0, sizeof(float) * C);
    for (int64_t k = 0; k < blocks; k++)
        for (int64_t j = 0; j < C; j++) dgamma[j] += partial[2 * k * C + j], dbeta[j] += partial[(2 * k + 1) * C + j];
}
