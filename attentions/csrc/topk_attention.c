/* Top-k attention's forward on the CPU, scores to output in one pass: the kernel behind
 * attentions/ops/topk_attention/cpu.py (float32).
 *
 * Per head g (G = B H heads, C queries, N keys of D dims) each query row i gets
 *     s = scale q_i K^T + bias   [N]   (bias 0 for a real key, -inf for padding),
 *     its k largest scores (select.h: the same choice as lra::topk_select, ties to the lower index),
 *     p = softmax over those k,  out_i = sum_j p_j v_{idx_j},
 * and writes out_i [D], the chosen key indices [k] and p [k] (the backward's sparse products read
 * them; ops/row_products). A row whose chosen scores are all -inf (no real key) gets p = 0, out 0.
 *
 * The unfused path writes every [C, N] score row to memory (a batched matmul), reads it back to
 * select and then gathers: at N = 1K the scores of a batch are tens of MB, and the selection ran at
 * the speed of memory. Here QB queries at a time are scored into a [QB, N] block that stays in the
 * cache while they are selected and mixed. Threads take (head, query block) units: no two write the
 * same row, no atomics, the same bits for any thread count.
 */
#include "blocks.h"
#include "select.h"

typedef struct {
    int64_t G, C, N, D, k, heads, threads;
    float scale;
    const float *q;    /* [G, C, D] */
    const float *kt;   /* [G, D, N] the keys, transposed */
    const float *v;    /* [G, N, D] */
    const float *bias; /* [G / heads, N] 0 or -inf, or NULL: every key real */
    float *out;        /* [G, C, D] */
    int64_t *index;    /* [G, C, k] */
    float *weights;    /* [G, C, k] */
} TopkAttention;

/* queries scored at once: their [QB, N] scores stay in L2 up to N = 16K */
#define QB 16

typedef struct {
    float *scores, *qs, *zeros, *top;
    void *scratch, *filter;
} Buffers;

/* softmax of the k chosen scores into w [k]; all zeros when none is above -inf */
static void softmax_of(const float *s, int64_t k, float *w) {
    const float most = max_of(s, k);
    if (most == -INFINITY) {
        memset(w, 0, k * sizeof(float));
        return;
    }
    for (int64_t j = 0; j < k; j++) w[j] = exp_nonpos(s[j] - most);
    const float inv = 1.0f / sum_of(w, k);
    for (int64_t j = 0; j < k; j++) w[j] *= inv;
}

/* Queries [c0, c0 + rows) of head g. */
static void query_block(const TopkAttention *a, int64_t g, int64_t c0, int64_t rows, const Buffers *b) {
    const int64_t N = a->N, D = a->D, k = a->k;
    const float *Q = a->q + (g * a->C + c0) * D, *kt = a->kt + g * D * N;
    const float *bias = a->bias ? a->bias + (g / a->heads) * N : b->zeros;
    for (int64_t i = 0; i < rows * D; i++) b->qs[i] = Q[i] * a->scale;
    dots_of_rows(b->qs, rows, kt, bias, N, D, b->scores, N);
    for (int64_t c = 0; c < rows; c++) {
        const int64_t row = g * a->C + c0 + c;
        int64_t *idx = a->index + row * k;
        float *w = a->weights + row * k;
        select_row(b->scores + c * N, N, k, b->top, idx, b->scratch, b->filter);
        softmax_of(b->top, k, w);
        mix_picked(w, idx, a->v, g * N, k, D, a->out + row * D);
    }
}

/* 0 on success, 1 when a thread's buffers could not be allocated */
int topk_attention_forward(const TopkAttention *a) {
    const int64_t blocks = (a->C + QB - 1) / QB, units = a->G * blocks;
    int64_t threads = a->threads < 1 ? 1 : a->threads;
    if (threads > units) threads = units > 0 ? units : 1;
    int failed = 0;
    /* the OpenMP runtime torch has loaded (see attentions/ops/native.py); one thread without -fopenmp */
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        Buffers b = {0};
        float *floats = (float *)malloc(sizeof(float) * (QB * a->N + QB * a->D + a->N + a->k));
        b.scratch = malloc(select_scratch_bytes(a->N));
        b.filter = a->N >= FILTER_MIN ? malloc(filter_bytes(a->k)) : NULL;
        const int ok = floats && b.scratch && (a->N < FILTER_MIN || b.filter);
        failed |= !ok;
        if (ok) {
            b.scores = floats, b.qs = b.scores + QB * a->N, b.zeros = b.qs + QB * a->D, b.top = b.zeros + a->N;
            memset(b.zeros, 0, a->N * sizeof(float));
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!ok) continue;
            const int64_t g = u / blocks, c0 = (u % blocks) * QB;
            query_block(a, g, c0, a->C - c0 < QB ? a->C - c0 : QB, &b);
        }
        free(floats), free(b.scratch), free(b.filter);
    }
    return failed;
}
