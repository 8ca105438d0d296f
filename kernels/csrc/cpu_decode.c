/* kvpress native CPU decode kernels (fp32), called through ctypes by kvpress/kernels/native.py.
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
 */
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

#define KVP_ABI_VERSION 5

int kvp_abi_version(void) { return KVP_ABI_VERSION; }

/* ------------------------------------------------------------------ threads
 *
 * Built with -fopenmp, this library needs libgomp.so.1 -- the soname of the runtime torch's
 * wheel bundles and has already loaded -- so a parallel region here runs on torch's own worker
 * threads (no second pool spinning against the first) and follows torch.set_num_threads.
 * kvp_set_max_threads caps it (kvpress/kernels/native.py sets 1 when it finds a second OpenMP
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
static int team(int64_t items, double work) {
    int n = kvp_max_threads();
    if (work < 2e5 || items < 2) return 1;
    return items < n ? (int)items : n;
}

static void set_rc(int *rc, int code) { __atomic_store_n(rc, code, __ATOMIC_RELAXED); }

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

/* out[t] = sum_c qs[c] * lab[c * sc + t], t < len: 16 tokens per step accumulated in registers
 * over the r channels (one store per token instead of one load + store per channel). */
static inline void label_row(float *out, const float *qs, const float *lab, int64_t sc, int64_t r, int64_t len) {
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) {
        f32x8 a0 = {0}, a1 = {0};
        for (int64_t c = 0; c < r; ++c) {
            f32x8 l0, l1;
            memcpy(&l0, lab + c * sc + t, sizeof l0);
            memcpy(&l1, lab + c * sc + t + 8, sizeof l1);
            a0 += qs[c] * l0;
            a1 += qs[c] * l1;
        }
        memcpy(out + t, &a0, sizeof a0);
        memcpy(out + t + 8, &a1, sizeof a1);
    }
    for (; t < len; ++t) {
        float a = 0.0f;
        for (int64_t c = 0; c < r; ++c) a += qs[c] * lab[c * sc + t];
        out[t] = a;
    }
}

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
static void select_top(const float *x, int64_t n, int64_t k, int32_t *out, int32_t *live, uint32_t *keys) {
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
static void sort_ids(int32_t *ids, int64_t k, int64_t n, uint64_t *bits) {
    int64_t words = (n + 63) / 64;
    memset(bits, 0, sizeof(uint64_t) * (size_t)words);
    for (int64_t i = 0; i < k; ++i) bits[ids[i] >> 6] |= 1ull << (ids[i] & 63);
    int64_t o = 0;
    for (int64_t w = 0; w < words; ++w)
        for (uint64_t x = bits[w]; x; x &= x - 1) ids[o++] = (int32_t)(w * 64 + __builtin_ctzll(x));
}

/* reduction codes: 0 max, 1 mean, 2 softmax_max, 3 softmax_mean (kvpress.kernels.REDUCTIONS) */
static void softmax_row(float *row, int64_t n) {
    float m = -INFINITY, s = 0.0f;
    for (int64_t t = 0; t < n; ++t) m = row[t] > m ? row[t] : m;
    for (int64_t t = 0; t < n; ++t) { row[t] = expf(row[t] - m); s += row[t]; }
    float inv = 1.0f / s;
    for (int64_t t = 0; t < n; ++t) row[t] *= inv;
}

static void reduce_into(float *acc, const float *row, int64_t n, int g, int reduction) {
    if (g == 0) { memcpy(acc, row, (size_t)n * sizeof(float)); return; }
    if (reduction == 0 || reduction == 2) {
        for (int64_t t = 0; t < n; ++t) acc[t] = row[t] > acc[t] ? row[t] : acc[t];
    } else {
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) acc[t] += row[t];
    }
}

/* Double Sparsity selection of one decode step, unpadded rows, candidates [lo, hi) of every row.
 *
 * Label score of token t for query head g: scale * sum_c q[g, channels[c]] * labels[c, t],
 * reduced over the group (`reduction`). The `m` best candidates by label score form a shortlist;
 * when m > keep they are re-scored by exact scale * q . k (same reduction, softmax over the
 * shortlist) and the `keep` best kept. ids_out (B, H, keep) receives absolute token ids,
 * ascending. Requires keep <= m <= hi - lo. */
int kvp_label_select(const float *q, int64_t B, int64_t Hq, int64_t H, int64_t D,
                     const int64_t *channels, int64_t r,
                     const float *labels, int64_t lab_sb, int64_t lab_sh, int64_t lab_sc,
                     const float *k, int64_t k_sb, int64_t k_sh,
                     int64_t lo, int64_t hi, int64_t m, int64_t keep, float scale, int reduction,
                     int32_t *ids_out) {
    enum { TILE = 256 };
    int64_t n = hi - lo, G = Hq / H;
    if (n <= 0 || keep <= 0 || m < keep || m > n || G * H != Hq || G > 8 || reduction < 0 || reduction > 3) return -1;
    if (m > keep && k == NULL) return -2;
    int soft = reduction >= 2;
    /* floats: per-head rows (G * n when softmax, else G * TILE), reduced scores n, exact G * m,
     * reduced exact m, scaled query channels G * r; ints: shortlist m, final keep, radix live n;
     * keys n; a bitmap of n bits */
    int64_t rows = soft ? G * n : G * TILE;
    int nt = team(B * H, (double)(B * H) * (double)(G * (n * r + (m > keep ? m * D : 0)))), rc = 0;
    (void)nt;  /* unused in a build without OpenMP */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *fbuf = malloc(sizeof(float) * (size_t)(rows + n + G * m + m + G * r));
        int32_t *ibuf = malloc(sizeof(int32_t) * (size_t)(m + keep + n));
        uint32_t *keys = malloc(sizeof(uint32_t) * (size_t)n);
        uint64_t *mark = malloc(sizeof(uint64_t) * (size_t)((n + 63) / 64));
        int ok = fbuf && ibuf && keys && mark;
        if (!ok) set_rc(&rc, -3);
        float *row = fbuf, *red = row + rows, *ex = red + n, *exred = ex + G * m, *qsel = exred + m;
        int32_t *cand = ibuf, *pick = cand + m, *live = pick + keep;
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            if (!ok) continue;
            int64_t b = bh / H, h = bh % H;
            const float *lab = labels + b * lab_sb + h * lab_sh + lo;
            const float *qh = q + (b * Hq + h * G) * D;
            const int64_t *ch = channels + h * r;
            for (int64_t g = 0; g < G; ++g)
                for (int64_t c = 0; c < r; ++c) qsel[g * r + c] = qh[g * D + ch[c]] * scale;
            /* label scores, a tile of tokens at a time: the tile's labels are read from memory
             * once and serve the whole group from L1 */
            for (int64_t t0 = 0; t0 < n; t0 += TILE) {
                int64_t len = n - t0 < TILE ? n - t0 : TILE;
                for (int64_t g = 0; g < G; ++g) {
                    float *rg = soft ? row + g * n + t0 : row + g * TILE;
                    label_row(rg, qsel + g * r, lab + t0, lab_sc, r, len);
                    if (!soft) reduce_into(red + t0, rg, len, (int)g, reduction);
                }
            }
            if (soft)
                for (int64_t g = 0; g < G; ++g) {
                    softmax_row(row + g * n, n);
                    reduce_into(red, row + g * n, n, (int)g, reduction);
                }
            select_top(red, n, m, cand, live, keys);  /* cand[0..m): the shortlist */
            int32_t *out = ids_out + (b * H + h) * keep;
            if (m > keep) {
                const float *kh = k + b * k_sb + h * k_sh;
                for (int64_t i = 0; i < m; ++i) {
                    const float *kr = kh + (lo + cand[i]) * D;
                    if (i + 8 < m) prefetch_row(kh + (lo + cand[i + 8]) * D, D);
                    float acc[8];
                    dots(acc, qh, kr, G, D);
                    for (int64_t g = 0; g < G; ++g) ex[g * m + i] = scale * acc[g];
                }
                for (int64_t g = 0; g < G; ++g) {
                    if (soft) softmax_row(ex + g * m, m);
                    reduce_into(exred, ex + g * m, m, (int)g, reduction);
                }
                select_top(exred, m, keep, pick, live, keys);
                for (int64_t i = 0; i < keep; ++i) out[i] = cand[pick[i]];
            } else {
                memcpy(out, cand, sizeof(int32_t) * (size_t)keep);
            }
            sort_ids(out, keep, n, mark);
            for (int64_t i = 0; i < keep; ++i) out[i] += (int32_t)lo;
        }
        free(fbuf);
        free(ibuf);
        free(keys);
        free(mark);
    }
    return rc;
}

/* ------------------------------------------------------------------ attention */

/* Sparse decode attention over a clean token / block index, optionally merged with the chunk-mean
 * estimate of the tokens it leaves out (kvpress.kernels.tail).
 *
 * Row b, KV head h attends: sinks [start, start + S), blocks blocks[b, h, 0..K) (block j = tokens
 * [j * bs, (j + 1) * bs)), and the dense tail [len - W, len), where start = seq_starts[b] (0 when
 * NULL) and len = seq_lens[b]; the caller guarantees these are distinct tokens of the row.
 *
 * With N > 0 chunks (chunk c = tokens start + [c * chunk, (c + 1) * chunk)), every chunk also stands
 * for its n_c tokens that are not attended, with key (k_sum[c] - sum of attended keys in c) / n_c
 * and value likewise; all scores share one softmax. out (B, Hq, D) fp32; lse (B, Hq) the
 * log-sum-exp of everything (-inf when nothing is attended or estimated). */
