/* Test-Time Training's dual form on the CPU (Sun et al. 2024): TTT-Linear and TTT-MLP, forward and
 * backward, one (batch, head) group per thread at a time, the mini-batch recurrence in C.
 *
 * A group's sequence is M mini-batches of K tokens: q, k, v [M, K, D] and each key's learning rate lr
 * [M, K]; in a mini-batch, the target t = v - k and the steps eta [K, K], eta[i][j] = ts[i] lr[j] for
 * keys j <= i (0 above the diagonal), the step key j takes in the weights query i reads (ts [K] a factor
 * per place). The state is the inner model's weights, one flat block: [W D x D, b D] (linear) or
 * [W1 D x E, b1 E, W2 E x D, b2 D] (the MLP, E hidden units). Mini-batch m, from the state it starts
 * with (attentions/ops/ttt/dual.py is the same computation in PyTorch, the reference this is tested
 * against):
 *
 *   linear:  Z = k W + b, G = LN-L2 grad(Z, t), z = q W + b - (eta * (q k^T + 1)) G
 *   MLP:     Z1 = k W1 + b1, X2 = gelu(Z1), G2 = LN-L2 grad(X2 W2 + b2, t), G1 = (G2 W2^T) * gelu'(Z1),
 *            X2q = gelu(q W1 + b1 - (eta * (q k^T + 1)) G1),
 *            z = X2q W2 + b2 - (eta * (X2q X2^T + 1)) G2
 *   out = q + LN(z); the next state: each weight W -= x^T (e * G) and its bias b -= sum_s e_s G_s (x the
 *   layer's input at the keys, e = eta's last row).
 *
 * LN is the inner layer norm (weight lnw, bias lnb); LN-L2 grad(z, t) is d/dz 1/2 ||LN(z) - t||^2. The
 * forward writes out and, for the backward, the pre-norm outputs z and the state each mini-batch starts
 * from. The backward runs the mini-batches last to first, recomputes each one's intermediates from its
 * saved state and carries the adjoint of the state back; it gives the gradients of q, k, v, lr, ts, the
 * initial state and lnw, lnb (those of ts, lnw, lnb per group: the caller sums them). The products are
 * small ([K, D] x [D, E]): mm() keeps 4 rows x 2 vectors of the result in registers. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "vec.h"

typedef struct {
    int64_t G, M, K, D, E, threads;  /* E = 0: the linear model */
    double eps;
    /* q, k, v [G, M, K, D], lr [G, M, K], ts [K], w0 [G, S], lnw, lnb [G, D] */
    const float *q, *k, *v, *lr, *ts, *w0, *lnw, *lnb;
    float *out, *states, *saved; /* [G, M, K, D], [G, M, S], [G, M, saved_size] (NULL: not kept) */
    const float *dout;                              /* backward: [G, M, K, D] */
    float *dq, *dk, *dv, *dlr, *dts, *dw0, *dlnw, *dlnb; /* backward: as their inputs, dts [G, K] */
} TTT;

/* floats in one state block */
static int64_t state_size(int64_t D, int64_t E) { return E == 0 ? D * D + D : 2 * D * E + E + D; }

/* ---- small products ---------------------------------------------------------------------------- */

/* R rows of C (rows ldc apart) = [C +] alpha * A B over Kd, A(r, k) = A[r * ai + k * ak], B [Kd, N] rows
 * ldb apart; R a constant of each call site (1 or 4) so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void mm_rows(const int R, int64_t N, int64_t Kd, const float *A,
                                                          int64_t ai, int64_t ak, const float *B, int64_t ldb,
                                                          float *C, int64_t ldc, float alpha, int acc) {
    int64_t n = 0;
    for (; n + 2 * VW <= N; n += 2 * VW) {
        vf c0[4], c1[4];
        for (int r = 0; r < R; r++) c0[r] = c1[r] = splatv(0.0f);
        for (int64_t k = 0; k < Kd; k++) {
            const vf b0 = loadv(B + k * ldb + n), b1 = loadv(B + k * ldb + n + VW);
            for (int r = 0; r < R; r++) {
                const vf a = splatv(A[r * ai + k * ak]);
                c0[r] += a * b0;
                c1[r] += a * b1;
            }
        }
        for (int r = 0; r < R; r++) {
            float *c = C + r * ldc + n;
            vf x0 = splatv(alpha) * c0[r], x1 = splatv(alpha) * c1[r];
            if (acc) {
                x0 += loadv(c);
                x1 += loadv(c + VW);
            }
            storev(c, x0);
            storev(c + VW, x1);
        }
    }
    for (; n + VW <= N; n += VW) {
        vf c0[4];
        for (int r = 0; r < R; r++) c0[r] = splatv(0.0f);
        for (int64_t k = 0; k < Kd; k++) {
            const vf b0 = loadv(B + k * ldb + n);
            for (int r = 0; r < R; r++) c0[r] += splatv(A[r * ai + k * ak]) * b0;
        }
        for (int r = 0; r < R; r++) {
            float *c = C + r * ldc + n;
            const vf x0 = splatv(alpha) * c0[r];
            storev(c, acc ? x0 + loadv(c) : x0);
        }
    }
    for (; n < N; n++) {
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int64_t k = 0; k < Kd; k++) s += A[r * ai + k * ak] * B[k * ldb + n];
            C[r * ldc + n] = (acc ? C[r * ldc + n] : 0.0f) + alpha * s;
        }
    }
}

/* C [Mr, N] (rows ldc apart) = [C +] alpha * A B, A(i, k) = A[i * ai + k * ak] (A [Mr, Kd] row-major:
 * ai = Kd, ak = 1; its transpose stored [Kd, Mr]: ai = 1, ak = Mr), B [Kd, N] row-major */
