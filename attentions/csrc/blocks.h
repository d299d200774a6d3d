/* Vectorised building blocks shared by the CPU kernels (grouped, landmark, block gate, row products,
 * Top-k attention, TTT), at the machine's vector width VW (vec.h): a branch-free e^x, lane-wise max and
 * sum, and the products of several rows at once against a block held in the L1 cache (dots2, dots6:
 * across keys of a transposed block; mix2_rows, mix6_rows: weighted sums of rows, of a block or read
 * in place; add_outer: a rank-C gradient update); transposes in 8 x 8 register tiles; the order in
 * which threads take pieces of work, largest first. All static inline: each kernel compiles its own
 * copy. */
#ifndef LRA_BLOCKS_H
#define LRA_BLOCKS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

/* (size, index) pairs: larger size first, ties in index order */
static inline int larger_first(const void *x, const void *y) {
    const int64_t *a = (const int64_t *)x, *b = (const int64_t *)y;
    if (a[0] != b[0]) return a[0] > b[0] ? -1 : 1;
    return a[1] < b[1] ? -1 : a[1] > b[1];
}

/* A new array [n] of 0 .. n - 1 ordered by size [n], largest first, ties in index order; NULL when
 * out of memory. The order in which threads take whole pieces of work one at a time as each
 * finishes one (OpenMP's dynamic schedule): the last pieces taken are the smallest, so the threads
 * finish together, where a fixed share each would leave one idle for the difference. Each piece is
 * one thread's whole work, so the results are the same whichever thread takes it. */
static inline int64_t *largest_first(const int64_t *size, int64_t n) {
    int64_t *pairs = (int64_t *)malloc(sizeof(int64_t) * (2 * n + 1)); /* + 1: never malloc(0) */
    if (!pairs) return NULL;
    for (int64_t i = 0; i < n; i++) pairs[2 * i] = size[i], pairs[2 * i + 1] = i;
    qsort(pairs, n, 2 * sizeof(int64_t), larger_first);
    for (int64_t i = 0; i < n; i++) pairs[i] = pairs[2 * i + 1];
    return pairs;
}

/* e^x for x <= ~0: e^x = 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2]
 * (ln 2 split in two, Cephes' constants, so r is exact), e^r by a degree-6 polynomial fitted for
 * relative error (~2e-7 in float arithmetic, against Cephes' degree-7 form's ~1e-7: 1.6 times the
 * speed on the AMD EPYC). 0 below -87.7 (2^n's exponent field then 0), so a -inf logit weighs 0.
 * Branch-free, so that loops over it vectorise: round(x / ln 2) is read from the low bits of
 * x / ln 2 + 1.5 2^23 (the float adds round to nearest), and that sum's bits shifted into the
 * exponent field give 2^n. tests/test_cpu_kernels.py checks it against torch.exp (lra_exp_nonpos). */
static inline float exp_nonpos(float x) {
    union { float f; uint32_t u; } b;
    b.f = x;
    /* as unsigned bits a negative float grows with its magnitude: the min clamps x to >= -88 */
    b.u = b.u < 0xC2B00000u ? b.u : 0xC2B00000u;
    const float shifted = b.f * 1.44269504088896341f + 12582912.0f; /* 1.5 2^23 + round(x / ln 2) */
    const float n = shifted - 12582912.0f;
    float r = b.f - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 8.290314115583897e-3f;
    p = p * r + 4.189793020486832e-2f;
    p = p * r + 1.666763573884964e-1f;
    p = p * r + 4.999915063381195e-1f;
    p = p * r + 9.999997019767761e-1f;
    p = p * r + 1.0f;
    /* 2^n: n in [-127, 0] sits in the low bits of shifted's; shifted into the exponent field and
     * biased by 127 (n = -127 gives the bits of 0.0f) */
    union { float f; uint32_t u; } s, two_n;
    s.f = shifted;
    two_n.u = (s.u << 23) + 0x3F800000u;
    return p * two_n.f;
}

/* y[i] = exp_nonpos(x[i]) for i < n: the tests' way in */
void lra_exp_nonpos(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = exp_nonpos(x[i]);
}

/* dst[0..n) = src[0..n): a row of a few vectors copied inline (a memcpy call per row of 32 floats
 * cost 1/8 of the grouped forward) */
