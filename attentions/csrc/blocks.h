/* Vectorised building blocks shared by the CPU kernels (grouped_cpu.c, landmark_cpu.c): a
 * branch-free e^x, lane-wise max and sum, and the products of two rows at once against a block held
 * in the L1 cache (dots2: across keys of a transposed block; mix2: a weighted sum of rows; add_outer:
 * a rank-C gradient update). All static inline: each kernel compiles its own copy. */
#ifndef LRA_BLOCKS_H
#define LRA_BLOCKS_H

#include <math.h>
#include <stdint.h>

#include "vec.h"

/* e^x for x <= ~0 (Cephes' expf polynomial, ~1e-7 relative error above -87); 0 below -87, so a
 * -inf logit weighs 0. Branch-free (the clamps are min/max on integers) so that loops over it vectorise. */
static inline float exp_nonpos(float x) {
    union { float f; uint32_t u; } b;
    b.f = x;
    /* as unsigned bits a negative float grows with its magnitude: the min clamps x to >= -100 */
    b.u = b.u < 0xC2C80000u ? b.u : 0xC2C80000u;
    const float c = b.f;
    const int32_t ni = (int32_t)(c * 1.44269504088896341f - 0.5f); /* round(c / ln 2) for c <= 0 */
    const float n = (float)ni;
    const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n as float bits; an exponent that would underflow becomes 0, i.e. weight 0 */
    const int32_t e = ni + 127 > 0 ? ni + 127 : 0;
    union { int32_t i; float f; } two_n;
    two_n.i = e << 23;
    return p * two_n.f;
}

/* dst[0..n) = src[0..n): a row of a few vectors copied inline (a memcpy call per row of 32 floats
 * cost 1/8 of the grouped forward) */
static inline void copy_row(float *dst, const float *src, int64_t n) {
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) store8(dst + d, load8(src + d));
    for (; d < n; d++) dst[d] = src[d];
}

/* max and sum of x[0..n) in 8 lanes (a plain float reduction does not vectorise: it fixes the order;
 * the max as a compare and blend of whole vectors: written lane by lane it stayed scalar) */
static inline float max_of(const float *x, int64_t n) {
    v8 lanes = splat8(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const v8 r = load8(x + j);
        const v8i more = r > lanes;
        lanes = (v8)((more & (v8i)r) | (~more & (v8i)lanes));
    }
    float top = -INFINITY;
    for (; j < n; j++) top = x[j] > top ? x[j] : top;
    for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    return top;
}

static inline float sum_of(const float *x, int64_t n) {
    v8 lanes = splat8(0.0f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) lanes += load8(x + j);
    float total = 0.0f;
    for (; j < n; j++) total += x[j];
    for (int l = 0; l < 8; l++) total += lanes[l];
    return total;
}

/* The products of two queries (or d_outs) at once: each block of an expert's buffers is read
 * from the cache once for both, with 32 floats of each result in registers (8 AVX2 registers).
 * An odd last pair goes through as both halves (the same result written twice). */

/* res_c[j] = init[j] + sum_d x_c[d] t[d * n + j] for j < n and c = 0, 1: x_c [D] against the
 * columns of t [D][n] */