static void mm(int64_t Mr, int64_t N, int64_t Kd, const float *A, int64_t ai, int64_t ak, const float *B,
               float *C, float alpha, int acc) {
    int64_t i = 0;
    for (; i + 4 <= Mr; i += 4) mm_rows(4, N, Kd, A + i * ai, ai, ak, B, N, C + i * N, N, alpha, acc);
    for (; i < Mr; i++) mm_rows(1, N, Kd, A + i * ai, ai, ak, B, N, C + i * N, N, alpha, acc);
}

/* the row-major products the steps use: C = [C +] alpha A B (A [Mr, Kd]), alpha A^T B (A [Kd, Mr]) */
static void mm_nn(int64_t Mr, int64_t N, int64_t Kd, const float *A, const float *B, float *C, float alpha, int acc) {
    mm(Mr, N, Kd, A, Kd, 1, B, C, alpha, acc);
}
static void mm_tn(int64_t Mr, int64_t N, int64_t Kd, const float *A, const float *B, float *C, float alpha, int acc) {
    mm(Mr, N, Kd, A, 1, Mr, B, C, alpha, acc);
}

/* x [R, C] += the row b at every row */
static void add_row(float *x, const float *b, int64_t R, int64_t C) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) x[r * C + c] += b[c];
}

/* acc [C] += sign * sum over rows of w_r x[r] (w NULL: 1) */
static void add_col_sums(float *acc, const float *x, const float *w, int64_t R, int64_t C, float sign) {
    for (int64_t r = 0; r < R; r++) {
        const float s = sign * (w ? w[r] : 1.0f);
        for (int64_t c = 0; c < C; c++) acc[c] += s * x[r * C + c];
    }
}

/* y [R, C] = x with row r times w[r] */
static void scale_rows(const float *x, const float *w, int64_t R, int64_t C, float *y) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) y[r * C + c] = w[r] * x[r * C + c];
}

/* ---- the inner model's pieces ------------------------------------------------------------------ */

/* tanh(u) = sign(u) (1 - e^-2|u|) / (1 + e^-2|u|): absolute error ~1e-7, which is what gelu reads */
static inline float tanh_fast(float u) {
    const float a = fabsf(u);
    const float r = exp_nonpos(-2.0f * a);
    const float th = (1.0f - r) / (1.0f + r);
    return u < 0.0f ? -th : th;
}

#define GELU_C 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_A 0.044715f

/* gelu(x) = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3) (the authors' tanh form); y = gelu(x),
 * dy = gelu'(x), ddy = gelu''(x), each optional */
static void gelu_rows(const float *x, int64_t n, float *y, float *dy, float *ddy) {
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i], v2 = v * v;
        const float th = tanh_fast(GELU_C * (v + GELU_A * v * v2));
        const float du = GELU_C * (1.0f + 3.0f * GELU_A * v2), sech2 = 1.0f - th * th;
        if (y) y[i] = 0.5f * v * (1.0f + th);
        if (dy) dy[i] = 0.5f * (1.0f + th) + 0.5f * v * sech2 * du;
        if (ddy) ddy[i] = sech2 * (du + 0.5f * v * (6.0f * GELU_A * GELU_C * v - 2.0f * th * du * du));
    }
}

static inline float dot_of(const float *a, const float *b, int64_t n) {
    vf lanes = splatv(0.0f);
    int64_t j = 0;
    for (; j + VW <= n; j += VW) lanes += loadv(a + j) * loadv(b + j);
    float total = 0.0f;
    for (; j < n; j++) total += a[j] * b[j];
    return total + sumv(lanes);
}