int kvp_sparse_decode(const float *q, int64_t B, int64_t Hq, int64_t H, int64_t D,
                      const float *k, int64_t k_sb, int64_t k_sh,
                      const float *v, int64_t v_sb, int64_t v_sh,
                      const int32_t *blocks, int64_t K, int64_t bs,
                      const int32_t *seq_lens, const int32_t *seq_starts, int64_t S, int64_t W,
                      const float *k_sum, const float *v_sum, int64_t sum_sb, int64_t sum_sh,
                      const float *count, int64_t count_sb, int64_t N, int64_t chunk,
                      float scale, float *out, float *lse) {
    int64_t G = Hq / H, V = S + W + K * bs;
    if (G * H != Hq || V < 0 || (N > 0 && chunk <= 0)) return -1;
    size_t nf = (size_t)(G * V + (N > 0 ? G * N + N + N + G * N : 0) + G * D + G);
    int nt = team(B * H, (double)(B * H) * (double)(2 * G * (V + N) * D)), rc = 0;
    (void)nt;  /* unused in a build without OpenMP */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *s = malloc(sizeof(float) * nf);
        int64_t *pos = malloc(sizeof(int64_t) * (size_t)(V > 0 ? V : 1));
        int32_t *cof = malloc(sizeof(int32_t) * (size_t)(V > 0 ? V : 1));
        int ok = s && pos && cof;
        if (!ok) set_rc(&rc, -3);
        float *sc = s + G * V, *rem_n = sc + G * N, *n_rest = rem_n + N, *wc = n_rest + N, *acc = wc + G * N;
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            if (!ok) continue;
            int64_t b = bh / H, h = bh % H;
            int64_t start = seq_starts ? seq_starts[b] : 0, len = seq_lens[b];
            const int32_t *blk = blocks + (b * H + h) * K;
            int64_t j = 0;
            for (int64_t t = 0; t < S; ++t) pos[j++] = start + t;
            for (int64_t i = 0; i < K; ++i)
                for (int64_t t = 0; t < bs; ++t) pos[j++] = (int64_t)blk[i] * bs + t;
            for (int64_t t = len - W; t < len; ++t) pos[j++] = t;
            const float *kh = k + b * k_sb + h * k_sh, *vh = v + b * v_sb + h * v_sh;
            const float *qh = q + (b * Hq + h * G) * D;
            for (int64_t i = 0; i < V; ++i) {
                const float *kr = kh + pos[i] * D;
                for (int64_t g = 0; g < G; ++g) s[g * V + i] = scale * dot(qh + g * D, kr, D);
            }
            if (N > 0) {
                const float *ks = k_sum + b * sum_sb + h * sum_sh, *cnt = count + b * count_sb;
                memset(sc, 0, sizeof(float) * (size_t)(G * N + N));  /* removed scores, then rem_n */
                for (int64_t i = 0; i < V; ++i) {
                    int64_t c = (pos[i] - start) / chunk;
                    c = c < 0 ? 0 : (c > N - 1 ? N - 1 : c);
                    cof[i] = (int32_t)c;
                    rem_n[c] += 1.0f;
                    for (int64_t g = 0; g < G; ++g) sc[g * N + c] += s[g * V + i];
                }
                for (int64_t c = 0; c < N; ++c) {
                    float nr = cnt[c] - rem_n[c], inv = 1.0f / (nr > 1.0f ? nr : 1.0f);
                    n_rest[c] = nr;
                    for (int64_t g = 0; g < G; ++g) {
                        float *x = sc + g * N + c;
                        *x = nr < 0.5f ? -INFINITY
                                       : (scale * dot(qh + g * D, ks + c * D, D) - *x) * inv + logf(nr > 1.0f ? nr : 1.0f);
                    }
                }
            }
            /* one softmax per query head over [attended tokens, chunk summaries] */
            float *norm = acc + G * D;
            for (int64_t g = 0; g < G; ++g) {
                float *sg = s + g * V, *cg = sc + g * N;
                float mx = -INFINITY, total = 0.0f;
                for (int64_t i = 0; i < V; ++i) mx = sg[i] > mx ? sg[i] : mx;
                for (int64_t c = 0; c < N; ++c) mx = cg[c] > mx ? cg[c] : mx;
                if (mx == -INFINITY) {  /* nothing attended or estimated: zero output */
                    for (int64_t i = 0; i < V; ++i) sg[i] = 0.0f;
                    for (int64_t c = 0; c < N; ++c) cg[c] = 0.0f;
                    norm[g] = 0.0f;
                    lse[b * Hq + h * G + g] = -INFINITY;
                    continue;
                }
                for (int64_t i = 0; i < V; ++i) { sg[i] = expf(sg[i] - mx); total += sg[i]; }
                for (int64_t c = 0; c < N; ++c) { cg[c] = expf(cg[c] - mx); total += cg[c]; }
                norm[g] = 1.0f / total;
                lse[b * Hq + h * G + g] = mx + logf(total);
            }
            memset(acc, 0, sizeof(float) * (size_t)(G * D));
            if (N > 0) {
                /* chunk c contributes w_c * (v_sum[c] - attended values in c) */
                const float *vs = v_sum + b * sum_sb + h * sum_sh;
                for (int64_t g = 0; g < G; ++g)
                    for (int64_t c = 0; c < N; ++c)
                        wc[g * N + c] = sc[g * N + c] * norm[g] / (n_rest[c] > 1.0f ? n_rest[c] : 1.0f);
                for (int64_t c = 0; c < N; ++c)
                    for (int64_t g = 0; g < G; ++g)
                        if (wc[g * N + c] != 0.0f) axpy(acc + g * D, wc[g * N + c], vs + c * D, D);
                for (int64_t g = 0; g < G; ++g)
                    for (int64_t i = 0; i < V; ++i) s[g * V + i] = s[g * V + i] * norm[g] - wc[g * N + cof[i]];
            } else {
                for (int64_t g = 0; g < G; ++g)
                    for (int64_t i = 0; i < V; ++i) s[g * V + i] *= norm[g];
            }
            for (int64_t i = 0; i < V; ++i) {  /* each value row read once for the whole group */
                const float *vr = vh + pos[i] * D;
                for (int64_t g = 0; g < G; ++g) axpy(acc + g * D, s[g * V + i], vr, D);
            }
            memcpy(out + (b * Hq + h * G) * D, acc, sizeof(float) * (size_t)(G * D));
        }
        free(s);
        free(pos);
        free(cof);
    }
    return rc;
}

/* ------------------------------------------------------------------ packed low-bit K/V (kvpress.kernels.quant) */

typedef int32_t i32x8 __attribute__((vector_size(32)));

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

/* Codes of plane `plane` (bits [plane * bits, (plane + 1) * bits)) of 8 consecutive bytes, as floats. */
static inline f32x8 plane8(const uint8_t *src, int shift, int mask) {
#if defined(__AVX2__)
    __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));  /* one vpmovzxbd */
    w = _mm256_and_si256(_mm256_srli_epi32(w, shift), _mm256_set1_epi32(mask));
    return (f32x8)_mm256_cvtepi32_ps(w);
#else
    i32x8 w;
    for (int l = 0; l < 8; ++l) w[l] = src[l];
    w = (w >> shift) & mask;
    return __builtin_convertvector(w, f32x8);
#endif
}


/* n halves -> floats (F16C when the build has it). */
static void halfs_to_floats(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; ++i) dst[i] = h2f(src[i]);
}

/* r[i] = sum of the lanes of a[i], i < 8 (one vector of eight horizontal sums). */
static inline f32x8 hsum8x8(const f32x8 *a) {
#if defined(__AVX2__)
    __m256 h01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), h23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 h45 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), h67 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    return (f32x8)_mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
#else
    f32x8 r;
    for (int i = 0; i < 8; ++i) r[i] = hsum8(a[i]);
    return r;
#endif
}

/* Plane order: position p * nb + j holds channel j * per + p (byte j, plane p); a vector of 8
 * positions is 8 consecutive bytes of one plane. */

/* Scores of 8 consecutive packed rows (8 tokens) for M (<= 8) query rows whose scaled
 * coefficients qs (M, D) are in plane order: acc[m] receives the 8 tokens' sums. Each row is
 * unpacked once for all M. */
static inline __attribute__((always_inline)) void code_dots8_n(f32x8 *res, const float *qs, const uint8_t *rows,
                                                               int64_t nb, const int bits, const int64_t M) {
    const int per = 8 / bits, mask = (1 << bits) - 1;
    f32x8 part[8][8];  /* [m][token] */
    for (int tt = 0; tt < 8; ++tt) {
        const uint8_t *row = rows + tt * nb;
        f32x8 a[8];
        for (int64_t m = 0; m < M; ++m) a[m] = (f32x8){0};
        for (int p = 0; p < per; ++p)
            for (int64_t j = 0; j < nb; j += 8) {
                f32x8 f = plane8(row + j, p * bits, mask), qv;
                for (int64_t m = 0; m < M; ++m) {
                    memcpy(&qv, qs + m * nb * per + p * nb + j, sizeof qv);
                    a[m] += qv * f;
                }
            }
        for (int64_t m = 0; m < M; ++m) part[m][tt] = a[m];
    }
    for (int64_t m = 0; m < M; ++m) res[m] = hsum8x8(part[m]);
}

/* Tokens per piece of work in the packed-store kernels (scores: rounded up to whole key groups),
 * and per block of the values loop (a block's codes and scales stay in L1). */
enum { SPAN = 512, VBLK = 64 };

static inline int64_t span_len(int64_t G) { return (SPAN + G - 1) / G * G; }

#define KVP_BITS_CASES(CALL) \
    switch (bits) { case 2: CALL(2); break; case 4: CALL(4); break; default: CALL(8); break; }

