/* Float vectors for the CPU kernels (GCC and Clang vector extensions), so the hot loops keep their
 * accumulators in registers instead of leaving the layout to the auto-vectoriser.
 *
 * vf: VW floats, as wide as the machine the library is built for (-march=native): 16 where AVX-512
 * is there, else 8 (AVX2; two NEON registers on ARM). Defining LRA_NARROW builds the 8-wide form on
 * any machine, LRA_WIDE the 16-wide form (each vector op then runs as two or four of the machine's
 * own), so that the tests run both widths wherever they run (attentions/ops/native.py). LRA_PORTABLE
 * builds what a machine without x86 intrinsics builds (ARM, for one): 8 floats of plain C vectors,
 * no intrinsic anywhere (the stores below and select.h's passes), so that x86 machines test that form.
 * v8: always 8 floats, for the register transposes of 8 x 8 tiles. */
#ifndef LRA_VEC_H
#define LRA_VEC_H

#include <stdint.h>

#if (defined(__AVX512F__) || defined(LRA_WIDE)) && !defined(LRA_NARROW) && !defined(LRA_PORTABLE)
#define VW 16
#else
#define VW 8
#endif

typedef float vf __attribute__((vector_size(4 * VW)));
/* lane masks of comparisons between vfs (all bits set where true) */
typedef int32_t vfi __attribute__((vector_size(4 * VW)));
/* the same, at any float alignment: loads and stores of table rows */
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4)));

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

/* the width a library was built with (attentions/ops/native.py reports it) */
int lra_vector_width(void) { return VW; }

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf x) { *(vfu *)p = x; }
static inline vf splatv(float x) { return x - (vf){0}; }
/* lane by lane, a where mask is set (all bits), else b: a compare's result picking between vectors */
static inline vf pickv(vfi mask, vf a, vf b) { return (vf)((mask & (vfi)a) | (~mask & (vfi)b)); }
static inline vfi picki(vfi mask, vfi a, vfi b) { return (mask & a) | (~mask & b); }
/* fold(x, h): lanes h .. 2 h - 1 of x moved onto lanes 0 .. h - 1 (the rest: don't care), so that
 * an op of x and fold(x, h) combines lane l with lane l + h: log2(VW) such steps reduce a vector to
 * its lane 0 in a tree. A serial pass over the lanes is a chain of VW dependent operations (64
 * cycles of adds at VW 16), which the landmark pass and the softmax rows would pay once per row and per
 * block of keys; the tree takes four shuffles and four adds. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define LRA_HAS_FOLD 1
#if VW == 16
#define FOLD8(x) __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)
#define FOLD4(x) __builtin_shufflevector(x, x, 4, 5, 6, 7, 4, 5, 6, 7, 12, 13, 14, 15, 12, 13, 14, 15)
#define FOLD2(x) __builtin_shufflevector(x, x, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15)
#define FOLD1(x) __builtin_shufflevector(x, x, 1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15)
#else
#define FOLD4(x) __builtin_shufflevector(x, x, 4, 5, 6, 7, 4, 5, 6, 7)
#define FOLD2(x) __builtin_shufflevector(x, x, 2, 3, 2, 3, 6, 7, 6, 7)
#define FOLD1(x) __builtin_shufflevector(x, x, 1, 1, 3, 3, 5, 5, 7, 7)
#endif
#endif
#endif

/* the sum of x's lanes: a tree (lane l + lane l + VW / 2, ...) where the compiler has vector
 * shuffles, else in lane order */
static inline float sumv(vf x) {
#ifdef LRA_HAS_FOLD
#if VW == 16
    x += FOLD8(x);
#endif
    x += FOLD4(x);
    x += FOLD2(x);
    x += FOLD1(x);
    return x[0];
#else
    float total = 0.0f;
    for (int l = 0; l < VW; l++) total += x[l];
    return total;
#endif
}

/* A store that bypasses the caches (x86's non-temporal stores) for rows written once and read back
 * much later, so they do not push the working set out; p aligned to a whole vector (STREAM_ALIGN
 * bytes). A plain store where the machine has none. stream_fence() orders them before the stores
 * that follow (call it once when a thread is done). */
#define STREAM_ALIGN (4 * VW)
#if VW == 16 && defined(__AVX512F__) && !defined(LRA_PORTABLE)
#include <immintrin.h>
static inline void streamv(float *p, vf x) { _mm512_stream_ps(p, (__m512)x); }
static inline void stream_fence(void) { _mm_sfence(); }
#elif VW == 8 && defined(__AVX__) && !defined(LRA_PORTABLE)
#include <immintrin.h>
static inline void streamv(float *p, vf x) { _mm256_stream_ps(p, (__m256)x); }
static inline void stream_fence(void) { _mm_sfence(); }
#else
static inline void streamv(float *p, vf x) { storev(p, x); }
static inline void stream_fence(void) {}
#endif

static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 x) { *(v8u *)p = x; }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

#endif