static inline void copy_row(float *dst, const float *src, int64_t n) {
    int64_t d = 0;
    for (; d + VW <= n; d += VW) storev(dst + d, loadv(src + d));
    for (; d < n; d++) dst[d] = src[d];
}

/* dst[0..n) = src[0..n) * f in whole vectors (written as a plain loop through a struct's fields, the
 * compiler reloads the factor after every store and leaves the loop scalar) */
static inline void scale_row(float *dst, const float *src, float f, int64_t n) {
    const vf fs = splatv(f);
    int64_t d = 0;
    for (; d + VW <= n; d += VW) storev(dst + d, loadv(src + d) * fs);
    for (; d < n; d++) dst[d] = src[d] * f;
}

/* max and sum of x[0..n) in VW lanes (a plain float reduction does not vectorise: it fixes the order;
 * the max as a compare and blend of whole vectors: written lane by lane it stayed scalar) */
static inline float max_of(const float *x, int64_t n) {
    vf lanes = splatv(-INFINITY);
    int64_t j = 0;
    for (; j + VW <= n; j += VW) {
        const vf r = loadv(x + j);
        const vfi more = r > lanes;
        lanes = pickv(more, r, lanes);
    }
    float top = -INFINITY;
    for (; j < n; j++) top = x[j] > top ? x[j] : top;
#ifdef LRA_HAS_FOLD
    /* the lanes' max in a tree (vec.h's fold): exact, so the same value as in lane order */
#if VW == 16
    lanes = pickv(FOLD8(lanes) > lanes, FOLD8(lanes), lanes);
#endif
    lanes = pickv(FOLD4(lanes) > lanes, FOLD4(lanes), lanes);
    lanes = pickv(FOLD2(lanes) > lanes, FOLD2(lanes), lanes);
    lanes = pickv(FOLD1(lanes) > lanes, FOLD1(lanes), lanes);
    return lanes[0] > top ? lanes[0] : top;
#else
    for (int l = 0; l < VW; l++) top = lanes[l] > top ? lanes[l] : top;
    return top;
#endif
}

static inline float sum_of(const float *x, int64_t n) {
    vf lanes = splatv(0.0f);
    int64_t j = 0;
    for (; j + VW <= n; j += VW) lanes += loadv(x + j);
    float total = 0.0f;
    for (; j < n; j++) total += x[j];
    return total + sumv(lanes);
}

/* The products of two queries (or d_outs) at once: each block of an expert's buffers is read from
 * the cache once for both: a tile's rows are loaded into an array of vectors, which the compiler
 * keeps in registers and feeds to the FMAs of both (taking a loaded row as an FMA's memory operand
 * instead would load it twice). Two FMAs issue a cycle, each with a latency of 4 cycles (Intel) or
 * 5 (AMD Zen 2), so 8 to 10 independent accumulators keep them busy: the two-row tiles below hold 8
 * vectors of results in registers at either width (across keys: 4 vectors of each row; across the
 * head dim, 32 floats of each row, as 4 vectors at VW 8 and as 2 vectors summed over alternate keys
 * at VW 16); the six-row forms hold 12 (2 vectors of each row; 24 at VW 16 across the head dim),
 * which AVX2's 16 registers still fit beside the loaded rows (on the AMD EPYC at N = 1K, against
 * the two-row forms: the landmark pass 17-23% faster, the grouped backward 18-22%, its forward
 * 5-9%). They sum in the two-row forms' order, so either gives the same bits.
 * An odd last pair goes through as both halves (the same result written twice). */

/* vectors of each row in dots2's tile across keys */
#define DOT_NV 4
/* vectors in 32 floats, and the alternating accumulators that make 8 with two rows */
#define ROW_NV (32 / VW)
#define ROW_P (4 / ROW_NV)

/* res_c[j] = init[j] + sum_d x_c[d] t[d * n + j] for j < n and c = 0, 1: x_c [D] against the
 * columns of t [D][n] */