static void code_dots8(f32x8 *res, const float *qs, const uint8_t *rows, int64_t nb, int bits, int64_t M) {
#define KVP_M_CASES(B) switch (M) { \
        case 1: code_dots8_n(res, qs, rows, nb, B, 1); break; case 2: code_dots8_n(res, qs, rows, nb, B, 2); break; \
        case 3: code_dots8_n(res, qs, rows, nb, B, 3); break; case 4: code_dots8_n(res, qs, rows, nb, B, 4); break; \
        case 5: code_dots8_n(res, qs, rows, nb, B, 5); break; case 6: code_dots8_n(res, qs, rows, nb, B, 6); break; \
        case 7: code_dots8_n(res, qs, rows, nb, B, 7); break; default: code_dots8_n(res, qs, rows, nb, B, 8); break; }
    KVP_BITS_CASES(KVP_M_CASES)
#undef KVP_M_CASES
}

/* Scores of packed tokens [t0, t1) (multiples of G) of one (row, KV head) against per-channel
 * keys: out[m * o_sm + t - t0]. ch / sh / zh point at the head's codes, scales and zero points;
 * qs is scratch of M * D + 2 * D floats. */
static void scores_span(const float *qh, int64_t M, int64_t D, const uint8_t *ch, const uint16_t *sh,
                        const uint16_t *zh, int64_t t0, int64_t t1, int bits, int64_t G, float *out, int64_t o_sm,
                        float *qs) {
    int per = 8 / bits, mask = (1 << bits) - 1;
    int64_t nb = D * bits / 8;
    int vec = nb % 8 == 0 && G % 8 == 0;
    float *sf = qs + M * D, *zf = sf + D;
    float bias[8];
    for (int64_t g0 = t0; g0 < t1; g0 += G) {
        halfs_to_floats(sf, sh + (g0 / G) * D, D);
        halfs_to_floats(zf, zh + (g0 / G) * D, D);
        for (int64_t m = 0; m < M; ++m) {  /* fold the group's scale into q; its zero point is a bias */
            float acc = 0.0f;
            for (int64_t d = 0; d < D; ++d) acc += qh[m * D + d] * zf[d];
            bias[m] = acc;
            for (int p = 0; p < per; ++p)
                for (int64_t j = 0; j < nb; ++j) qs[m * D + p * nb + j] = qh[m * D + j * per + p] * sf[j * per + p];
        }
        if (vec) {
            for (int64_t t = g0; t < g0 + G; t += 8) {
                f32x8 res[8];
                code_dots8(res, qs, ch + t * nb, nb, bits, M);
                for (int64_t m = 0; m < M; ++m) {
                    f32x8 r = res[m] + bias[m];
                    memcpy(out + m * o_sm + t - t0, &r, sizeof r);
                }
            }
            continue;
        }
        for (int64_t t = g0; t < g0 + G; ++t) {
            const uint8_t *row = ch + t * nb;
            float acc[8] = {0};
            for (int p = 0; p < per; ++p)
                for (int64_t j = 0; j < nb; ++j) {
                    float f = (float)((row[j] >> (p * bits)) & mask);
                    for (int64_t m = 0; m < M; ++m) acc[m] += qs[m * D + p * nb + j] * f;
                }
            for (int64_t m = 0; m < M; ++m) out[m * o_sm + t - t0] = acc[m] + bias[m];
        }
    }
}

/* Scores against per-channel-quantized keys (KIVI keys; groups of G tokens per channel):
 * out[b, h, m, t] = sum_d q[b, h, m, d] * (code[t, d] * scale[t / G, d] + zero[t / G, d]), t < T.
 * q (B, H, M, D) fp32 contiguous, M <= 8; out (B, H, M, T) fp32 contiguous; T a multiple of G.
 * Pieces of work: (row, KV head, span of tokens). */
int kvp_channel_scores(const float *q, int64_t B, int64_t H, int64_t M, int64_t D,
                       const uint8_t *codes, int64_t c_sb, int64_t c_sh,
                       const uint16_t *scale, const uint16_t *zero, int64_t s_sb, int64_t s_sh,
                       int64_t T, int bits, int64_t G, float *out) {
    if (!(bits == 2 || bits == 4 || bits == 8) || M < 1 || M > 8 || G <= 0 || T % G || (D * bits) % 8) return -1;
    int64_t S = span_len(G), ns = (T + S - 1) / S, items = B * H * ns;
    int nt = team(items, (double)(B * H * T) * (double)(M * D)), rc = 0;
    (void)nt;  /* unused in a build without OpenMP */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *qs = malloc(sizeof(float) * (size_t)(M * D + 2 * D));
        if (!qs) set_rc(&rc, -3);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            if (!qs) continue;
            int64_t bh = it / ns, b = bh / H, h = bh % H, t0 = (it % ns) * S, t1 = t0 + S < T ? t0 + S : T;
            scores_span(q + bh * M * D, M, D, codes + b * c_sb + h * c_sh, scale + b * s_sb + h * s_sh,
                        zero + b * s_sb + h * s_sh, t0, t1, bits, G, out + bh * M * T + t0, T, qs);
        }
        free(qs);
    }
    return rc;
}

/* Values of a block of tokens applied for M query rows, SL vectors (8 plane-order positions each)
 * starting at vector s0, accumulators in registers: acc[m][s] += sum_t w[m][t] * deq[t][s]. The
 * block's scales / zero points are floats sfb / zfb (n_tok, ng); svec (n_tok, D) / zvec, when not
 * NULL, hold them spread to plane order (groups narrower than a vector). */
static inline __attribute__((always_inline)) void values_slice_n(
        float *acc, const float *w, int64_t w_sm, const uint8_t *rows, int64_t n_tok, int64_t nb, int64_t ng,
        int64_t Gv, const float *sfb, const float *zfb, const float *svec, const float *zvec, int64_t D,
        int64_t s0, const int bits, const int64_t M, const int64_t SL) {
    const int per = 8 / bits, mask = (1 << bits) - 1;
    f32x8 a[8][4];
    int64_t pos[4], joff[4], kk[4];
    int shift[4];
    for (int64_t s = 0; s < SL; ++s) {  /* where vector s of the slice sits: byte offset, plane, value group */
        pos[s] = (s0 + s) * 8;
        joff[s] = pos[s] % nb;
        shift[s] = (int)(pos[s] / nb) * bits;
        kk[s] = (joff[s] * per + pos[s] / nb) / Gv;
    }
    for (int64_t m = 0; m < M; ++m)
        for (int64_t s = 0; s < SL; ++s) memcpy(&a[m][s], acc + m * D + pos[s], sizeof(f32x8));
    for (int64_t t = 0; t < n_tok; ++t) {
        const uint8_t *row = rows + t * nb;
        f32x8 deq[4];
        for (int64_t s = 0; s < SL; ++s) {
            f32x8 f = plane8(row + joff[s], shift[s], mask);
            if (svec) {
                f32x8 sv, zv;
                memcpy(&sv, svec + t * D + pos[s], sizeof sv);
                memcpy(&zv, zvec + t * D + pos[s], sizeof zv);
                deq[s] = f * sv + zv;
            } else {
                deq[s] = f * sfb[t * ng + kk[s]] + zfb[t * ng + kk[s]];
            }
        }
        for (int64_t m = 0; m < M; ++m) {
            float wm = w[m * w_sm + t];
            for (int64_t s = 0; s < SL; ++s) a[m][s] += wm * deq[s];
        }
    }
    for (int64_t m = 0; m < M; ++m)
        for (int64_t s = 0; s < SL; ++s) memcpy(acc + m * D + pos[s], &a[m][s], sizeof(f32x8));
}

/* acc (M, D), plane order, += sum over packed tokens t in [t0, t1) of one (row, KV head) of
 * w[m * w_sm + t - t0] * dequantized value row t (per-token groups of Gv channels). Tokens go in
 * blocks that stay in L1 while the output channels are swept a few vectors at a time (the
 * accumulators stay in registers). gidx (D): the value group of each plane-order position;
 * scratch: values_scratch(D, Gv) floats. */
static int64_t values_scratch(int64_t D, int64_t Gv) { return 2 * VBLK * (D / Gv) + 2 * VBLK * D + D; }

