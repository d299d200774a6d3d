/* Eight-float vectors for the CPU kernels (GCC and Clang vector extensions: AVX on x86-64 with
 * -march=native, two NEON registers on ARM), so the hot loops keep their accumulators in registers
 * instead of leaving the layout to the auto-vectoriser. */
#ifndef LRA_VEC_H
#define LRA_VEC_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
/* lane masks of comparisons between v8s (all bits set where true) */
typedef int32_t v8i __attribute__((vector_size(32)));
/* the same, at any float alignment: loads and stores of table rows */
typedef float v8u __attribute__((vector_size(32), aligned(4)));

/* Keeps x in a register. An FMA can take a loaded row as a memory operand, and GCC folds the load
 * into every FMA that uses the row: the two-row products would issue 10 loads per 8 FMAs, more than
 * the two vector loads a cycle the FMAs leave room for. The empty asm is opaque to the compiler, so
 * the row is loaded once and stays in a register. */
#if defined(__x86_64__) && defined(__AVX__)
#define IN_REGISTER(x) __asm__("" : "+x"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif

static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 x) { *(v8u *)p = x; }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline float sum8(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

#endif
