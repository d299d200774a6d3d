/* MiTA's landmark pass and routing on the CPU: the kernels behind attentions/ops/landmark/cpu.py (float32).
 *
 * Per head g (G = B H heads, each with m landmarks and N keys of D dims):
 *     S = L K^T [m, N]  (L: the landmarks, pre-scaled by 1 / sqrt(D)), -inf at masked keys,
 *     P = softmax(S) over the keys,  shared values V_s = P V [m, D],  lse = log sum_j e^S [m].
 * S is written out (the top-k selection of the routed experts reads it) and kept for the backward,
 * which recomputes P from S and lse and, with the gradient dV_s,
 *     dS = P * (dV_s V^T - delta),  delta_i = dV_s[i] . V_s[i],
 *     dL = dS K,  dK = dS^T L,  dV = P^T dV_s.
 * One pass over the keys in blocks of BLOCK, forward and backward: a block's keys (transposed) and
 * values stay in the L1 cache while every landmark uses them, and no [m, N] temporary beyond S is
 * made (the PyTorch path makes four: scores, mask, softmax, its gradient). The forward's softmax is
 * online (a running max per landmark, its shared values rescaled when the max grows), so S is
 * written once and not read back until the top-k selection. A landmark whose keys are all masked
 * gets lse -inf, shared values 0 and zero gradients.
 *
 * route_best: each query's best landmark, argmax_j q . L_j + bias_j (bias 0 or -inf for a missing
 * landmark; the first of equal values, as torch.argmax), -1 when every landmark is missing (and,
 * given key_ok, for the padded queries of a run of 2 VW that holds no real one: route_order drops
 * every padded query's route).
 * route_order: route_best and the grouping of the queries by it in one call (a counting sort).
 *
 * Threads take whole heads: no two write the same row, no atomics, the same bits for any thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

#define BLOCK 64

typedef struct {
    int64_t G, m, N, D, heads, threads; /* heads: heads per mask row (the mask is [G / heads, N]) */
    int64_t accumulate;                 /* backward: 0 writes dmarks, dkeys, dvalues; 1 adds to them */
    const float *marks;                 /* [G, m, D] pre-scaled landmarks */
    const float *keys, *values;         /* [G, N, D] */
    const uint8_t *key_ok;              /* [G / heads, N] or NULL: every key real */
    float *scores;                      /* [G, m, N] forward; read by the backward */
    float *lse;                         /* [G, m] forward; read by the backward */
    float *shared;                      /* [G, m, D] forward; read by the backward */
    const float *dshared;               /* [G, m, D] backward */
    float *dmarks, *dkeys, *dvalues;    /* [G, m, D], [G, N, D] x 2 backward, whole (see accumulate) */
} Landmarks;

/* 0 for a real key, -inf for a masked one, over keys [j0, j0 + nb). */
static void key_bias(const uint8_t *ok, int64_t j0, int64_t nb, float *bias) {
    for (int64_t j = 0; j < nb; j++) bias[j] = (ok && !ok[j0 + j]) ? -INFINITY : 0.0f;
}

/* Whether keys [j0, j0 + nb) are all masked. The pass skips such a block: its probabilities are 0,
 * so it adds nothing to a landmark's max, total, shared values or gradients, and its scores are
 * -inf whatever the dots (the same bits as running it, for finite keys and values). A padded
 * row's tail is such blocks: a quarter of the keys in rows of N/2..N real tokens. */
static int masked_block(const uint8_t *ok, int64_t j0, int64_t nb) {
    if (!ok) return 0;
    for (int64_t j = 0; j < nb; j++)
        if (ok[j0 + j]) return 0;
    return 1;
}

/* p[j] = e^(s[j] - shift) for j < nb; 0 everywhere when shift is -inf (every key masked). */
static void exps(const float *s, int64_t nb, float shift, float *p) {
    if (shift == -INFINITY) {
        memset(p, 0, nb * sizeof(float));
        return;
    }
    for (int64_t j = 0; j < nb; j++) p[j] = exp_nonpos(s[j] - shift);
}

