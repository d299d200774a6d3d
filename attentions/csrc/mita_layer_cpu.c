/* MiTA's layer on the CPU, head by head: the kernels behind attentions/ops/landmark/mita_layer_cpu.py
 * (float32): the forward's preparation of the experts (mita_prepare, below) and the backward.
 *
 * The backward of MiTA's default form is two passes that meet in the same buffers: the grouped
 * attention's (grouped_cpu.c: the shared and routed experts' softmax) makes dq, the key and value
 * gradients dK, dV [G N, D] and the shared tables' gradients d marks, d V_s [G, m, D]; the landmark
 * pass's (landmark_cpu.c) takes d V_s and adds into d marks, dK and dV. Run as two calls over every
 * head, each reads and writes dK and dV whole (2 MB each at N = 1K, batch 8, 2 heads), and with the
 * scores, keys and values between them nothing is left in the cache for the second. Here a thread
 * takes a head through both: zeroes its rows of dK, dV and d marks, d V_s, runs the grouped backward
 * of its m experts (their routed keys are rows of the same head: the head's rows are its own) and
 * then the landmark backward of the head, into the same rows while they are in the cache (and, when
 * asked, the landmarks' pooling backward into the head's dq rows). The same
 * arithmetic in the same order as the two calls: the same bits (tests/test_mita_cpu.py). MiTA's layer
 * (forward and backward, batch 8, 2 threads, AMD EPYC) 4-7% faster at 1K-4K; the same at 64K (B = 1,
 * H = 4), where a head's rows no longer fit the caches (results/throughput/kernel-ab-amd-epyc-2c/).
 *
 * Both kernels and the top-k selection (select.h) are compiled into this library (their sources
 * included: static functions, one translation unit); their own libraries stay the entry points of
 * every other caller.
 */
#include "grouped_cpu.c"
#include "landmark_cpu.c"
#include "select.h"

/* ga: the grouped backward of G m experts, M = m shared keys per group of m experts (group = m),
 * keys read by index from rows of their own head (rows [G m, S] into [G N, D]); its dkeys, dvalues,
 * dskeys, dsvalues are written whole (no zero fill needed). la: the landmark backward of the same G heads with accumulate 1,
 * dshared = ga->dsvalues, dmarks = ga->dskeys, dkeys and dvalues those of ga. pool, or NULL: the
 * landmarks' pooling (backward, accumulate 1, dout = dmarks, dx = ga->dq with its rows in query
 * order): the head's d marks are multiplied by pool_scale (the gradient of the unscaled landmarks,
 * which the layer scaled by it) and spread over the head's dq rows while they are in the cache, as
 * lra::pool_bins_backward_add of them would after the call (the same bits). 0 on success, 1 when a
 * thread's buffers could not be allocated. */
int mita_backward(const Grouped *ga, const Landmarks *la, const Pool *pool, float pool_scale) {
    const int64_t G = la->G, m = la->m, N = la->N, D = la->D;
    const int64_t threads = ga->threads < 1 ? 1 : (ga->threads > G ? G : ga->threads);
    no_expert_pairs(ga, 1);
    offsets_of_pairs(ga);
    int64_t *order = heads_by_size(la);
    if (!order) return 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        void *work = calloc(1, work_bytes(ga));
        float *pass = (float *)malloc(sizeof(float) * (D * BLOCK + 2 * m * BLOCK + m + BLOCK));
        failed |= work == NULL || pass == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < G; i++) {
            const int64_t g = order[i];
            if (!work || !pass) continue;
            memset(ga->dkeys + g * N * D, 0, sizeof(float) * N * D);
            memset(ga->dvalues + g * N * D, 0, sizeof(float) * N * D);
            memset(ga->dskeys + g * m * D, 0, sizeof(float) * m * D);
            memset(ga->dsvalues + g * m * D, 0, sizeof(float) * m * D);
            run_experts(ga, g * m, (g + 1) * m, 1, work);
            backward_head(la, g, pass);
            if (pool) {
                for (int64_t i = 0; i < m * D; i++) ga->dskeys[g * m * D + i] *= pool_scale;
                pool_head(pool, g);
            }
        }
        free(work);
        free(pass);
    }
    free(order);
    return failed;
}

