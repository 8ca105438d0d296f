/* kvpress native CPU kernels over full-precision K/V: Double Sparsity's selection, sparse decode
 * attention (with the tail estimate) and exact attention over a few row sets. */
#include "kvp.h"

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

/* ------------------------------------------------------------------ merging two attention states */

/* `merge_states` (kvpress/kernels/merge.py, `torch_merge_states` the reference) for R rows of D:
 * the attention over the union of two disjoint token sets from each set's normalised output
 * (oa, ob: R x D) and natural log-sum-exp (la, lb: R; -inf marks an empty set, whose output is
 * ignored even if NaN). out (R x D; may be oa or ob) and lse (R; may be la or lb): zeros / -inf
 * where both sets are empty. One pass, no threads (R is B * Hq: a few rows). 0, or -1 for bad shapes. */
int kvp_merge_states(const float *oa, const float *la, const float *ob, const float *lb, int64_t R, int64_t D,
                     float *out, float *lse) {
    if (R < 0 || D <= 0) return -1;
    for (int64_t r = 0; r < R; ++r) {
        float a = la[r], b = lb[r], m = a > b ? a : b;
        if (m == -INFINITY) m = 0.0f;  /* both empty: shift by 0, as the reference */
        float wa = expf(a - m), wb = expf(b - m), total = wa + wb;
        int empty = total == 0.0f;
        float denom = empty ? 1.0f : total, sa = wa / denom, sb = wb / denom;
        const float *xa = oa + r * D, *xb = ob + r * D;
        float *o = out + r * D;
        for (int64_t d = 0; d < D; ++d) {
            float ca = wa > 0.0f ? xa[d] * sa : 0.0f, cb = wb > 0.0f ? xb[d] * sb : 0.0f;
            o[d] = ca + cb;
        }
        lse[r] = empty ? -INFINITY : m + logf(denom);
    }
    return 0;
}
