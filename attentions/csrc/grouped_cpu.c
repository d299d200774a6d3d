/* Grouped attention on the CPU: the kernel behind attentions/ops/grouped/cpu.py (float32).
 *
 * Pairs (query, expert) come sorted by expert: expert x owns order[offsets[x] .. offsets[x+1]).
 * Expert x attends to S keys read by index, rows[x * S + s] of the [R, D] key and value tables
 * (rows NULL: row x * S + s), and, when M > 0, to the M shared keys of its group g = x / group,
 * all under one softmax of logits scale * q . k (masked keys -inf). Per pair the forward writes
 * out [D] and the log-sum-exp of the logits; a pair whose keys are all masked gets 0 and -inf.
 * With p = softmax(logits), the backward is
 *     d_logits = p * (d_out . v + offset),  offset = d_lse - d_out . out,
 *     dq = scale d_logits K,  dK = scale d_logits^T q,  dV = p^T d_out.
 * With query_rows Q, pair p is part p / Q of query p % Q and reads q's row p % Q (MoBA: a query's
 * blocks are separate pairs, merged afterwards); with weights too, the backward takes the merged
 * d_out and out [Q, D] and each part's weight in the merge instead of the parts' d_out and d_lse
 * (part_weight). dq is a row per pair either way.
 *
 * The products across keys read an expert's keys (forward) or values (backward) from a small
 * transposed copy [D][n] made once per expert, so the inner loops run over contiguous floats and
 * vectorise; the products across the head dim read the value (forward) or key (backward) rows where
 * they lie in the tables, through a table of n row pointers (a row-major copy of them cost 3-10% of
 * either pass at N = 1K). Threads take units of `unit` whole experts, so that two threads never add
 * into the same gradient row: the caller sets unit so that experts of different units share no key
 * rows and no shared table. No atomics; the results are the same bits for any thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

typedef struct {
    int64_t experts, S, D, M, group, unit, threads, pairs;
    int64_t query_rows;      /* Q > 0: pair p is part p / Q of query p % Q (see query_row); 0: a query per pair */
    float scale;
    const float *q;          /* [P, D], or [Q, D] with query_rows */
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
    const float *dout;       /* [P, D] backward; [Q, D] with weights */
    const float *dlse;       /* [P] backward, the lse's gradient, or NULL: none */
    const float *weights;    /* [Q, P / Q] backward with query_rows, or NULL: the parts' weights in their
                              * queries' merge; then dout and out are the merged rows [Q, D] */
    float *offset;           /* [P] backward: d_lse - d_out . out, filled before the pairs run */
    float *dq;               /* [P, D] backward */
    float *dkeys, *dvalues;  /* [R, D] backward, zero-filled by the caller */
    float *dskeys, *dsvalues;/* [G, M, D] backward, zero-filled by the caller */
    int64_t dout_heads;      /* H > 0: dout in the heads-merged layout [B, N, H, D] (see dout_row); 0: [P, D] */
    int64_t dout_n;          /* N, with dout_heads */
} Grouped;

static inline int64_t key_row(const Grouped *a, int64_t x, int64_t s) {
    return a->rows ? a->rows[x * a->S + s] : x * a->S + s;
}

/* The row of q (and, with weights, of dout and out) that pair p reads: its query p % Q with
 * query_rows Q (MoBA: a query's parts, one per chosen block, are pairs i, i + Q, ...), else p. */
static inline int64_t query_row(const Grouped *a, int64_t p) {
    return a->query_rows > 0 ? p % a->query_rows : p;
}

/* The row of dout that pair p reads without weights: p, or with dout_heads H (pairs a query each, in
 * query order: pair p is token t = p % N of head g = p / N, head h = g % H of sequence b = g / H)
 * the row of [B, N, H, D] where the model's heads merge leaves it, (b N + t) H + h, so that the
 * gradient is read in place instead of copied into [B, H, N, D] first. */
static inline int64_t dout_row(const Grouped *a, int64_t p) {
    if (a->dout_heads <= 0) return p;
    const int64_t H = a->dout_heads, N = a->dout_n, g = p / N, t = p % N;
    return ((g / H) * N + t) * H + g % H;
}