/* The forward's steps 1-4 for MiTA's default form, a head at a time: what lra::pool_bins,
 * lra::landmark_forward, lra::topk_select and lra::route_order compute in four calls over every head
 * (and the bins, masks and key rows that about twenty small tensor operations made between them),
 * the same arithmetic in the same order: the same bits. A thread takes a head (largest first) through
 * its pooling, its landmark pass, the top-k selection of each landmark's scores while they are in the
 * cache, and its routing while its queries are; then the grouping by expert (route_order's counting
 * sort) over all heads. */
typedef struct {
    int64_t B, heads, m, N, D, keys, threads;
    const float *q, *k, *v;           /* [G, N, D] each, G = B heads */
    const uint8_t *mask;              /* [B, N] (right-padded) or NULL: every token real */
    int64_t *starts, *ends;           /* [B, m]: bin j of sequence b covers [start, end); a missing bin 0, 0 */
    uint8_t *mark_ok;                 /* [G, m]: the real landmarks (bins) of each head */
    float *marks, *scaled;            /* [G, m, D]: the landmarks, and divided by sqrt(D) */
    float *shared, *scores, *lse;     /* [G, m, D], [G, m, N], [G, m]: landmark_forward's */
    int64_t *rows;                    /* [G m, keys]: each landmark's selected keys as rows of [G N, D] */
    uint8_t *key_ok;                  /* [G m, keys] or NULL: which of them are real keys */
    int64_t *order, *offsets;         /* [G N], [G m + 1]: route_order's */
    int64_t *inverse;                 /* [G N] or NULL (then sorted NULL too): route_order's */
    float *sorted;
} Prepare;

/* Lengths and bins of every sequence (masking.real_lengths and real_bins, as kernel_bins gives them):
 * 0, or 2 when a mask row is not right-padded, 3 when a row has no real token (checked in that order,
 * as real_lengths does). */
static int prepare_bins(const Prepare *a) {
    const int64_t m = a->m, N = a->N;
    int64_t *lengths = (int64_t *)malloc(sizeof(int64_t) * a->B);
    if (!lengths) return 1;
    int bad = 0;
    for (int64_t b = 0; b < a->B && !bad; b++) {
        const uint8_t *row = a->mask ? a->mask + b * N : NULL;
        int64_t length = N;
        if (row) {
            length = 0;
            while (length < N && row[length]) length++;
            for (int64_t t = length; t < N; t++)
                if (row[t]) bad = 2;
        }
        lengths[b] = length;
    }
    for (int64_t b = 0; b < a->B && !bad; b++)
        if (lengths[b] == 0) bad = 3;
    for (int64_t b = 0; b < a->B && !bad; b++) {
        const int64_t length = lengths[b], count = length < m ? length : m;
        for (int64_t j = 0; j < m; j++) {
            const int64_t real = j < count;
            /* torch's adaptive-pool rule over the length tokens: floor(j L / c) .. ceil((j + 1) L / c) */
            a->starts[b * m + j] = real ? j * length / count : 0;
            a->ends[b * m + j] = real ? ((j + 1) * length + count - 1) / count : 0;
            for (int64_t h = 0; h < a->heads; h++) a->mark_ok[(b * a->heads + h) * m + j] = (uint8_t)real;
        }
    }
    free(lengths);
    return bad;
}

/* Head g's steps 1-4: pooling, landmark pass, top-k selection, routes into best [G N] and the head's
 * route counts [m + 1] (slot m: no expert). */
