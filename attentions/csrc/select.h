/* Exact top-k selection of one row of floats, shared by the CPU kernels that select (topk_select.c:
 * rows of scores handed in; topk_attention.c: rows it scores itself).
 *
 * select_row writes the k largest values of a row and their column indices, in no particular order
 * (as torch.topk(sorted=False)); among equal values at the boundary the lower indices win. +inf
 * comes first, then the largest finite values, then (a row with fewer than k finite values) -inf
 * and NaN, each lowest index first. The finite part bisects on the value for a threshold t with
 * exactly k values x >= t, each step one vectorised counting pass over the row, then keeps x >= t
 * in one branch-free pass. Two shortcuts cut the passes over a long row to about one:
 *   - sampled (n >= ROW_SAMPLE_MIN): a threshold from an evenly spaced sample of the row, a little
 *     below where the sample puts the k-th largest, keeps some 1.5 k candidates in one pass; the
 *     bisection runs on them;
 *   - filtered (n >= FILTER_MIN, where the sample let fewer than k through): values below a running
 *     threshold, the k-th largest of a candidate buffer, are skipped in one pass.
 * Both keep the candidates in index order, so ties still go to the lower indices, and both return
 * exactly what the bisection on the whole row returns.
 */
#ifndef LRA_SELECT_H
#define LRA_SELECT_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"
/* the keep and count passes in AVX-512 where the library is built at 16 floats, in AVX2 where it is
 * built at 8 on a machine with AVX2 (so the LRA_NARROW form runs the AVX2 passes on an AVX-512
 * machine too); in plain C elsewhere (ARM, for one) and in the LRA_PORTABLE form (vec.h) */
#if VW == 16 && defined(__AVX512F__) && !defined(LRA_PORTABLE)
#define LRA_SELECT_AVX512 1
#elif defined(__AVX2__) && !defined(LRA_PORTABLE)
#define LRA_SELECT_AVX2 1
#endif
#if defined(LRA_SELECT_AVX512) || defined(LRA_SELECT_AVX2)
#include <immintrin.h>
#endif
/* count(t <= x < inf) over n values: 16 at a time as a mask's bits with AVX-512, else in 8 lanes so
 * the loop vectorises */
static int64_t count_at_least(const float *x, int64_t n, float t) {
    int64_t j = 0, total = 0;
#ifdef LRA_SELECT_AVX512
    const __m512 low = _mm512_set1_ps(t), inf = _mm512_set1_ps(INFINITY);
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        total += __builtin_popcount(
            (unsigned)(_mm512_cmp_ps_mask(v, low, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, inf, _CMP_LT_OQ)));
    }
#endif
    int32_t lane[8] = {0};
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lane[l] += (x[j + l] >= t) & (x[j + l] < INFINITY);
    for (; j < n; j++) total += (x[j] >= t) & (x[j] < INFINITY);
    for (int l = 0; l < 8; l++) total += lane[l];
    return total;
}

/* smallest and largest finite value of x [n] (lo > hi when there is none), in 8 lanes: compares and
 * blends of whole vectors (written lane by lane with conditionals, the loop stayed scalar) */
__attribute__((always_inline)) static inline void finite_range(const float *x, int64_t n, float *lo, float *hi) {
    v8 low = splat8(INFINITY), high = splat8(-INFINITY);
    const v8 inf = splat8(INFINITY), ninf = splat8(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const v8 r = load8(x + j);
        const v8i finite = (r > ninf) & (r < inf);
        const v8i less = finite & (r < low), more = finite & (r > high);
        low = (v8)((less & (v8i)r) | (~less & (v8i)low));
        high = (v8)((more & (v8i)r) | (~more & (v8i)high));
    }
    *lo = INFINITY, *hi = -INFINITY;
    for (; j < n; j++) {
        const float v = x[j];
        const int finite = (v > -INFINITY) & (v < INFINITY);
        *lo = finite && v < *lo ? v : *lo;
        *hi = finite && v > *hi ? v : *hi;
    }
    for (int l = 0; l < 8; l++) {
        *lo = low[l] < *lo ? low[l] : *lo;
        *hi = high[l] > *hi ? high[l] : *hi;
    }
}

