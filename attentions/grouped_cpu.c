/* Grouped attention on the CPU: the kernel behind attentions/grouped_cpu.py (float32).
 *
 * Pairs (query, expert) come sorted by expert: expert x owns order[offsets[x] .. offsets[x+1]).
 * Expert x attends to S keys read by index, rows[x * S + s] of the [R, D] key and value tables
 * (rows NULL: row x * S + s), and, when M > 0, to the M shared keys of its group g = x / group,
 * all under one softmax of logits scale * q . k (masked keys -inf). Per pair the forward writes
 * out [D] and the log-sum-exp of the logits; a pair whose keys are all masked gets 0 and -inf.
 * With p = softmax(logits), the backward is
 *     d_logits = p * (d_out . v + offset),  offset = d_lse - d_out . out,
 *     dq = scale d_logits K,  dK = scale d_logits^T q,  dV = p^T d_out.
 *
 * An expert's keys and values are copied once into small buffers (transposed [D][n] for the
 * products across keys, row-major [n][D] for the products across the head dim), so the inner
 * loops run over contiguous floats and vectorise. Threads take runs of `unit` whole experts
 * chosen so that two threads never add into the same gradient row: the caller sets unit so that
 * experts of different units share no key rows and no shared table. No atomics; for a given
 * thread count the results are deterministic.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t experts, S, D, M, group, unit, threads;
    float scale;
    const float *q;          /* [P, D] */
    const int64_t *order;    /* [P] pairs sorted by expert */
    const int64_t *offsets;  /* [X + 1] */
    const float *keys;       /* [R, D] */
    const float *values;     /* [R, D] */
    const int64_t *rows;     /* [X, S] or NULL */
    const uint8_t *key_ok;   /* [X, S] or NULL */
    const float *skeys;      /* [G, M, D] or NULL */
    const float *svalues;    /* [G, M, D] or NULL */
    const uint8_t *sok;      /* [G, M] or NULL */
    float *out;              /* [P, D] forward */
    float *lse;              /* [P] forward; read by the backward */
    float *probs;            /* [P, M + S] softmax rows in sorted pair order, or NULL: recomputed */
    const float *dout;       /* [P, D] backward */
    const float *offset;     /* [P] backward */
    float *dq;               /* [P, D] backward, zeros for pairs with no expert */
    float *dkeys, *dvalues;  /* [R, D] backward, zero-filled by the caller */
    float *dskeys, *dsvalues;/* [G, M, D] backward, zero-filled by the caller */
} Grouped;

typedef struct {
    const Grouped *a;
    int64_t first, last; /* experts [first, last) */
    int backward;
} Work;

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