/* x [D] = (z - mean(z)) / s for one row; returns 1 / s, s = sqrt(var(z) + eps) */
static inline float normalise(const float *z, int64_t D, float eps, float *x) {
    const float mu = sum_of(z, D) / (float)D;
    for (int64_t j = 0; j < D; j++) x[j] = z[j] - mu;
    const float inv = 1.0f / sqrtf(dot_of(x, x, D) / (float)D + eps);
    for (int64_t j = 0; j < D; j++) x[j] *= inv;
    return inv;
}

/* g [K, D] = d/dz 1/2 ||LN(z) - t||^2 row by row: with x = (z - mean) / s, s = sqrt(var + eps) and
 * e = (x lnw + lnb - t) lnw, g = (e - mean(e) - x mean(e x)) / s; x [D] scratch */
static void ln_l2_grad(const float *z, const float *t, const float *w, const float *bl, float eps, int64_t K,
                       int64_t D, float *g, float *x) {
    for (int64_t r = 0; r < K; r++) {
        const float *tr = t + r * D;
        float *gr = g + r * D;
        const float inv = normalise(z + r * D, D, eps, x);
        for (int64_t j = 0; j < D; j++) gr[j] = (x[j] * w[j] + bl[j] - tr[j]) * w[j];
        const float em = sum_of(gr, D) / (float)D, exm = dot_of(gr, x, D) / (float)D;
        for (int64_t j = 0; j < D; j++) gr[j] = (gr[j] - em - x[j] * exm) * inv;
    }
}

/* The backward of ln_l2_grad: given gg = d loss / d g [K, D], dz [K, D] and dt [K, D] are set and
 * dw, dbl [D] added to. With the forward's x, s, e, mean(e x) = exm:
 * de = (gg - mean(gg) - x mean(gg x)) / s; dx = -(gg exm + e mean(gg x)) / s + de lnw^2;
 * ds = -sum(gg g) / s - sum(dx x) / s; dz = dc - mean(dc), dc = dx / s + ds x / D.
 * x, e, dx [D] scratch. */
static void ln_l2_grad_backward(const float *z, const float *t, const float *w, const float *bl, float eps,
                                int64_t K, int64_t D, const float *gg, float *dz, float *dt, float *dw,
                                float *dbl, float *x, float *e, float *dx) {
    for (int64_t r = 0; r < K; r++) {
        const float *tr = t + r * D, *ggr = gg + r * D;
        float *dzr = dz + r * D, *dtr = dt + r * D;
        const float inv = normalise(z + r * D, D, eps, x);
        for (int64_t j = 0; j < D; j++) e[j] = (x[j] * w[j] + bl[j] - tr[j]) * w[j];
        const float em = sum_of(e, D) / (float)D, exm = dot_of(e, x, D) / (float)D;
        const float gm = sum_of(ggr, D) / (float)D, gxm = dot_of(ggr, x, D) / (float)D;
        /* sum(gg g) = (sum(gg e) - em sum(gg) - exm sum(gg x)) / s */
        const float gout = (dot_of(ggr, e, D) - (em * gm + exm * gxm) * (float)D) * inv;
        for (int64_t j = 0; j < D; j++) {
            const float de = (ggr[j] - gm - x[j] * gxm) * inv;
            dx[j] = -(ggr[j] * exm + e[j] * gxm) * inv + de * w[j] * w[j];
            dtr[j] = -de * w[j];
            dw[j] += de * (x[j] * w[j] + bl[j] - tr[j] + w[j] * x[j]);
            dbl[j] += de * w[j];
        }
        const float ds = -(gout + dot_of(dx, x, D)) * inv;
        for (int64_t j = 0; j < D; j++) dzr[j] = dx[j] * inv + ds * x[j] / (float)D;
        const float dcm = sum_of(dzr, D) / (float)D;
        for (int64_t j = 0; j < D; j++) dzr[j] -= dcm;
    }
}

/* o [K, D] = q + LN(z) row by row (the inner layer norm on the outputs, and the residual) */
static void output_norm(const float *z, const float *q, const float *w, const float *bl, float eps, int64_t K,
                        int64_t D, float *o, float *x) {
    for (int64_t r = 0; r < K; r++) {
        normalise(z + r * D, D, eps, x);
        for (int64_t j = 0; j < D; j++) o[r * D + j] = q[r * D + j] + x[j] * w[j] + bl[j];
    }
}

/* The backward of output_norm's layer norm: dz [K, D] = d/dz of do . LN(z); dw, dbl [D] added to */
static void output_norm_backward(const float *z, const float *dout, const float *w, float eps, int64_t K,
                                 int64_t D, float *dz, float *dw, float *dbl, float *x) {
    for (int64_t r = 0; r < K; r++) {
        const float *dr = dout + r * D;
        float *dzr = dz + r * D;
        const float inv = normalise(z + r * D, D, eps, x);
        for (int64_t j = 0; j < D; j++) {
            dw[j] += dr[j] * x[j];
            dbl[j] += dr[j];
            dzr[j] = dr[j] * w[j];
        }
        const float m = sum_of(dzr, D) / (float)D, mx = dot_of(dzr, x, D) / (float)D;
        for (int64_t j = 0; j < D; j++) dzr[j] = (dzr[j] - m - x[j] * mx) * inv;
    }
}