static void values_span(const float *w, int64_t w_sm, int64_t M, int64_t D, const uint8_t *ch, const uint16_t *sh,
                        const uint16_t *zh, int64_t t0, int64_t t1, int bits, int64_t Gv, const int32_t *gidx,
                        float *acc, float *scratch) {
    int per = 8 / bits, mask = (1 << bits) - 1;
    int64_t nb = D * bits / 8, ng = D / Gv;
    /* a vector of 8 bytes of one plane spans 8 * per channels: one value group when Gv is a multiple */
    int vec = nb % 8 == 0, uniform = Gv % (8 * per) == 0;
    /* accumulator vectors per pass: M * SL <= 12 registers */
    int64_t SL = M <= 3 ? 4 : (M <= 6 ? 2 : 1), nvec = D / 8;
    float *sfb = scratch, *zfb = sfb + VBLK * ng, *svec = zfb + VBLK * ng, *zvec = svec + VBLK * D;
    float *deq = zvec + VBLK * D;
    for (int64_t b0 = t0; b0 < t1; b0 += VBLK) {
        int64_t n_tok = t1 - b0 < VBLK ? t1 - b0 : VBLK;
        const float *wb = w + (b0 - t0);
        halfs_to_floats(sfb, sh + b0 * ng, n_tok * ng);
        halfs_to_floats(zfb, zh + b0 * ng, n_tok * ng);
        const uint8_t *rows = ch + b0 * nb;
        if (!vec) {
            for (int64_t t = 0; t < n_tok; ++t) {
                for (int pl = 0; pl < per; ++pl)
                    for (int64_t j = 0; j < nb; ++j) {
                        int64_t k = gidx[pl * nb + j];
                        deq[pl * nb + j] = (float)((rows[t * nb + j] >> (pl * bits)) & mask) * sfb[t * ng + k]
                                           + zfb[t * ng + k];
                    }
                for (int64_t m = 0; m < M; ++m) axpy(acc + m * D, wb[m * w_sm + t], deq, D);
            }
            continue;
        }
        const float *sv = NULL, *zv = NULL;
        if (!uniform) {
            for (int64_t t = 0; t < n_tok; ++t)
                for (int64_t i = 0; i < D; ++i) {
                    svec[t * D + i] = sfb[t * ng + gidx[i]];
                    zvec[t * D + i] = zfb[t * ng + gidx[i]];
                }
            sv = svec, zv = zvec;
        }
        for (int64_t s0 = 0; s0 < nvec; s0 += SL) {
            int64_t sl = nvec - s0 < SL ? nvec - s0 : SL;
#define KVP_SLICE(Bi, Mi, Si) values_slice_n(acc, wb, w_sm, rows, n_tok, nb, ng, Gv, sfb, zfb, sv, zv, D, s0, Bi, Mi, Si)
#define KVP_SL(Bi, Mi) do { if (sl == 4) KVP_SLICE(Bi, Mi, 4); else if (sl == 3) KVP_SLICE(Bi, Mi, 3); \
                            else if (sl == 2) KVP_SLICE(Bi, Mi, 2); else KVP_SLICE(Bi, Mi, 1); } while (0)
#define KVP_MS(Bi) switch (M) { case 1: KVP_SL(Bi, 1); break; case 2: KVP_SL(Bi, 2); break; \
                                case 3: KVP_SL(Bi, 3); break; case 4: KVP_SL(Bi, 4); break; case 5: KVP_SL(Bi, 5); break; \
                                case 6: KVP_SL(Bi, 6); break; case 7: KVP_SL(Bi, 7); break; default: KVP_SL(Bi, 8); break; }
            KVP_BITS_CASES(KVP_MS)
#undef KVP_MS
#undef KVP_SL
#undef KVP_SLICE
        }
    }
}

/* gidx[i]: the value group of plane-order position i (D ints). */
static void plane_groups(int32_t *gidx, int64_t D, int bits, int64_t Gv) {
    int per = 8 / bits;
    int64_t nb = D * bits / 8;
    for (int pl = 0; pl < per; ++pl)
        for (int64_t j = 0; j < nb; ++j) gidx[pl * nb + j] = (int32_t)((j * per + pl) / Gv);
}

/* out (M, D) channel order = acc (M, D) plane order (a permutation). */
static void plane_to_channel(float *out, const float *acc, int64_t M, int64_t D, int bits) {
    int per = 8 / bits;
    int64_t nb = D * bits / 8;
    for (int64_t m = 0; m < M; ++m)
        for (int pl = 0; pl < per; ++pl)
            for (int64_t j = 0; j < nb; ++j) out[m * D + j * per + pl] = acc[m * D + pl * nb + j];
}

/* Probabilities applied to per-token-quantized values (groups of Gv channels per token):
 * out[b, h, m, d] = sum_t p[b, h, m, t] * (code[t, d] * scale[t, d / Gv] + zero[t, d / Gv]), t < T.
 * p (B, H, M, *) fp32 with row stride p_sm (so a slice of wider scores works), M <= 8;
 * out (B, H, M, D) fp32 contiguous. Pieces of work: (row, KV head, span of tokens), each summed
 * on its own, then added in span order. */
int kvp_token_values(const float *p, int64_t B, int64_t H, int64_t M, int64_t p_sm, int64_t D,
                     const uint8_t *codes, int64_t c_sb, int64_t c_sh,
                     const uint16_t *scale, const uint16_t *zero, int64_t s_sb, int64_t s_sh,
                     int64_t T, int bits, int64_t Gv, float *out) {
    if (!(bits == 2 || bits == 4 || bits == 8) || M < 1 || M > 8 || Gv <= 0 || D % Gv || (D * bits) % 8 || T < 0)
        return -1;
    int64_t ns = (T + SPAN - 1) / SPAN, items = B * H * ns;
    if (ns == 0) {
        memset(out, 0, sizeof(float) * (size_t)(B * H * M * D));
        return 0;
    }
    float *part = malloc(sizeof(float) * (size_t)(items * M * D));
    int32_t *gidx = malloc(sizeof(int32_t) * (size_t)D);
    if (!part || !gidx) { free(part); free(gidx); return -3; }
    plane_groups(gidx, D, bits, Gv);
    int nt = team(items, (double)(B * H * T) * (double)(M * D)), rc = 0;
    (void)nt;  /* unused in a build without OpenMP */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *scratch = malloc(sizeof(float) * (size_t)values_scratch(D, Gv));
        if (!scratch) set_rc(&rc, -3);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            if (!scratch) continue;
            int64_t bh = it / ns, b = bh / H, h = bh % H, t0 = (it % ns) * SPAN, t1 = t0 + SPAN < T ? t0 + SPAN : T;
            float *acc = part + it * M * D;
            memset(acc, 0, sizeof(float) * (size_t)(M * D));
            values_span(p + bh * M * p_sm + t0, p_sm, M, D, codes + b * c_sb + h * c_sh, scale + b * s_sb + h * s_sh,
                        zero + b * s_sb + h * s_sh, t0, t1, bits, Gv, gidx, acc, scratch);
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            float *acc = part + bh * ns * M * D;
            for (int64_t k = 1; k < ns; ++k)
                for (int64_t i = 0; i < M * D; ++i) acc[i] += acc[k * M * D + i];
            plane_to_channel(out + bh * M * D, acc, M, D, bits);
        }
        free(scratch);
    }
    free(part);
    free(gidx);
    return rc;
}

/* ------------------------------------------------------------------ GEAR's corrections (kvpress/policies/gear.py)
 *
 * Beside a KIVI-format packed store of n tokens, GEAR keeps per (row, KV head):
 *   a low-rank error of keys and of values: left factors l (n, R) fp16, token-aligned, and per
 *     flushed chunk c (tokens [bounds[c], bounds[c + 1])) right factors rf (D, R) fp16; the
 *     chunk's error is l_c rf_c^T;
 *   key outliers per token group g: J offsets inside the group (uint8) and corrections (fp16),
 *     both (n / G, J, D): entry (g * G + off[g, j, d], d) gets + corr[g, j, d];
 *   value outliers per token t: D / Gv * J offsets inside the channel group and corrections, both
 *     (n, D / Gv * J): entry (t, gd * Gv + off[t, gd * J + j]) gets + corr[t, gd * J + j];
 *   sink corrections sk / sv (S, D) fp16: what the parts above miss on each row's first S real
 *     tokens (sequence index sink_start[b] + i, clamped to n - 1; zero until flushed).
 * R = 0, J = 0 or S = 0 leaves a part out. An offset outside its group (not a GEAR store) is
 * skipped and reported (-4). */
typedef struct {
    int64_t R;
    const int64_t *bounds;
    int64_t C;
    const uint16_t *kl, *kr, *vl, *vr;
    int64_t kl_sb, kl_sh, kr_sb, kr_sh, vl_sb, vl_sh, vr_sb, vr_sh;
    int64_t J;
    const uint8_t *ko, *vo;
    const uint16_t *kx, *vx;
    int64_t ko_sb, ko_sh, vo_sb, vo_sh;
    int64_t S;
    const uint16_t *sk, *sv;
    int64_t sk_sb, sk_sh;
    const int32_t *sink_start;
} kvp_gear;

enum { GEAR_BLK = 256 };  /* tokens whose fp16 factors / corrections are converted at a time */

/* floats of scratch gear_key_span / gear_value_span need */
static int64_t gear_scratch(const kvp_gear *x, int64_t M, int64_t D, int64_t Gv) {
    int64_t per_tok = D / Gv * x->J, blk = GEAR_BLK * (x->R > per_tok ? x->R : per_tok);
    return M * x->R + blk + D * x->R + x->J * D + D + 1;
}

static int gear_ok(const kvp_gear *x, int64_t n) {
    return x->R >= 0 && x->J >= 0 && x->S >= 0
           && (x->R == 0 || (x->C >= 1 && x->bounds[0] == 0 && x->bounds[x->C] == n));
}

/* the packed column of row b's sink i: its sequence index, clamped into the n packed tokens (a sink
 * not flushed yet has a zero correction, so any in-range column will do) */
static inline int64_t sink_col(const kvp_gear *x, int64_t b, int64_t n, int64_t i) {
    int64_t c = (x->sink_start ? x->sink_start[b] : 0) + i;
    return c < n - 1 ? c : n - 1;
}