/* Head g forward; buf: D BLOCK + m BLOCK + 2 m floats. */
static void forward_head(const Landmarks *a, int64_t g, float *buf) {
    const int64_t m = a->m, N = a->N, D = a->D;
    const float *L = a->marks + g * m * D, *K = a->keys + g * N * D, *V = a->values + g * N * D;
    const uint8_t *ok = a->key_ok ? a->key_ok + (g / a->heads) * N : NULL;
    float *S = a->scores + g * m * N, *lse = a->lse + g * m, *out = a->shared + g * m * D;
    /* p [m][BLOCK]: the block's key bias (0 or -inf) while the scores are made, then every landmark's exps */
    float *kt = buf, *p = kt + D * BLOCK, *top = p + m * BLOCK, *total = top + m;
    /* one pass over the keys, a block at a time, with an online softmax: each landmark's running
     * max (the softmax's shift) and its exps' total, its shared values rescaled when the max grows.
     * Per block three phases, each with one [BLOCK][D] block in L1: the scores of every landmark
     * against the transposed keys, written to S; their exps, while the block's scores are still in
     * cache (S is read back by the top-k selection and the backward, not by this pass); the values
     * mixed by them */
    for (int64_t i = 0; i < m; i++) top[i] = -INFINITY, total[i] = 0.0f;
    memset(out, 0, m * D * sizeof(float));
    for (int64_t j0 = 0; j0 < N; j0 += BLOCK) {
        const int64_t nb = N - j0 < BLOCK ? N - j0 : BLOCK;
        if (masked_block(ok, j0, nb)) {
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = 0; j < nb; j++) S[r * N + j0 + j] = -INFINITY;
            continue;
        }
        transpose_block(K + j0 * D, nb, D, kt);
        key_bias(ok, j0, nb, p);
        dots_of_rows(L, m, kt, p, nb, D, S + j0, N);
        for (int64_t r = 0; r < m; r++) {
            const float most = max_of(S + r * N + j0, nb);
            if (most > top[r]) {
                /* e^(old - new): 0 while every key so far was masked (top -inf, out and total 0) */
                const float shrink = top[r] == -INFINITY ? 0.0f : exp_nonpos(top[r] - most);
                for (int64_t d = 0; d < D; d++) out[r * D + d] *= shrink;
                total[r] *= shrink;
                top[r] = most;
            }
            exps(S + r * N + j0, nb, top[r], p + r * nb);
            total[r] += sum_of(p + r * nb, nb);
        }
        mix_weighted(p, m, V + j0 * D, NULL, nb, D, out, NULL, 1);
    }
    for (int64_t r = 0; r < m; r++) {
        const float inv = top[r] == -INFINITY ? 0.0f : 1.0f / total[r];
        for (int64_t d = 0; d < D; d++) out[r * D + d] *= inv;
        lse[r] = top[r] == -INFINITY ? top[r] : top[r] + logf(total[r]);
    }
}

/* Head g backward; buf: D BLOCK + 2 m BLOCK + m + BLOCK floats. */
static void backward_head(const Landmarks *a, int64_t g, float *buf) {
    const int64_t m = a->m, N = a->N, D = a->D;
    const float *L = a->marks + g * m * D, *K = a->keys + g * N * D, *V = a->values + g * N * D;
    const float *S = a->scores + g * m * N, *lse = a->lse + g * m, *out = a->shared + g * m * D;
    const float *dout = a->dshared + g * m * D;
    const uint8_t *ok = a->key_ok ? a->key_ok + (g / a->heads) * N : NULL;
    float *dL = a->dmarks + g * m * D, *dK = a->dkeys + g * N * D, *dV = a->dvalues + g * N * D;
    float *vt = buf, *p = vt + D * BLOCK, *ds = p + m * BLOCK, *delta = ds + m * BLOCK, *zeros = delta + m;
    memset(zeros, 0, BLOCK * sizeof(float));
    for (int64_t i = 0; i < m; i++) {
        float t = 0.0f;
        for (int64_t d = 0; d < D; d++) t += dout[i * D + d] * out[i * D + d];
        delta[i] = t;
    }
    if (!a->accumulate) memset(dL, 0, m * D * sizeof(float));
    for (int64_t j0 = 0; j0 < N; j0 += BLOCK) {
        const int64_t nb = N - j0 < BLOCK ? N - j0 : BLOCK;
        if (masked_block(ok, j0, nb)) {
            if (!a->accumulate) {
                memset(dK + j0 * D, 0, nb * D * sizeof(float));
                memset(dV + j0 * D, 0, nb * D * sizeof(float));
            }
            continue;
        }
        /* the next block's scores, fetched while this one's products run: m pieces of nb floats
         * N apart, more streams than the hardware prefetchers follow, so the exps below would wait
         * on each (at N = 64K, where S is 16 MB a head, half of this pass's own time) */
        const int64_t next = j0 + BLOCK, nn = N - next < BLOCK ? N - next : BLOCK;
        for (int64_t r = 0; r < m && nn > 0; r++)
            for (int64_t j = 0; j < nn; j += 16) __builtin_prefetch(S + r * N + next + j);
        transpose_block(V + j0 * D, nb, D, vt);
        /* d_scores = p (dV_s . v - delta), the exps again from S and lse */
        dots_of_rows(dout, m, vt, zeros, nb, D, ds, nb);
        for (int64_t r = 0; r < m; r++) {
            float *pr = p + r * nb, *dr = ds + r * nb;
            exps(S + r * N + j0, nb, lse[r], pr);
            for (int64_t j = 0; j < nb; j++) dr[j] = pr[j] * (dr[j] - delta[r]);
        }
        mix_weighted(ds, m, K + j0 * D, NULL, nb, D, dL, NULL, 1);
        /* the block's key and value gradients: rank-m updates, written once (or added) */
        if (!a->accumulate) {
            memset(dK + j0 * D, 0, nb * D * sizeof(float));
            memset(dV + j0 * D, 0, nb * D * sizeof(float));
        }
        add_outer(ds, nb, L, m, nb, D, dK + j0 * D, NULL);
        add_outer(p, nb, dout, m, nb, D, dV + j0 * D, NULL);
    }
}