/* a [K, K] = eta * (p + 1): the weights a query's read gives each key's gradient */
static void read_weights(const float *eta, const float *p, int64_t K, float *a) {
    for (int64_t i = 0; i < K * K; i++) a[i] = eta[i] * (p[i] + 1.0f);
}

/* ---- one mini-batch ---------------------------------------------------------------------------- */

/* Per-thread buffers, each sized for the largest use (E or D wide, K rows). */
typedef struct {
    float *z1, *x2, *z2, *g2, *h, *g1, *dg, *ddg, *z1q, *x2q, *dgq, *ge, *zo, *dzo, *t;
    float *d_x2, *d_x2q, *d_z1, *d_g1, *d_g2, *d_e;
    float *p1, *a1, *p2, *a2, *d_a, *eta, *d_eta, *w1t, *w2t, *row, *tr;
} Buffers;

static int buffers_make(Buffers *b, int64_t K, int64_t D, int64_t E) {
    const int64_t W = E > D ? E : D, KW = K * W, KK = K * K, DW = D * W;
    float **wide[] = {&b->z1, &b->x2, &b->z2, &b->g2, &b->h, &b->g1, &b->dg, &b->ddg, &b->z1q, &b->x2q, &b->dgq,
                      &b->ge, &b->zo, &b->dzo, &b->t, &b->d_x2, &b->d_x2q, &b->d_z1, &b->d_g1, &b->d_g2, &b->d_e};
    float **square[] = {&b->p1, &b->a1, &b->p2, &b->a2, &b->d_a, &b->eta, &b->d_eta};
    const int nw = sizeof(wide) / sizeof(wide[0]), ns = sizeof(square) / sizeof(square[0]);
    const int64_t total = nw * KW + ns * KK + 2 * DW + 3 * W + (K > W ? K : W) * W;
    float *all = (float *)malloc(sizeof(float) * (size_t)total);
    if (!all) return -1;
    float *p = all;
    for (int i = 0; i < nw; i++, p += KW) *wide[i] = p;
    for (int i = 0; i < ns; i++, p += KK) *square[i] = p;
    b->w1t = p; p += DW;
    b->w2t = p; p += DW;
    b->row = p; p += 3 * W; /* three rows of scratch */
    b->tr = p;              /* transposes up to [max(K, W), W] */
    return 0;
}

/* Floats the forward keeps per mini-batch for the backward (besides the state): the pre-norm outputs
 * z [K, D], and the products the backward reads: linear: k W + b [K, D]; MLP: Z1, Z1q = q W1 + b1 -
 * A1 G1, H = G2 W2^T [K, E] each, Z2 [K, D], X2q X2^T [K, K] */
static int64_t saved_size(int64_t K, int64_t D, int64_t E) {
    return E == 0 ? 2 * K * D : 2 * K * D + 3 * K * E + K * K;
}

/* the saved block's parts */
typedef struct {
    float *z, *z1, *z1q, *h, *z2, *p2;
} Saved;

static Saved saved_parts(float *sv, int64_t K, int64_t D, int64_t E) {
    Saved p = {sv, sv + K * D, NULL, NULL, NULL, NULL};
    if (E > 0) {
        p.z1q = p.z1 + K * E;
        p.h = p.z1q + K * E;
        p.z2 = p.h + K * E;
        p.p2 = p.z2 + K * D;
    }
    return p;
}

/* One layer's read at the queries: z [K, Y] = x W + bias - A G, x [K, X] the layer's inputs at the
 * queries, W [X, Y], A [K, K] the read weights, G [K, Y] the layer's gradients at the keys */
static void layer_read(int64_t K, int64_t X, int64_t Y, const float *x, const float *W, const float *bias,
                       const float *A, const float *G, float *z) {
    mm_nn(K, Y, X, x, W, z, 1.0f, 0);
    add_row(z, bias, K, Y);
    mm_nn(K, Y, K, A, G, z, -1.0f, 1);
}

/* One layer's update: W [X, Y] -= x^T (e G), bias [Y] -= sum_s e_s G_s, x [K, X] the layer's inputs at
 * the keys; ge [K, Y] scratch */
static void layer_update(int64_t K, int64_t X, int64_t Y, const float *x, const float *G, const float *e, float *W,
                         float *bias, float *ge) {
    scale_rows(G, e, K, Y, ge);
    mm_tn(X, Y, K, x, ge, W, -1.0f, 1);
    add_col_sums(bias, ge, NULL, K, Y, -1.0f);
}