/* With weights, pair p's weight in its query's merge, out = sum_e w_e part_e; the merge's backward
 * gives the part d_out_e = w_e d_out and d_lse_e = w_e (d_out . part_e - d_out . out), so the pair's
 * offset (below) is -w_e d_out . out: the part's own output cancels, and the merge's gradient
 * needs no pass of its own. */
static inline float part_weight(const Grouped *a, int64_t p) {
    const int64_t Q = a->query_rows, parts = a->pairs / Q;
    return a->weights[(p % Q) * parts + p / Q];
}

/* Column block [first, first + count) of the expert buffers from table rows: transposed kt, vt
 * [D][n], each only where the pass reads it (else NULL: the forward reads kt, the backward vt, and
 * kt only to recompute the softmax rows); pointers to the rows of `mixed` (the forward's values,
 * the backward's keys) in rows [n]; bias 0 or -inf per key. */
static void load_keys(const Grouped *a, int64_t n, int64_t first, int64_t count, const float *keys,
                      const float *values, const float *mixed, const int64_t *row_of, const uint8_t *ok, float *kt,
                      float *vt, const float **rows, float *bias) {
    const int64_t D = a->D;
    for (int64_t s0 = 0; s0 < count; s0 += 8) {
        const int64_t c = count - s0 < 8 ? count - s0 : 8;
        const float *krow[8], *vrow[8];
        for (int64_t i = 0; i < c; i++) {
            const int64_t s = s0 + i, j = first + s;
            krow[i] = keys + row_of[s] * D, vrow[i] = values + row_of[s] * D;
            rows[j] = mixed + row_of[s] * D;
            bias[j] = (ok && !ok[s]) ? -INFINITY : 0.0f;
        }
        if (kt) transpose_rows(krow, c, D, kt + first + s0, n);
        if (vt) transpose_rows(vrow, c, D, vt + first + s0, n);
    }
}

/* The buffers of expert x: its group's shared keys (when the group changed) and its own keys. The
 * forward mixes value rows (kt, no vt), the backward key rows (vt, and kt when recomputing). */
static void load_expert(const Grouped *a, int64_t x, int backward, int64_t *group_loaded, int64_t *row_of,
                        float *kt, float *vt, const float **rows, float *bias) {
    const int64_t S = a->S, M = a->M, n = M + S;
    const int64_t g = x / a->group;
    if (M > 0 && g != *group_loaded) {
        for (int64_t j = 0; j < M; j++) row_of[j] = g * M + j;
        load_keys(a, n, 0, M, a->skeys, a->svalues, backward ? a->skeys : a->svalues, row_of,
                  a->sok ? a->sok + g * M : NULL, kt, vt, rows, bias);
        *group_loaded = g;
    }
    for (int64_t s = 0; s < S; s++) row_of[s] = key_row(a, x, s);
    load_keys(a, n, M, S, a->keys, a->values, backward ? a->keys : a->values, row_of,
              a->key_ok ? a->key_ok + x * S : NULL, kt, vt, rows, bias);
}

/* Softmax of logits [n] in place (unnormalised exps); returns the max, -inf when every key is masked,
 * and the exps' total in *total. */
static float softmax_exps(float *logits, int64_t n, float *total) {
    const float top = max_of(logits, n);
    if (top == -INFINITY) return top;
    for (int64_t j = 0; j < n; j++) logits[j] = exp_nonpos(logits[j] - top);
    *total = sum_of(logits, n);
    return top;
}

/* Up to CHUNK pairs of one expert at a time. Forward: their softmax rows and scaled queries stay in
 * the cache while the products run phase by phase (all the logits against kt, then the softmaxes,
 * then all the mixes of the value rows), so that each phase reads one [n][D] block, not both (at
 * 16K, 14% faster than two pairs through all three steps). Backward: phase by phase too (the
 * output gradients against vt, then d_logits, then dq's mixes of the key rows), their p, d_logits,
 * scaled queries and output gradients staying in the cache for the expert's rank-C updates (at 1K,
 * 9% faster than two pairs through every step, both with the six-row products of blocks.h). */
