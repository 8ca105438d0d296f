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
 * Every function returns 0, or a negative code for inputs it refuses (the Python side checks
 * shapes first, so that is a bug guard, not an error path).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVP_ABI_VERSION 1

int kvp_abi_version(void) { return KVP_ABI_VERSION; }

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
    for (int64_t g = 0; g < G; ++g) {
        f32x8 x = a[g];
        acc[g] = ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
    }
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
    float *fbuf = malloc(sizeof(float) * (size_t)(rows + n + G * m + m + G * r));
    int32_t *ibuf = malloc(sizeof(int32_t) * (size_t)(m + keep + n));
    uint32_t *keys = malloc(sizeof(uint32_t) * (size_t)n);
    uint64_t *mark = malloc(sizeof(uint64_t) * (size_t)((n + 63) / 64));
    if (!fbuf || !ibuf || !keys || !mark) { free(fbuf); free(ibuf); free(keys); free(mark); return -3; }
    float *row = fbuf, *red = row + rows, *ex = red + n, *exred = ex + G * m, *qsel = exred + m;
    int32_t *cand = ibuf, *pick = cand + m, *live = pick + keep;
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
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
    }
    free(fbuf);
    free(ibuf);
    free(keys);
    free(mark);
    return 0;
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
    float *s = malloc(sizeof(float) * nf);
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(V > 0 ? V : 1));
    int32_t *cof = malloc(sizeof(int32_t) * (size_t)(V > 0 ? V : 1));
    if (!s || !pos || !cof) { free(s); free(pos); free(cof); return -3; }
    float *sc = s + G * V, *rem_n = sc + G * N, *n_rest = rem_n + N, *wc = n_rest + N, *acc = wc + G * N;
    for (int64_t b = 0; b < B; ++b) {
        int64_t start = seq_starts ? seq_starts[b] : 0, len = seq_lens[b];
        for (int64_t h = 0; h < H; ++h) {
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
    }
    free(s);
    free(pos);
    free(cof);
    return 0;
}