/* the chunk holding token t: bounds[c] <= t < bounds[c + 1] */
static int64_t chunk_of(const int64_t *bounds, int64_t C, int64_t t) {
    int64_t lo = 0, hi = C - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (bounds[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* sc[m * s_sm + t - t0] += q . (key corrections of token t), t in [t0, t1) (multiples of G), for
 * row b, KV head h; qh (M, D) scaled queries. */
static void gear_key_span(const kvp_gear *x, int64_t b, int64_t h, const float *qh, int64_t M, int64_t D, int64_t G,
                          int64_t n, int64_t t0, int64_t t1, float *sc, int64_t s_sm, float *scr, int *rc) {
    int64_t R = x->R, J = x->J;
    float *qr = scr, *lf = qr + M * R, *rff = lf + GEAR_BLK * (R > 0 ? R : 0), *cf = rff + D * R, *row = cf + J * D;
    if (R > 0 && t1 > t0) {
        const uint16_t *lh = x->kl + b * x->kl_sb + h * x->kl_sh, *rh = x->kr + b * x->kr_sb + h * x->kr_sh;
        for (int64_t c = chunk_of(x->bounds, x->C, t0); c < x->C && x->bounds[c] < t1; ++c) {
            int64_t a = x->bounds[c] > t0 ? x->bounds[c] : t0, e = x->bounds[c + 1] < t1 ? x->bounds[c + 1] : t1;
            halfs_to_floats(rff, rh + c * D * R, D * R);
            for (int64_t m = 0; m < M; ++m)  /* q rf_c: (M, R) */
                for (int64_t r = 0; r < R; ++r) {
                    float acc = 0.0f;
                    for (int64_t d = 0; d < D; ++d) acc += qh[m * D + d] * rff[d * R + r];
                    qr[m * R + r] = acc;
                }
            for (int64_t u0 = a; u0 < e; u0 += GEAR_BLK) {
                int64_t nb = e - u0 < GEAR_BLK ? e - u0 : GEAR_BLK;
                halfs_to_floats(lf, lh + u0 * R, nb * R);
                for (int64_t m = 0; m < M; ++m) {
                    float *out = sc + m * s_sm + u0 - t0;
                    for (int64_t r = 0; r < R; ++r) {
                        float f = qr[m * R + r];
#pragma omp simd
                        for (int64_t i = 0; i < nb; ++i) out[i] += f * lf[i * R + r];
                    }
                }
            }
        }
    }
    if (J > 0) {
        const uint8_t *oh = x->ko + b * x->ko_sb + h * x->ko_sh;
        const uint16_t *ch = x->kx + b * x->ko_sb + h * x->ko_sh;
        for (int64_t g = t0 / G; g < t1 / G; ++g) {
            const uint8_t *og = oh + g * J * D;
            halfs_to_floats(cf, ch + g * J * D, J * D);
            for (int64_t j = 0, i = 0; j < J; ++j)
                for (int64_t d = 0; d < D; ++d, ++i) {
                    if (og[i] >= G) { set_rc(rc, -4); continue; }
                    float *col = sc + g * G + og[i] - t0;
                    for (int64_t m = 0; m < M; ++m) col[m * s_sm] += qh[m * D + d] * cf[i];
                }
        }
    }
    for (int64_t i = 0; i < x->S && n > 0; ++i) {
        int64_t col = sink_col(x, b, n, i);
        if (col < t0 || col >= t1) continue;
        halfs_to_floats(row, x->sk + b * x->sk_sb + h * x->sk_sh + i * D, D);
        for (int64_t m = 0; m < M; ++m) sc[m * s_sm + col - t0] += dot(qh + m * D, row, D);
    }
}

/* acc (M, D) channel order += sum over t in [a, t1) of w[m * w_sm + t - t0] * (value corrections
 * of token t), for row b, KV head h (value groups of Gv channels). */
static void gear_value_span(const kvp_gear *x, int64_t b, int64_t h, const float *w, int64_t w_sm, int64_t M,
                            int64_t D, int64_t Gv, int64_t n, int64_t t0, int64_t a, int64_t t1, float *acc,
                            float *scr, int *rc) {
    int64_t R = x->R, J = x->J, per_tok = D / Gv * J, blk = GEAR_BLK * (R > per_tok ? R : per_tok);
    float *pc = scr, *bf = pc + M * R, *rff = bf + blk, *row = rff + D * R + J * D;
    if (R > 0 && t1 > a) {
        const uint16_t *lh = x->vl + b * x->vl_sb + h * x->vl_sh, *rh = x->vr + b * x->vr_sb + h * x->vr_sh;
        for (int64_t c = chunk_of(x->bounds, x->C, a); c < x->C && x->bounds[c] < t1; ++c) {
            int64_t lo = x->bounds[c] > a ? x->bounds[c] : a, e = x->bounds[c + 1] < t1 ? x->bounds[c + 1] : t1;
            for (int64_t i = 0; i < M * R; ++i) pc[i] = 0.0f;  /* w_c l_c: (M, R) */
            for (int64_t u0 = lo; u0 < e; u0 += GEAR_BLK) {
                int64_t nb = e - u0 < GEAR_BLK ? e - u0 : GEAR_BLK;
                halfs_to_floats(bf, lh + u0 * R, nb * R);
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t r = 0; r < R; ++r) {
                        float s = 0.0f;
                        const float *wm = w + m * w_sm + u0 - t0;
#pragma omp simd reduction(+ : s)
                        for (int64_t i = 0; i < nb; ++i) s += wm[i] * bf[i * R + r];
                        pc[m * R + r] += s;
                    }
            }
            halfs_to_floats(rff, rh + c * D * R, D * R);
            for (int64_t m = 0; m < M; ++m)
                for (int64_t r = 0; r < R; ++r) {
                    float f = pc[m * R + r];
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) acc[m * D + d] += f * rff[d * R + r];
                }
        }
    }
    if (J > 0) {
        const uint8_t *offh = x->vo + b * x->vo_sb + h * x->vo_sh;
        const uint16_t *ch = x->vx + b * x->vo_sb + h * x->vo_sh;
        for (int64_t u0 = a; u0 < t1; u0 += GEAR_BLK) {
            int64_t nb = t1 - u0 < GEAR_BLK ? t1 - u0 : GEAR_BLK;
            halfs_to_floats(bf, ch + u0 * per_tok, nb * per_tok);
            for (int64_t t = u0, i = 0; t < u0 + nb; ++t) {
                float pt[8];
                for (int64_t m = 0; m < M; ++m) pt[m] = w[m * w_sm + t - t0];
                for (int64_t gd = 0; gd < D / Gv; ++gd)
                    for (int64_t j = 0; j < J; ++j, ++i) {
                        uint8_t o = offh[t * per_tok + gd * J + j];
                        if (o >= Gv) { set_rc(rc, -4); continue; }
                        for (int64_t m = 0; m < M; ++m) acc[m * D + gd * Gv + o] += pt[m] * bf[i];
                    }
            }
        }
    }
    for (int64_t i = 0; i < x->S && n > 0; ++i) {
        int64_t col = sink_col(x, b, n, i);
        if (col < a || col >= t1) continue;
        halfs_to_floats(row, x->sv + b * x->sk_sb + h * x->sk_sh + i * D, D);
        for (int64_t m = 0; m < M; ++m) axpy(acc + m * D, w[m * w_sm + col - t0], row, D);
    }
}

/* GEAR's corrections on their own; pieces of work: (row, KV head).
 * values == 0: out = s (B, H, M, N) fp32 contiguous += in = q (B, H, M, D) (scaled, contiguous,
 *   in_sm = D) . the key corrections (x's key fields; G the key group);
 * values == 1: out (B, H, M, D) fp32 contiguous += in = p (B, H, M, *) (row stride in_sm) applied
 *   to the value corrections (x's value fields; G the value group). */
int kvp_gear_extra(int values, const float *in, int64_t B, int64_t H, int64_t M, int64_t in_sm, int64_t D, int64_t N,
                   const kvp_gear *x, int64_t G, float *out) {
    if (M < 1 || M > 8 || G <= 0 || N < 0 || (values ? D % G : N % G) || !gear_ok(x, N)) return -1;
    double per_tok = values ? (double)(D / G) * x->J : (double)x->J * D / G;
    int nt = team(B * H, (double)(B * H) * M * (N * (x->R + per_tok) + (double)x->C * D * x->R)), rc = 0;
    (void)nt;  /* unused in a build without OpenMP */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *scr = malloc(sizeof(float) * (size_t)gear_scratch(x, M, D, G));
        if (!scr) set_rc(&rc, -3);
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            if (!scr) continue;
            if (values)
                gear_value_span(x, bh / H, bh % H, in + bh * M * in_sm, in_sm, M, D, G, N, 0, 0, N, out + bh * M * D,
                                scr, &rc);
            else
                gear_key_span(x, bh / H, bh % H, in + bh * M * D, M, D, G, N, 0, N, out + bh * M * N, N, scr, &rc);
        }
        free(scr);
    }
    return rc;
}

/* A packed KIVI-format store read by kvp_quant_attend: keys per channel (codes (B, H, >=n, D * bits / 8),
 * fp16 scales / zero points (B, H, >=n / G, D)), values per token (codes (B, H, >=n, D * bits / 8),
 * scales / zero points (B, H, >=n, D / Gv)); element strides for the batch and head dims. Tokens
 * before starts[b * st_sb + h * st_sh] are not attended (starts NULL: all are); vmul, when not
 * NULL, is an fp16 (B, H, D) per-channel factor on the segment's values (ZipCache's normaliser);
 * gear, when not NULL, GEAR's corrections to this store (value groups of Gv channels). */
typedef struct {
    const uint8_t *kc;
    const uint16_t *ks, *kz;
    const uint8_t *vc;
    const uint16_t *vs, *vz;
    int64_t kc_sb, kc_sh, ks_sb, ks_sh, vc_sb, vc_sh, vs_sb, vs_sh;
    int64_t n, bits, G, Gv;
    const int32_t *starts;
    int64_t st_sb, st_sh;
    const uint16_t *vmul;
    int64_t vm_sb, vm_sh;
    const kvp_gear *gear;
} kvp_segment;

enum { MAX_SEGMENTS = 8 };

/* One decode step over packed segments and a full-precision window, under one softmax: q (B, H,
 * M, D) fp32 contiguous, already scaled, M <= 8; the window rows [w_starts[b], W) of kw / vw (fp32
 * (B, H, W_cap, D), dense (W, D) dims; w_starts NULL: all). out (B, H, M, D) fp32; lse (B, H, M)
 * (-inf when nothing is attended).
 *
 * Split like flash-decoding: each piece (row, KV head, span of one segment's tokens, or the window)
 * keeps its own running max, sum of exponentials and unnormalised value sum; the pieces of a (row,
 * KV head) are merged in a fixed order. */
