/* MoBA's gate on the CPU: the kernel behind attentions/ops/block_gate/cpu.py (float32).
 *
 * Per head g (G = B H heads, N queries, `blocks` key blocks of D dims) each query i scores every
 * block by q_i . mean_j, its own block (i / block_size) forced in with +inf when `own` is set, an
 * all-padding block (empty) at -inf whatever else, and keeps the `per_query` best blocks:
 *     chosen [G, N, per_query] block numbers, ok [G, N, per_query] 1 for a block with a real key.
 * The order of a query's chosen blocks is best first; of equal gates the lower block number wins.
 * The PyTorch path (moba.choose_blocks) builds the [B, H, chunk, blocks] gate tensor, scatters the
 * +inf, masks and runs topk over it; here six queries at a time score the head's transposed means,
 * which stay in the L1 cache, and a per_query-long sorted list replaces topk (per_query is small).
 *
 * Threads take whole heads: no two write the same row, no atomics, the same bits for any thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

typedef struct {
    int64_t G, N, D, blocks, block_size, per_query, own, heads, threads;
    const float *q;       /* [G, N, D] */
    const float *means;   /* [G, blocks, D] each block's mean over its real keys */
    const uint8_t *empty; /* [G / heads, blocks] 1 for a block without a real key, or NULL: none */
    int64_t *chosen;      /* [G, N, per_query] */
    uint8_t *ok;          /* [G, N, per_query] */
} Gate;

/* The per_query best of gate [blocks] into the query's rows of chosen and ok. */
static void keep_best(const Gate *a, const float *gate, int64_t *chosen, uint8_t *ok, float *best) {
    const int64_t t = a->per_query;
    int64_t kept = 0;
    for (int64_t j = 0; j < a->blocks; j++) {
        const float v = gate[j];
        if (kept == t && !(v > best[t - 1])) continue;
        /* insert j after every kept gate >= v (the earlier block wins a tie) */
        int64_t at = kept < t ? kept : t - 1;
        while (at > 0 && best[at - 1] < v) {
            best[at] = best[at - 1], chosen[at] = chosen[at - 1];
            at--;
        }
        best[at] = v, chosen[at] = j;
        if (kept < t) kept++;
    }
    for (int64_t s = 0; s < t; s++) ok[s] = best[s] > -INFINITY;
}

/* Head g; buf: D blocks (means transposed) + 7 blocks (bias, six queries' gates) + per_query floats. */
static void gate_head(const Gate *a, int64_t g, float *buf) {
    const int64_t N = a->N, D = a->D, nb = a->blocks, t = a->per_query;
    float *mt = buf, *bias = mt + D * nb, *gates = bias + nb, *best = gates + 6 * nb;
    const float *means = a->means + g * nb * D;
    for (int64_t j = 0; j < nb; j++)
        for (int64_t d = 0; d < D; d++) mt[d * nb + j] = means[j * D + d];
    const uint8_t *empty = a->empty ? a->empty + (g / a->heads) * nb : NULL;
    for (int64_t j = 0; j < nb; j++) bias[j] = empty && empty[j] ? -INFINITY : 0.0f;
    const float *Q = a->q + g * N * D;
    /* six queries at a time (dots_of_rows: 12 accumulators where the blocks fill two vectors) */
    for (int64_t i = 0; i < N;) {
        const int64_t rows = N - i < 6 ? N - i : 6;
        dots_of_rows(Q + i * D, rows, mt, bias, nb, D, gates, nb);
        for (int64_t c = 0; c < rows; c++) {
            const int64_t r = i + c;
            float *gate = gates + c * nb;
            const int64_t own = r / a->block_size;
            /* the own block forced in, unless it holds no real key (its bias is -inf) */
            if (a->own && bias[own] == 0.0f) gate[own] = INFINITY;
            keep_best(a, gate, a->chosen + (g * N + r) * t, a->ok + (g * N + r) * t, best);
        }
        i += rows;
    }
}

int block_gate(const Gate *a) {
    const int64_t threads = a->threads < 1 ? 1 : (a->threads > a->G ? a->G : a->threads);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = (float *)malloc(sizeof(float) * (a->D * a->blocks + 7 * a->blocks + a->per_query));
        failed |= buf == NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < a->G; g++)
            if (buf) gate_head(a, g, buf);
        free(buf);
    }
    return failed;
}
