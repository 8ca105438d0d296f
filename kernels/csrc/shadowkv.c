/* kvpress native CPU kernels: ShadowKV's chunk selection (RoPE tables, the low-rank key rebuild,
 * landmark scores and the exact re-scoring of a shortlist). */
#include "kvp.h"

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
 * (B, H, k * cs, D), zeros in empty slots. With `tokens` (select="tokens", `select_tokens`) the
 * shortlist of max(n_cand, k) chunks is always re-scored and its best allow[b, h] * cs single
 * tokens are chosen instead: token ids (chunk * cs + offset) to ids_out (B, H, k * cs).
 *
 * q (B, Hq, D); lm (B, H, C, D); sel (B, H, C) bytes (0 / 1: a torch bool tensor); factor (B, T_pad, R); basis
 * (B, R, H, D); inv_freq (D / 2); rope_start (B) int64; allow (B, H) int32. All fp32, contiguous. */
int kvp_shadowkv_select(const float *q, int64_t B, int64_t Hq, int64_t H, int64_t D,
                        const float *lm, int64_t C, const uint8_t *sel,
                        const float *factor, int64_t T_pad, int64_t R, const float *basis,
                        const float *inv_freq, const int64_t *rope_start, int64_t cs,
                        const int32_t *allow, int64_t k, int64_t n_cand, float scale, int reduction, int tokens,
                        int32_t *ids_out, float *keys_out) {
    int64_t G = Hq / H, half = D / 2, M = n_cand > k ? n_cand : k;
    if (G * H != Hq || G > 8 || D % 2 || D > 512 || cs <= 0 || T_pad < 0 || k < 0 || C * cs > T_pad || M > C
        || reduction < 0 || reduction > 3) return -1;
    int soft = reduction >= 2, rerank = n_cand > k || tokens;
    int64_t max_pos = 0;  /* the largest position any row's chunk can start at */
    for (int64_t b = 0; b < B; ++b) max_pos = T_pad - rope_start[b] > max_pos ? T_pad - rope_start[b] : max_pos;
    kvp_rope rope;
    if (rope_init(&rope, inv_freq, half, cs, max_pos) != 0) return -3;
    int64_t nk = rerank ? M * cs : 0;
    int64_t n_pick = tokens ? M * cs : M, n_top = C > nk ? C : nk;  /* chosen slots; select_top's scratch */
    int64_t slots = tokens ? k * cs : k;  /* ids per (row, KV head) */
    int nt = team(B * H, (double)(B * H) * (double)(G * C * D + (rerank ? nk * (R + G) * D : k * cs * R * D))), rc = 0;
    (void)nt;  /* unused in a build without OpenMP */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *fb = malloc(sizeof(float) * (size_t)(G * D + G * C + C + nk * D + G * nk + nk + M + 2 * cs * half));
        int32_t *ib = malloc(sizeof(int32_t) * (size_t)(C + n_top + 2 * n_pick));
        uint32_t *keys = malloc(sizeof(uint32_t) * (size_t)n_top);
        uint64_t *mark = malloc(sizeof(uint64_t) * (size_t)((C * cs + 63) / 64 + 1));
        uint8_t *anyb = malloc((size_t)C + 1);
        int ok = fb && ib && keys && mark && anyb;
        if (!ok) set_rc(&rc, -3);
        float *qs = fb, *sg = qs + G * D, *red = sg + G * C, *kb = red + C, *ex = kb + nk * D, *tok = ex + G * nk,
              *csc = tok + nk, *cosv = csc + M, *sinv = cosv + cs * half;
        int32_t *cand = ib, *live = cand + C, *pick = live + n_top, *tmp = pick + n_pick;
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
            int32_t *ids = ids_out + bh * slots;
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
            int64_t want = allow[bh] < k ? allow[bh] : k, m = rerank ? (M < fin ? M : fin) : 0, kk;
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
                if (tokens) {  /* the best single tokens of the shortlist, ascending by id */
                    kk = want * cs < m * cs ? want * cs : m * cs;
                    select_top(tok, m * cs, kk, pick, live, keys);
                    for (int64_t i = 0; i < kk; ++i) tmp[i] = cand[pick[i] / cs] * (int32_t)cs + pick[i] % (int32_t)cs;
                    sort_ids(tmp, kk, C * cs, mark);
                    for (int64_t i = 0, p = 0; i < kk; ++i) {  /* the shortlist is ascending: find each token's chunk */
                        while (cand[p] != tmp[i] / cs) ++p;
                        memcpy(kout + i * D, kb + (p * cs + tmp[i] % cs) * D, sizeof(float) * (size_t)D);
                    }
                    memcpy(ids, tmp, sizeof(int32_t) * (size_t)kk);
                    for (int64_t i = kk; i < slots; ++i) ids[i] = -1;
                    memset(kout + kk * D, 0, sizeof(float) * (size_t)((slots - kk) * D));
                    continue;
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

/* ------------------------------------------------------------------ the keys' residual */

/* out (N, D) = keys (N, D) + the residual of `residual_table` rows (N, W) uint8: D * bits / 8
 * bytes of codes (channel c in byte c / per at bit (c % per) * bits, per = 8 / bits), then D / group
 * fp16 scales and D / group fp16 zero points as bytes; residual = code * scale + zero of c's group.
 * Rows independent; `out` may be `keys`. 0, or 1 for a bad bit width / group (at most 64 groups
 * per row), 2 for a row width that does not match them. */
int kvp_add_residual(const float *keys, const uint8_t *table, int64_t N, int64_t D, int64_t W, int bits,
                     int64_t group, float *out) {
    if (!(bits == 2 || bits == 4 || bits == 8) || group <= 0 || D <= 0 || D % group || (D * bits) % 8
        || D / group > 64)
        return 1;
    const int64_t nb = D * bits / 8, ng = D / group;
    if (W != nb + 4 * ng) return 2;
    const int per = 8 / bits, mask = (1 << bits) - 1;
    const int nt = team(N, (double)N * D);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t i = 0; i < N; ++i) {
        const uint8_t *row = table + i * W;
        uint16_t h[2 * 64];  /* scales then zeros (ng <= 64, checked above) */
        float sz[2 * 64];
        memcpy(h, row + nb, (size_t)(4 * ng));
        halfs_to_floats(sz, h, 2 * ng);
        const float *k = keys + i * D;
        float *o = out + i * D;
        for (int64_t c = 0; c < D; ++c) {
            const int code = (row[c / per] >> ((c % per) * bits)) & mask;
            const int64_t g = c / group;
            o[c] = k[c] + ((float)code * sz[g] + sz[ng + g]);  /* the reference's order (maybe fused) */
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ the tail estimate */

/* `tail_estimate_tokens` then `landmark_tail_estimate` (kvpress/policies/_shadowkv_select.py,
 * kvpress/kernels/tail.py) for one decode query per head: chunk c of (b, h) stands for
 * w = sel * (1 - taken / cs) of its cs tokens (taken: the attended token ids in it); chunks fall in
 * groups g = (c + off) / m of N; group g has kept = sum w, key k_sum / kept (1 if 0) with k_sum the
 * w-weighted sum of its landmarks, n = kept * cs tokens and value (v_sum[g] - the attended tokens'
 * values in it) / max(n, 1); each query head attends the groups with logits q.k * scale + log
 * max(n, 1), groups with n < 0.5 left out. out (B, Hq, D), lse (B, Hq): zeros / -inf when none is
 * left. q (B, Hq, D); lm (B, H, C, D); sel (B, H, C) bytes; v_sum (B, H, N, D); ids (B, H, K)
 * int32 (-1 empty) and vals (B, H, K, D), K may be 0. All fp32, contiguous. 0, or -1 for bad
 * shapes, -3 out of memory. */
int kvp_shadowkv_tail(const float *q, int64_t B, int64_t Hq, int64_t H, int64_t D,
                      const float *lm, int64_t C, const uint8_t *sel, const float *v_sum, int64_t N,
                      const int32_t *ids, const float *vals, int64_t K, int64_t cs, int64_t m, int64_t off,
                      float scale, float *out, float *lse) {
    int64_t G = Hq / H;
    if (G * H != Hq || G > 8 || D <= 0 || cs <= 0 || m <= 0 || off < 0 || off >= m || C < 0 || K < 0
        || N != (C + off + m - 1) / m) return -1;
    int nt = team(B * H, (double)(B * H) * (double)(C * D + N * D * (G + 1) + K * D)), rc = 0;
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *fb = malloc(sizeof(float) * (size_t)(C + 2 * N * D + N + D + N + 1));
        if (!fb) set_rc(&rc, -3);
        float *w = fb, *km = w + C, *vm = km + N * D, *cnt = vm + N * D, *qs = cnt + N, *lg = qs + D;
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            if (!fb) continue;
            int64_t b = bh / H, h = bh % H;
            const uint8_t *selh = sel + bh * C;
            const float *lmh = lm + bh * C * D, *vsh = v_sum + bh * N * D;
            for (int64_t c = 0; c < C; ++c) w[c] = 0.0f;
            memset(vm, 0, sizeof(float) * (size_t)(N * D));  /* the attended values' group sums */
            for (int64_t j = 0; j < K; ++j) {
                int32_t id = ids[bh * K + j];
                if (id < 0) continue;
                int64_t c = id / cs;
                if (c >= C) continue;
                w[c] += 1.0f;
                axpy(vm + ((c + off) / m) * D, 1.0f, vals + (bh * K + j) * D, D);
            }
            for (int64_t c = 0; c < C; ++c) w[c] = selh[c] ? 1.0f - w[c] / (float)cs : 0.0f;
            for (int64_t g = 0; g < N; ++g) {
                float *kg = km + g * D, *vg = vm + g * D, s = 0.0f;
                for (int64_t d = 0; d < D; ++d) kg[d] = 0.0f;
                for (int64_t i = 0; i < m; ++i) {
                    int64_t c = g * m + i - off;
                    if (c < 0 || c >= C) continue;
                    s += w[c];
                    if (w[c] != 0.0f) axpy(kg, w[c], lmh + c * D, D);
                }
                float kd = s > 0.0f ? s : 1.0f, n = s * (float)cs, nd = n > 1.0f ? n : 1.0f;
                cnt[g] = n;
                for (int64_t d = 0; d < D; ++d) {
                    kg[d] /= kd;
                    vg[d] = (vsh[g * D + d] - vg[d]) / nd;
                }
            }
            for (int64_t gq = 0; gq < G; ++gq) {
                const float *qh = q + (b * Hq + h * G + gq) * D;
                float *o = out + (b * Hq + h * G + gq) * D, mx = -INFINITY;
                for (int64_t d = 0; d < D; ++d) qs[d] = qh[d] * scale;
                for (int64_t g = 0; g < N; ++g) {
                    lg[g] = cnt[g] < 0.5f ? -INFINITY
                                          : dot(qs, km + g * D, D) + logf(cnt[g] > 1.0f ? cnt[g] : 1.0f);
                    if (lg[g] > mx) mx = lg[g];
                }
                for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
                if (mx == -INFINITY) {
                    lse[b * Hq + h * G + gq] = -INFINITY;
                    continue;
                }
                double z = 0.0;
                for (int64_t g = 0; g < N; ++g) z += lg[g] == -INFINITY ? 0.0 : exp((double)(lg[g] - mx));
                for (int64_t g = 0; g < N; ++g) {
                    if (lg[g] == -INFINITY) continue;
                    axpy(o, (float)(exp((double)(lg[g] - mx)) / z), vm + g * D, D);
                }
                lse[b * Hq + h * G + gq] = mx + (float)log(z);
            }
        }
        free(fb);
    }
    return rc;
}