int kvp_quant_attend(const float *q, int64_t B, int64_t H, int64_t M, int64_t D,
                     const kvp_segment *seg, int64_t nseg,
                     const float *kw, const float *vw, int64_t w_sb, int64_t w_sh, int64_t W, const int32_t *w_starts,
                     float *out, float *lse) {
    if (M < 1 || M > 8 || W < 0 || nseg < 0 || nseg > MAX_SEGMENTS) return -1;
    int64_t per_bh = 1, smax = W > D ? W : D, vmax = 0, total_n = 0;
    for (int64_t i = 0; i < nseg; ++i) {
        const kvp_segment *g = seg + i;
        if (!(g->bits == 2 || g->bits == 4 || g->bits == 8) || g->G <= 0 || g->Gv <= 0 || g->n < 0 || g->n % g->G
            || D % g->Gv || (D * g->bits) % 8 || (g->gear && !gear_ok(g->gear, g->n))) return -1;
        int64_t S = span_len(g->G), vs = values_scratch(D, g->Gv);
        if (g->gear && gear_scratch(g->gear, M, D, g->Gv) > vs) vs = gear_scratch(g->gear, M, D, g->Gv);
        per_bh += (g->n + S - 1) / S;
        smax = S > smax ? S : smax;
        vmax = vs > vmax ? vs : vmax;
        total_n += g->n;
    }
    /* a piece: value sum (M, D) in plane order, max (M), sum (M), GEAR's value corrections (M, D) in channel order */
    int64_t psz = 2 * M * D + 2 * M, items = B * H * per_bh;
    float *part = malloc(sizeof(float) * (size_t)(items * psz));
    int32_t *gidx = malloc(sizeof(int32_t) * (size_t)(nseg * D + 1));
    int64_t *piece = malloc(sizeof(int64_t) * (size_t)(3 * per_bh));  /* segment, first token, end */
    if (!part || !gidx || !piece) { free(part); free(gidx); free(piece); return -3; }
    int64_t k = 0;
    for (int64_t i = 0; i < nseg; ++i) {
        plane_groups(gidx + i * D, D, (int)seg[i].bits, seg[i].Gv);
        int64_t S = span_len(seg[i].G);
        for (int64_t t0 = 0; t0 < seg[i].n; t0 += S, ++k)
            piece[3 * k] = i, piece[3 * k + 1] = t0, piece[3 * k + 2] = t0 + S < seg[i].n ? t0 + S : seg[i].n;
    }
    int nt = team(items, (double)(B * H * (total_n + W)) * (double)(M * D)), rc = 0;
    (void)nt;  /* unused in a build without OpenMP */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *qs = malloc(sizeof(float) * (size_t)(M * D + 2 * D + M * smax + vmax + M * D));
        if (!qs) set_rc(&rc, -3);
        float *sc = qs + M * D + 2 * D, *vscr = sc + M * smax, *tmp2 = vscr + vmax;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            if (!qs) continue;
            int64_t bh = it / per_bh, b = bh / H, h = bh % H, kk = it % per_bh;
            const float *qh = q + bh * M * D;
            float *acc = part + it * psz, *mx = acc + M * D, *sum = mx + M, *acc2 = sum + M;
            memset(acc, 0, sizeof(float) * (size_t)(M * D));
            memset(acc2, 0, sizeof(float) * (size_t)(M * D));
            for (int64_t m = 0; m < M; ++m) mx[m] = -INFINITY, sum[m] = 0.0f;
            if (kk < per_bh - 1) {  /* a span [t0, t1) of a segment; values in its plane order */
                const kvp_segment *g = seg + piece[3 * kk];
                int64_t t0 = piece[3 * kk + 1], t1 = piece[3 * kk + 2], bits = g->bits;
                int64_t n0 = g->starts ? g->starts[b * g->st_sb + h * g->st_sh] : 0;
                n0 = n0 < t0 ? t0 : n0;
                if (n0 >= t1) continue;
                scores_span(qh, M, D, g->kc + b * g->kc_sb + h * g->kc_sh, g->ks + b * g->ks_sb + h * g->ks_sh,
                            g->kz + b * g->ks_sb + h * g->ks_sh, t0, t1, (int)bits, g->G, sc, t1 - t0, qs);
                if (g->gear) gear_key_span(g->gear, b, h, qh, M, D, g->G, g->n, t0, t1, sc, t1 - t0, vscr, &rc);
                int64_t lo = n0 - t0, len = t1 - n0;
                for (int64_t m = 0; m < M; ++m) {
                    float *r = sc + m * (t1 - t0) + lo, x = -INFINITY, tot = 0.0f;
                    for (int64_t i = 0; i < len; ++i) x = r[i] > x ? r[i] : x;
                    for (int64_t i = 0; i < len; ++i) { r[i] = expf(r[i] - x); tot += r[i]; }
                    mx[m] = x, sum[m] = tot;
                }
                values_span(sc + lo, t1 - t0, M, D, g->vc + b * g->vc_sb + h * g->vc_sh,
                            g->vs + b * g->vs_sb + h * g->vs_sh,
                            g->vz + b * g->vs_sb + h * g->vs_sh, n0, t1, (int)bits, g->Gv, gidx + piece[3 * kk] * D,
                            acc, vscr);
                if (g->gear)
                    gear_value_span(g->gear, b, h, sc, t1 - t0, M, D, g->Gv, g->n, t0, n0, t1, acc2, vscr, &rc);
            } else {  /* the window: rows [w0, W), values in channel order */
                int64_t w0 = w_starts ? w_starts[b] : 0;
                w0 = w0 < 0 ? 0 : w0;
                if (w0 >= W) continue;
                const float *kwh = kw + b * w_sb + h * w_sh, *vwh = vw + b * w_sb + h * w_sh;
                for (int64_t i = w0; i < W; ++i) {
                    float d8[8];
                    dots(d8, qh, kwh + i * D, M, D);
                    for (int64_t m = 0; m < M; ++m) sc[m * W + i] = d8[m];
                }
                for (int64_t m = 0; m < M; ++m) {
                    float *r = sc + m * W, x = -INFINITY, tot = 0.0f;
                    for (int64_t i = w0; i < W; ++i) x = r[i] > x ? r[i] : x;
                    for (int64_t i = w0; i < W; ++i) { r[i] = expf(r[i] - x); tot += r[i]; }
                    mx[m] = x, sum[m] = tot;
                }
                for (int64_t i = w0; i < W; ++i) {  /* each window value row read once for the group */
                    const float *vr = vwh + i * D;
                    for (int64_t m = 0; m < M; ++m) axpy(acc + m * D, sc[m * W + i], vr, D);
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; ++bh) {  /* merge the pieces of (row, KV head) in order */
            if (!qs) continue;
            int64_t b = bh / H, h = bh % H;
            const float *pb = part + bh * per_bh * psz, *pw = pb + (per_bh - 1) * psz;  /* the window piece is last */
            float *oh = out + bh * M * D, *lh = lse + bh * M, *tmp = qs, *seg_out = sc, tot[8], top[8];
            for (int64_t m = 0; m < M; ++m) {
                float x = -INFINITY;
                for (int64_t kk = 0; kk < per_bh; ++kk) x = pb[kk * psz + M * D + m] > x ? pb[kk * psz + M * D + m] : x;
                top[m] = x, tot[m] = 0.0f;
                for (int64_t kk = 0; kk < per_bh && x != -INFINITY; ++kk)
                    if (pb[kk * psz + M * D + m] != -INFINITY)
                        tot[m] += expf(pb[kk * psz + M * D + m] - x) * pb[kk * psz + M * D + M + m];
            }
            memset(oh, 0, sizeof(float) * (size_t)(M * D));
            for (int64_t i = 0, kk = 0; i < nseg; ++i) {  /* each segment: its pieces in plane order, then channels */
                memset(tmp, 0, sizeof(float) * (size_t)(M * D));
                if (seg[i].gear) memset(tmp2, 0, sizeof(float) * (size_t)(M * D));
                for (; kk < per_bh - 1 && piece[3 * kk] == i; ++kk)
                    for (int64_t m = 0; m < M; ++m) {
                        const float *pk = pb + kk * psz;
                        if (top[m] == -INFINITY || pk[M * D + m] == -INFINITY) continue;
                        float f = expf(pk[M * D + m] - top[m]);
                        axpy(tmp + m * D, f, pk + m * D, D);
                        if (seg[i].gear) axpy(tmp2 + m * D, f, pk + M * D + 2 * M + m * D, D);
                    }
                plane_to_channel(seg_out, tmp, M, D, (int)seg[i].bits);
                if (seg[i].gear)
                    for (int64_t m = 0; m < M; ++m) axpy(seg_out + m * D, 1.0f, tmp2 + m * D, D);
                if (seg[i].vmul) {
                    const uint16_t *vm = seg[i].vmul + b * seg[i].vm_sb + h * seg[i].vm_sh;
                    for (int64_t d = 0; d < D; ++d) {
                        float f = h2f(vm[d]);
                        for (int64_t m = 0; m < M; ++m) seg_out[m * D + d] *= f;
                    }
                }
                for (int64_t m = 0; m < M; ++m) axpy(oh + m * D, 1.0f, seg_out + m * D, D);
            }
            for (int64_t m = 0; m < M; ++m) {
                if (top[m] == -INFINITY) {  /* nothing attended */
                    memset(oh + m * D, 0, sizeof(float) * (size_t)D);
                    lh[m] = -INFINITY;
                    continue;
                }
                if (pw[M * D + m] != -INFINITY) axpy(oh + m * D, expf(pw[M * D + m] - top[m]), pw + m * D, D);
                float inv = 1.0f / tot[m];
                for (int64_t d = 0; d < D; ++d) oh[m * D + d] *= inv;
                lh[m] = top[m] + logf(tot[m]);
            }
        }
        free(qs);
    }
    free(part);
    free(gidx);
    free(piece);
    return rc;
}