static inline void dots2(const float *x0, const float *x1, const float *t, const float *init, int64_t n, int64_t D,
                  float *res0, float *res1) {
    int64_t j0 = 0;
    for (; j0 + 32 <= n; j0 += 32) {
        v8 a0 = load8(init + j0), a1 = load8(init + j0 + 8), a2 = load8(init + j0 + 16), a3 = load8(init + j0 + 24);
        v8 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
        for (int64_t d = 0; d < D; d++) {
            const float *row = t + d * n + j0;
            v8 r0 = load8(row), r1 = load8(row + 8), r2 = load8(row + 16), r3 = load8(row + 24);
            IN_REGISTER(r0); IN_REGISTER(r1); IN_REGISTER(r2); IN_REGISTER(r3);
            const v8 u = splat8(x0[d]), w = splat8(x1[d]);
            a0 += u * r0, a1 += u * r1, a2 += u * r2, a3 += u * r3;
            b0 += w * r0, b1 += w * r1, b2 += w * r2, b3 += w * r3;
        }
        store8(res0 + j0, a0), store8(res0 + j0 + 8, a1), store8(res0 + j0 + 16, a2), store8(res0 + j0 + 24, a3);
        store8(res1 + j0, b0), store8(res1 + j0 + 8, b1), store8(res1 + j0 + 16, b2), store8(res1 + j0 + 24, b3);
    }
    for (int64_t j = j0; j < n; j++) {
        float u = init[j], w = init[j];
        for (int64_t d = 0; d < D; d++) u += x0[d] * t[d * n + j], w += x1[d] * t[d * n + j];
        res0[j] = u, res1[j] = w;
    }
}

/* res_c[d] = (add ? res_c[d] : 0) + sum_j w_c[j] r[j * D + d] for d < D and c = 0, 1: the rows of
 * r [n][D] mixed by w_c [n]. With add and res0 == res1 (an odd last pair) the row gets the sum once. */
static inline void mix2(const float *w0, const float *w1, const float *r, int64_t n, int64_t D, float *res0,
                        float *res1, int add) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) {
        const v8 zero = splat8(0.0f);
        v8 a0 = add ? load8(res0 + d0) : zero, a1 = add ? load8(res0 + d0 + 8) : zero;
        v8 a2 = add ? load8(res0 + d0 + 16) : zero, a3 = add ? load8(res0 + d0 + 24) : zero;
        v8 b0 = add ? load8(res1 + d0) : zero, b1 = add ? load8(res1 + d0 + 8) : zero;
        v8 b2 = add ? load8(res1 + d0 + 16) : zero, b3 = add ? load8(res1 + d0 + 24) : zero;
        for (int64_t j = 0; j < n; j++) {
            const float *row = r + j * D + d0;
            v8 r0 = load8(row), r1 = load8(row + 8), r2 = load8(row + 16), r3 = load8(row + 24);
            IN_REGISTER(r0); IN_REGISTER(r1); IN_REGISTER(r2); IN_REGISTER(r3);
            const v8 u = splat8(w0[j]), w = splat8(w1[j]);
            a0 += u * r0, a1 += u * r1, a2 += u * r2, a3 += u * r3;
            b0 += w * r0, b1 += w * r1, b2 += w * r2, b3 += w * r3;
        }
        store8(res0 + d0, a0), store8(res0 + d0 + 8, a1), store8(res0 + d0 + 16, a2), store8(res0 + d0 + 24, a3);
        store8(res1 + d0, b0), store8(res1 + d0 + 8, b1), store8(res1 + d0 + 16, b2), store8(res1 + d0 + 24, b3);
    }
    for (int64_t d = d0; d < D; d++) {
        float u = add ? res0[d] : 0.0f, w = add ? res1[d] : 0.0f;
        for (int64_t j = 0; j < n; j++) u += w0[j] * r[j * D + d], w += w1[j] * r[j * D + d];
        res0[d] = u, res1[d] = w;
    }
}

/* g[j * D + d] += sum_c w[c * n + j] * x[c * D + d]: the rank-C update w^T x of a [n][D] gradient.
 * Two keys at a time: each row of x, loaded once, feeds both (six loads per eight FMAs, against
 * five per four one key at a time, which left the loads, not the FMAs, setting the pace). */