#define CHUNK 32
/* pairs between a kept softmax row's prefetch and its use in the backward */
#define AHEAD 8

/* The rows that pairs order[from .. to) will read, fetched into the cache while the chunk before them
 * computes: q rows, and the backward's d_out rows. A chunk's pairs lie anywhere in those tables
 * (queries in expert order, rows in query order), and loaded on demand each row's first read waited
 * on memory: 15% of the forward chunks' time in MoBA's layer at 4K, 5% in MiTA's at 1K (Intel Xeon,
 * perf). The rows a chunk writes (out, dq) are not fetched: with them the prefetches filled the
 * cache's miss buffers and stalled, and the layer was 2-5% slower. Always inlined: a function of
 * prefetches alone is pure to GCC's interprocedural analysis, and it drops the calls as dead. */
static inline __attribute__((always_inline)) void prefetch_pairs(const Grouped *a, int64_t from, int64_t to, int backward) {
    const int64_t D = a->D;
    for (int64_t t = from; t < to; t++) {
        const int64_t pair = a->order[t], row = query_row(a, pair);
        for (int64_t d = 0; d < D; d += 16) {
            __builtin_prefetch(a->q + row * D + d);
            if (backward) __builtin_prefetch(a->dout + (a->weights ? row : dout_row(a, pair)) * D + d);
        }
    }
}

/* Pairs order[t0 .. t0 + rows) of one expert: out [D] and lse each; their softmax rows into
 * probs (in sorted pair order) when the caller keeps them. The expert's n value rows: the block
 * vblock [n][D] or the pointers vrows (row_at); p: CHUNK n floats, qs: CHUNK D. */
static void forward_chunk(const Grouped *a, int64_t t0, int64_t rows, int64_t n, const float *kt,
                          const float *vblock, const float *const *vrows, const float *bias, float *p, float *qs) {
    const int64_t D = a->D;
    const int64_t *pair = a->order + t0;
    float top[CHUNK], total[CHUNK];
    for (int64_t c = 0; c < rows; c++)
        scale_row(qs + c * D, a->q + query_row(a, pair[c]) * D, a->scale, D);
    dots_of_rows(qs, rows, kt, bias, n, D, p, n);
    for (int64_t c = 0; c < rows; c++) {
        total[c] = 1.0f;
        top[c] = softmax_exps(p + c * n, n, &total[c]);
    }
    mix_weighted(p, rows, vblock, vrows, n, D, a->out, pair, 0);
    for (int64_t c = 0; c < rows; c++) {
        float *out = a->out + pair[c] * D;
        const int masked = top[c] == -INFINITY;
        const float inv = masked ? 0.0f : 1.0f / total[c];
        for (int64_t d = 0; d < D; d++) out[d] = masked ? 0.0f : out[d] * inv;
        a->lse[pair[c]] = masked ? -INFINITY : top[c] + logf(total[c]);
        if (a->probs) {
            /* streamed past the caches where the rows are whole aligned vectors: the backward reads
             * them long after (8 MB at N = 1K, batch 8), and written through the cache they evicted
             * the tables this pass reads (the forward 7-14% faster on the AMD EPYC at 1K) */
            float *saved = a->probs + (t0 + c) * n;
            int64_t j = 0;
            if ((uintptr_t)saved % STREAM_ALIGN == 0 && n % VW == 0)
                for (; j < n; j += VW) streamv(saved + j, masked ? splatv(0.0f) : loadv(p + c * n + j) * inv);
            for (; j < n; j++) saved[j] = masked ? 0.0f : p[c * n + j] * inv;
        }
    }
}

/* Pairs order[t0 .. t0 + rows) of one expert, phase by phase (six rows at a time, then two; an
 * odd last row goes through as both halves): the scaled queries and output gradients into qs, dout
 * [CHUNK][D]; d_logits into ds; dq written (the expert's n key rows: kblock [n][D] or the pointers
 * krows). Returns the chunk's softmax rows [rows][n]: the kept ones where they lie in probs (the
 * chunk's pairs are consecutive there; each row fetched AHEAD pairs ahead), else made again in p
 * [CHUNK][n] from the logits and the saved log-sum-exps. A pair whose keys are all masked (lse
 * -inf) has a softmax row of zeros (kept or made so), zero d_logits and dq 0. */