/* ------------------------------------------------------------------ ShadowKV chunk selection */

/* RoPE angles for ShadowKV's rebuild. The reference (kvpress/kernels/shadowkv_rebuild.py) takes
 * cos / sin of the fp32 product fl(p * f_i) at position p. Here the exact angle p * f_i comes from
 * double rotations -- a table `lo` of (cos, sin)(l * f_i), l < 64, one `hi` of (cos, sin)(64 u * f_i),
 * both built by recurrence once per call, composed per chunk start and advanced by (cos, sin)(j * f_i)
 * -- and is then moved by the first-order correction for the rounding e = fl(p * f_i) - p * f_i
 * (|e| <= half an ulp of the angle, so what is left, e^2 / 2, is below fp32's resolution): no sin /
 * cos per token. Tables: (cos, sin) pairs, `half` frequencies per entry. */
typedef struct {
    int64_t half, cs, n_hi;
    const float *inv_freq;
    double *lo, *hi, *step;  /* 64 entries, n_hi entries, cs entries; each 2 * half doubles */
} kvp_rope;

static void rot_table(double *t, int64_t n, int64_t half, const double *unit) {
    for (int64_t i = 0; i < half; ++i) t[2 * i] = 1.0, t[2 * i + 1] = 0.0;
    for (int64_t e = 1; e < n; ++e)
        for (int64_t i = 0; i < half; ++i) {
            double c = t[(e - 1) * 2 * half + 2 * i], s = t[(e - 1) * 2 * half + 2 * i + 1];
            double uc = unit[2 * i], us = unit[2 * i + 1];
            t[e * 2 * half + 2 * i] = c * uc - s * us;
            t[e * 2 * half + 2 * i + 1] = s * uc + c * us;
        }
}

static int rope_init(kvp_rope *r, const float *inv_freq, int64_t half, int64_t cs, int64_t max_pos) {
    r->half = half, r->cs = cs, r->inv_freq = inv_freq, r->n_hi = max_pos / 64 + 2;
    double *buf = malloc(sizeof(double) * (size_t)(2 * half * (64 + r->n_hi + cs + 2)));
    if (!buf) return -3;
    r->lo = buf, r->hi = buf + 2 * half * 64, r->step = r->hi + 2 * half * r->n_hi;
    double *u1 = r->step + 2 * half * cs, *u64 = u1 + 2 * half;
    for (int64_t i = 0; i < half; ++i) {
        double f = (double)inv_freq[i];
        u1[2 * i] = cos(f), u1[2 * i + 1] = sin(f), u64[2 * i] = cos(64.0 * f), u64[2 * i + 1] = sin(64.0 * f);
    }
    rot_table(r->lo, 64, half, u1);
    rot_table(r->hi, r->n_hi, half, u64);
    rot_table(r->step, cs, half, u1);
    return 0;
}

/* cos / sin (fp32, as the reference rounds) for positions t0 + j, j < cs: cosv / sinv (cs, half). */
static void rope_chunk(const kvp_rope *r, float *cosv, float *sinv, int64_t t0) {
    int64_t half = r->half;
    double c0[256], s0[256];
    if (t0 >= 0 && t0 / 64 < r->n_hi) {
        const double *h = r->hi + (t0 / 64) * 2 * half, *l = r->lo + (t0 % 64) * 2 * half;
        for (int64_t i = 0; i < half; ++i) {
            c0[i] = h[2 * i] * l[2 * i] - h[2 * i + 1] * l[2 * i + 1];
            s0[i] = h[2 * i + 1] * l[2 * i] + h[2 * i] * l[2 * i + 1];
        }
    } else {  /* outside the tables (a padded position): direct */
        for (int64_t i = 0; i < half; ++i) {
            double a = (double)t0 * (double)r->inv_freq[i];
            c0[i] = cos(a), s0[i] = sin(a);
        }
    }
    for (int64_t j = 0; j < r->cs; ++j) {
        const double *st = r->step + j * 2 * half;
        float p = (float)(t0 + j);
        for (int64_t i = 0; i < half; ++i) {
            double c = c0[i] * st[2 * i] - s0[i] * st[2 * i + 1];
            double s = s0[i] * st[2 * i] + c0[i] * st[2 * i + 1];
            double e = (double)(p * r->inv_freq[i]) - (double)(t0 + j) * (double)r->inv_freq[i];
            cosv[j * half + i] = (float)(c - e * s);
            sinv[j * half + i] = (float)(s + e * c);
        }
    }
}

/* pre (ND * 8 floats) = sum_r f[r] * basis[r * stride ..], accumulated in registers. */
#define KVP_LOWRANK(ND)                                                                                        \
    static inline void lowrank_##ND(float *pre, const float *f, const float *basis, int64_t stride, int64_t R) { \
        f32x8 a[ND];                                                                                           \
        for (int k = 0; k < ND; ++k) a[k] = (f32x8){0};                                                        \
        for (int64_t r = 0; r < R; ++r) {                                                                      \
            const float *w = basis + r * stride;                                                               \
            for (int k = 0; k < ND; ++k) {                                                                     \
                f32x8 wv;                                                                                      \
                memcpy(&wv, w + 8 * k, sizeof wv);                                                             \
                a[k] += f[r] * wv;                                                                             \
            }                                                                                                  \
        }                                                                                                      \
        memcpy(pre, a, sizeof a);                                                                              \
    }
KVP_LOWRANK(4)
KVP_LOWRANK(8)
KVP_LOWRANK(16)

static void lowrank(float *pre, const float *f, const float *basis, int64_t stride, int64_t R, int64_t D) {
    switch (D) {
        case 32: lowrank_4(pre, f, basis, stride, R); return;
        case 64: lowrank_8(pre, f, basis, stride, R); return;
        case 128: lowrank_16(pre, f, basis, stride, R); return;
        default:
            memset(pre, 0, sizeof(float) * (size_t)D);
            for (int64_t r = 0; r < R; ++r) axpy(pre, f[r], basis + r * stride, D);
    }
}

/* Keys of chunk `chunk` rebuilt into out (cs, D): pre = factor[t] @ basis (R rows of stride
 * b_stride), rotated by RoPE (rotate_half layout) at position t - rs. cosv / sinv: cs * D / 2 scratch. */
static void rebuild_chunk(float *out, const float *factor, int64_t R, const float *basis, int64_t b_stride,
                          int64_t D, int64_t chunk, int64_t rs, const kvp_rope *rope, float *cosv, float *sinv) {
    int64_t half = D / 2, cs = rope->cs;
    rope_chunk(rope, cosv, sinv, chunk * cs - rs);
    for (int64_t j = 0; j < cs; ++j) {
        float pre[512];
        lowrank(pre, factor + (chunk * cs + j) * R, basis, b_stride, R, D);
        float *o = out + j * D;
        const float *cj = cosv + j * half, *sj = sinv + j * half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            float lo = pre[i], hi = pre[i + half];
            o[i] = lo * cj[i] - hi * sj[i];
            o[i + half] = hi * cj[i] + lo * sj[i];
        }
    }
}

/* softmax over the finite entries of row[0..n) in place (all -inf -> zeros, as nan_to_num(0)). */
static void softmax_or_zero(float *row, int64_t n) {
    float m = -INFINITY;
    for (int64_t t = 0; t < n; ++t) m = row[t] > m ? row[t] : m;
    if (m == -INFINITY) { memset(row, 0, sizeof(float) * (size_t)n); return; }
    softmax_row(row, n);
}

/* ShadowKV's chunk selection of one decode step (kvpress/policies/shadowkv.py, `_attend_selected`).
 *
 * Row b, KV head h: landmark scores scale * q_g . lm[c] over the chunks any head of the row may
 * select (the others -inf), softmax per query head for the softmax_* reductions, reduced
 * over the group; chunks this head may not select -> -inf. With n_cand > k the top n_cand finite
 * chunks are a shortlist whose keys are rebuilt (factor @ basis[:, h], RoPE at t - rope_start[b]) and
 * re-scored exactly (softmax per query head over the shortlist's tokens, group-reduced, max over a
 * chunk's tokens); otherwise the landmark scores decide. The best allow[b, h] (<= k) chunks are
 * written to ids_out (B, H, k) ascending, -1 after, and their rebuilt keys to keys_out
 * (B, H, k * cs, D), zeros in empty slots.
 *
 * q (B, Hq, D); lm (B, H, C, D); sel (B, H, C) bytes (0 / 1: a torch bool tensor); factor (B, T_pad, R); basis
 * (B, R, H, D); inv_freq (D / 2); rope_start (B) int64; allow (B, H) int32. All fp32, contiguous. */