static inline void dots2(const float *x0, const float *x1, const float *t, const float *init, int64_t n, int64_t D,
                         float *res0, float *res1) {
    int64_t j0 = 0;
    for (; j0 + DOT_NV * VW <= n; j0 += DOT_NV * VW) {
        vf a[DOT_NV], b[DOT_NV];
        for (int v = 0; v < DOT_NV; v++) a[v] = b[v] = loadv(init + j0 + v * VW);
        for (int64_t d = 0; d < D; d++) {
            const float *row = t + d * n + j0;
            vf r[DOT_NV];
            for (int v = 0; v < DOT_NV; v++) r[v] = loadv(row + v * VW);
            const vf u = splatv(x0[d]), w = splatv(x1[d]);
            for (int v = 0; v < DOT_NV; v++) a[v] += u * r[v], b[v] += w * r[v];
        }
        for (int v = 0; v < DOT_NV; v++) storev(res0 + j0 + v * VW, a[v]), storev(res1 + j0 + v * VW, b[v]);
    }
    for (; j0 + VW <= n; j0 += VW) {
        vf a = loadv(init + j0), b = a;
        for (int64_t d = 0; d < D; d++) {
            const vf r = loadv(t + d * n + j0);
            a += splatv(x0[d]) * r, b += splatv(x1[d]) * r;
        }
        storev(res0 + j0, a), storev(res1 + j0, b);
    }
    for (int64_t j = j0; j < n; j++) {
        float u = init[j], w = init[j];
        for (int64_t d = 0; d < D; d++) u += x0[d] * t[d * n + j], w += x1[d] * t[d * n + j];
        res0[j] = u, res1[j] = w;
    }
}

/* dots2 for six rows x[0..6) at once (res[c][j] = init[j] + sum_d x[c][d] t[d * n + j]; the same
 * sums in the same order, so the same bits): 2 vectors of keys per tile, 12 accumulators */
static inline void dots6(const float *const x[6], const float *t, const float *init, int64_t n, int64_t D,
                         float *const res[6]) {
    int64_t j0 = 0;
    for (; j0 + 2 * VW <= n; j0 += 2 * VW) {
        vf a[6][2];
        const vf i0 = loadv(init + j0), i1 = loadv(init + j0 + VW);
        for (int c = 0; c < 6; c++) a[c][0] = i0, a[c][1] = i1;
        for (int64_t d = 0; d < D; d++) {
            const vf r0 = loadv(t + d * n + j0), r1 = loadv(t + d * n + j0 + VW);
            for (int c = 0; c < 6; c++) {
                const vf u = splatv(x[c][d]);
                a[c][0] += u * r0, a[c][1] += u * r1;
            }
        }
        for (int c = 0; c < 6; c++) storev(res[c] + j0, a[c][0]), storev(res[c] + j0 + VW, a[c][1]);
    }
    for (; j0 + VW <= n; j0 += VW) {
        vf a[6];
        for (int c = 0; c < 6; c++) a[c] = loadv(init + j0);
        for (int64_t d = 0; d < D; d++) {
            const vf r = loadv(t + d * n + j0);
            for (int c = 0; c < 6; c++) a[c] += splatv(x[c][d]) * r;
        }
        for (int c = 0; c < 6; c++) storev(res[c] + j0, a[c]);
    }
    for (; j0 < n; j0++)
        for (int c = 0; c < 6; c++) {
            float u = init[j0];
            for (int64_t d = 0; d < D; d++) u += x[c][d] * t[d * n + j0];
            res[c][j0] = u;
        }
}

/* Row j of the rows a mix reads: r + j D of a block r [n][D], or rp[j] of a table of row pointers
 * (rows read where they lie, with no copy into a block); one of r and rp is NULL. */
static inline const float *row_at(const float *r, const float *const *rp, int64_t j, int64_t D) {
    return rp ? rp[j] : r + j * D;
}

/* res_c[d] = (add ? res_c[d] : 0) + sum_j w_c[j] row_j[d] for d < D and c = 0, 1: the rows row_j
 * (row_at) mixed by w_c [n]. With add and res0 == res1 (an odd last pair) the row gets the sum once.
 * Inlined, a call with a constant NULL rp or r compiles to the loop of its own kind. */