/* The forward of one mini-batch from state s (updated in place to the next one's): o [K, D] = q + LN(z);
 * where sv is set, what the backward reads is kept there (saved_size floats) */
static void step_forward(const TTT *a, Buffers *b, float *s, const float *q, const float *k, const float *t,
                         const float *eta, float *o, float *sv) {
    const int64_t K = a->K, D = a->D, E = a->E;
    const float *w = a->lnw, *bl = a->lnb, eps = (float)a->eps, *e = eta + (K - 1) * K;
    const Saved keep = sv ? saved_parts(sv, K, D, E) : (Saved){b->zo, b->z1, b->z1q, b->h, b->z2, b->p2};
    float *z = keep.z;
    transpose_block(k, K, D, b->tr); /* k^T [D, K] */
    mm_nn(K, K, D, q, b->tr, b->p1, 1.0f, 0);
    read_weights(eta, b->p1, K, b->a1);
    if (E == 0) {
        float *W = s, *bias = s + D * D, *zk = keep.z1;
        mm_nn(K, D, D, k, W, zk, 1.0f, 0);
        add_row(zk, bias, K, D);
        ln_l2_grad(zk, t, w, bl, eps, K, D, b->g1, b->row);
        layer_read(K, D, D, q, W, bias, b->a1, b->g1, z);
        output_norm(z, q, w, bl, eps, K, D, o, b->row);
        layer_update(K, D, D, k, b->g1, e, W, bias, b->ge);
        return;
    }
    float *W1 = s, *b1 = W1 + D * E, *W2 = b1 + E, *b2 = W2 + E * D;
    float *z1 = keep.z1, *z1q = keep.z1q, *h = keep.h, *z2 = keep.z2, *p2 = keep.p2;
    mm_nn(K, E, D, k, W1, z1, 1.0f, 0);
    add_row(z1, b1, K, E);
    gelu_rows(z1, K * E, b->x2, b->dg, NULL);
    mm_nn(K, D, E, b->x2, W2, z2, 1.0f, 0);
    add_row(z2, b2, K, D);
    ln_l2_grad(z2, t, w, bl, eps, K, D, b->g2, b->row);
    transpose_block(W2, E, D, b->w2t); /* [D, E] */
    mm_nn(K, E, D, b->g2, b->w2t, h, 1.0f, 0);
    for (int64_t i = 0; i < K * E; i++) b->g1[i] = h[i] * b->dg[i];
    layer_read(K, D, E, q, W1, b1, b->a1, b->g1, z1q);
    gelu_rows(z1q, K * E, b->x2q, NULL, NULL);
    transpose_block(b->x2, K, E, b->tr); /* X2^T [E, K] */
    mm_nn(K, K, E, b->x2q, b->tr, p2, 1.0f, 0);
    read_weights(eta, p2, K, b->a2);
    layer_read(K, E, D, b->x2q, W2, b2, b->a2, b->g2, z);
    output_norm(z, q, w, bl, eps, K, D, o, b->row);
    layer_update(K, D, E, k, b->g1, e, W1, b1, b->ge);
    layer_update(K, E, D, b->x2, b->g2, e, W2, b2, b->ge);
}

/* d_eta [K, K] += d_a * (p + 1); d_a becomes d_p = d_a * eta (the read weights' backward) */
static void read_weights_backward(const float *eta, const float *p, int64_t K, float *d_a, float *d_eta) {
    for (int64_t i = 0; i < K * K; i++) {
        d_eta[i] += d_a[i] * (p[i] + 1.0f);
        d_a[i] *= eta[i];
    }
}

/* The update's backward for one layer: W' = W - x^T (e G), b' = b - sum_s e_s G_s with x [K, X] the
 * layer's inputs at the keys and G [K, Y] its gradients; gW [X, Y] and gb [Y] the adjoints of W' and
 * b' (read before this mini-batch adds to them). de [K] is added to, dg [K, Y] set, and dx [K, X] gets
 * -(e G) gW^T (added to with accumulate_dx, else set). */
static void update_backward(Buffers *b, int64_t K, int64_t X, int64_t Y, const float *x, const float *G,
                            const float *e, const float *gW, const float *gb, float *de, float *dg, float *dx,
                            int accumulate_dx) {
    mm_nn(K, Y, X, x, gW, b->d_e, -1.0f, 0); /* d(e G) = -x gW' - gb' */
    for (int64_t r = 0; r < K; r++) {
        float *row = b->d_e + r * Y;
        for (int64_t j = 0; j < Y; j++) row[j] -= gb[j];
        de[r] += dot_of(row, G + r * Y, Y);
    }
    scale_rows(b->d_e, e, K, Y, dg);
    scale_rows(G, e, K, Y, b->ge);
    transpose_block(gW, X, Y, b->tr); /* gW'^T [Y, X] */
    mm_nn(K, X, Y, b->ge, b->tr, dx, -1.0f, accumulate_dx);
}