/* max and sum of x[0..n) in 8 lanes (a plain float reduction does not vectorise: it fixes the order) */
static inline float max_of(const float *x, int64_t n) {
    float lane[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lane[l] = x[j + l] > lane[l] ? x[j + l] : lane[l];
    float top = -INFINITY;
    for (; j < n; j++) top = x[j] > top ? x[j] : top;
    for (int l = 0; l < 8; l++) top = lane[l] > top ? lane[l] : top;
    return top;
}

static inline float sum_of(const float *x, int64_t n) {
    float lane[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lane[l] += x[j + l];
    float total = 0.0f;
    for (; j < n; j++) total += x[j];
    for (int l = 0; l < 8; l++) total += lane[l];
    return total;
}

static inline int64_t key_row(const Grouped *a, int64_t x, int64_t s) {
    return a->rows ? a->rows[x * a->S + s] : x * a->S + s;
}

/* Column block [first, first + count) of the expert buffers from table rows: transposed kt, vt
 * [D][n] (vt only in the backward) and row-major kr, vr [n][D]; bias 0 or -inf per key. */
static void load_keys(const Grouped *a, int64_t n, int64_t first, int64_t count, const float *keys,
                      const float *values, const int64_t *row_of, const uint8_t *ok, float *kt, float *vt,
                      float *kr, float *vr, float *bias) {
    const int64_t D = a->D;
    for (int64_t s = 0; s < count; s++) {
        const int64_t j = first + s;
        const float *k = keys + row_of[s] * D, *v = values + row_of[s] * D;
        memcpy(kr + j * D, k, D * sizeof(float));
        memcpy(vr + j * D, v, D * sizeof(float));
        for (int64_t d = 0; d < D; d++) {
            kt[d * n + j] = k[d];
            if (vt) vt[d * n + j] = v[d];
        }
        bias[j] = (ok && !ok[s]) ? -INFINITY : 0.0f;
    }
}

/* The buffers of expert x: its group's shared keys (when the group changed) and its own keys. */
static void load_expert(const Grouped *a, int64_t x, int64_t *group_loaded, int64_t *row_of, float *kt,
                        float *vt, float *kr, float *vr, float *bias) {
    const int64_t S = a->S, M = a->M, n = M + S;
    const int64_t g = x / a->group;
    if (M > 0 && g != *group_loaded) {
        for (int64_t j = 0; j < M; j++) row_of[j] = g * M + j;
        load_keys(a, n, 0, M, a->skeys, a->svalues, row_of, a->sok ? a->sok + g * M : NULL, kt, vt, kr, vr, bias);
        *group_loaded = g;
    }
    for (int64_t s = 0; s < S; s++) row_of[s] = key_row(a, x, s);
    load_keys(a, n, M, S, a->keys, a->values, row_of, a->key_ok ? a->key_ok + x * S : NULL, kt, vt, kr, vr, bias);
}

/* Register blocks: BLOCK floats (4 AVX2 vectors) accumulate in registers across the inner loop. */
#define BLOCK 32

/* res[j] = init[j] + sum_d x[d] * t[d * n + j] for j < n: x [D] against the columns of t [D][n] */
static void dots(const float *x, const float *t, const float *init, int64_t n, int64_t D, float *res) {
    int64_t j0 = 0;
    for (; j0 + BLOCK <= n; j0 += BLOCK) {
        float acc[BLOCK];
        for (int l = 0; l < BLOCK; l++) acc[l] = init[j0 + l];
        for (int64_t d = 0; d < D; d++) {
            const float xd = x[d];
            const float *row = t + d * n + j0;
            for (int l = 0; l < BLOCK; l++) acc[l] += xd * row[l];
        }
        for (int l = 0; l < BLOCK; l++) res[j0 + l] = acc[l];
    }
    for (int64_t j = j0; j < n; j++) res[j] = init[j];
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = j0; j < n; j++) res[j] += x[d] * t[d * n + j];
}

/* res[d] = sum_j w[j] * r[j * D + d] for d < D: the rows of r [n][D] mixed by the weights w [n] */
static void mix(const float *w, const float *r, int64_t n, int64_t D, float *res) {
    int64_t d0 = 0;
    for (; d0 + BLOCK <= D; d0 += BLOCK) {
        float acc[BLOCK] = {0};
        for (int64_t j = 0; j < n; j++) {
            const float wj = w[j];
            const float *row = r + j * D + d0;
            for (int l = 0; l < BLOCK; l++) acc[l] += wj * row[l];
        }
        for (int l = 0; l < BLOCK; l++) res[d0 + l] = acc[l];
    }
    for (int64_t d = d0; d < D; d++) res[d] = 0.0f;
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = d0; d < D; d++) res[d] += w[j] * r[j * D + d];
}

/* g[j * D + d] += sum_c w[c * n + j] * x[c * D + d]: the rank-C update w^T x of a [n][D] gradient */
static void add_outer(const float *w, const float *x, int64_t rows, int64_t n, int64_t D, float *g) {
    for (int64_t j = 0; j < n; j++) {
        int64_t d0 = 0;
        for (; d0 + BLOCK <= D; d0 += BLOCK) {
            float acc[BLOCK];
            for (int l = 0; l < BLOCK; l++) acc[l] = g[j * D + d0 + l];
            for (int64_t c = 0; c < rows; c++) {
                const float wc = w[c * n + j];
                const float *row = x + c * D + d0;
                for (int l = 0; l < BLOCK; l++) acc[l] += wc * row[l];
            }
            for (int l = 0; l < BLOCK; l++) g[j * D + d0 + l] = acc[l];
        }
        for (int64_t c = 0; c < rows; c++)
            for (int64_t d = d0; d < D; d++) g[j * D + d] += w[c * n + j] * x[c * D + d];
    }
}