static const float *backward_chunk(const Grouped *a, int64_t t0, int64_t rows, int64_t n, const float *kt,
                                   const float *vt, const float *kblock, const float *const *krows,
                                   const float *bias, const float *zeros, float *p, float *ds, float *qs,
                                   float *dout) {
    const int64_t D = a->D;
    const int64_t *pair = a->order + t0;
    for (int64_t c = 0; c < rows; c++) {
        const int64_t row = query_row(a, pair[c]);
        scale_row(qs + c * D, a->q + row * D, a->scale, D);
        if (a->weights) {
            const float w = part_weight(a, pair[c]);
            for (int64_t d = 0; d < D; d++) dout[c * D + d] = w * a->dout[row * D + d];
        } else {
            copy_row(dout + c * D, a->dout + dout_row(a, pair[c]) * D, D);
        }
        /* the kept softmax rows come from memory (the forward streamed them past the caches):
         * each is fetched AHEAD pairs ahead, a 64-byte line per 16 floats, across experts, and read
         * where it lies (a copy into p cost a pass over them) */
        if (a->probs && t0 + c + AHEAD < a->pairs)
            for (int64_t j = 0; j < n; j += 16) __builtin_prefetch(a->probs + (t0 + c + AHEAD) * n + j);
    }
    if (a->probs) {
        p = a->probs + t0 * n;
    } else {
        /* the softmax rows again from the logits and the saved log-sum-exps */
        dots_of_rows(qs, rows, kt, bias, n, D, p, n);
        for (int64_t c = 0; c < rows; c++) {
            const float lse = a->lse[pair[c]];
            for (int64_t j = 0; j < n; j++) p[c * n + j] = lse == -INFINITY ? 0.0f : exp_nonpos(p[c * n + j] - lse);
        }
    }
    /* d_logits = p (d_out . v + offset) */
    dots_of_rows(dout, rows, vt, zeros, n, D, ds, n);
    for (int64_t c = 0; c < rows; c++) {
        const float offset = a->offset[pair[c]];
        for (int64_t j = 0; j < n; j++) ds[c * n + j] = p[c * n + j] * (ds[c * n + j] + offset);
    }
    mix_weighted(ds, rows, kblock, krows, n, D, a->dq, pair, 0);
    for (int64_t c = 0; c < rows; c++) {
        float *dq = a->dq + pair[c] * D;
        const int masked = a->lse[pair[c]] == -INFINITY;
        for (int64_t d = 0; d < D; d++) dq[d] = masked ? 0.0f : dq[d] * a->scale;
        if (masked) memset(ds + c * n, 0, n * sizeof(float));
    }
    return p;
}

/* Rows [first, last) of an expert's key and value gradients summed in its buffer into the tables:
 * rows below M added into group g's shared tables; the rest (only without rows: expert x's keys are
 * its own rows x S .. x S + S - 1, no other expert's) written, not added, since the caller leaves
 * those tables unset (see zero_own_rows). Routed keys read by index add into their rows directly
 * (add_outer's rows). */
static void store_gradients(const Grouped *a, int64_t g, const int64_t *row_of, const float *dk, const float *dv,
                            int64_t first, int64_t last) {
    const int64_t M = a->M, D = a->D;
    for (int64_t j = first; j < last; j++) {
        if (j >= M) {
            copy_row(a->dkeys + row_of[j - M] * D, dk + j * D, D);
            copy_row(a->dvalues + row_of[j - M] * D, dv + j * D, D);
            continue;
        }
        float *gk = a->dskeys + (g * M + j) * D, *gv = a->dsvalues + (g * M + j) * D;
        for (int64_t d = 0; d < D; d++) {
            gk[d] += dk[j * D + d];
            gv[d] += dv[j * D + d];
        }
    }
}