static void prepare_head(const Prepare *a, const Pool *pool, const Landmarks *scaled_pass,
                         const Landmarks *route_pass, int64_t g, int64_t *best, int64_t *counts, float *buf,
                         void *scratch, void *filter, float *top, int64_t *index) {
    const int64_t m = a->m, N = a->N, D = a->D, keys = a->keys;
    pool_head(pool, g);
    /* the landmarks as keys (marks / sqrt(D), as the layer's division of the tensor by the float) */
    const float root = (float)sqrt((double)D);
    for (int64_t i = g * m * D; i < (g + 1) * m * D; i++) a->scaled[i] = a->marks[i] / root;
    forward_head(scaled_pass, g, buf);
    for (int64_t j = 0; j < m; j++) {
        const int64_t x = g * m + j;
        select_row(a->scores + x * N, N, keys, top, index, scratch, filter);
        for (int64_t i = 0; i < keys; i++) {
            a->rows[x * keys + i] = g * N + index[i];
            if (a->key_ok) a->key_ok[x * keys + i] = top[i] > -INFINITY;
        }
    }
    route_head(route_pass, a->q, a->mark_ok, g, best, buf);
    count_routes(route_pass, g, best, counts);
}

/* Every head's steps 1-4 (prepare_head), the threads taking heads largest first (heads_by_size);
 * counts [G][m + 1]. 0 on success, 1 when a thread's buffers could not be allocated. */
static int prepare_heads(const Prepare *a, const int64_t *order, int64_t *best, int64_t *counts) {
    const int64_t G = a->B * a->heads, m = a->m, N = a->N, D = a->D;
    const Pool pool = {G, m, N, D, a->heads, 1, 0, 0, a->starts, a->ends, a->q, NULL, a->marks, NULL};
    const Landmarks scaled_pass = {G, m, N, D, a->heads, 1, 0, a->scaled, a->k, a->v, a->mask, a->scores,
                                   a->lse, a->shared, NULL, NULL, NULL, NULL};
    Landmarks route_pass = scaled_pass; /* routing scores the unscaled landmarks, as route_order */
    route_pass.marks = a->marks;
    const int64_t threads = a->threads < 1 ? 1 : (a->threads > G ? G : a->threads);
    /* one buffer for the landmark pass and then the routing */
    const int64_t pass_floats = D * BLOCK + m * BLOCK + 2 * m, route_floats = 2 * D * VW + m;
    const int64_t floats = pass_floats > route_floats ? pass_floats : route_floats;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = (float *)malloc(sizeof(float) * floats);
        void *scratch = malloc(select_scratch_bytes(N));
        void *filter = N >= FILTER_MIN ? malloc(filter_bytes(a->keys)) : NULL;
        float *top = (float *)malloc(sizeof(float) * a->keys);
        int64_t *index = (int64_t *)malloc(sizeof(int64_t) * a->keys);
        const int mine = !buf || !scratch || (N >= FILTER_MIN && !filter) || !top || !index;
        failed |= mine;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < G; i++)
            if (!mine)
                prepare_head(a, &pool, &scaled_pass, &route_pass, order[i], best, counts + order[i] * (m + 1), buf,
                             scratch, filter, top, index);
        free(buf), free(scratch), free(filter), free(top), free(index);
    }
    return failed;
}

/* 0 on success, 1 when memory ran out, 2 or 3 for a bad mask (prepare_bins). 1 <= keys < N. */
int mita_prepare(const Prepare *a) {
    const int64_t G = a->B * a->heads, m = a->m, N = a->N;
    const int bad = prepare_bins(a);
    if (bad) return bad;
    /* the head sizes, and the grouping's shapes and threads */
    const Landmarks heads = {.G = G, .m = m, .N = N, .D = a->D, .heads = a->heads, .threads = a->threads,
                             .key_ok = a->mask};
    int64_t *order = heads_by_size(&heads);
    int64_t *best = (int64_t *)malloc(sizeof(int64_t) * G * N);
    int64_t *counts = (int64_t *)calloc(G * (m + 1), sizeof(int64_t));
    int failed = order == NULL || best == NULL || counts == NULL;
    if (!failed) failed = prepare_heads(a, order, best, counts);
    if (!failed) order_by_expert(&heads, a->q, best, counts, a->order, a->offsets, a->inverse, a->sorted);
    free(order), free(best), free(counts);
    return failed;
}
