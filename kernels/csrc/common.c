/* kvpress native CPU kernels: the ABI version, the thread cap and the top-k selection helpers. */
#include "kvp.h"

int kvp_abi_version(void) { return KVP_ABI_VERSION; }

/* ------------------------------------------------------------------ threads
 *
 * Built with -fopenmp, this library needs libgomp.so.1 -- the soname of the runtime torch's
 * wheel bundles and has already loaded -- so a parallel region here runs on torch's own worker
 * threads (no second pool spinning against the first) and follows torch.set_num_threads.
 * kvp_set_max_threads caps it (kvpress/kernels/_native_lib.py sets 1 when it finds a second OpenMP
 * runtime in the process). Work is cut into pieces fixed by the shapes, never by the number of
 * threads, and partial results are combined in a fixed order: the outputs are bitwise the same
 * for any number of threads. */
static int kvp_cap = 0;

void kvp_set_max_threads(int n) { kvp_cap = n > 0 ? n : 0; }

int kvp_max_threads(void) {
#ifdef _OPENMP
    int n = omp_get_max_threads();
    return kvp_cap > 0 && kvp_cap < n ? kvp_cap : n;
#else
    return 1;
#endif
}

/* Threads for `items` pieces of about `work` multiply-adds in all: one below the size where a
 * fork and join (a few microseconds) costs more than it saves. */
int team(int64_t items, double work) {
    int n = kvp_max_threads();
    if (work < 2e5 || items < 2) return 1;
    return items < n ? (int)items : n;
}

/* ------------------------------------------------------------------ selection */

/* Order-preserving map of a float to uint32 (larger float -> larger key; +NaN above +inf, as
 * torch.topk ranks NaN above everything). */
static inline uint32_t fkey(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Indices of the k largest x[0..n) (ties broken by lower index), written to out[0..k) in no set
 * order. Radix select on the keys' bits, 11 + 11 + 10 per level: one histogram pass and one
 * partition pass over the elements still undecided; branch-light, O(n). live (n ints) and keys
 * (n uint32) are scratch. */
void select_top(const float *x, int64_t n, int64_t k, int32_t *out, int32_t *live, uint32_t *keys) {
    static const int shifts[3] = {21, 10, 0};
    static const uint32_t masks[3] = {0x7FFu, 0x7FFu, 0x3FFu};
    int64_t o = 0, nl = n;
    if (k <= 0) return;
    if (k >= n) {
        for (int64_t i = 0; i < n; ++i) out[i] = (int32_t)i;
        return;
    }
    for (int64_t i = 0; i < n; ++i) { keys[i] = fkey(x[i]); live[i] = (int32_t)i; }
    for (int level = 0; level < 3 && k > 0; ++level) {
        uint32_t hist[2048] = {0};
        int sh = shifts[level];
        uint32_t mk = masks[level];
        for (int64_t i = 0; i < nl; ++i) ++hist[(keys[live[i]] >> sh) & mk];
        int64_t above = 0;
        int64_t bin = (int64_t)mk;
        while (above + (int64_t)hist[bin] < k) above += hist[bin--];
        /* bins > bin: all taken; bin: the boundary, decided at the next level */
        int64_t nn = 0;
        for (int64_t i = 0; i < nl; ++i) {
            int32_t id = live[i];
            int64_t b = (keys[id] >> sh) & mk;
            if (b > bin) out[o++] = id;
            else if (b == bin) live[nn++] = id;
        }
        k -= above;
        nl = nn;
    }
    for (int64_t i = 0; i < k; ++i) out[o++] = live[i];  /* equal keys: the first ones */
}

/* ids[0..k) (distinct, in [0, n)) -> ascending, through a bitmap of n bits (scratch). */
void sort_ids(int32_t *ids, int64_t k, int64_t n, uint64_t *bits) {
    int64_t words = (n + 63) / 64;
    memset(bits, 0, sizeof(uint64_t) * (size_t)words);
    for (int64_t i = 0; i < k; ++i) bits[ids[i] >> 6] |= 1ull << (ids[i] & 63);
    int64_t o = 0;
    for (int64_t w = 0; w < words; ++w)
        for (uint64_t x = bits[w]; x; x &= x - 1) ids[o++] = (int32_t)(w * 64 + __builtin_ctzll(x));
}

/* reduction codes: 0 max, 1 mean, 2 softmax_max, 3 softmax_mean (kvpress.kernels.REDUCTIONS) */
void softmax_row(float *row, int64_t n) {
    float m = -INFINITY, s = 0.0f;
    for (int64_t t = 0; t < n; ++t) m = row[t] > m ? row[t] : m;
    for (int64_t t = 0; t < n; ++t) { row[t] = expf(row[t] - m); s += row[t]; }
    float inv = 1.0f / s;
    for (int64_t t = 0; t < n; ++t) row[t] *= inv;
}

void reduce_into(float *acc, const float *row, int64_t n, int g, int reduction) {
    if (g == 0) { memcpy(acc, row, (size_t)n * sizeof(float)); return; }
    if (reduction == 0 || reduction == 2) {
        for (int64_t t = 0; t < n; ++t) acc[t] = row[t] > acc[t] ? row[t] : acc[t];
    } else {
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) acc[t] += row[t];
    }
}