static inline void mix2_rows(const float *w0, const float *w1, const float *r, const float *const *rp, int64_t n,
                             int64_t D, float *res0, float *res1, int add) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) {
        vf a[ROW_P][ROW_NV], b[ROW_P][ROW_NV];
        for (int p = 0; p < ROW_P; p++)
            for (int v = 0; v < ROW_NV; v++) {
                a[p][v] = p == 0 && add ? loadv(res0 + d0 + v * VW) : splatv(0.0f);
                b[p][v] = p == 0 && add ? loadv(res1 + d0 + v * VW) : splatv(0.0f);
            }
        int64_t j = 0;
        for (; j + ROW_P <= n; j += ROW_P)
            for (int p = 0; p < ROW_P; p++) {
                const float *row = row_at(r, rp, j + p, D) + d0;
                vf x[ROW_NV];
                for (int v = 0; v < ROW_NV; v++) x[v] = loadv(row + v * VW);
                const vf u = splatv(w0[j + p]), w = splatv(w1[j + p]);
                for (int v = 0; v < ROW_NV; v++) a[p][v] += u * x[v], b[p][v] += w * x[v];
            }
        for (; j < n; j++) {
            const float *row = row_at(r, rp, j, D) + d0;
            const vf u = splatv(w0[j]), w = splatv(w1[j]);
            for (int v = 0; v < ROW_NV; v++) {
                const vf x = loadv(row + v * VW);
                a[0][v] += u * x, b[0][v] += w * x;
            }
        }
        for (int p = 1; p < ROW_P; p++)
            for (int v = 0; v < ROW_NV; v++) a[0][v] += a[p][v], b[0][v] += b[p][v];
        for (int v = 0; v < ROW_NV; v++) storev(res0 + d0 + v * VW, a[0][v]), storev(res1 + d0 + v * VW, b[0][v]);
    }
    for (; d0 + VW <= D; d0 += VW) {
        vf a = add ? loadv(res0 + d0) : splatv(0.0f), b = add ? loadv(res1 + d0) : splatv(0.0f);
        for (int64_t j = 0; j < n; j++) {
            const vf x = loadv(row_at(r, rp, j, D) + d0);
            a += splatv(w0[j]) * x, b += splatv(w1[j]) * x;
        }
        storev(res0 + d0, a), storev(res1 + d0, b);
    }
    for (int64_t d = d0; d < D; d++) {
        float u = add ? res0[d] : 0.0f, w = add ? res1[d] : 0.0f;
        for (int64_t j = 0; j < n; j++) u += w0[j] * row_at(r, rp, j, D)[d], w += w1[j] * row_at(r, rp, j, D)[d];
        res0[d] = u, res1[d] = w;
    }
}

/* mix2_rows for six weight rows w[0..6) at once, into res[0..6) (the same sums in the same order as
 * mix2_rows, so the same bits): 2 vectors of the head dim per pass, 12 accumulators at VW 8 (24 at
 * VW 16, alternate keys apart as in mix2_rows). A head dim that is not a whole number of passes goes
 * through mix2_rows. */
static inline void mix6_rows(const float *const w[6], const float *r, const float *const *rp, int64_t n, int64_t D,
                             float *const res[6], int add) {
    if (D % (2 * VW) != 0 || D % 32 != 0) {
        for (int c = 0; c < 6; c += 2) mix2_rows(w[c], w[c + 1], r, rp, n, D, res[c], res[c + 1], add);
        return;
    }
    for (int64_t d0 = 0; d0 < D; d0 += 2 * VW) {
        vf a[6][ROW_P][2];
        for (int c = 0; c < 6; c++)
            for (int p = 0; p < ROW_P; p++)
                for (int v = 0; v < 2; v++) a[c][p][v] = p == 0 && add ? loadv(res[c] + d0 + v * VW) : splatv(0.0f);
        int64_t j = 0;
        for (; j + ROW_P <= n; j += ROW_P)
            for (int p = 0; p < ROW_P; p++) {
                const float *row = row_at(r, rp, j + p, D) + d0;
                const vf x0 = loadv(row), x1 = loadv(row + VW);
                for (int c = 0; c < 6; c++) {
                    const vf u = splatv(w[c][j + p]);
                    a[c][p][0] += u * x0, a[c][p][1] += u * x1;
                }
            }
        for (; j < n; j++) {
            const float *row = row_at(r, rp, j, D) + d0;
            const vf x0 = loadv(row), x1 = loadv(row + VW);
            for (int c = 0; c < 6; c++) {
                const vf u = splatv(w[c][j]);
                a[c][0][0] += u * x0, a[c][0][1] += u * x1;
            }
        }
        for (int c = 0; c < 6; c++) {
            for (int p = 1; p < ROW_P; p++)
                for (int v = 0; v < 2; v++) a[c][0][v] += a[c][p][v];
            storev(res[c] + d0, a[c][0][0]), storev(res[c] + d0 + VW, a[c][0][1]);
        }
    }
}