/* Landmarks j .. j + K - 1 (bias_j + L_j . q against 2 VW queries in the lanes of qt, blocks.h's
 * lane_scores) against each query's best score so far (top) and its landmark (which), in landmark
 * order: only a strictly greater score replaces the best. Inlined with a constant K. */
__attribute__((always_inline)) static inline void route_landmarks(int K, int64_t j, const float *L, const float *bias,
                                                                  const float *qt, int64_t D, vf top[2], vfi which[2]) {
    const vfi zero = {0};
    vf acc[6][2];
    lane_scores(K, j, L, bias, qt, D, acc);
    for (int i = 0; i < K; i++)
        for (int h = 0; h < 2; h++) {
            const vfi more = acc[i][h] > top[h];
            top[h] = pickv(more, acc[i][h], top[h]);
            which[h] = picki(more, zero + (int32_t)(j + i), which[h]);
        }
}

/* Each query's best landmark for head g, 2 VW queries at a time in the vector lanes: their rows
 * transposed (qt [D][2 VW]; a short last run repeats its last row), each landmark's scores of all of
 * them in two vectors, and the best score and its landmark kept lane by lane. Only a strictly greater
 * score replaces the best, so the first of equal scores stays (torch.argmax's choice) and a missing
 * landmark (bias -inf) never enters: a head with none leaves -1. No per-query max and scan: those
 * (a horizontal max, then a search for it) cost as much as the scores. Each score is bias_j + the
 * sum over d in order, as one row of dots2 would make it. Six landmarks at a time (then four, then
 * one): 12 independent FMA chains, as in blocks.h's six-row forms (route_order 14% faster than eight
 * landmarks against VW queries on the AMD EPYC at N = 1K). buf: 2 D VW + m floats. */
static void route_head(const Landmarks *a, const float *q, const uint8_t *mark_ok, int64_t g, int64_t *best,
                       float *buf) {
    const int64_t m = a->m, N = a->N, D = a->D;
    const float *Q = q + g * N * D, *L = a->marks + g * m * D;
    float *qt = buf, *bias = qt + 2 * D * VW;
    key_bias(mark_ok ? mark_ok + g * m : NULL, 0, m, bias);
    const vfi zero = {0};
    const uint8_t *ok = a->key_ok ? a->key_ok + (g / a->heads) * N : NULL;
    for (int64_t t0 = 0; t0 < N; t0 += 2 * VW) {
        const int64_t count = N - t0 < 2 * VW ? N - t0 : 2 * VW;
        if (masked_block(ok, t0, count)) {
            for (int64_t l = 0; l < count; l++) best[g * N + t0 + l] = -1;
            continue;
        }
        rows_into_lanes(Q, t0, N, D, qt);
        vf top[2] = {splatv(-INFINITY), splatv(-INFINITY)};
        vfi which[2] = {zero - 1, zero - 1};
        int64_t j = 0;
        for (; j + 6 <= m; j += 6) route_landmarks(6, j, L, bias, qt, D, top, which);
        for (; j + 4 <= m; j += 4) route_landmarks(4, j, L, bias, qt, D, top, which);
        for (; j < m; j++) route_landmarks(1, j, L, bias, qt, D, top, which);
        for (int64_t l = 0; l < count; l++) best[g * N + t0 + l] = which[l / VW][l % VW];
    }
}