static inline void add_outer(const float *w, const float *x, int64_t rows, int64_t n, int64_t D, float *g) {
    int64_t j = 0;
    if (D % 32 == 0) {
        for (; j + 2 <= n; j += 2) {
            float *g0 = g + j * D, *g1 = g0 + D;
            for (int64_t d0 = 0; d0 < D; d0 += 32) {
                v8 a0 = load8(g0 + d0), a1 = load8(g0 + d0 + 8), a2 = load8(g0 + d0 + 16), a3 = load8(g0 + d0 + 24);
                v8 b0 = load8(g1 + d0), b1 = load8(g1 + d0 + 8), b2 = load8(g1 + d0 + 16), b3 = load8(g1 + d0 + 24);
                for (int64_t c = 0; c < rows; c++) {
                    const v8 u = splat8(w[c * n + j]), t = splat8(w[c * n + j + 1]);
                    const float *row = x + c * D + d0;
                    v8 r0 = load8(row), r1 = load8(row + 8), r2 = load8(row + 16), r3 = load8(row + 24);
                    IN_REGISTER(r0); IN_REGISTER(r1); IN_REGISTER(r2); IN_REGISTER(r3);
                    a0 += u * r0, a1 += u * r1, a2 += u * r2, a3 += u * r3;
                    b0 += t * r0, b1 += t * r1, b2 += t * r2, b3 += t * r3;
                }
                store8(g0 + d0, a0), store8(g0 + d0 + 8, a1), store8(g0 + d0 + 16, a2), store8(g0 + d0 + 24, a3);
                store8(g1 + d0, b0), store8(g1 + d0 + 8, b1), store8(g1 + d0 + 16, b2), store8(g1 + d0 + 24, b3);
            }
        }
    }
    for (; j < n; j++) {
        float *gj = g + j * D;
        int64_t d0 = 0;
        for (; d0 + 32 <= D; d0 += 32) {
            v8 a0 = load8(gj + d0), a1 = load8(gj + d0 + 8), a2 = load8(gj + d0 + 16), a3 = load8(gj + d0 + 24);
            for (int64_t c = 0; c < rows; c++) {
                const v8 wc = splat8(w[c * n + j]);
                const float *row = x + c * D + d0;
                a0 += wc * load8(row), a1 += wc * load8(row + 8);
                a2 += wc * load8(row + 16), a3 += wc * load8(row + 24);
            }
            store8(gj + d0, a0), store8(gj + d0 + 8, a1), store8(gj + d0 + 16, a2), store8(gj + d0 + 24, a3);
        }
        for (int64_t c = 0; c < rows; c++)
            for (int64_t d = d0; d < D; d++) gj[d] += w[c * n + j] * x[c * D + d];
    }
}


/* rows[0..8) of 8 floats each, transposed in registers: afterwards rows[d] holds element d of every
 * input row. (A scalar transpose stored one float per cache line touched: building an expert's
 * transposed key block that way cost twice the block's arithmetic.) */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define LRA_HAS_TRANSPOSE8 1
static inline void transpose8(v8 r[8]) {
    v8 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    v8 u[8];
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            u[i + 2 * h] = __builtin_shufflevector(t[i + h], t[i + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[i + 2 * h + 1] = __builtin_shufflevector(t[i + h], t[i + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int i = 0; i < 4; i++) {
        r[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        r[i + 4] = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}
#endif
#endif

/* t[d * stride + j] = rows[j][d] for j < count, d < D: count rows of D floats (each at its own
 * address) into the columns of a transposed block; 8 x 8 tiles in registers where they fit. */
static inline void transpose_rows(const float *const *rows, int64_t count, int64_t D, float *t, int64_t stride) {
    int64_t j0 = 0;
#ifdef LRA_HAS_TRANSPOSE8
    for (; j0 + 8 <= count; j0 += 8) {
        int64_t d0 = 0;
        for (; d0 + 8 <= D; d0 += 8) {
            v8 r[8];
            for (int i = 0; i < 8; i++) r[i] = load8(rows[j0 + i] + d0);
            transpose8(r);
            for (int i = 0; i < 8; i++) store8(t + (d0 + i) * stride + j0, r[i]);
        }
        for (; d0 < D; d0++)
            for (int i = 0; i < 8; i++) t[d0 * stride + j0 + i] = rows[j0 + i][d0];
    }
#endif
    for (; j0 < count; j0++)
        for (int64_t d = 0; d < D; d++) t[d * stride + j0] = rows[j0][d];
}

#endif