/* dots over `rows` rows x [rows][D] into res (row c at res + c * stride): six at a time, then two
 * (an odd last row goes through as both halves) */
static inline void dots_of_rows(const float *x, int64_t rows, const float *t, const float *init, int64_t n,
                                int64_t D, float *res, int64_t stride) {
    int64_t c = 0;
    for (; c + 6 <= rows; c += 6) {
        const float *xc[6];
        float *rc[6];
        for (int i = 0; i < 6; i++) xc[i] = x + (c + i) * D, rc[i] = res + (c + i) * stride;
        dots6(xc, t, init, n, D, rc);
    }
    for (; c < rows; c += 2) {
        const int64_t c1 = c + 1 < rows ? c + 1 : c;
        dots2(x + c * D, x + c1 * D, t, init, n, D, res + c * stride, res + c1 * stride);
    }
}

/* mixes of the rows (row_at) by `rows` weight rows w [rows][n] into out row (at ? at[c] : c) of D
 * floats: six at a time, then two (an odd last row goes through as both halves; with add, once) */
static inline void mix_weighted(const float *w, int64_t rows, const float *r, const float *const *rp, int64_t n,
                                int64_t D, float *out, const int64_t *at, int add) {
    int64_t c = 0;
    for (; c + 6 <= rows; c += 6) {
        const float *wc[6];
        float *rc[6];
        for (int i = 0; i < 6; i++) wc[i] = w + (c + i) * n, rc[i] = out + (at ? at[c + i] : c + i) * D;
        mix6_rows(wc, r, rp, n, D, rc, add);
    }
    for (; c < rows; c += 2) {
        const int64_t c1 = c + 1 < rows ? c + 1 : c;
        mix2_rows(w + c * n, w + c1 * n, r, rp, n, D, out + (at ? at[c] : c) * D, out + (at ? at[c1] : c1) * D, add);
    }
}

/* mix2_rows of a block r [n][D] */
static inline void mix2(const float *w0, const float *w1, const float *r, int64_t n, int64_t D, float *res0,
                        float *res1, int add) {
    mix2_rows(w0, w1, r, NULL, n, D, res0, res1, add);
}

/* out [D] = sum_j w[j] table[(base + idx[j]) D ..]: k rows picked by index and mixed (Top-k attention's
 * output and dq): 32 floats at a time over alternating picks (8 accumulators), then a vector, then
 * one by one */
static inline void mix_picked(const float *w, const int64_t *idx, const float *table, int64_t base, int64_t k,
                              int64_t D, float *out) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) {
        vf a[2 * ROW_P][ROW_NV];
        for (int p = 0; p < 2 * ROW_P; p++)
            for (int v = 0; v < ROW_NV; v++) a[p][v] = splatv(0.0f);
        int64_t j = 0;
        for (; j + 2 * ROW_P <= k; j += 2 * ROW_P)
            for (int p = 0; p < 2 * ROW_P; p++) {
                const vf wj = splatv(w[j + p]);
                const float *row = table + (base + idx[j + p]) * D + d0;
                for (int v = 0; v < ROW_NV; v++) a[p][v] += wj * loadv(row + v * VW);
            }
        for (; j < k; j++) {
            const vf wj = splatv(w[j]);
            const float *row = table + (base + idx[j]) * D + d0;
            for (int v = 0; v < ROW_NV; v++) a[0][v] += wj * loadv(row + v * VW);
        }
        for (int p = 1; p < 2 * ROW_P; p++)
            for (int v = 0; v < ROW_NV; v++) a[0][v] += a[p][v];
        for (int v = 0; v < ROW_NV; v++) storev(out + d0 + v * VW, a[0][v]);
    }
    for (; d0 + VW <= D; d0 += VW) {
        vf acc = splatv(0.0f);
        for (int64_t j = 0; j < k; j++) acc += splatv(w[j]) * loadv(table + (base + idx[j]) * D + d0);
        storev(out + d0, acc);
    }
    for (int64_t d = d0; d < D; d++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; j++) acc += w[j] * table[(base + idx[j]) * D + d];
        out[d] = acc;
    }
}

/* Row j of an outer product's gradient: to[j] where the rows are scattered (NULL: g + j D, a block). */
static inline float *grad_row(float *g, float *const *to, int64_t j, int64_t D) {
    return to ? to[j] : g + j * D;
}