/* Without rows: the key and value gradients of expert x, which has no pairs, are 0. */
static void zero_own_rows(const Grouped *a, int64_t x) {
    memset(a->dkeys + x * a->S * a->D, 0, sizeof(float) * a->S * a->D);
    memset(a->dvalues + x * a->S * a->D, 0, sizeof(float) * a->S * a->D);
}

/* Bytes of the per-thread buffer that run_experts takes (zero-filled: `zeros` below is read, not written). */
static size_t work_bytes(const Grouped *a) {
    const int64_t n = a->M + a->S, D = a->D;
    /* kt, vt, dk, dv [n * D]; bias, zeros [n]; p, ds [CHUNK * n]; qs, dout [CHUNK * D] (an even
     * number of floats: the pointers after them are aligned); the mixed rows' pointers [n], the
     * routed keys' gradient rows [2 n]; row_of */
    const int64_t floats = 4 * n * D + 2 * n + 2 * CHUNK * n + 2 * CHUNK * D;
    return sizeof(float) * floats + sizeof(float *) * 3 * n + sizeof(int64_t) * (n + 1);
}

/* Experts [first, last), forward or backward, with a zero-filled buffer of work_bytes(a). */
static void run_experts(const Grouped *a, int64_t first, int64_t last, int backward, void *buffer) {
    const int64_t S = a->S, M = a->M, D = a->D, n = M + S;
    float *kt = (float *)buffer, *vt = kt + n * D, *dk = vt + n * D, *dv = dk + n * D;
    float *bias = dv + n * D, *zeros = bias + n, *p = zeros + n, *ds = p + CHUNK * n;
    float *qs = ds + CHUNK * n, *dout = qs + CHUNK * D;
    const float **mixed = (const float **)(dout + CHUNK * D);
    float **dk_rows = (float **)(mixed + n), **dv_rows = dk_rows + n;
    int64_t *row_of = (int64_t *)(dv_rows + n);
    /* the backward's shared-key gradients (rows below M of dk, dv) add up over all the experts of a
     * group and go to the shared tables once per group: per expert, zeroing and adding back M rows
     * cost as much as the expert's own S rows (at N = 1K, an expert has ~16 queries) */
    int64_t group_loaded = -1, group_summed = -1;
    /* the range's last pair: no prefetch beyond it (another thread's pairs) */
    const int64_t stop = a->offsets[last];
    for (int64_t x = first; x < last; x++) {
        const int64_t begin = a->offsets[x], end = a->offsets[x + 1];
        if (begin == end) {
            if (backward && !a->rows) zero_own_rows(a, x);
            continue;
        }
        load_expert(a, x, backward, &group_loaded, row_of, backward && a->probs ? NULL : kt, backward ? vt : NULL,
                    mixed, bias);
        /* an expert whose keys are its own rows and no shared ones mixes its rows as one block */
        const float *block = !a->rows && M == 0 ? (backward ? a->keys : a->values) + x * S * D : NULL;
        const float *const *at = block ? NULL : mixed;
        if (!backward) {
            for (int64_t t0 = begin; t0 < end; t0 += CHUNK) {
                const int64_t rows = end - t0 < CHUNK ? end - t0 : CHUNK;
                prefetch_pairs(a, t0 + rows, t0 + rows + CHUNK < stop ? t0 + rows + CHUNK : stop, 0);
                forward_chunk(a, t0, rows, n, kt, block, at, bias, p, qs);
            }
            continue;
        }
        if (M > 0 && x / a->group != group_summed) {
            if (group_summed >= 0) store_gradients(a, group_summed, row_of, dk, dv, 0, M);
            memset(dk, 0, sizeof(float) * M * D);
            memset(dv, 0, sizeof(float) * M * D);
            group_summed = x / a->group;
        }
        /* the routed keys' gradients: added into their rows of dK and dV where they lie (keys read
         * by index: load_expert left the rows in row_of), else summed in the buffer's rows and
         * written to the expert's own rows (see store_gradients) */
        if (a->rows) {
            for (int64_t s = 0; s < S; s++)
                dk_rows[s] = a->dkeys + row_of[s] * D, dv_rows[s] = a->dvalues + row_of[s] * D;
        } else {
            memset(dk + M * D, 0, sizeof(float) * S * D);
            memset(dv + M * D, 0, sizeof(float) * S * D);
        }
        for (int64_t t0 = begin; t0 < end; t0 += CHUNK) {
            const int64_t rows = end - t0 < CHUNK ? end - t0 : CHUNK;
            prefetch_pairs(a, t0 + rows, t0 + rows + CHUNK < stop ? t0 + rows + CHUNK : stop, 1);
            const float *pr = backward_chunk(a, t0, rows, n, kt, vt, block, at, bias, zeros, p, ds, qs, dout);
            /* dK += d_logits^T (scale q), dV += p^T d_out over the chunk's pairs: the shared keys'
             * rows in the buffer (summed over the group), the routed keys' as above */
            add_outer(ds, n, qs, rows, M, D, dk, NULL);
            add_outer(pr, n, dout, rows, M, D, dv, NULL);
            add_outer(ds + M, n, qs, rows, S, D, a->rows ? NULL : dk + M * D, a->rows ? dk_rows : NULL);
            add_outer(pr + M, n, dout, rows, S, D, a->rows ? NULL : dv + M * D, a->rows ? dv_rows : NULL);
        }
        if (!a->rows) store_gradients(a, x / a->group, row_of, dk, dv, M, n);
    }
    if (group_summed >= 0) store_gradients(a, group_summed, row_of, dk, dv, 0, M);
}