/* Pair i: out [D] and lse; its softmax row into saved [n] when the caller keeps them (else NULL). */
static void forward_pair(const Grouped *a, int64_t i, int64_t n, const float *kt, const float *vr,
                         const float *bias, float *qs, float *logits, float *saved) {
    const int64_t D = a->D;
    float *out = a->out + i * D;
    for (int64_t d = 0; d < D; d++) qs[d] = a->q[i * D + d] * a->scale;
    dots(qs, kt, bias, n, D, logits);
    const float top = max_of(logits, n);
    if (top == -INFINITY) {
        memset(out, 0, D * sizeof(float));
        a->lse[i] = -INFINITY;
        if (saved) memset(saved, 0, n * sizeof(float));
        return;
    }
    for (int64_t j = 0; j < n; j++) logits[j] = exp_nonpos(logits[j] - top);
    const float total = sum_of(logits, n);
    mix(logits, vr, n, D, out);
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
    a->lse[i] = top + logf(total);
    if (saved)
        for (int64_t j = 0; j < n; j++) saved[j] = logits[j] * inv;
}

/* Up to CHUNK pairs of one expert at a time in the backward: their softmax rows p, d_logits and
 * scaled queries and output gradients stay in the L1/L2 cache for the expert's rank-C updates */
#define CHUNK 32

/* One pair's row c of the chunk: p and d_logits [n], scaled q and d_out [D]; dq written. A pair
 * whose keys are all masked (lse -inf) gets zero rows and dq 0. */
static void backward_pair(const Grouped *a, int64_t i, int64_t n, const float *kt, const float *vt,
                          const float *kr, const float *bias, const float *zeros, const float *saved, float *p,
                          float *ds, float *qs, float *dout) {
    const int64_t D = a->D;
    float *dq = a->dq + i * D;
    const float lse = a->lse[i];
    if (lse == -INFINITY) {
        memset(dq, 0, D * sizeof(float));
        memset(p, 0, n * sizeof(float));
        memset(ds, 0, n * sizeof(float));
        return;
    }
    for (int64_t d = 0; d < D; d++) qs[d] = a->q[i * D + d] * a->scale;
    memcpy(dout, a->dout + i * D, D * sizeof(float));
    if (saved) {
        memcpy(p, saved, n * sizeof(float));
    } else {
        /* the softmax row again from the logits and the saved log-sum-exp */
        dots(qs, kt, bias, n, D, p);
        for (int64_t j = 0; j < n; j++) p[j] = exp_nonpos(p[j] - lse);
    }
    /* d_logits = p (d_out . v + offset) */
    dots(dout, vt, zeros, n, D, ds);
    const float offset = a->offset[i];
    for (int64_t j = 0; j < n; j++) ds[j] = p[j] * (ds[j] + offset);
    mix(ds, kr, n, D, dq);
    for (int64_t d = 0; d < D; d++) dq[d] *= a->scale;
}

/* The expert's accumulated key and value gradients added into the tables they came from. */
static void store_gradients(const Grouped *a, int64_t x, const int64_t *row_of, const float *dk, const float *dv) {
    const int64_t S = a->S, M = a->M, D = a->D;
    for (int64_t j = 0; j < M + S; j++) {
        float *gk, *gv;
        if (j < M) {
            const int64_t r = (x / a->group) * M + j;
            gk = a->dskeys + r * D;
            gv = a->dsvalues + r * D;
        } else {
            const int64_t r = row_of[j - M];
            gk = a->dkeys + r * D;
            gv = a->dvalues + r * D;
        }
        for (int64_t d = 0; d < D; d++) {
            gk[d] += dk[j * D + d];
            gv[d] += dv[j * D + d];
        }
    }
}

