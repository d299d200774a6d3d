/* Row-wise top-k selection on the CPU: the kernel behind attentions/select.py (float32).
 *
 * For each row of x [rows, n] it writes the k largest values and their column indices, in no
 * particular order (as torch.topk(sorted=False)); among equal values at the boundary the lower
 * indices win. Instead of sorting, it bisects on the value for a threshold t with exactly k values
 * x >= t, each step one vectorised counting pass over the row, then keeps x >= t in one branch-free
 * pass. On LRA score rows (n = 1K-4K, k = 64-128) that is ~10-15 passes over a row that sits in the
 * L1 cache, against torch.topk's sort of (value, index) pairs.
 * -inf and NaN are never above a finite threshold: they fill a row's last places only when it has
 * fewer than k finite values (lowest index first). Threads take whole runs of rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *x;
    float *values;
    int64_t *indices;
    int64_t n, k, first, last;
} Rows;

/* count(t <= x < inf) over n values, in 8 lanes so the loop vectorises */
static int64_t count_at_least(const float *x, int64_t n, float t) {
    int32_t lane[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lane[l] += (x[j + l] >= t) & (x[j + l] < INFINITY);
    int64_t total = 0;
    for (; j < n; j++) total += (x[j] >= t) & (x[j] < INFINITY);
    for (int l = 0; l < 8; l++) total += lane[l];
    return total;
}

/* smallest and largest finite value of x [n] (lo > hi when there is none), in 8 lanes */
static void finite_range(const float *x, int64_t n, float *lo, float *hi) {
    float low[8], high[8];
    for (int l = 0; l < 8; l++) low[l] = INFINITY, high[l] = -INFINITY;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) {
            const float v = x[j + l];
            const int finite = (v > -INFINITY) & (v < INFINITY);
            low[l] = finite && v < low[l] ? v : low[l];
            high[l] = finite && v > high[l] ? v : high[l];
        }
    for (; j < n; j++) {
        const float v = x[j];
        const int finite = (v > -INFINITY) & (v < INFINITY);
        low[0] = finite && v < low[0] ? v : low[0];
        high[0] = finite && v > high[0] ? v : high[0];
    }
    *lo = INFINITY, *hi = -INFINITY;
    for (int l = 0; l < 8; l++) {
        *lo = low[l] < *lo ? low[l] : *lo;
        *hi = high[l] > *hi ? high[l] : *hi;
    }
}

/* The finite values t <= x < inf of row x [n], lowest index first, into values and indices
 * [n + 1]; branch-free: every value is written and the write position moves on only for a kept
 * one. Returns how many were kept. */
static int64_t keep_at_least(const float *x, int64_t n, float t, float *values, int64_t *indices) {
    int64_t w = 0;
    for (int64_t j = 0; j < n; j++) {
        const float v = x[j];
        values[w] = v;
        indices[w] = j;
        w += (v >= t) & (v < INFINITY);
    }
    return w;
}

/* The k largest finite values of row x [n] into values, indices [k]; returns how many were written
 * (fewer than k when the row has fewer finite values). scratch: n + 1 indices, then n + 1 floats. */
static int64_t select_finite(const float *x, int64_t n, int64_t k, float *values, int64_t *indices,
                             int64_t *scratch) {
    if (k <= 0) return 0;
    float lo, hi;
    finite_range(x, n, &lo, &hi);
    if (hi < lo) return 0; /* no finite value */
    int64_t at_lo = count_at_least(x, n, lo), at_hi = count_at_least(x, n, hi);
    float threshold = at_lo <= k ? lo : hi;
    /* invariant: count(x >= lo) > k >= count(x >= hi); halve [lo, hi) until count(x >= hi) == k
     * (interpolating on the counts took more steps on Gaussian score rows) */
    while (at_lo > k && at_hi < k) {
        const float mid = lo + (hi - lo) * 0.5f;
        if (!(mid > lo && mid < hi)) break; /* no float between the bounds: ties at lo */
        const int64_t at_mid = count_at_least(x, n, mid);
        if (at_mid > k) lo = mid, at_lo = at_mid;
        else hi = mid, at_hi = at_mid;
    }
    threshold = at_lo <= k ? lo : hi;
    float *kept = (float *)(scratch + n + 1);
    int64_t w = keep_at_least(x, n, threshold, kept, scratch);
    w = w < k ? w : k; /* more than k values tie at the max: the lowest indices of them */
    memcpy(values, kept, w * sizeof(float));
    memcpy(indices, scratch, w * sizeof(int64_t));
    if (w < k && at_lo > k) {
        /* ties at lo stopped the bisection: the rest are lo's lowest indices (lo is the only value in [lo, hi)) */
        for (int64_t j = 0; j < n && w < k; j++)
            if (x[j] >= lo && x[j] < hi) values[w] = x[j], indices[w++] = j;
    }
    return w;
}

static int has_positive_infinity(const float *x, int64_t n) {
    int32_t lane[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lane[l] |= x[j + l] == INFINITY;
    int32_t any = 0;
    for (; j < n; j++) any |= x[j] == INFINITY;
    for (int l = 0; l < 8; l++) any |= lane[l];
    return any;
}

static void *run_rows(void *arg) {
    const Rows *r = (const Rows *)arg;
    /* select_finite's scratch: n + 1 indices and n + 1 floats */
    int64_t *scratch = (int64_t *)malloc((sizeof(int64_t) + sizeof(float)) * (r->n + 1));
    if (!scratch) return (void *)1;
    for (int64_t row = r->first; row < r->last; row++) {
        const float *x = r->x + row * r->n;
        float *values = r->values + row * r->k;
        int64_t *indices = r->indices + row * r->k;
        /* +inf first, then the largest finite values, then (a row with fewer than k finite values)
         * -inf and NaN, each lowest index first */
        int64_t w = 0;
        if (has_positive_infinity(x, r->n))
            for (int64_t j = 0; j < r->n && w < r->k; j++)
                if (x[j] == INFINITY) values[w] = x[j], indices[w++] = j;
        w += select_finite(x, r->n, r->k - w, values + w, indices + w, scratch);
        for (int64_t j = 0; j < r->n && w < r->k; j++)
            if (!(x[j] >= -INFINITY) || x[j] == -INFINITY) values[w] = x[j], indices[w++] = j;
    }
    free(scratch);
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