/* Experts [first, last) of a thread, forward or backward, with a zero-filled buffer of its own;
 * returns 0 on success. */
static int run_share(const Grouped *a, int64_t first, int64_t last, int backward) {
    void *buffer = calloc(1, work_bytes(a));
    if (!buffer) return 1;
    run_experts(a, first, last, backward, buffer);
    stream_fence();
    free(buffer);
    return 0;
}

/* Single experts as units (MoBA's key blocks: many, each a small share): a run of consecutive
 * experts per thread, cut where the pairs so far reach (t + 1) / threads of the total, so the
 * shares differ by at most an expert's pairs and neighbouring experts' rows stay together (taken
 * one at a time by size, as below, MoBA's layer at 1K took 3% longer). */
static int run_in_runs(const Grouped *a, int64_t threads, int backward) {
    const int64_t X = a->experts, total = a->offsets[X] - a->offsets[0];
    int64_t *cut = (int64_t *)malloc(sizeof(int64_t) * (threads + 1)); /* thread t: [cut[t], cut[t + 1]) */
    if (!cut) return 1;
    cut[0] = 0;
    for (int64_t t = 0, x = 0; t < threads; t++) {
        const int64_t start = x, goal = a->offsets[0] + total * (t + 1) / threads;
        while (x < X && (t == threads - 1 || a->offsets[x + 1] <= goal)) x++;
        if (x == start && x < X) x++;
        cut[t + 1] = x;
    }
    int failed = 0;
    /* OpenMP: the libgomp that torch has loaded, so its warm threads and no second pool spinning
     * against them; one thread when built without -fopenmp */
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(| : failed)
    for (int64_t t = 0; t < threads; t++) failed |= run_share(a, cut[t], cut[t + 1], backward);
    free(cut);
    return failed;
}

/* Units of several experts (MiTA's: a head's m experts, with their shared table): few and large, so
 * the threads take them one at a time, most pairs first (blocks.h's largest_first; a run of whole
 * units per thread would leave one thread up to a unit's pairs longer than the other in padded
 * batches, 4% of the grouped forward at 1K, batch 8). */
static int run_by_size(const Grouped *a, int64_t units, int64_t threads, int backward) {
    const int64_t X = a->experts, unit = a->unit;
    int64_t *pairs = (int64_t *)malloc(sizeof(int64_t) * (units + 1));
    if (!pairs) return 1;
    for (int64_t u = 0; u < units; u++)
        pairs[u] = a->offsets[(u + 1) * unit < X ? (u + 1) * unit : X] - a->offsets[u * unit];
    int64_t *order = largest_first(pairs, units);
    free(pairs);
    if (!order) return 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        void *buffer = calloc(1, work_bytes(a));
        failed |= buffer == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < units; i++) {
            const int64_t first = order[i] * unit, last = first + unit < X ? first + unit : X;
            if (buffer) run_experts(a, first, last, backward, buffer);
        }
        stream_fence();
        free(buffer);
    }
    free(order);
    return failed;
}