/* Accumulator init from a row of the gradient: a block's row is added to; scattered rows are summed
 * from 0 and added to their row at the end (outer_store), so a row listed twice gets both sums. */
static inline vf outer_init(const float *row, int scattered) {
    return scattered ? splatv(0.0f) : loadv(row);
}

static inline void outer_store(float *row, int scattered, vf a) {
    storev(row, scattered ? loadv(row) + a : a);
}

/* g_j[d] += sum_c w[c * ldw + j] * x[c * D + d] for keys j < n: the rank-C update w^T x of a [n][D]
 * gradient, its rows g + j D (to NULL) or to[j] (rows of a table, read by index: MiTA's routed
 * keys, added into dK and dV where they lie instead of into a block that is zeroed, summed and
 * then added to them; the same sums, so the same bits as the block and its addition).
 * Two keys at a time: each row of x, loaded once, feeds both (six loads per eight FMAs, against
 * five per four one key at a time, which left the loads, not the FMAs, setting the pace); at VW 16
 * alternate rows c add into separate accumulators (8 in all). */
static inline void add_outer(const float *w, int64_t ldw, const float *x, int64_t rows, int64_t n, int64_t D,
                             float *g, float *const *to) {
    const int scattered = to != NULL;
    int64_t j = 0;
    if (D % 32 == 0 && D % (2 * VW) == 0) {
        /* six keys at a time over 2 vectors of the head dim: 12 accumulators (24 at VW 16), each
         * row of x loaded once for all six; the sums in the order of the two-key loop below */
        for (; j + 6 <= n; j += 6)
            for (int64_t d0 = 0; d0 < D; d0 += 2 * VW) {
                vf a[6][ROW_P][2];
                for (int k = 0; k < 6; k++)
                    for (int p = 0; p < ROW_P; p++)
                        for (int v = 0; v < 2; v++)
                            a[k][p][v] = p == 0 ? outer_init(grad_row(g, to, j + k, D) + d0 + v * VW, scattered)
                                                : splatv(0.0f);
                int64_t c = 0;
                for (; c + ROW_P <= rows; c += ROW_P)
                    for (int p = 0; p < ROW_P; p++) {
                        const float *row = x + (c + p) * D + d0, *wc = w + (c + p) * ldw + j;
                        const vf r0 = loadv(row), r1 = loadv(row + VW);
                        for (int k = 0; k < 6; k++) {
                            const vf u = splatv(wc[k]);
                            a[k][p][0] += u * r0, a[k][p][1] += u * r1;
                        }
                    }
                for (; c < rows; c++) {
                    const float *row = x + c * D + d0, *wc = w + c * ldw + j;
                    const vf r0 = loadv(row), r1 = loadv(row + VW);
                    for (int k = 0; k < 6; k++) {
                        const vf u = splatv(wc[k]);
                        a[k][0][0] += u * r0, a[k][0][1] += u * r1;
                    }
                }
                for (int k = 0; k < 6; k++) {
                    for (int p = 1; p < ROW_P; p++)
                        for (int v = 0; v < 2; v++) a[k][0][v] += a[k][p][v];
                    float *out = grad_row(g, to, j + k, D) + d0;
                    outer_store(out, scattered, a[k][0][0]);
                    outer_store(out + VW, scattered, a[k][0][1]);
                }
            }
    }
    if (D % 32 == 0) {
        for (; j + 2 <= n; j += 2) {
            float *g0 = grad_row(g, to, j, D), *g1 = grad_row(g, to, j + 1, D);
            for (int64_t d0 = 0; d0 < D; d0 += 32) {
                vf a[ROW_P][ROW_NV], b[ROW_P][ROW_NV];
                for (int p = 0; p < ROW_P; p++)
                    for (int v = 0; v < ROW_NV; v++) {
                        a[p][v] = p == 0 ? outer_init(g0 + d0 + v * VW, scattered) : splatv(0.0f);
                        b[p][v] = p == 0 ? outer_init(g1 + d0 + v * VW, scattered) : splatv(0.0f);
                    }
                int64_t c = 0;
                for (; c + ROW_P <= rows; c += ROW_P)
                    for (int p = 0; p < ROW_P; p++) {
                        const vf u = splatv(w[(c + p) * ldw + j]), t = splatv(w[(c + p) * ldw + j + 1]);
                        const float *row = x + (c + p) * D + d0;
                        vf r[ROW_NV];
                        for (int v = 0; v < ROW_NV; v++) r[v] = loadv(row + v * VW);
                        for (int v = 0; v < ROW_NV; v++) a[p][v] += u * r[v], b[p][v] += t * r[v];
                    }
                for (; c < rows; c++) {
                    const vf u = splatv(w[c * ldw + j]), t = splatv(w[c * ldw + j + 1]);
                    for (int v = 0; v < ROW_NV; v++) {
                        const vf r = loadv(x + c * D + d0 + v * VW);
                        a[0][v] += u * r, b[0][v] += t * r;
                    }
                }
                for (int p = 1; p < ROW_P; p++)
                    for (int v = 0; v < ROW_NV; v++) a[0][v] += a[p][v], b[0][v] += b[p][v];
                for (int v = 0; v < ROW_NV; v++) outer_store(g0 + d0 + v * VW, scattered, a[0][v]);
                for (int v = 0; v < ROW_NV; v++) outer_store(g1 + d0 + v * VW, scattered, b[0][v]);
            }
        }
    }
    for (; j < n; j++) {
        float *gj = grad_row(g, to, j, D);
        int64_t d0 = 0;
        for (; d0 + VW <= D; d0 += VW) {
            vf acc = outer_init(gj + d0, scattered);
            for (int64_t c = 0; c < rows; c++) acc += splatv(w[c * ldw + j]) * loadv(x + c * D + d0);
            outer_store(gj + d0, scattered, acc);
        }
        for (int64_t d = d0; d < D; d++) {
            float acc = scattered ? 0.0f : gj[d];
            for (int64_t c = 0; c < rows; c++) acc += w[c * ldw + j] * x[c * D + d];
            gj[d] = scattered ? gj[d] + acc : acc;
        }
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

/* The [nb][D] rows at src transposed into t [D][nb]. */
static inline void transpose_block(const float *src, int64_t nb, int64_t D, float *t) {
    for (int64_t j0 = 0; j0 < nb; j0 += 8) {
        const float *rows[8];
        const int64_t c = nb - j0 < 8 ? nb - j0 : 8;
        for (int64_t i = 0; i < c; i++) rows[i] = src + (j0 + i) * D;
        transpose_rows(rows, c, D, t + j0, nb);
    }
}

/* Queries in the vector lanes: 2 VW query rows t0 .. t0 + 2 VW - 1 of Q [N][D] transposed into
 * qt [D][2 VW] (8 x 8 register tiles), so that one vector op handles a score of 2 VW queries at once;
 * a short last run (fewer than 2 VW rows left) repeats its last row. */
static inline void rows_into_lanes(const float *Q, int64_t t0, int64_t N, int64_t D, float *qt) {
    const int64_t count = N - t0 < 2 * VW ? N - t0 : 2 * VW;
    const float *rows[2 * VW];
    for (int64_t l = 0; l < 2 * VW; l++) rows[l] = Q + (t0 + (l < count ? l : count - 1)) * D;
    for (int h = 0; h < 2 * VW; h += 8) transpose_rows(rows + h, 8, D, qt + h, 2 * VW);
}

/* Rows j .. j + K - 1 of R [rows][D] scored against the 2 VW queries in the lanes of qt [D][2 VW]:
 * acc[i][h] lane l = bias[j + i] + sum_d R[(j + i) D + d] qt[d][h VW + l], the sum over d in order
 * (the bits of one row of dots2). Inlined with a constant K <= 6: 2 K independent FMA chains in
 * registers, 12 at K = 6 as in the six-row forms above. */
__attribute__((always_inline)) static inline void lane_scores(int K, int64_t j, const float *R, const float *bias,
                                                             const float *qt, int64_t D, vf acc[6][2]) {
    for (int i = 0; i < K; i++) acc[i][0] = acc[i][1] = splatv(bias[j + i]);
    for (int64_t d = 0; d < D; d++) {
        const vf x0 = loadv(qt + d * 2 * VW), x1 = loadv(qt + d * 2 * VW + VW);
        for (int i = 0; i < K; i++) {
            const vf u = splatv(R[(j + i) * D + d]);
            acc[i][0] += u * x0, acc[i][1] += u * x1;
        }
    }
}

#endif