/* What one head does, with its thread's buffer. */
typedef struct {
    const Landmarks *a;
    int kind; /* 0 forward, 1 backward, 2 routing */
    const float *q;
    const uint8_t *mark_ok;
    int64_t *best;
} Job;

static void run_head(const Job *job, int64_t g, float *buf) {
    if (job->kind == 0) forward_head(job->a, g, buf);
    else if (job->kind == 1) backward_head(job->a, g, buf);
    else route_head(job->a, job->q, job->mark_ok, g, job->best, buf);
}

/* The order [G] in which the threads take the heads (blocks.h's largest_first), by their real tokens
 * (key_ok): a head's work in every pass here and in the grouped attention grows with them (the
 * masked key blocks skipped, padded queries in no expert). NULL when out of memory. */
static int64_t *heads_by_size(const Landmarks *a) {
    const int64_t G = a->G, N = a->N, heads = a->heads < 1 ? 1 : a->heads;
    int64_t *real = (int64_t *)malloc(sizeof(int64_t) * (G + 1));
    if (!real) return NULL;
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *ok = a->key_ok ? a->key_ok + (g / heads) * N : NULL;
        real[g] = N;
        if (ok && g % heads == 0) {
            real[g] = 0;
            for (int64_t t = 0; t < N; t++) real[g] += ok[t] != 0;
        } else if (ok) {
            real[g] = real[g - 1]; /* the same mask row as the head before */
        }
    }
    int64_t *order = largest_first(real, G);
    free(real);
    return order;
}

/* The job over every head, whole heads per thread (heads_by_size), each thread with a buffer of
 * `floats`; 0 on success. */
static int over_heads(const Job *job, int64_t floats) {
    const Landmarks *a = job->a;
    const int64_t threads = a->threads < 1 ? 1 : (a->threads > a->G ? a->G : a->threads);
    int64_t *order = heads_by_size(a);
    if (!order) return 1;
    int failed = 0;
    /* the OpenMP runtime torch has loaded (see attentions/ops/native.py); one thread without -fopenmp */
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = (float *)malloc(sizeof(float) * floats);
        failed |= buf == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < a->G; i++)
            if (buf) run_head(job, order[i], buf);
        free(buf);
    }
    free(order);
    return failed;
}

int landmark_forward(const Landmarks *a) {
    const Job job = {a, 0, NULL, NULL, NULL};
    return over_heads(&job, a->D * BLOCK + a->m * BLOCK + 2 * a->m);
}

int landmark_backward(const Landmarks *a) {
    const Job job = {a, 1, NULL, NULL, NULL};
    return over_heads(&job, a->D * BLOCK + 2 * a->m * BLOCK + a->m + BLOCK);
}

/* q [G, N, D]; a->marks unscaled; mark_ok [G, m] or NULL; best [G, N] */
int route_best(const Landmarks *a, const float *q, const uint8_t *mark_ok, int64_t *best) {
    const Job job = {a, 2, q, mark_ok, best};
    return over_heads(&job, 2 * a->D * VW + a->m);
}

/* Step 1, the landmarks: bin means of each head's queries. x [G, N, D]; bins [G / heads, m] of
 * [start, end) (end > start for a real bin; end == start: a missing bin, mean 0); out [G, m, D].
 * The backward (backward != 0) spreads dout [G, m, D] back over the bins into dx [G, N, D],
 * written whole (accumulate == 0) or added to it (1): a token in two overlapping bins gets both
 * shares. */
typedef struct {
    int64_t G, m, N, D, heads, threads, backward, accumulate;
    const int64_t *starts, *ends;
    const float *x, *dout;
    float *out, *dx;
} Pool;

static void pool_head(const Pool *a, int64_t g) {
    const int64_t m = a->m, N = a->N, D = a->D;
    const int64_t *starts = a->starts + (g / a->heads) * m, *ends = a->ends + (g / a->heads) * m;
    if (a->backward) {
        float *dx = a->dx + g * N * D;
        if (!a->accumulate) memset(dx, 0, N * D * sizeof(float));
        for (int64_t j = 0; j < m; j++) {
            if (ends[j] <= starts[j]) continue;
            const float *g_row = a->dout + (g * m + j) * D;
            const float inv = 1.0f / (float)(ends[j] - starts[j]);
            for (int64_t t = starts[j]; t < ends[j]; t++)
                for (int64_t d = 0; d < D; d++) dx[t * D + d] += g_row[d] * inv;
        }
        return;
    }
    const float *x = a->x + g * N * D;
    for (int64_t j = 0; j < m; j++) {
        float *row = a->out + (g * m + j) * D;
        memset(row, 0, D * sizeof(float));
        if (ends[j] <= starts[j]) continue;
        for (int64_t t = starts[j]; t < ends[j]; t++)
            for (int64_t d = 0; d < D; d++) row[d] += x[t * D + d];
        const float inv = 1.0f / (float)(ends[j] - starts[j]);
        for (int64_t d = 0; d < D; d++) row[d] *= inv;
    }
}

