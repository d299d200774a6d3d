/* Dropout on the CPU: the kernel behind lra/dropout.py (float32).
 *
 *     out[i] = keep(i) ? x[i] * scale : 0,   keep(i) = hash(seed, i) >= threshold,
 *
 * with threshold = p 2^32 and scale = 1 / (1 - p). The mask is a pure function of (seed, i): the
 * backward applies the same call to the output gradient (nothing is stored between the passes),
 * and the bits do not depend on the thread count. torch's CPU dropout draws a Bernoulli variable per
 * element from a Mersenne twister, and at LRA's sizes that took a fifth of a training step.
 *
 * The hash is two rounds of a 32-bit multiply-xorshift mixer (Wellons' "lowbias32" constants) over
 * a Weyl sequence of the index, a vector of lanes at a time (vec.h's width). The hash, not the
 * memory, sets the kernel's pace (2-4x a plain multiply at LRA's sizes), so each multiply saved and
 * each lane added counts.
 */
#include <stdint.h>

#include "vec.h"

/* VW lanes of 32-bit words (vec.h's width: 16 with AVX-512, else 8) */
typedef uint32_t vu __attribute__((vector_size(4 * VW)));

static inline vu mix(vu h) {
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return h;
}

#define WEYL 0x9e3779b9u

/* The 32 random bits of elements i .. i + VW - 1 (i a multiple of VW: they share their high word),
 * given weyl = their low words times WEYL (mod 2^32). */
static inline vu bits_of(vu weyl, int64_t i, uint32_t s0, uint32_t s1) {
    return mix(mix(weyl ^ s0) ^ (s1 + (uint32_t)((uint64_t)i >> 32)));
}

/* Elements [first, last) of x into out; first is a multiple of VW. Each element's bits depend on its
 * index alone, so every vector width gives the same mask. The Weyl sequence advances by an addition
 * (VW WEYL mod 2^32 a vector), the same words as the multiplication of each index and one multiply
 * fewer of five a vector. */
static void apply_range(const float *x, float *out, int64_t first, int64_t last, uint32_t s0, uint32_t s1,
                        uint32_t threshold, float scale) {
    vu weyl;
    for (int l = 0; l < VW; l++) weyl[l] = ((uint32_t)first + (uint32_t)l) * WEYL;
    const uint32_t step = (uint32_t)VW * WEYL;
    const vf scales = splatv(scale);
    int64_t i = first;
    for (; i + VW <= last; i += VW, weyl += step) {
        /* lanes compare to all-ones (kept) or zero: the factor is scale or 0 (x times 0, as torch
         * multiplies by its mask, so a NaN stays NaN) */
        const vfi keep = (vfi)(bits_of(weyl, i, s0, s1) >= threshold);
        storev(out + i, loadv(x + i) * (vf)((vfi)scales & keep));
    }
    if (i < last) {
        const vu h = bits_of(weyl, i, s0, s1);
        for (int64_t j = 0; i + j < last; j++) out[i + j] = x[i + j] * (h[j] >= threshold ? scale : 0.0f);
    }
}

/* out = dropout(x) over n elements (out may be x); the seed's two words select the mask. */
void dropout_apply(const float *x, float *out, int64_t n, uint64_t seed, uint32_t threshold, float scale,
                   int64_t threads) {
    const uint32_t s0 = (uint32_t)seed, s1 = (uint32_t)(seed >> 32);
    /* blocks of 64 KiB per task, on the OpenMP runtime torch has loaded (attentions/ops/native.py) */
    const int64_t block = 16384, blocks = (n + block - 1) / block;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * block, last = first + block < n ? first + block : n;
        apply_range(x, out, first, last, s0, s1, threshold, scale);
    }
}