/* The backward of one mini-batch that started from state s: gs [S] holds the adjoint of the state
 * after it and becomes that of s; d_o = d out [K, D], sv what the forward kept; dq, dk, dt [K, D] and
 * d_eta [K, K] are set, dlnw, dlnb [D] added to. */
static void step_backward(const TTT *a, Buffers *b, const float *s, float *gs, const float *q, const float *k,
                          const float *t, const float *eta, float *sv, const float *d_o, float *dq, float *dk,
                          float *dt, float *d_eta, float *dlnw, float *dlnb) {
    const int64_t K = a->K, D = a->D, E = a->E, R = E > D ? E : D; /* a scratch row's length */
    const float *w = a->lnw, *bl = a->lnb, eps = (float)a->eps, *e = eta + (K - 1) * K;
    const Saved kept = saved_parts(sv, K, D, E);
    float *de = d_eta + (K - 1) * K; /* eta's last row: the update's step sizes */
    float *dout = b->dzo;            /* d z, through the output's layer norm */
    memset(d_eta, 0, sizeof(float) * (size_t)(K * K));
    memcpy(dq, d_o, sizeof(float) * (size_t)(K * D)); /* the residual q */
    output_norm_backward(kept.z, d_o, w, eps, K, D, dout, dlnw, dlnb, b->row);
    transpose_block(k, K, D, b->tr);
    mm_nn(K, K, D, q, b->tr, b->p1, 1.0f, 0);
    read_weights(eta, b->p1, K, b->a1);
    if (E == 0) {
        const float *W = s, *zk = kept.z1;
        float *gW = gs, *gb = gs + D * D;
        ln_l2_grad(zk, t, w, bl, eps, K, D, b->g1, b->row);
        /* the update W' = W - k^T (e G), b' = b - sum e G */
        update_backward(b, K, D, D, k, b->g1, e, gW, gb, de, b->d_g1, dk, 0);
        /* z = q W + b - A G, A = eta * (q k^T + 1) */
        transpose_block(W, D, D, b->w1t);
        mm_nn(K, D, D, dout, b->w1t, dq, 1.0f, 1);
        mm_tn(D, D, K, q, dout, gW, 1.0f, 1);
        add_col_sums(gb, dout, NULL, K, D, 1.0f);
        transpose_block(b->g1, K, D, b->tr);
        mm_nn(K, K, D, dout, b->tr, b->d_a, -1.0f, 0);
        mm_tn(K, D, K, b->a1, dout, b->d_g1, -1.0f, 1);
        read_weights_backward(eta, b->p1, K, b->d_a, d_eta);
        mm_nn(K, D, K, b->d_a, k, dq, 1.0f, 1);
        mm_tn(K, D, K, b->d_a, q, dk, 1.0f, 1);
        /* G = LN-L2 grad(k W + b, t) */
        ln_l2_grad_backward(zk, t, w, bl, eps, K, D, b->d_g1, b->d_z1, dt, dlnw, dlnb, b->row, b->row + R,
                            b->row + 2 * R);
        mm_nn(K, D, D, b->d_z1, b->w1t, dk, 1.0f, 1);
        mm_tn(D, D, K, k, b->d_z1, gW, 1.0f, 1);
        add_col_sums(gb, b->d_z1, NULL, K, D, 1.0f);
        return;
    }
    const float *W1 = s, *W2 = W1 + D * E + E;
    float *gW1 = gs, *gb1 = gW1 + D * E, *gW2 = gb1 + E, *gb2 = gW2 + E * D;
    const float *z1 = kept.z1, *z1q = kept.z1q, *h = kept.h, *z2 = kept.z2, *p2 = kept.p2;
    /* the forward's elementwise pieces again, from its products */
    gelu_rows(z1, K * E, b->x2, b->dg, b->ddg);
    gelu_rows(z1q, K * E, b->x2q, b->dgq, NULL);
    ln_l2_grad(z2, t, w, bl, eps, K, D, b->g2, b->row);
    for (int64_t i = 0; i < K * E; i++) b->g1[i] = h[i] * b->dg[i];
    read_weights(eta, p2, K, b->a2);
    transpose_block(W2, E, D, b->w2t); /* [D, E] */
    transpose_block(W1, D, E, b->w1t); /* [E, D] */
    /* the update: W1' = W1 - k^T (e G1), b1' = b1 - sum e G1, W2' = W2 - X2^T (e G2), b2' = b2 - sum e G2 */
    memset(dk, 0, sizeof(float) * (size_t)(K * D));
    update_backward(b, K, D, E, k, b->g1, e, gW1, gb1, de, b->d_g1, dk, 1);
    update_backward(b, K, E, D, b->x2, b->g2, e, gW2, gb2, de, b->d_g2, b->d_x2, 0);
    /* z = X2q W2 + b2 - A2 G2, A2 = eta * (X2q X2^T + 1) */
    mm_nn(K, E, D, dout, b->w2t, b->d_x2q, 1.0f, 0);
    mm_tn(E, D, K, b->x2q, dout, gW2, 1.0f, 1);
    add_col_sums(gb2, dout, NULL, K, D, 1.0f);
    transpose_block(b->g2, K, D, b->tr);
    mm_nn(K, K, D, dout, b->tr, b->d_a, -1.0f, 0);
    mm_tn(K, D, K, b->a2, dout, b->d_g2, -1.0f, 1);
    read_weights_backward(eta, p2, K, b->d_a, d_eta);
    mm_nn(K, E, K, b->d_a, b->x2, b->d_x2q, 1.0f, 1);
    mm_tn(K, E, K, b->d_a, b->x2q, b->d_x2, 1.0f, 1);
    /* X2q = gelu(Z1q), Z1q = q W1 + b1 - A1 G1, A1 = eta * (q k^T + 1) */
    for (int64_t i = 0; i < K * E; i++) b->d_x2q[i] *= b->dgq[i]; /* d Z1q */
    mm_nn(K, D, E, b->d_x2q, b->w1t, dq, 1.0f, 1);
    mm_tn(D, E, K, q, b->d_x2q, gW1, 1.0f, 1);
    add_col_sums(gb1, b->d_x2q, NULL, K, E, 1.0f);
    transpose_block(b->g1, K, E, b->tr);
    mm_nn(K, K, E, b->d_x2q, b->tr, b->d_a, -1.0f, 0);
    mm_tn(K, E, K, b->a1, b->d_x2q, b->d_g1, -1.0f, 1);
    read_weights_backward(eta, b->p1, K, b->d_a, d_eta);
    mm_nn(K, D, K, b->d_a, k, dq, 1.0f, 1);
    mm_tn(K, D, K, b->d_a, q, dk, 1.0f, 1);
    /* G1 = H * gelu'(Z1), H = G2 W2^T */
    for (int64_t i = 0; i < K * E; i++) {
        b->d_z1[i] = b->d_g1[i] * h[i] * b->ddg[i];
        b->d_g1[i] *= b->dg[i]; /* d H */
    }
    mm_nn(K, D, E, b->d_g1, W2, b->d_g2, 1.0f, 1);
    mm_tn(E, D, K, b->d_g1, b->g2, gW2, 1.0f, 1);
    /* G2 = LN-L2 grad(Z2, t), Z2 = X2 W2 + b2 */
    ln_l2_grad_backward(z2, t, w, bl, eps, K, D, b->d_g2, b->ge, dt, dlnw, dlnb, b->row, b->row + R,
                        b->row + 2 * R);
    mm_nn(K, E, D, b->ge, b->w2t, b->d_x2, 1.0f, 1);
    mm_tn(E, D, K, b->x2, b->ge, gW2, 1.0f, 1);
    add_col_sums(gb2, b->ge, NULL, K, D, 1.0f);
    /* X2 = gelu(Z1), Z1 = k W1 + b1 */
    for (int64_t i = 0; i < K * E; i++) b->d_z1[i] += b->d_x2[i] * b->dg[i];
    mm_nn(K, D, E, b->d_z1, b->w1t, dk, 1.0f, 1);
    mm_tn(D, E, K, k, b->d_z1, gW1, 1.0f, 1);
    add_col_sums(gb1, b->d_z1, NULL, K, E, 1.0f);
}

