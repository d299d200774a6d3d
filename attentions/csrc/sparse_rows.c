/* Products with k table rows chosen per query, on the CPU: the kernels behind attentions/ops/row_products/cpu.py
 * (float32). Query r of R picks k rows of a table [G * N, D]: row (r / per_group) * N + idx[r, j]
 * (its group's block of N rows, e.g. the keys of its (batch, head)).
 *
 *   mix_rows      out[r]      = sum_j w[r, j] table[row(r, j)]          ([R, k] weights -> [R, D])
 *   dot_rows      res[r, j]   = x[r] . table[row(r, j)]                 ([R, D] -> [R, k])
 *   scatter_outer grad[row(r, j)] += w[r, j] x[r]                        (into a [G * N, D] gradient)
 *
 * Top-k attention uses them for its output, d_weights, dq, dk and dv, in place of dense [R, N]
 * rows that are mostly zeros. mix and dot split the queries over threads; scatter splits whole
 * groups, so no two threads add into one row (no atomics; deterministic for a thread count).
 */
#include <stdint.h>
#include <string.h>

#include "blocks.h"

enum { MIX, DOT, SCATTER };

typedef struct {
    int op;
    const float *w;      /* [R, k] weights (mix, scatter) */
    const int64_t *idx;  /* [R, k] */
    const float *x;      /* [R, D] (dot, scatter) */
    const float *table;  /* [G * N, D] (mix, dot) */
    float *out;          /* mix: [R, D]; dot: [R, k]; scatter: [G * N, D] */
    int64_t k, D, per_group, group_rows;
    int64_t first, last; /* this thread's queries */
} Job;

/* res [k] = x . row_j */
static void dot_one(const float *x, const int64_t *idx, const float *table, int64_t base, int64_t k, int64_t D,
                    float *res) {
    for (int64_t j = 0; j < k; j++) {
        const float *row = table + (base + idx[j]) * D;
        vf acc = splatv(0.0f);
        int64_t d = 0;
        for (; d + VW <= D; d += VW) acc += loadv(x + d) * loadv(row + d);
        float total = sumv(acc);
        for (; d < D; d++) total += x[d] * row[d];
        res[j] = total;
    }
}

/* row_j += w[j] x for the k picked rows */
static void scatter_one(const float *w, const int64_t *idx, const float *x, int64_t base, int64_t k, int64_t D,
                        float *grad) {
    for (int64_t j = 0; j < k; j++) {
        const vf wj = splatv(w[j]);
        float *row = grad + (base + idx[j]) * D;
        int64_t d = 0;
        for (; d + VW <= D; d += VW) storev(row + d, loadv(row + d) + wj * loadv(x + d));
        for (; d < D; d++) row[d] += w[j] * x[d];
    }
}

static void *run_job(void *arg) {
    const Job *a = (const Job *)arg;
    const int64_t k = a->k, D = a->D;
    for (int64_t r = a->first; r < a->last; r++) {
        const int64_t base = (r / a->per_group) * a->group_rows;
        if (a->op == MIX) mix_picked(a->w + r * k, a->idx + r * k, a->table, base, k, D, a->out + r * D);
        else if (a->op == DOT) dot_one(a->x + r * D, a->idx + r * k, a->table, base, k, D, a->out + r * k);
        else scatter_one(a->w + r * k, a->idx + r * k, a->x + r * D, base, k, D, a->out);
    }
    return NULL;
}

static int run(Job job, int64_t rows, int64_t threads) {
    /* scatter: whole groups per thread; the others: any split of the queries */
    const int64_t unit = job.op == SCATTER ? job.per_group : 1;
    const int64_t units = unit > 0 ? (rows + unit - 1) / unit : 0;
    if (threads > units) threads = units;
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    Job jobs[64];
    for (int64_t t = 0; t < threads; t++) {
        jobs[t] = job;
        jobs[t].first = units * t / threads * unit;
        jobs[t].last = units * (t + 1) / threads * unit;
        jobs[t].last = jobs[t].last < rows ? jobs[t].last : rows;
    }
    /* one share per thread of OpenMP: the libgomp that torch has loaded, so its warm threads and no
     * second pool spinning against them; one thread when built without -fopenmp */
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++) run_job(&jobs[t]);
    return 0;
}

int mix_rows(const float *w, const int64_t *idx, const float *table, int64_t rows, int64_t k, int64_t D,
             int64_t per_group, int64_t group_rows, float *out, int64_t threads) {
    Job job = {MIX, w, idx, NULL, table, out, k, D, per_group, group_rows, 0, 0};
    return run(job, rows, threads);
}

int dot_rows(const float *x, const int64_t *idx, const float *table, int64_t rows, int64_t k, int64_t D,
             int64_t per_group, int64_t group_rows, float *out, int64_t threads) {
    Job job = {DOT, NULL, idx, x, table, out, k, D, per_group, group_rows, 0, 0};
    return run(job, rows, threads);
}

int scatter_outer(const float *w, const int64_t *idx, const float *x, int64_t rows, int64_t k, int64_t D,
                  int64_t per_group, int64_t group_rows, float *grad, int64_t threads) {
    Job job = {SCATTER, w, idx, x, NULL, grad, k, D, per_group, group_rows, 0, 0};
    return run(job, rows, threads);
}