static void *run_work(void *arg) {
    const Work *w = (const Work *)arg;
    const Grouped *a = w->a;
    const int64_t S = a->S, M = a->M, D = a->D, n = M + S;
    /* kt, vt, kr, vr, dk, dv [n * D]; bias, zeros [n]; p, ds [CHUNK * n]; qs, dout [CHUNK * D]; row_of */
    const int64_t floats = 6 * n * D + 2 * n + 2 * CHUNK * n + 2 * CHUNK * D;
    float *buf = (float *)calloc(1, sizeof(float) * floats + sizeof(int64_t) * (S + M + 1));
    if (!buf) return (void *)1;
    float *kt = buf, *vt = kt + n * D, *kr = vt + n * D, *vr = kr + n * D, *dk = vr + n * D, *dv = dk + n * D;
    float *bias = dv + n * D, *zeros = bias + n, *p = zeros + n, *ds = p + CHUNK * n;
    float *qs = ds + CHUNK * n, *dout = qs + CHUNK * D;
    int64_t *row_of = (int64_t *)(dout + CHUNK * D);
    int64_t group_loaded = -1;
    for (int64_t x = w->first; x < w->last; x++) {
        const int64_t begin = a->offsets[x], end = a->offsets[x + 1];
        if (begin == end) continue;
        load_expert(a, x, &group_loaded, row_of, kt, w->backward ? vt : NULL, kr, vr, bias);
        if (!w->backward) {
            for (int64_t t = begin; t < end; t++)
                forward_pair(a, a->order[t], n, kt, vr, bias, qs, p, a->probs ? a->probs + t * n : NULL);
            continue;
        }
        memset(dk, 0, sizeof(float) * n * D);
        memset(dv, 0, sizeof(float) * n * D);
        for (int64_t t0 = begin; t0 < end; t0 += CHUNK) {
            const int64_t rows = end - t0 < CHUNK ? end - t0 : CHUNK;
            for (int64_t c = 0; c < rows; c++)
                backward_pair(a, a->order[t0 + c], n, kt, vt, kr, bias, zeros,
                              a->probs ? a->probs + (t0 + c) * n : NULL, p + c * n, ds + c * n, qs + c * D,
                              dout + c * D);
            /* dK += d_logits^T (scale q), dV += p^T d_out over the chunk's pairs */
            add_outer(ds, qs, rows, n, D, dk);
            add_outer(p, dout, rows, n, D, dv);
        }
        /* load_expert left the routed keys' rows in row_of */
        store_gradients(a, x, row_of, dk, dv);
    }
    free(buf);
    return NULL;
}

/* Runs of whole units (unit experts each) per thread, balanced by their pairs; returns 0 on success. */
static int run(const Grouped *a, int backward) {
    const int64_t X = a->experts, unit = a->unit > 0 ? a->unit : 1;
    const int64_t units = (X + unit - 1) / unit;
    int64_t threads = a->threads < 1 ? 1 : a->threads;
    if (threads > units) threads = units;
    if (threads > 64) threads = 64;
    Work work[64];
    const int64_t total = a->offsets[X] - a->offsets[0];
    int64_t u = 0;
    for (int64_t t = 0; t < threads; t++) {
        const int64_t start = u;
        /* this thread's share ends where the pairs so far reach (t + 1) / threads of the total */
        const int64_t goal = a->offsets[0] + total * (t + 1) / threads;
        while (u < units && (t == threads - 1 || a->offsets[(u + 1) * unit < X ? (u + 1) * unit : X] <= goal)) u++;
        if (u == start && u < units) u++;
        work[t].a = a;
        work[t].first = start * unit < X ? start * unit : X;
        work[t].last = u * unit < X ? u * unit : X;
        work[t].backward = backward;
    }
    int failed = 0;
    /* one share per thread of OpenMP: the libgomp that torch has loaded, so its warm threads and no
     * second pool spinning against them; one thread when built without -fopenmp */
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(| : failed)
    for (int64_t t = 0; t < threads; t++) failed |= run_work(&work[t]) != NULL;
    return failed;
}

int grouped_forward(const Grouped *a) { return run(a, 0); }

int grouped_backward(const Grouped *a) { return run(a, 1); }
