/* Row-wise top-k selection on the CPU: the kernel behind attentions/ops/topk_selection/cpu.py (float32).
 *
 * For each row of x [rows, n] it writes the k largest values and their column indices, in no
 * particular order (as torch.topk(sorted=False)); among equal values at the boundary the lower
 * indices win; -inf and NaN fill a row's last places only when it has fewer than k finite values.
 * The selection of a row (select.h) bisects on the value instead of sorting: on LRA score rows
 * (n = 1K-4K, k = 64-128), one pass over a row to a sampled threshold's candidates and a few over
 * those, against torch.topk's sort of (value, index) pairs. Threads take whole runs of rows.
 */
#include "select.h"

typedef struct {
    const float *x;
    float *values;
    int64_t *indices;
    int64_t n, k, first, last;
} Rows;

static void *run_rows(void *arg) {
    const Rows *r = (const Rows *)arg;
    void *scratch = malloc(select_scratch_bytes(r->n));
    void *filter = r->n >= FILTER_MIN ? malloc(filter_bytes(r->k)) : NULL;
    if (!scratch || (r->n >= FILTER_MIN && !filter)) {
        free(scratch), free(filter);
        return (void *)1;
    }
    for (int64_t row = r->first; row < r->last; row++)
        select_row(r->x + row * r->n, r->n, r->k, r->values + row * r->k, r->indices + row * r->k, scratch, filter);
    free(scratch), free(filter);
    return NULL;
}

/* x [rows, n] -> values [rows, k], indices [rows, k] (k <= n); returns 0 on success */
int topk_rows(const float *x, int64_t rows, int64_t n, int64_t k, float *values, int64_t *indices, int64_t threads) {
    if (threads < 1) threads = 1;
    if (threads > rows) threads = rows > 0 ? rows : 1;
    if (threads > 64) threads = 64;
    Rows work[64];
    for (int64_t t = 0; t < threads; t++) {
        work[t] = (Rows){x, values, indices, n, k, rows * t / threads, rows * (t + 1) / threads};
    }
    int failed = 0;
    /* one share per thread of OpenMP: the libgomp that torch has loaded, so its warm threads and no
     * second pool spinning against them; one thread when built without -fopenmp */
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(| : failed)
    for (int64_t t = 0; t < threads; t++) failed |= run_rows(&work[t]) != NULL;
    return failed;
}