/* a keep pass writes up to this many places past the last value it keeps */
#define SPILL 16

/* The finite values t <= x < inf of row x [n], lowest index first, into values and indices
 * [n + SPILL]; returns how many were kept. On AVX-512 each 16 values' kept lanes are compressed in a
 * register and all 16 lanes stored (the next store overwrites the extra ones; a compress straight to
 * memory is several times slower); on AVX2 each 8 values' kept lanes are moved to the front by a
 * permutation looked up from their mask (LEFT_PACK) and all 8 stored the same way; elsewhere
 * branch-free: every value is written and the write position moves on only for a kept one. */
#ifdef LRA_SELECT_AVX2
/* LEFT_PACK[mask]: the lanes set in mask, lowest first, as 4-bit lane numbers (lane of output i in
 * bits 4 i .. 4 i + 3; unused outputs 0) */
static const uint32_t LEFT_PACK[256] = {
    0x00000000u, 0x00000000u, 0x00000001u, 0x00000010u, 0x00000002u, 0x00000020u, 0x00000021u, 0x00000210u,
    0x00000003u, 0x00000030u, 0x00000031u, 0x00000310u, 0x00000032u, 0x00000320u, 0x00000321u, 0x00003210u,
    0x00000004u, 0x00000040u, 0x00000041u, 0x00000410u, 0x00000042u, 0x00000420u, 0x00000421u, 0x00004210u,
    0x00000043u, 0x00000430u, 0x00000431u, 0x00004310u, 0x00000432u, 0x00004320u, 0x00004321u, 0x00043210u,
    0x00000005u, 0x00000050u, 0x00000051u, 0x00000510u, 0x00000052u, 0x00000520u, 0x00000521u, 0x00005210u,
    0x00000053u, 0x00000530u, 0x00000531u, 0x00005310u, 0x00000532u, 0x00005320u, 0x00005321u, 0x00053210u,
    0x00000054u, 0x00000540u, 0x00000541u, 0x00005410u, 0x00000542u, 0x00005420u, 0x00005421u, 0x00054210u,
    0x00000543u, 0x00005430u, 0x00005431u, 0x00054310u, 0x00005432u, 0x00054320u, 0x00054321u, 0x00543210u,
    0x00000006u, 0x00000060u, 0x00000061u, 0x00000610u, 0x00000062u, 0x00000620u, 0x00000621u, 0x00006210u,
    0x00000063u, 0x00000630u, 0x00000631u, 0x00006310u, 0x00000632u, 0x00006320u, 0x00006321u, 0x00063210u,
    0x00000064u, 0x00000640u, 0x00000641u, 0x00006410u, 0x00000642u, 0x00006420u, 0x00006421u, 0x00064210u,
    0x00000643u, 0x00006430u, 0x00006431u, 0x00064310u, 0x00006432u, 0x00064320u, 0x00064321u, 0x00643210u,
    0x00000065u, 0x00000650u, 0x00000651u, 0x00006510u, 0x00000652u, 0x00006520u, 0x00006521u, 0x00065210u,
    0x00000653u, 0x00006530u, 0x00006531u, 0x00065310u, 0x00006532u, 0x00065320u, 0x00065321u, 0x00653210u,
    0x00000654u, 0x00006540u, 0x00006541u, 0x00065410u, 0x00006542u, 0x00065420u, 0x00065421u, 0x00654210u,
    0x00006543u, 0x00065430u, 0x00065431u, 0x00654310u, 0x00065432u, 0x00654320u, 0x00654321u, 0x06543210u,
    0x00000007u, 0x00000070u, 0x00000071u, 0x00000710u, 0x00000072u, 0x00000720u, 0x00000721u, 0x00007210u,
    0x00000073u, 0x00000730u, 0x00000731u, 0x00007310u, 0x00000732u, 0x00007320u, 0x00007321u, 0x00073210u,
    0x00000074u, 0x00000740u, 0x00000741u, 0x00007410u, 0x00000742u, 0x00007420u, 0x00007421u, 0x00074210u,
    0x00000743u, 0x00007430u, 0x00007431u, 0x00074310u, 0x00007432u, 0x00074320u, 0x00074321u, 0x00743210u,
    0x00000075u, 0x00000750u, 0x00000751u, 0x00007510u, 0x00000752u, 0x00007520u, 0x00007521u, 0x00075210u,
    0x00000753u, 0x00007530u, 0x00007531u, 0x00075310u, 0x00007532u, 0x00075320u, 0x00075321u, 0x00753210u,
    0x00000754u, 0x00007540u, 0x00007541u, 0x00075410u, 0x00007542u, 0x00075420u, 0x00075421u, 0x00754210u,
    0x00007543u, 0x00075430u, 0x00075431u, 0x00754310u, 0x00075432u, 0x00754320u, 0x00754321u, 0x07543210u,
    0x00000076u, 0x00000760u, 0x00000761u, 0x00007610u, 0x00000762u, 0x00007620u, 0x00007621u, 0x00076210u,
    0x00000763u, 0x00007630u, 0x00007631u, 0x00076310u, 0x00007632u, 0x00076320u, 0x00076321u, 0x00763210u,
    0x00000764u, 0x00007640u, 0x00007641u, 0x00076410u, 0x00007642u, 0x00076420u, 0x00076421u, 0x00764210u,
    0x00007643u, 0x00076430u, 0x00076431u, 0x00764310u, 0x00076432u, 0x00764320u, 0x00764321u, 0x07643210u,
    0x00000765u, 0x00007650u, 0x00007651u, 0x00076510u, 0x00007652u, 0x00076520u, 0x00076521u, 0x00765210u,
    0x00007653u, 0x00076530u, 0x00076531u, 0x00765310u, 0x00076532u, 0x00765320u, 0x00765321u, 0x07653210u,
    0x00007654u, 0x00076540u, 0x00076541u, 0x00765410u, 0x00076542u, 0x00765420u, 0x00765421u, 0x07654210u,
    0x00076543u, 0x00765430u, 0x00765431u, 0x07654310u, 0x00765432u, 0x07654320u, 0x07654321u, 0x76543210u,
};
#endif
static int64_t keep_at_least(const float *x, int64_t n, float t, float *values, int64_t *indices) {
    int64_t w = 0, j = 0;
#ifdef LRA_SELECT_AVX512
    const __m512 low = _mm512_set1_ps(t), inf = _mm512_set1_ps(INFINITY);
    __m512i pos = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; j + 16 <= n && j + 16 <= INT32_MAX; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        const __mmask16 keep = _mm512_cmp_ps_mask(v, low, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, inf, _CMP_LT_OQ);
        if (keep) {
            _mm512_storeu_ps(values + w, _mm512_maskz_compress_ps(keep, v));
            const __m512i at = _mm512_maskz_compress_epi32(keep, pos);
            _mm512_storeu_si512((void *)(indices + w), _mm512_cvtepi32_epi64(_mm512_castsi512_si256(at)));
            _mm512_storeu_si512((void *)(indices + w + 8), _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(at, 1)));
            w += __builtin_popcount((unsigned)keep);
        }
        pos = _mm512_add_epi32(pos, step);
    }