int kvp_shadowkv_select(const float *q, int64_t B, int64_t Hq, int64_t H, int64_t D,
                        const float *lm, int64_t C, const uint8_t *sel,
                        const float *factor, int64_t T_pad, int64_t R, const float *basis,
                        const float *inv_freq, const int64_t *rope_start, int64_t cs,
                        const int32_t *allow, int64_t k, int64_t n_cand, float scale, int reduction,
                        int32_t *ids_out, float *keys_out) {
    int64_t G = Hq / H, half = D / 2, M = n_cand > k ? n_cand : k;
    if (G * H != Hq || G > 8 || D % 2 || D > 512 || cs <= 0 || T_pad < 0 || k < 0 || C * cs > T_pad || M > C
        || reduction < 0 || reduction > 3) return -1;
    int soft = reduction >= 2, rerank = n_cand > k;
    int64_t max_pos = 0;  /* the largest position any row's chunk can start at */
    for (int64_t b = 0; b < B; ++b) max_pos = T_pad - rope_start[b] > max_pos ? T_pad - rope_start[b] : max_pos;
    kvp_rope rope;
    if (rope_init(&rope, inv_freq, half, cs, max_pos) != 0) return -3;
    int64_t nk = rerank ? n_cand * cs : 0;
    int nt = team(B * H, (double)(B * H) * (double)(G * C * D + (rerank ? nk * (R + G) * D : k * cs * R * D))), rc = 0;
    (void)nt;  /* unused in a build without OpenMP */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *fb = malloc(sizeof(float) * (size_t)(G * D + G * C + C + nk * D + G * nk + nk + M + 2 * cs * half));
        int32_t *ib = malloc(sizeof(int32_t) * (size_t)(3 * C + 2 * M));
        uint32_t *keys = malloc(sizeof(uint32_t) * (size_t)C);
        uint64_t *mark = malloc(sizeof(uint64_t) * (size_t)((C + 63) / 64 + 1));
        uint8_t *anyb = malloc((size_t)C + 1);
        int ok = fb && ib && keys && mark && anyb;
        if (!ok) set_rc(&rc, -3);
        float *qs = fb, *sg = qs + G * D, *red = sg + G * C, *kb = red + C, *ex = kb + nk * D, *tok = ex + G * nk,
              *csc = tok + nk, *cosv = csc + M, *sinv = cosv + cs * half;
        int32_t *cand = ib, *live = cand + C, *pick = live + C, *tmp = pick + M;
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            if (!ok) continue;
            int64_t b = bh / H, h = bh % H, rs = rope_start[b];
            const float *qh = q + (b * Hq + h * G) * D, *lmh = lm + bh * C * D;
            const float *fac = factor + b * T_pad * R, *bas = basis + (b * R * H + h) * D;
            const uint8_t *selh = sel + bh * C;
            memset(anyb, 0, (size_t)C);
            for (int64_t hh = 0; hh < H; ++hh)
                for (int64_t c = 0; c < C; ++c) anyb[c] |= sel[(b * H + hh) * C + c];
            int32_t *ids = ids_out + bh * k;
            float *kout = keys_out + bh * k * cs * D;
            for (int64_t i = 0; i < G * D; ++i) qs[i] = qh[i] * scale;
            for (int64_t c = 0; c < C; ++c) {
                float acc[8];
                if (anyb[c]) dots(acc, qs, lmh + c * D, G, D);
                for (int64_t g = 0; g < G; ++g) sg[g * C + c] = anyb[c] ? acc[g] : -INFINITY;
            }
            for (int64_t g = 0; g < G; ++g) {
                if (soft) softmax_or_zero(sg + g * C, C);
                reduce_into(red, sg + g * C, C, (int)g, reduction);
            }
            int64_t fin = 0;
            for (int64_t c = 0; c < C; ++c) {
                if (!selh[c]) red[c] = -INFINITY;
                fin += red[c] > -INFINITY;
            }
            int64_t want = allow[bh] < k ? allow[bh] : k, m = rerank ? (n_cand < fin ? n_cand : fin) : 0, kk;
            if (want < 0) want = 0;
            if (!rerank) {
                kk = want < fin ? want : fin;
                select_top(red, C, kk, cand, live, keys);
                sort_ids(cand, kk, C, mark);
                for (int64_t i = 0; i < kk; ++i)
                    rebuild_chunk(kout + i * cs * D, fac, R, bas, H * D, D, cand[i], rs, &rope, cosv, sinv);
                memcpy(ids, cand, sizeof(int32_t) * (size_t)kk);
            } else {
                select_top(red, C, m, cand, live, keys);
                sort_ids(cand, m, C, mark);
                for (int64_t i = 0; i < m; ++i)
                    rebuild_chunk(kb + i * cs * D, fac, R, bas, H * D, D, cand[i], rs, &rope, cosv, sinv);
                for (int64_t t = 0; t < m * cs; ++t) {
                    float acc[8];
                    dots(acc, qs, kb + t * D, G, D);
                    for (int64_t g = 0; g < G; ++g) ex[g * m * cs + t] = acc[g];
                }
                for (int64_t g = 0; g < G; ++g) {
                    if (soft) softmax_or_zero(ex + g * m * cs, m * cs);
                    reduce_into(tok, ex + g * m * cs, m * cs, (int)g, reduction);
                }
                for (int64_t i = 0; i < m; ++i) {
                    float best = -INFINITY;
                    for (int64_t j = 0; j < cs; ++j) best = tok[i * cs + j] > best ? tok[i * cs + j] : best;
                    csc[i] = best;
                }
                kk = want < m ? want : m;
                select_top(csc, m, kk, pick, live, keys);
                for (int64_t i = 0; i < kk; ++i) tmp[i] = cand[pick[i]];
                sort_ids(tmp, kk, C, mark);
                for (int64_t i = 0, p = 0; i < kk; ++i) {  /* the shortlist is ascending: find each chosen slot */
                    while (cand[p] != tmp[i]) ++p;
                    memcpy(kout + i * cs * D, kb + p * cs * D, sizeof(float) * (size_t)(cs * D));
                }
                memcpy(ids, tmp, sizeof(int32_t) * (size_t)kk);
            }
            for (int64_t i = kk; i < k; ++i) ids[i] = -1;
            memset(kout + kk * cs * D, 0, sizeof(float) * (size_t)((k - kk) * cs * D));
        }
        free(fb);
        free(ib);
        free(keys);
        free(mark);
        free(anyb);
    }
    free(rope.lo);
    return rc;
}

/* ------------------------------------------------------------------ attention over row sets */

typedef struct {
    const float *k, *v;   /* (B, H, n_cap, D), rows dense; k and v share the strides */
    int64_t sb, sh;       /* element strides of the batch and head dims */
    const int32_t *cnt;   /* (B, H) rows in use (a prefix), or NULL: n for every (row, head) */
    int64_t n;            /* rows in use at most */
} kvp_rows;

/* Exact attention of q (B, Hq, D) over the union of a few row sets of every (row b, KV head h)
 * under one softmax -- what sparse_decode over each set plus merge_states gives, in one call
 * (ShadowKV's generated tokens, exact tokens and selected chunks). out (B, Hq, D) fp32; lse (B, Hq)
 * (-inf and zeros when no row is in use). */
int kvp_attend_rows(const float *q, int64_t B, int64_t Hq, int64_t H, int64_t D, const kvp_rows *src, int64_t nsrc,
                    float scale, float *out, float *lse) {
    int64_t G = Hq / H, N = 0;
    if (G * H != Hq || G > 8 || nsrc < 0 || nsrc > 8) return -1;
    for (int64_t i = 0; i < nsrc; ++i) N += src[i].n;
    int nt = team(B * H, (double)(B * H) * (double)(2 * G * N * D)), rc = 0;
    (void)nt;  /* unused in a build without OpenMP */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *s = malloc(sizeof(float) * (size_t)(G * N + G * D + G * D + 1));
        if (!s) set_rc(&rc, -3);
        float *acc = s + G * N, *qs = acc + G * D;
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            if (!s) continue;
            int64_t b = bh / H, h = bh % H, V = 0;
            const float *qh = q + (b * Hq + h * G) * D;
            for (int64_t i = 0; i < G * D; ++i) qs[i] = qh[i] * scale;
            for (int64_t i = 0; i < nsrc; ++i) {  /* scores, set after set: s[g * N + V + t] */
                int64_t n = src[i].cnt ? src[i].cnt[bh] : src[i].n;
                n = n < 0 ? 0 : (n > src[i].n ? src[i].n : n);
                const float *kh = src[i].k + b * src[i].sb + h * src[i].sh;
                for (int64_t t = 0; t < n; ++t, ++V) {
                    float a[8];
                    dots(a, qs, kh + t * D, G, D);
                    for (int64_t g = 0; g < G; ++g) s[g * N + V] = a[g];
                }
            }
            memset(acc, 0, sizeof(float) * (size_t)(G * D));
            for (int64_t g = 0; g < G; ++g) {
                float *sg = s + g * N, mx = -INFINITY, tot = 0.0f;
                for (int64_t t = 0; t < V; ++t) mx = sg[t] > mx ? sg[t] : mx;
                if (V == 0) { lse[b * Hq + h * G + g] = -INFINITY; continue; }
                for (int64_t t = 0; t < V; ++t) { sg[t] = expf(sg[t] - mx); tot += sg[t]; }
                float inv = 1.0f / tot;
                for (int64_t t = 0; t < V; ++t) sg[t] *= inv;
                lse[b * Hq + h * G + g] = mx + logf(tot);
            }
            V = 0;
            for (int64_t i = 0; i < nsrc; ++i) {  /* each value row read once for the whole group */
                int64_t n = src[i].cnt ? src[i].cnt[bh] : src[i].n;
                n = n < 0 ? 0 : (n > src[i].n ? src[i].n : n);
                const float *vh = src[i].v + b * src[i].sb + h * src[i].sh;
                for (int64_t t = 0; t < n; ++t, ++V)
                    for (int64_t g = 0; g < G; ++g) axpy(acc + g * D, s[g * N + V], vh + t * D, D);
            }
            memcpy(out + (b * Hq + h * G) * D, acc, sizeof(float) * (size_t)(G * D));
        }
        free(s);
    }
    return rc;
}
