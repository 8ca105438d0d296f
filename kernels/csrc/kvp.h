/* kvpress native CPU decode kernels (fp32), called through ctypes by kvpress/kernels/native.py and
 * native_quant.py; kvpress/kernels/_native_lib.py compiles every .c file of this folder into one library.
 *
 * Why C: on a CPU a query-aware decode step at a 256-token budget is ~100 small torch operators
 * per layer (scores, top-k, gathers, softmax, the tail estimate), each paying a fixed dispatch
 * cost that exceeds its arithmetic. These functions do one (row, KV head) at a time in one call,
 * reading only the rows they need. The torch implementations stay the reference
 * (kvpress.kernels.torch_decode / tail / scores); tests compare the two.
 *
 * Layouts (element strides passed for the batch and head dims; the last two dims of K / V
 * caches and the last dim of everything else are contiguous):
 *   q        (B, Hq, D)           query head h uses KV head h / G, G = Hq / H
 *   k, v     (B, H, T_cap, D)
 *   labels   (B, H, r, T_cap)     token-last label cache (double_sparsity)
 *   k_sum, v_sum (B, H, N_cap, D) fp32 chunk sums; count (B, N_cap) tokens per chunk
 *   codes    (B, H, T_cap, D * bits / 8) uint8, packed as kvpress/kernels/quant.py describes
 *   scales / zero points fp16 (as uint16 bits): keys (B, H, T_cap / G, D), values (B, H, T_cap, D / Gv)
 * Every function returns 0, or a negative code for inputs it refuses (the Python side checks
 * shapes first, so that is a bug guard, not an error path).
 *
 * Files: this header (the helpers the hot loops of several files need inlined, and the internal
 * functions they share); common.c (ABI version, thread cap, top-k selection); sparse.c (Double
 * Sparsity's selection, sparse decode attention, attention over row sets, merging two attention
 * states); quant.c (the readers of
 * packed low-bit K/V); quant_attend.c (GEAR's corrections, a whole quantized decode step);
 * shadowkv.c (ShadowKV's chunk selection). Only the kvp_* entry points are exported: the shared
 * internals are KVP_HIDDEN.
 */
#ifndef KVP_H
#define KVP_H

#include <math.h>
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define KVP_ABI_VERSION 10

/* internal functions shared between the files: kept out of the library's exported symbols */
#define KVP_HIDDEN __attribute__((visibility("hidden")))

/* ------------------------------------------------------------------ threads (common.c) */

/* Threads for `items` pieces of about `work` multiply-adds in all. */
KVP_HIDDEN int team(int64_t items, double work);

/* ------------------------------------------------------------------ inline helpers
 *
 * Called in the hot loops of several files: defined here, static inline, so that every file's
 * loops inline them (a call into another translation unit cannot be inlined without LTO). */

/* an error code from inside a parallel region (any thread may store it) */
static inline void set_rc(int *rc, int code) { __atomic_store_n(rc, code, __ATOMIC_RELAXED); }

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

typedef float f32x8 __attribute__((vector_size(32)));

/* Sum of the 8 lanes (a fixed pairing, so every caller rounds alike). */
static inline float hsum8(f32x8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

typedef int32_t i32x8 __attribute__((vector_size(32)));

/* acc[g] = q[g] . kr for the G (<= 8) query heads of a group: the key row is loaded once. */
static inline __attribute__((always_inline)) void dots_n(float *acc, const float *q, const float *kr,
                                                         const int64_t G, int64_t D) {
    f32x8 a[8];
    for (int64_t g = 0; g < G; ++g) a[g] = (f32x8){0};
    for (int64_t d = 0; d < D; d += 8) {
        f32x8 kv, qv;
        memcpy(&kv, kr + d, sizeof kv);
        for (int64_t g = 0; g < G; ++g) {
            memcpy(&qv, q + g * D + d, sizeof qv);
            a[g] += qv * kv;
        }
    }
    for (int64_t g = 0; g < G; ++g) acc[g] = hsum8(a[g]);
}

static inline void dots(float *acc, const float *q, const float *kr, int64_t G, int64_t D) {
    if (D % 8) {
        for (int64_t g = 0; g < G; ++g) acc[g] = dot(q + g * D, kr, D);
        return;
    }
    switch (G) {  /* a constant group size keeps the accumulators in registers */
        case 1: dots_n(acc, q, kr, 1, D); break;
        case 2: dots_n(acc, q, kr, 2, D); break;
        case 3: dots_n(acc, q, kr, 3, D); break;
        case 4: dots_n(acc, q, kr, 4, D); break;
        case 5: dots_n(acc, q, kr, 5, D); break;
        case 6: dots_n(acc, q, kr, 6, D); break;
        case 7: dots_n(acc, q, kr, 7, D); break;
        default: dots_n(acc, q, kr, 8, D); break;
    }
}

/* Prefetch the D floats of a row (one cache line per 16 floats). */
static inline void prefetch_row(const float *row, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d);
}

/* ------------------------------------------------------------------ selection (common.c) */

KVP_HIDDEN void select_top(const float *x, int64_t n, int64_t k, int32_t *out, int32_t *live, uint32_t *keys);
KVP_HIDDEN void sort_ids(int32_t *ids, int64_t k, int64_t n, uint64_t *bits);
KVP_HIDDEN void softmax_row(float *row, int64_t n);
KVP_HIDDEN void reduce_into(float *acc, const float *row, int64_t n, int g, int reduction);

/* ------------------------------------------------------------------ packed low-bit K/V (quant.c)
 *
 * fp16 conversions and sizes inline; the span readers are shared with quant_attend.c. */

/* IEEE half (bits) -> float, subnormals included. */
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, u;
    float f;
    if (e == 0x1Fu) {
        u = sign | 0x7F800000u | (m << 13);
    } else if (e) {
        u = sign | ((e + 112u) << 23) | (m << 13);
    } else {
        f = (float)m * 5.9604644775390625e-8f; /* m * 2^-24 */
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    memcpy(&f, &u, sizeof f);
    return f;
}

/* n halves -> floats (F16C when the build has it). */
static inline void halfs_to_floats(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; ++i) dst[i] = h2f(src[i]);
}

/* Tokens per piece of work in the packed-store kernels (scores: rounded up to whole key groups),
 * and per block of the values loop (a block's codes and scales stay in L1). */
enum { SPAN = 512, VBLK = 64 };

static inline int64_t span_len(int64_t G) { return (SPAN + G - 1) / G * G; }

/* floats of scratch values_span needs */
static inline int64_t values_scratch(int64_t D, int64_t Gv) { return 2 * VBLK * (D / Gv) + 2 * VBLK * D + D; }

KVP_HIDDEN void scores_span(const float *qh, int64_t M, int64_t D, const uint8_t *ch, const uint16_t *sh,
                            const uint16_t *zh, int64_t t0, int64_t t1, int bits, int64_t G, float *out,
                            int64_t o_sm, float *qs);
KVP_HIDDEN void values_span(const float *w, int64_t w_sm, int64_t M, int64_t D, const uint8_t *ch,
                            const uint16_t *sh, const uint16_t *zh, int64_t t0, int64_t t1, int bits, int64_t Gv,
                            const int32_t *gidx, float *acc, float *scratch);
KVP_HIDDEN void plane_groups(int32_t *gidx, int64_t D, int bits, int64_t Gv);
KVP_HIDDEN void plane_to_channel(float *out, const float *acc, int64_t M, int64_t D, int bits);

#endif