#elif defined(LRA_SELECT_AVX2)
    const __m256 low = _mm256_set1_ps(t), inf = _mm256_set1_ps(INFINITY);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), nibble = _mm256_set1_epi32(15);
    for (; j + 8 <= n && j + 8 <= INT32_MAX; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        const int keep = _mm256_movemask_ps(
            _mm256_and_ps(_mm256_cmp_ps(v, low, _CMP_GE_OQ), _mm256_cmp_ps(v, inf, _CMP_LT_OQ)));
        /* no test for an empty mask: at the ~16% of a row a sampled threshold keeps, a quarter of
         * the 8-value groups keep none, at random, and the mispredicted branch cost more than the
         * stores it skipped (the keep pass 2x, a 1K row's selection 25% faster on the AMD EPYC) */
        const __m256i lanes =
            _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)LEFT_PACK[keep]), shifts), nibble);
        _mm256_storeu_ps(values + w, _mm256_permutevar8x32_ps(v, lanes));
        const __m256i at = _mm256_add_epi32(lanes, _mm256_set1_epi32((int)j));
        _mm256_storeu_si256((__m256i *)(indices + w), _mm256_cvtepi32_epi64(_mm256_castsi256_si128(at)));
        _mm256_storeu_si256((__m256i *)(indices + w + 4), _mm256_cvtepi32_epi64(_mm256_extracti128_si256(at, 1)));
        w += __builtin_popcount((unsigned)keep);
    }