/* Every expert, forward or backward, in units of `unit` experts that no two threads share; returns
 * 0 on success. */
static int run(const Grouped *a, int backward) {
    const int64_t unit = a->unit > 0 ? a->unit : 1, units = (a->experts + unit - 1) / unit;
    int64_t threads = a->threads < 1 ? 1 : a->threads;
    if (threads > units) threads = units > 0 ? units : 1;
    return unit == 1 ? run_in_runs(a, threads, backward) : run_by_size(a, units, threads, backward);
}

/* The pairs with no expert, order[offsets[X] ..): outside every expert's run, so set here (out and,
 * in the backward, dq 0; lse -inf; their kept softmax rows, in sorted pair order, 0). */
static void no_expert_pairs(const Grouped *a, int backward) {
    const int64_t D = a->D, n = a->M + a->S;
    for (int64_t i = a->offsets[a->experts]; i < a->pairs; i++) {
        const int64_t p = a->order[i];
        if (backward) {
            memset(a->dq + p * D, 0, sizeof(float) * D);
            continue;
        }
        memset(a->out + p * D, 0, sizeof(float) * D);
        a->lse[p] = -INFINITY;
        if (a->probs) memset(a->probs + i * n, 0, sizeof(float) * n);
    }
}

int grouped_forward(const Grouped *a) {
    no_expert_pairs(a, 0);
    return run(a, 0);
}

/* offset = d_lse - d_out . out for every pair, in row order (streamed: the pairs' own loop reads
 * them in expert order, where a row of out per pair was one more cache miss); with weights,
 * -w d_out . out of the pair's query (part_weight), its dot made once for all the query's parts.
 * A query's parts p = e Q + r are taken by query r and part e: two divisions a pair (p % Q, p / Q)
 * cost as much as the rest of the pass (MoBA's layer 4% at 4K, Intel Xeon). */
static void offsets_of_pairs(const Grouped *a) {
    const int64_t D = a->D, threads = a->threads < 1 ? 1 : a->threads;
    const int64_t Q = a->query_rows > 0 ? a->query_rows : a->pairs, parts = Q > 0 ? a->pairs / Q : 0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < Q; r++) {
        if (a->weights) {
            float t = 0.0f;
            for (int64_t d = 0; d < D; d++) t -= a->dout[r * D + d] * a->out[r * D + d];
            for (int64_t e = 0; e < parts; e++) a->offset[e * Q + r] = a->weights[r * parts + e] * t;
            continue;
        }
        for (int64_t e = 0; e < parts; e++) {
            const int64_t i = e * Q + r, grad = dout_row(a, i);
            float t = a->dlse ? a->dlse[i] : 0.0f;
            for (int64_t d = 0; d < D; d++) t -= a->dout[grad * D + d] * a->out[i * D + d];
            a->offset[i] = t;
        }
    }
}

int grouped_backward(const Grouped *a) {
    no_expert_pairs(a, 1);
    offsets_of_pairs(a);
    return run(a, 1);
}

/* One softmax over each row's E partial results (a query's experts in separate pairs):
 *     out [D] = sum_e w_e part_e,  w = softmax(lse) over e,
 * a row whose parts all have lse -inf gets 0 (every weight 0). The backward, for d_out [D]:
 *     d part_e = w_e d_out,  d lse_e = w_e (d_out . part_e - d_out . out).
 * Rows are independent: any thread split gives the same bits. Layout: parts [R, E, D] and lse [R, E]
 * (row-major), or with slot_major parts [E, R, D] and lse [E, R]; the gradients in the parts' layout. */
typedef struct {
    int64_t R, E, D, threads, slot_major;
    const float *parts;  /* [R, E, D] */
    const float *lse;    /* [R, E] */
    float *weights;      /* [R, E] forward; read by the backward */
    float *out;          /* [R, D] forward; read by the backward */
    const float *dout;   /* [R, D] backward */
    float *dparts;       /* [R, E, D] backward */
    float *dlse;         /* [R, E] backward */
} Merge;