/* ---- the entries ------------------------------------------------------------------------------- */

/* mini-batch m's step sizes eta [K, K] (eta[i][j] = ts[i] lr[j] for keys j <= i, else 0) and targets
 * t = v - k [K, D] */
static void step_inputs(const TTT *a, Buffers *b, int64_t row) {
    const int64_t K = a->K, D = a->D;
    const float *lr = a->lr + row, *v = a->v + row * D, *k = a->k + row * D;
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < K; j++) b->eta[i * K + j] = j <= i ? a->ts[i] * lr[j] : 0.0f;
    for (int64_t i = 0; i < K * D; i++) b->t[i] = v[i] - k[i];
}

/* floats kept per mini-batch for the backward (saved_size) and in a state (state_size): what the caller
 * allocates (attentions/ops/ttt/cpu.py computes the same; the tests compare) */
int64_t ttt_saved_size(int64_t K, int64_t D, int64_t E) { return saved_size(K, D, E); }
int64_t ttt_state_size(int64_t D, int64_t E) { return state_size(D, E); }

/* group g's forward, mini-batch by mini-batch from its initial state (s [S] scratch) */
static void forward_group(const TTT *a, Buffers *b, float *s, int64_t g) {
    const int64_t M = a->M, K = a->K, D = a->D, S = state_size(D, a->E), X = saved_size(K, D, a->E);
    TTT local = *a;
    local.lnw = a->lnw + g * D;
    local.lnb = a->lnb + g * D;
    memcpy(s, a->w0 + g * S, sizeof(float) * (size_t)S);
    for (int64_t m = 0; m < M; m++) {
        const int64_t row = (g * M + m) * K;
        if (a->states) memcpy(a->states + (g * M + m) * S, s, sizeof(float) * (size_t)S);
        step_inputs(a, b, row);
        step_forward(&local, b, s, a->q + row * D, a->k + row * D, b->t, b->eta, a->out + row * D,
                     a->states ? a->saved + (g * M + m) * X : NULL);
    }
}