#endif
    for (; j < n; j++) {
        const float v = x[j];
        values[w] = v;
        indices[w] = j;
        w += (v >= t) & (v < INFINITY);
    }
    return w;
}

/* The k largest finite values of row x [n] into values, indices [k]; returns how many were written
 * (fewer than k when the row has fewer finite values). scratch: n + SPILL indices, then n + SPILL floats. */
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
    /* invariant: count(x >= lo) > k >= count(x >= hi); shrink [lo, hi) until count(x >= hi) == k.
     * Each step interpolates on the counts, unless the step before failed to halve the interval: then
     * it halves it (interpolation alone crawled on Gaussian rows, halving alone took ~20 steps) */
    int halve = 0;
    while (at_lo > k && at_hi < k) {
        const float width = hi - lo;
        float mid = halve ? lo + width * 0.5f : lo + width * ((float)(at_lo - k) / (float)(at_lo - at_hi));
        if (!(mid > lo && mid < hi)) mid = lo + width * 0.5f;
        if (!(mid > lo && mid < hi)) break; /* no float between the bounds: ties at lo */
        const int64_t at_mid = count_at_least(x, n, mid);
        if (at_mid > k) lo = mid, at_lo = at_mid;
        else hi = mid, at_hi = at_mid;
        halve = !halve && hi - lo > width * 0.5f;
    }
    threshold = at_lo <= k ? lo : hi;
    float *kept = (float *)(scratch + n + SPILL);
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
 * values [k], and select_finite's scratch for up to room + 64 candidates (room + 64 + SPILL indices,
 * then as many floats) */
static size_t filter_bytes(int64_t k) {
    const int64_t room = filter_room(k);
    return (sizeof(int64_t) + sizeof(float)) * (size_t)(room + 64 + k + room + 64 + SPILL);
}

/* The finite values of x [n] that can be among its k largest, in index order, into cv, ci
 * [room + 64]; returns how many, or -1 when ties keep the buffer from shrinking (the caller then
 * selects on the whole row). chosen, chosen_at [k] and scratch (room + 64 + SPILL indices, then floats)
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
 * the filter, select_finite on the whole row (scratch: n + SPILL indices, then n + SPILL floats). */