/* Where part e of row r starts, in rows of D (lse: in floats). */
static inline int64_t part_at(const Merge *a, int64_t r, int64_t e) {
    return a->slot_major ? e * a->R + r : r * a->E + e;
}

static void merge_row(const Merge *a, int64_t r) {
    const int64_t E = a->E, D = a->D;
    float *w = a->weights + r * E, *out = a->out + r * D;
    float top = -INFINITY, total = 0.0f;
    for (int64_t e = 0; e < E; e++) top = a->lse[part_at(a, r, e)] > top ? a->lse[part_at(a, r, e)] : top;
    for (int64_t e = 0; e < E; e++) total += w[e] = top == -INFINITY ? 0.0f : expf(a->lse[part_at(a, r, e)] - top);
    for (int64_t e = 0; e < E; e++) w[e] = top == -INFINITY ? 0.0f : w[e] / total;
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        const float *part = a->parts + part_at(a, r, e) * D;
        for (int64_t d = 0; d < D; d++) out[d] += w[e] * part[d];
    }
}

static void merge_row_backward(const Merge *a, int64_t r) {
    const int64_t E = a->E, D = a->D;
    const float *w = a->weights + r * E, *out = a->out + r * D, *dout = a->dout + r * D;
    float d_merged = 0.0f;
    for (int64_t d = 0; d < D; d++) d_merged += dout[d] * out[d];
    for (int64_t e = 0; e < E; e++) {
        const int64_t at = part_at(a, r, e);
        const float *part = a->parts + at * D;
        float *dpart = a->dparts + at * D, dot = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            dot += dout[d] * part[d];
            dpart[d] = w[e] * dout[d];
        }
        a->dlse[at] = w[e] * (dot - d_merged);
    }
}

int merge_parts(const Merge *a, int backward) {
    const int64_t threads = a->threads < 1 ? 1 : a->threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < a->R; r++) {
        if (backward) merge_row_backward(a, r);
        else merge_row(a, r);
    }
    return 0;
}

/* The pairs grouped by expert (attentions/ops/grouped/reference.expert_runs): order [P] lists the
 * pairs sorted by expert, stably (pair order within an expert), those of expert X (none) last;
 * expert x owns order[offsets[x] .. offsets[x + 1]), offsets [X + 1]. A counting sort, one thread:
 * at 32,768 pairs over 256 experts (MoBA at 1K, batch 8) 0.13 ms against 0.88 ms for torch's stable
 * argsort and bincount on 2 threads of the AMD EPYC.
 * Returns 1 when an expert number is outside [0, X] (nothing is ordered then), 2 when out of memory. */
int expert_runs(const int64_t *expert, int64_t P, int64_t X, int64_t *order, int64_t *offsets) {
    int64_t *next = (int64_t *)calloc(X + 1, sizeof(int64_t));
    if (!next) return 2;
    for (int64_t i = 0; i < P; i++) {
        if (expert[i] < 0 || expert[i] > X) {
            free(next);
            return 1;
        }
        next[expert[i]]++;
    }
    int64_t at = 0;
    for (int64_t x = 0; x <= X; x++) {
        const int64_t count = next[x];
        if (x < X) offsets[x] = at;
        next[x] = at;
        at += count;
    }
    offsets[X] = next[X];
    for (int64_t i = 0; i < P; i++) order[next[expert[i]]++] = i;
    free(next);
    return 0;
}

/* dst[r] = src[index[r]] for rows r < rows of D floats: the pairs' rows into expert order and back
 * (MiTA's queries, outputs and their gradients). Twice the speed of torch's index_select on 2
 * threads at 262,144 rows of 32 floats (7 vs 13 ms), the next source row prefetched. */
void take_rows(const float *src, const int64_t *index, float *dst, int64_t rows, int64_t D, int64_t threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (r + 8 < rows) __builtin_prefetch(src + index[r + 8] * D);
        copy_row(dst + r * D, src + index[r] * D, D);
    }
}
