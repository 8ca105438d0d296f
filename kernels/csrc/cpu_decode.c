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

#define KVP_ABI_VERSION 2

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

/* Scores against per-channel-quantized keys (KIVI keys; groups of G tokens per channel):
 * out[b, h, m, t] = sum_d q[b, h, m, d] * (code[t, d] * scale[t / G, d] + zero[t / G, d]), t < T.
 * q (B, H, M, D) fp32 contiguous, M <= 8; out (B, H, M, T) fp32 contiguous; T a multiple of G. */
int kvp_channel_scores(const float *q, int64_t B, int64_t H, int64_t M, int64_t D,
                       const uint8_t *codes, int64_t c_sb, int64_t c_sh,
                       const uint16_t *scale, const uint16_t *zero, int64_t s_sb, int64_t s_sh,
                       int64_t T, int bits, int64_t G, float *out) {
    if (!(bits == 2 || bits == 4 || bits == 8) || M < 1 || M > 8 || G <= 0 || T % G || (D * bits) % 8) return -1;
    int per = 8 / bits, mask = (1 << bits) - 1;
    int64_t nb = D * bits / 8;
    int vec = nb % 8 == 0 && G % 8 == 0;
    float *qs = malloc(sizeof(float) * (size_t)(M * D + D + D));
    if (!qs) return -3;
    float *sf = qs + M * D, *zf = sf + D;
    float bias[8];
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const float *qh = q + (b * H + h) * M * D;
            const uint8_t *ch = codes + b * c_sb + h * c_sh;
            const uint16_t *sh = scale + b * s_sb + h * s_sh, *zh = zero + b * s_sb + h * s_sh;
            float *oh = out + (b * H + h) * M * T;
            for (int64_t g0 = 0; g0 < T; g0 += G) {
                halfs_to_floats(sf, sh + (g0 / G) * D, D);
                halfs_to_floats(zf, zh + (g0 / G) * D, D);
                for (int64_t m = 0; m < M; ++m) {  /* fold the group's scale into q; its zero point is a bias */
                    float acc = 0.0f;
                    for (int64_t d = 0; d < D; ++d) acc += qh[m * D + d] * zf[d];
                    bias[m] = acc;
                    for (int p = 0; p < per; ++p)
                        for (int64_t j = 0; j < nb; ++j)
                            qs[m * D + p * nb + j] = qh[m * D + j * per + p] * sf[j * per + p];
                }
                if (vec) {
                    for (int64_t t = g0; t < g0 + G; t += 8) {
                        f32x8 res[8];
                        code_dots8(res, qs, ch + t * nb, nb, bits, M);
                        for (int64_t m = 0; m < M; ++m) {
                            f32x8 r = res[m] + bias[m];
                            memcpy(oh + m * T + t, &r, sizeof r);
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
                    for (int64_t m = 0; m < M; ++m) oh[m * T + t] = acc[m] + bias[m];
                }
            }
        }
    free(qs);
    return 0;
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

/* Probabilities applied to per-token-quantized values (groups of Gv channels per token):
 * out[b, h, m, d] = sum_t p[b, h, m, t] * (code[t, d] * scale[t, d / Gv] + zero[t, d / Gv]), t < T.
 * p (B, H, M, *) fp32 with row stride p_sm (so a slice of wider scores works), M <= 8;
 * out (B, H, M, D) fp32 contiguous. Tokens go in blocks that stay in L1 while the output
 * channels are swept a few vectors at a time (the accumulators stay in registers). */
int kvp_token_values(const float *p, int64_t B, int64_t H, int64_t M, int64_t p_sm, int64_t D,
                     const uint8_t *codes, int64_t c_sb, int64_t c_sh,
                     const uint16_t *scale, const uint16_t *zero, int64_t s_sb, int64_t s_sh,
                     int64_t T, int bits, int64_t Gv, float *out) {
    enum { BLK = 64 };
    if (!(bits == 2 || bits == 4 || bits == 8) || M < 1 || M > 8 || Gv <= 0 || D % Gv || (D * bits) % 8) return -1;
    int per = 8 / bits, mask = (1 << bits) - 1;
    int64_t nb = D * bits / 8, ng = D / Gv;
    /* a vector of 8 bytes of one plane spans 8 * per channels: one value group when Gv is a multiple */
    int vec = nb % 8 == 0, uniform = Gv % (8 * per) == 0;
    /* accumulator vectors per pass: M * SL <= 12 registers */
    int64_t SL = M <= 3 ? 4 : (M <= 6 ? 2 : 1), nvec = D / 8;
    float *acc = malloc(sizeof(float) * (size_t)(M * D + 2 * BLK * ng + 2 * BLK * D + D));
    int32_t *gidx = malloc(sizeof(int32_t) * (size_t)D);
    if (!acc || !gidx) { free(acc); free(gidx); return -3; }
    float *sfb = acc + M * D, *zfb = sfb + BLK * ng, *svec = zfb + BLK * ng, *zvec = svec + BLK * D, *deq = zvec + BLK * D;
    for (int pl = 0; pl < per; ++pl)
        for (int64_t j = 0; j < nb; ++j) gidx[pl * nb + j] = (int32_t)((j * per + pl) / Gv);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const float *ph = p + (b * H + h) * M * p_sm;
            const uint8_t *ch = codes + b * c_sb + h * c_sh;
            const uint16_t *sh = scale + b * s_sb + h * s_sh, *zh = zero + b * s_sb + h * s_sh;
            memset(acc, 0, sizeof(float) * (size_t)(M * D));
            for (int64_t t0 = 0; t0 < T; t0 += BLK) {
                int64_t n_tok = T - t0 < BLK ? T - t0 : BLK;
                halfs_to_floats(sfb, sh + t0 * ng, n_tok * ng);
                halfs_to_floats(zfb, zh + t0 * ng, n_tok * ng);
                const uint8_t *rows = ch + t0 * nb;
                if (!vec) {
                    for (int64_t t = 0; t < n_tok; ++t) {
                        for (int pl = 0; pl < per; ++pl)
                            for (int64_t j = 0; j < nb; ++j) {
                                int64_t k = gidx[pl * nb + j];
                                deq[pl * nb + j] = (float)((rows[t * nb + j] >> (pl * bits)) & mask) * sfb[t * ng + k]
                                                   + zfb[t * ng + k];
                            }
                        for (int64_t m = 0; m < M; ++m) axpy(acc + m * D, ph[m * p_sm + t0 + t], deq, D);
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
#define KVP_SLICE(Bi, Mi, Si) values_slice_n(acc, ph + t0, p_sm, rows, n_tok, nb, ng, Gv, sfb, zfb, sv, zv, D, s0, Bi, Mi, Si)
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
            float *oh = out + (b * H + h) * M * D;
            for (int64_t m = 0; m < M; ++m)  /* plane order -> channel order */
                for (int pl = 0; pl < per; ++pl)
                    for (int64_t j = 0; j < nb; ++j) oh[m * D + j * per + pl] = acc[m * D + pl * nb + j];
        }
    free(acc);
    free(gidx);
    return 0;
}

/* One decode step of KIVI-format attention: the packed tokens [starts[b], N) and the
 * full-precision window rows [w_starts[b], W) (fp32 (B, H, W_cap, D), dense (W, D) dims) under
 * one softmax. q (B, H, M, D) fp32 contiguous, already scaled, M <= 8; out (B, H, M, D) fp32;
 * lse (B, H, M) (-inf when nothing is attended). starts / w_starts NULL: every token. */
int kvp_quant_attend(const float *q, int64_t B, int64_t H, int64_t M, int64_t D,
                     const uint8_t *kc, const uint16_t *ks, const uint16_t *kz, int64_t kc_sb, int64_t kc_sh,
                     int64_t ks_sb, int64_t ks_sh,
                     const uint8_t *vc, const uint16_t *vs, const uint16_t *vz, int64_t vc_sb, int64_t vc_sh,
                     int64_t vs_sb, int64_t vs_sh,
                     int64_t N, int bits, int64_t G, int64_t Gv, const int32_t *starts,
                     const float *kw, const float *vw, int64_t w_sb, int64_t w_sh, int64_t W, const int32_t *w_starts,
                     float *out, float *lse) {
    if (!(bits == 2 || bits == 4 || bits == 8) || M < 1 || M > 8 || G <= 0 || Gv <= 0 || N % G || D % Gv
        || (D * bits) % 8 || W < 0) return -1;
    /* sp (M, N): packed scores, then probabilities; sw (M, W) the window's; vacc (M, D) */
    float *sp = malloc(sizeof(float) * (size_t)(M * N + M * W + M * D + 1));
    if (!sp) return -3;
    float *sw = sp + M * N, *vacc = sw + M * W;
    int rc = 0;
    for (int64_t b = 0; b < B && !rc; ++b)
        for (int64_t h = 0; h < H && !rc; ++h) {
            const float *qh = q + (b * H + h) * M * D;
            float *oh = out + (b * H + h) * M * D, *lh = lse + (b * H + h) * M;
            int64_t n0 = starts ? starts[b] : 0, w0 = w_starts ? w_starts[b] : 0;
            n0 = n0 < 0 ? 0 : (n0 > N ? N : n0);
            w0 = w0 < 0 ? 0 : (w0 > W ? W : w0);
            if (N > 0)
                rc = kvp_channel_scores(qh, 1, 1, M, D, kc + b * kc_sb + h * kc_sh, 0, 0, ks + b * ks_sb + h * ks_sh,
                                        kz + b * ks_sb + h * ks_sh, 0, 0, N, bits, G, sp);
            if (rc) break;
            const float *kwh = kw + b * w_sb + h * w_sh, *vwh = vw + b * w_sb + h * w_sh;
            for (int64_t i = 0; i < W; ++i) {
                float acc[8];
                dots(acc, qh, kwh + i * D, M, D);
                for (int64_t m = 0; m < M; ++m) sw[m * W + i] = acc[m];
            }
            for (int64_t m = 0; m < M; ++m) {  /* one softmax over [packed tokens n0.., window rows w0..] */
                float *pm = sp + m * N, *wm = sw + m * W, mx = -INFINITY, total = 0.0f;
                for (int64_t i = 0; i < n0; ++i) pm[i] = -INFINITY;
                for (int64_t i = 0; i < w0; ++i) wm[i] = -INFINITY;
                for (int64_t i = n0; i < N; ++i) mx = pm[i] > mx ? pm[i] : mx;
                for (int64_t i = w0; i < W; ++i) mx = wm[i] > mx ? wm[i] : mx;
                if (mx == -INFINITY) {
                    for (int64_t i = 0; i < N; ++i) pm[i] = 0.0f;
                    for (int64_t i = 0; i < W; ++i) wm[i] = 0.0f;
                    lh[m] = -INFINITY;
                    continue;
                }
                for (int64_t i = 0; i < N; ++i) { pm[i] = expf(pm[i] - mx); total += pm[i]; }
                for (int64_t i = 0; i < W; ++i) { wm[i] = expf(wm[i] - mx); total += wm[i]; }
                float inv = 1.0f / total;
                for (int64_t i = 0; i < N; ++i) pm[i] *= inv;
                for (int64_t i = 0; i < W; ++i) wm[i] *= inv;
                lh[m] = mx + logf(total);
            }
            if (N > 0)
                rc = kvp_token_values(sp, 1, 1, M, N, D, vc + b * vc_sb + h * vc_sh, 0, 0, vs + b * vs_sb + h * vs_sh,
                                      vz + b * vs_sb + h * vs_sh, 0, 0, N, bits, Gv, vacc);
            else
                memset(vacc, 0, sizeof(float) * (size_t)(M * D));
            for (int64_t i = w0; i < W; ++i) {  /* each window value row read once for the group */
                const float *vr = vwh + i * D;
                for (int64_t m = 0; m < M; ++m) axpy(vacc + m * D, sw[m * W + i], vr, D);
            }
            memcpy(oh, vacc, sizeof(float) * (size_t)(M * D));
        }
    free(sp);
    return rc;
}