static int64_t select_long(const float *x, int64_t n, int64_t k, float *values, int64_t *indices, void *buf,
                           int64_t *scratch) {
    if (k <= 0) return 0;
    const int64_t room = filter_room(k);
    char *at = (char *)buf; /* the int64 arrays first, then the floats: see filter_bytes */
    int64_t *ci = (int64_t *)at, *chosen_at = ci + room + 64, *fscratch = chosen_at + k;
    at = (char *)(fscratch + room + 64 + SPILL) + sizeof(float) * (room + 64 + SPILL); /* past fscratch's floats */
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

/* the sample's size, and the shortest row it is taken from (shorter rows: bisection on the row) */
#define SAMPLE 128
#define ROW_SAMPLE_MIN 512

/* bytes of select_row's scratch for rows of n values: select_finite's n + SPILL indices and as many
 * floats, then the sampled path's candidates (as much again) */
static size_t select_finite_bytes(int64_t n) {
    return ((sizeof(int64_t) + sizeof(float)) * (size_t)(n + SPILL) + 7) & ~(size_t)7; /* whole int64s */
}
static size_t select_scratch_bytes(int64_t n) { return 2 * select_finite_bytes(n); }

/* select_finite of row x [n] through a sampled threshold; -1 when the threshold let fewer than k
 * values through (or the sample says nothing), and the caller selects on the whole row. scratch:
 * select_scratch_bytes(n). */
static int64_t select_sampled(const float *x, int64_t n, int64_t k, float *values, int64_t *indices,
                              int64_t *scratch) {
    float sample[SAMPLE];
    const int64_t stride = n / SAMPLE;
    int64_t taken = 0;
    for (int64_t i = 0; i < SAMPLE; i++) {
        const float v = x[i * stride + (i * 5) % stride]; /* spread within each stride, not its first slot */
        sample[taken] = v;
        taken += (v > -INFINITY) & (v < INFINITY);
    }
    /* about SAMPLE k / n of the sample's values lie at or above the row's k-th largest; the threshold
     * is a value with r to r + r / 4 of the sample at or above it, r three standard deviations beyond
     * that count, so that k or more of the row's values pass but for a rare row */
    const double expect = (double)SAMPLE * (double)k / (double)n;
    const int64_t r = (int64_t)(expect + 3.0 * sqrt(expect)) + 2;
    if (r >= taken) return -1;
    float lo, hi;
    finite_range(sample, taken, &lo, &hi);
    /* invariant: count(sample >= lo) >= r; bisect until that count is within r / 4 of r */
    int64_t at_lo = taken;
    for (int step = 0; step < 32 && at_lo > r + r / 4; step++) {
        const float mid = lo + (hi - lo) * 0.5f;
        if (!(mid > lo && mid < hi)) break;
        const int64_t at_mid = count_at_least(sample, taken, mid);
        if (at_mid >= r) lo = mid, at_lo = at_mid;
        else hi = mid;
    }
    /* the candidates x >= lo, index order, after select_finite's scratch */
    int64_t *cand_at = (int64_t *)((char *)scratch + select_finite_bytes(n));
    float *cand = (float *)(cand_at + n + SPILL);
    const int64_t w = keep_at_least(x, n, lo, cand, cand_at);
    if (w < k) return -1;
    const int64_t got = select_finite(cand, w, k, values, indices, scratch);
    for (int64_t i = 0; i < got; i++) indices[i] = cand_at[indices[i]];
    return got;
}

/* The k largest values of row x [n] (k <= n) and their indices into values, indices [k] (see the
 * top of this file for the order). scratch: select_scratch_bytes(n); filter: filter_bytes(k) when
 * n >= FILTER_MIN, else unused. */
static void select_row(const float *x, int64_t n, int64_t k, float *values, int64_t *indices, void *scratch,
                       void *filter) {
    int64_t w = 0;
    if (has_positive_infinity(x, n))
        for (int64_t j = 0; j < n && w < k; j++)
            if (x[j] == INFINITY) values[w] = x[j], indices[w++] = j;
    /* the sampled threshold first (on rows in the cache it beat the filter at every length, 4K-64K);
     * where the sample misleads, the filter on a long row, else the bisection on the whole row */
    int64_t got = -1;
    if (n >= ROW_SAMPLE_MIN && k - w > 0) got = select_sampled(x, n, k - w, values + w, indices + w, (int64_t *)scratch);
    if (got < 0 && n >= FILTER_MIN)
        got = select_long(x, n, k - w, values + w, indices + w, filter, (int64_t *)scratch);
    if (got < 0) got = select_finite(x, n, k - w, values + w, indices + w, (int64_t *)scratch);
    w += got;
    for (int64_t j = 0; j < n && w < k; j++)
        if (!(x[j] >= -INFINITY) || x[j] == -INFINITY) values[w] = x[j], indices[w++] = j;
}

#endif