int pool_bins(const Pool *a) {
    const int64_t threads = a->threads < 1 ? 1 : (a->threads > a->G ? a->G : a->threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < a->G; g++) pool_head(a, g);
    return 0;
}

/* Head g's routes in best [G N] counted by slot into counts [m + 1] (slot m: no expert), a padded
 * query's route (key_ok) dropped to -1 first. */
static void count_routes(const Landmarks *a, int64_t g, int64_t *best, int64_t *counts) {
    const int64_t m = a->m, N = a->N;
    const uint8_t *ok = a->key_ok ? a->key_ok + (g / a->heads) * N : NULL;
    for (int64_t t = 0; t < N; t++) {
        if (ok && !ok[t]) best[g * N + t] = -1;
        counts[best[g * N + t] < 0 ? m : best[g * N + t]]++;
    }
}

/* route_order's grouping of the queries by their routes best [G N] (-1: no expert), from each head's
 * route counts start [G][m + 1] (slot m: no expert; overwritten with each slot's next position):
 * order, offsets, and inverse and sorted unless NULL (see route_order). */
static void order_by_expert(const Landmarks *a, const float *q, const int64_t *best, int64_t *start, int64_t *order,
                            int64_t *offsets, int64_t *inverse, float *sorted) {
    const int64_t G = a->G, m = a->m, N = a->N, D = a->D;
    int64_t at = 0;
    for (int64_t g = 0; g < G; g++)
        for (int64_t j = 0; j < m; j++) {
            const int64_t count = start[g * (m + 1) + j];
            offsets[g * m + j] = start[g * (m + 1) + j] = at;
            at += count;
        }
    offsets[G * m] = at;
    for (int64_t g = 0; g < G; g++) {
        const int64_t count = start[g * (m + 1) + m];
        start[g * (m + 1) + m] = at;
        at += count;
    }
    const int64_t threads = a->threads < 1 ? 1 : (a->threads > G ? G : a->threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < G; g++) {
        int64_t *next = start + g * (m + 1);
        for (int64_t t = 0; t < N; t++) {
            const int64_t row = g * N + t, slot = best[row] < 0 ? m : best[row], to = next[slot]++;
            order[to] = row;
            if (inverse) inverse[row] = to;
            if (sorted) copy_row(sorted + to * D, q + row * D, D);
        }
    }
}

/* Step 4 with the grouping the grouped kernel takes (attentions/ops/grouped/reference.expert_runs):
 * the best landmark j of each query of head g makes its expert g m + j; the queries sorted by expert,
 * stably (query order within an expert), those of a head with no real landmark after every expert
 * (also in query order); order [G N] lists query rows in that order, inverse [G N] gives each query's
 * position, offsets [G m + 1] each expert's run, and sorted [G N, D] holds the queries in that order
 * (inverse and sorted NULL: not made, for a caller that reads the queries where they lie). With
 * key_ok ([G / heads, N], the padding mask) a padded query joins no expert: it goes with the
 * queries of no expert, after every run, and the grouped kernel leaves its output 0.
 * A counting sort: the routes and each head's counts in one pass over the heads, the runs' starts,
 * then each head's queries placed. best: [G N] scratch. Any thread count gives the same result. */
int route_order(const Landmarks *a, const float *q, const uint8_t *mark_ok, int64_t *best, int64_t *order,
                int64_t *offsets, int64_t *inverse, float *sorted) {
    const int64_t G = a->G, m = a->m;
    if (route_best(a, q, mark_ok, best) != 0) return 1;
    /* counts [G][m + 1] (slot m: no expert), then each slot's first position; a padded query's
     * route dropped (-1) in the same pass */
    int64_t *start = (int64_t *)calloc(G * (m + 1), sizeof(int64_t));
    if (!start) return 1;
    const int64_t threads = a->threads < 1 ? 1 : (a->threads > G ? G : a->threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < G; g++) count_routes(a, g, best, start + g * (m + 1));
    order_by_expert(a, q, best, start, order, offsets, inverse, sorted);
    free(start);
    return 0;
}
