/* Row-wise top-k selection on the CPU: the kernel behind attentions/ops/topk_selection/cpu.py (float32).
 *
 * For each row of x [rows, n] it writes the k largest values and their column indices, in no
 * particular order (as torch.topk(sorted=False)); among equal values at the boundary the lower
 * indices win. Instead of sorting, it bisects on the value for a threshold t with exactly k values
 * x >= t, each step one vectorised counting pass over the row, then keeps x >= t in one branch-free
 * pass. On LRA score rows (n = 1K-4K, k = 64-128) that is ~10-15 passes over a row that sits in the
 * L1 cache, against torch.topk's sort of (value, index) pairs.
 * -inf and NaN are never above a finite threshold: they fill a row's last places only when it has
 * fewer than k finite values (lowest index first). Threads take whole runs of rows.
 *
 * A long row (n >= FILTER_MIN, e.g. a MiTA landmark's scores against all N keys) is first filtered in
 * one pass: values below a running threshold, the k-th largest of a candidate buffer, cannot be in the
 * top k (k values seen before are at least as large) and are skipped; the bisection then runs on the
 * candidates, which are kept in index order so that ties still go to the lower indices. On a 64K row
 * that replaces some twenty passes over 256 KB (out of L1) with one.
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
__attribute__((always_inline)) static inline void finite_range(const float *x, int64_t n, float *lo, float *hi) {
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
/* (forced inline, as finite_range: called from three places, the compiler stopped inlining them into
 * run_rows, and rows of 1K-2K values took 20% longer) */
__attribute__((always_inline)) static inline int64_t select_finite(const float *x, int64_t n, int64_t k,
                                                                   float *values, int64_t *indices,
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

/* rows at least this long are filtered first; the candidate buffer holds up to filter_room(k) (>= 4 k)
 * values between compactions. A small buffer compacts often, so the threshold keeps up with the row:
 * with 1,024 places (k = 64) it stayed at the first 1,024 values' 64th largest over most of a 16K
 * row, and most 64-value blocks went through the candidate loop (16K rows 7.5 -> 5.5 ms with 256) */
#define FILTER_MIN 4096
static int64_t filter_room(int64_t k) { return 4 * k > 256 ? 4 * k : 256; }

/* bytes of select_long's buffer: candidates ci, cv [room + 64], a compaction's chosen indices and
 * values [k], and select_finite's scratch for up to room + 64 candidates (room + 65 indices, then
 * room + 65 floats) */
static size_t filter_bytes(int64_t k) {
    const int64_t room = filter_room(k);
    return (sizeof(int64_t) + sizeof(float)) * (size_t)(room + 64 + k + room + 65);
}

/* The finite values of x [n] that can be among its k largest, in index order, into cv, ci
 * [room + 64]; returns how many, or -1 when ties keep the buffer from shrinking (the caller then
 * selects on the whole row). chosen, chosen_at [k] and scratch (room + 65 indices, then floats)
 * serve the compactions. */
static int64_t filter_candidates(const float *x, int64_t n, int64_t k, int64_t room, float *cv, int64_t *ci,
                                 float *chosen, int64_t *chosen_at, int64_t *scratch) {
    float t = -INFINITY; /* no threshold yet: every finite value is a candidate */
    int64_t w = 0;
    for (int64_t j0 = 0; j0 < n; j0 += 64) {
        const int64_t end = j0 + 64 < n ? j0 + 64 : n;
        int32_t any = 0;
        for (int64_t j = j0; j < end; j++) any |= (x[j] >= t) & (x[j] > -INFINITY) & (x[j] < INFINITY);
        if (!any) continue;
        for (int64_t j = j0; j < end; j++) {
            const float v = x[j];
            cv[w] = v, ci[w] = j;
            w += (v >= t) & (v > -INFINITY) & (v < INFINITY);
        }
        if (w + 64 > room) {
            /* the threshold rises to the k-th largest candidate; those below it leave, order kept */
            if (select_finite(cv, w, k, chosen, chosen_at, scratch) < k) return -1;
            t = chosen[0];
            for (int64_t i = 1; i < k; i++) t = chosen[i] < t ? chosen[i] : t;
            int64_t kept = 0;
            for (int64_t i = 0; i < w; i++) {
                cv[kept] = cv[i], ci[kept] = ci[i];
                kept += cv[i] >= t;
            }
            /* ties at the threshold leave under a quarter of the buffer free: filtering does not pay */
            if (kept + 64 > room - room / 4) return -1;
            w = kept;
        }
    }
    return w;
}

/* select_finite of a long row through filter_candidates (buf: filter_bytes(k)); where ties defeat
 * the filter, select_finite on the whole row (scratch: n + 1 indices, then n + 1 floats). */
static int64_t select_long(const float *x, int64_t n, int64_t k, float *values, int64_t *indices, void *buf,
                           int64_t *scratch) {
    if (k <= 0) return 0;
    const int64_t room = filter_room(k);
    char *at = (char *)buf; /* the int64 arrays first, then the floats: see filter_bytes */
    int64_t *ci = (int64_t *)at, *chosen_at = ci + room + 64, *fscratch = chosen_at + k;
    at = (char *)(fscratch + room + 65) + sizeof(float) * (room + 65); /* past fscratch's floats */
    float *cv = (float *)at, *chosen = cv + room + 64;
    const int64_t w = filter_candidates(x, n, k, room, cv, ci, chosen, chosen_at, fscratch);
    if (w < 0) return select_finite(x, n, k, values, indices, scratch);
    const int64_t got = select_finite(cv, w, k, values, indices, fscratch);
    for (int64_t i = 0; i < got; i++) indices[i] = ci[indices[i]];
    return got;
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
    /* select_finite's scratch: n + 1 indices and n + 1 floats; select_long's buffer on long rows */
    int64_t *scratch = (int64_t *)malloc((sizeof(int64_t) + sizeof(float)) * (r->n + 1));
    void *filter = r->n >= FILTER_MIN ? malloc(filter_bytes(r->k)) : NULL;
    if (!scratch || (r->n >= FILTER_MIN && !filter)) {
        free(scratch), free(filter);
        return (void *)1;
    }
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
        w += filter ? select_long(x, r->n, r->k - w, values + w, indices + w, filter, scratch)
                    : select_finite(x, r->n, r->k - w, values + w, indices + w, scratch);
        for (int64_t j = 0; j < r->n && w < r->k; j++)
            if (!(x[j] >= -INFINITY) || x[j] == -INFINITY) values[w] = x[j], indices[w++] = j;
    }
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
