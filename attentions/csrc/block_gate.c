/* MoBA's gate on the CPU: the kernel behind attentions/ops/block_gate/cpu.py (float32).
 *
 * Per head g (G = B H heads, N queries, `blocks` key blocks of D dims) each query i scores every
 * block by q_i . mean_j, its own block (i / block_size) forced in with +inf when `own` is set, an
 * all-padding block (empty) at -inf whatever else, and keeps the `per_query` best blocks:
 *     chosen [G, N, per_query] block numbers, ok [G, N, per_query] 1 for a block with a real key.
 * The order of a query's chosen blocks is best first; of equal gates the lower block number wins.
 * The PyTorch path (moba.choose_blocks) builds the [B, H, chunk, blocks] gate tensor, scatters the
 * +inf, masks and runs topk over it; here 2 VW queries at a time sit in the vector lanes, six
 * blocks at a time score all of them against the head's means (which stay in the L1 cache), and a
 * per_query-long sorted list per lane, kept by compares and blends, replaces topk (per_query is
 * small): the gate 3.0 times the speed of six queries' scores kept by a scalar insertion at N = 1K
 * and 4K (batch 8) on the AMD EPYC.
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

/* Block j's gates v of the queries in the lanes (two vectors) into each query's list of the t best
 * so far (best[s][h], which[s][h] for s < t, best first), the j blocks before it seen: the list is
 * min(j, t) long in every lane. v goes into the first slot whose gate it beats (strictly: of equal
 * gates the earlier block stays first), every later slot takes its predecessor, the last falling
 * off a full list; a list not yet full grows by one. The list being sorted, v beats slot s exactly
 * when s is at or after that first slot, so every slot's compare is against v and the old list,
 * independent of the others. Compares and blends only: a branch per slot goes the wrong way about
 * once per gate (a scalar insertion takes 80% of the gate's time at N = 1K on the AMD EPYC). */
__attribute__((always_inline)) static inline void keep_lanes(int64_t t, int64_t j, const vf v[2], vf (*best)[2],
                                                            vfi (*which)[2]) {
    const vfi zero = {0}, block = zero + (int32_t)j;
    const int64_t filled = j < t ? j : t;
    for (int h = 0; h < 2; h++) {
        /* what slot s - 1 held, and whether v beat it */
        vf above = v[h];
        vfi above_block = block, beat_above = zero;
        for (int64_t s = 0; s < filled; s++) {
            const vf b = best[s][h];
            const vfi w = which[s][h], beat = v[h] > b;
            /* beaten: v if it beat none above, else the slot above's entry */
            const vf in = pickv(beat_above, above, v[h]);
            const vfi in_block = picki(beat_above, above_block, block);
            best[s][h] = pickv(beat, in, b);
            which[s][h] = picki(beat, in_block, w);
            above = b, above_block = w, beat_above = beat;
        }
        if (j < t) {
            best[j][h] = pickv(beat_above, above, v[h]);
            which[j][h] = picki(beat_above, above_block, block);
        }
    }
}

/* Blocks j .. j + K - 1 scored against the lanes' queries (blocks.h's lane_scores), the own block
 * forced in where it holds a real key (own_block: each lane's block; force: include it), and each
 * kept in block order. Inlined with a constant K. */
__attribute__((always_inline)) static inline void gate_blocks(int K, int64_t j, const float *means, const float *bias,
                                                             const float *qt, int64_t D, const vfi own_block[2],
                                                             int force, int64_t t, vf (*best)[2], vfi (*which)[2]) {
    const vfi zero = {0};
    vf acc[6][2];
    lane_scores(K, j, means, bias, qt, D, acc);
    for (int i = 0; i < K; i++) {
        if (force && bias[j + i] == 0.0f)
            for (int h = 0; h < 2; h++) {
                acc[i][h] = pickv(own_block[h] == zero + (int32_t)(j + i), splatv(INFINITY), acc[i][h]);
            }
        keep_lanes(t, j + i, acc[i], best, which);
    }
}

/* Head g, 2 VW queries at a time in the vector lanes (their rows transposed, blocks.h's
 * rows_into_lanes): every block's gate of all of them in two vectors, six blocks at a time (12
 * FMA chains), each kept in the lanes' sorted lists (keep_lanes). Inlined with a constant t for
 * the usual list lengths, so that the lists stay in registers. buf: 2 D VW + blocks floats, then
 * 2 t vectors of each of best and which. */
__attribute__((always_inline)) static inline void gate_head_of(const Gate *a, int64_t g, float *buf, int64_t t) {
    const int64_t N = a->N, D = a->D, nb = a->blocks;
    float *qt = buf, *bias = qt + 2 * D * VW;
    vf (*best)[2] = (vf (*)[2])(bias + nb + (-(uintptr_t)(bias + nb) % (4 * VW)) / sizeof(float));
    vfi (*which)[2] = (vfi (*)[2])(best + t);
    const float *means = a->means + g * nb * D, *Q = a->q + g * N * D;
    const uint8_t *empty = a->empty ? a->empty + (g / a->heads) * nb : NULL;
    for (int64_t j = 0; j < nb; j++) bias[j] = empty && empty[j] ? -INFINITY : 0.0f;
    for (int64_t t0 = 0; t0 < N; t0 += 2 * VW) {
        const int64_t count = N - t0 < 2 * VW ? N - t0 : 2 * VW;
        rows_into_lanes(Q, t0, N, D, qt);
        /* each lane's own block, counted up from t0's (no division per lane) */
        vfi own_block[2];
        int64_t own = t0 / a->block_size, into = t0 % a->block_size;
        for (int64_t l = 0; l < 2 * VW; l++) {
            own_block[l / VW][l % VW] = (int32_t)own;
            if (++into == a->block_size) into = 0, own++;
        }
        int64_t j = 0;
        for (; j + 6 <= nb; j += 6) gate_blocks(6, j, means, bias, qt, D, own_block, a->own != 0, t, best, which);
        for (; j < nb; j++) gate_blocks(1, j, means, bias, qt, D, own_block, a->own != 0, t, best, which);
        for (int64_t l = 0; l < count; l++) {
            int64_t *chosen = a->chosen + (g * N + t0 + l) * t;
            uint8_t *ok = a->ok + (g * N + t0 + l) * t;
            for (int64_t s = 0; s < t; s++) {
                chosen[s] = which[s][l / VW][l % VW];
                ok[s] = best[s][l / VW][l % VW] > -INFINITY;
            }
        }
    }
}

static void gate_head(const Gate *a, int64_t g, float *buf) {
    switch (a->per_query) {
    case 1: gate_head_of(a, g, buf, 1); break;
    case 2: gate_head_of(a, g, buf, 2); break;
    case 3: gate_head_of(a, g, buf, 3); break;
    default: gate_head_of(a, g, buf, a->per_query);
    }
}

int block_gate(const Gate *a) {
    const int64_t threads = a->threads < 1 ? 1 : (a->threads > a->G ? a->G : a->threads);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* qt, bias, then best and which (2 per_query vectors each) at a whole vector */
        float *buf = (float *)malloc(sizeof(float) * (2 * a->D * VW + a->blocks + (4 * a->per_query + 1) * VW));
        failed |= buf == NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < a->G; g++)
            if (buf) gate_head(a, g, buf);
        free(buf);
    }
    return failed;
}