/* group g's backward, mini-batch by mini-batch from the last, carrying the state's adjoint (in dw0) */
static void backward_group(const TTT *a, Buffers *b, int64_t g) {
    const int64_t M = a->M, K = a->K, D = a->D, S = state_size(D, a->E), X = saved_size(K, D, a->E);
    float *gs = a->dw0 + g * S, *dts = a->dts + g * K;
    memset(gs, 0, sizeof(float) * (size_t)S);
    memset(dts, 0, sizeof(float) * (size_t)K);
    memset(a->dlnw + g * D, 0, sizeof(float) * (size_t)D);
    memset(a->dlnb + g * D, 0, sizeof(float) * (size_t)D);
    TTT local = *a;
    local.lnw = a->lnw + g * D;
    local.lnb = a->lnb + g * D;
    for (int64_t m = M - 1; m >= 0; m--) {
        const int64_t row = (g * M + m) * K;
        float *dk = a->dk + row * D, *dv = a->dv + row * D, *dlr = a->dlr + row;
        const float *lr = a->lr + row;
        step_inputs(a, b, row);
        step_backward(&local, b, a->states + (g * M + m) * S, gs, a->q + row * D, a->k + row * D, b->t, b->eta,
                      a->saved + (g * M + m) * X, a->dout + row * D, a->dq + row * D, dk, dv, b->d_eta,
                      a->dlnw + g * D, a->dlnb + g * D);
        /* t = v - k; eta[i][j] = ts[i] lr[j] (j <= i) */
        for (int64_t i = 0; i < K * D; i++) dk[i] -= dv[i];
        for (int64_t j = 0; j < K; j++) dlr[j] = 0.0f;
        for (int64_t i = 0; i < K; i++) {
            float acc = 0.0f;
            for (int64_t j = 0; j <= i; j++) {
                dlr[j] += b->d_eta[i * K + j] * a->ts[i];
                acc += b->d_eta[i * K + j] * lr[j];
            }
            dts[i] += acc;
        }
    }
}

/* threads for G groups: at least 1, at most one per group */
static int team_size(const TTT *a) { return (int)(a->threads < 1 ? 1 : (a->threads > a->G ? a->G : a->threads)); }

/* out = q + LN(z) (and, when states is set, the state each mini-batch starts from and what its backward
 * reads, in saved); 0, or -1 when a thread's buffers could not be allocated (its groups then not run).
 * Every thread meets the worksharing loop, one without buffers skipping its groups. */
int ttt_forward(const TTT *a) {
    int failed = 0;
#pragma omp parallel num_threads(team_size(a)) reduction(| : failed)
    {
        Buffers b;
        float *s = (float *)malloc(sizeof(float) * (size_t)state_size(a->D, a->E));
        const int ok = s != NULL && buffers_make(&b, a->K, a->D, a->E) == 0;
        failed |= !ok;
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < a->G; g++)
            if (ok) forward_group(a, &b, s, g);
        if (ok) free(b.z1);
        free(s);
    }
    return failed ? -1 : 0;
}

/* the gradients of q, k, v, lr, ts (per group), the initial state and lnw, lnb (per group) from d out
 * and what the forward kept; 0 or -1 as ttt_forward */
int ttt_backward(const TTT *a) {
    int failed = 0;
#pragma omp parallel num_threads(team_size(a)) reduction(| : failed)
    {
        Buffers b;
        const int ok = buffers_make(&b, a->K, a->D, a->E) == 0;
        failed |= !ok;
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < a->G; g++)
            if (ok) backward_group(a, &b, g);
        if (ok) free(b.z1);
    }
    return failed ? -1 : 0;
}
