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
 * a Weyl sequence of the index, eight lanes at a time.
 */
#include <stdint.h>

typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x8u __attribute__((vector_size(32), aligned(4)));

static inline u32x8 mix(u32x8 h) {
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return h;
}

/* the 32 random bits of elements i .. i + 7 (i a multiple of 8: they share their high word) */
static inline u32x8 bits_of(int64_t i, uint32_t s0, uint32_t s1) {
    const u32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const u32x8 low = lane + (uint32_t)i;
    return mix(mix(low * 0x9e3779b9u ^ s0) ^ (s1 + (uint32_t)((uint64_t)i >> 32)));
}

/* Elements [first, last) of x into out; first is a multiple of 8. */
static void apply_range(const float *x, float *out, int64_t first, int64_t last, uint32_t s0, uint32_t s1,
                        uint32_t threshold, float scale) {
    const f32x8 scales = {scale, scale, scale, scale, scale, scale, scale, scale};
    int64_t i = first;
    for (; i + 8 <= last; i += 8) {
        /* lanes compare to all-ones (kept) or zero: the factor is scale or 0 (x times 0, as torch
         * multiplies by its mask, so a NaN stays NaN) */
        const u32x8 keep = (u32x8)(bits_of(i, s0, s1) >= threshold);
        *(f32x8u *)(out + i) = *(const f32x8u *)(x + i) * (f32x8)((u32x8)scales & keep);
    }
    if (i < last) {
        const u32x8 h = bits_of(i, s0, s1);
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
