/* kvpress native CPU kernels: GEAR's corrections to a packed store, and a whole decode step of a
 * quantized policy (packed segments and a full-precision window under one softmax). */
#include "kvp.h"

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
 * gear, when not NULL, GEAR's corrections to this store (value groups of Gv channels). rc, when not
 * NULL, refined key channels (ZipCache's refine_key_channels): R channels per (row, KV head), ids
 * ridx (B, H, R) int64, whose second codes rc (B, H, >=n, R * bits / 8) with fp16 scales rs
 * (B, H, >=n / G, R) add code * scale to the key channel (no zero point). */
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
    const uint8_t *rc;
    const uint16_t *rs;
    const int64_t *ridx;
    int64_t rc_sb, rc_sh, rs_sb, rs_sh, ri_sb, ri_sh, R;
} kvp_segment;

enum { REFINE_MAX = 256 };

typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* acc[m] += the codes of the 8 lanes of v (n planes of `bits` bits, low first) times w[m * R + plane]. */
static inline __attribute__((always_inline)) void refine_planes(f32x8 *acc, u32x8 v, int64_t n, int64_t bits,
                                                                uint32_t mask, const float *w, int64_t R, int64_t M) {
    for (int64_t k = 0; k < n; ++k) {
        const f32x8 f = __builtin_convertvector((v >> (uint32_t)(k * bits)) & mask, f32x8);
        for (int64_t m = 0; m < M; ++m) acc[m] += f * w[m * R + k];
    }
}

/* Adds the refined channels' second codes to the scores sc (M rows of stride ld) of tokens [t0, t1).
 * Per key group the query coefficients of the refined channels take the group's scales (w = q *
 * scale, as scores_span folds its scales). Blocks of 8 tokens: one 4-byte word (or, for codes of
 * other widths, one byte) of the 8 tokens' second codes in a vector, each of its planes converted
 * once and taken by all M rows (8 token scores per vector, no horizontal sums). Groups are
 * multiples of 8 tokens (checked by the caller). The word reading needs a little-endian CPU. */
static void refine_span(const kvp_segment *g, int64_t b, int64_t h, const float *qh, int64_t M, int64_t D,
                        int64_t t0, int64_t t1, float *sc, int64_t ld) {
    const int64_t R = g->R, bits = g->bits, per = 8 / bits, row = R / per;
    const uint32_t mask = (1u << bits) - 1;
    const uint8_t *c = g->rc + b * g->rc_sb + h * g->rc_sh;
    const uint16_t *s = g->rs + b * g->rs_sb + h * g->rs_sh;
    const int64_t *ix = g->ridx + b * g->ri_sb + h * g->ri_sh;
    float qr[8 * REFINE_MAX], w[8 * REFINE_MAX];
    for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < R; ++r) qr[m * R + r] = qh[m * D + ix[r]];
    for (int64_t t = t0; t < t1;) {
        const int64_t grp = t / g->G, end = (grp + 1) * g->G < t1 ? (grp + 1) * g->G : t1;
        for (int64_t r = 0; r < R; ++r) {
            const float f = h2f(s[grp * R + r]);
            for (int64_t m = 0; m < M; ++m) w[m * R + r] = qr[m * R + r] * f;
        }
        for (; t + 8 <= end; t += 8) {
            const uint8_t *ct = c + t * row;
            f32x8 acc[8];
            for (int64_t m = 0; m < M; ++m) acc[m] = (f32x8){0};
            /* 4-byte words of 32 / bits codes; 8 tokens of one word each in one load */
            if (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ && row % 4 == 0) {
                for (int64_t wi = 0; wi < row / 4; ++wi) {
                    u32x8 v;
                    if (row == 4) memcpy(&v, ct, sizeof v);
                    else
                        for (int l = 0; l < 8; ++l) memcpy((uint32_t *)&v + l, ct + l * row + 4 * wi, 4);
                    refine_planes(acc, v, 32 / bits, bits, mask, w + wi * (32 / bits), R, M);
                }
            } else {
                for (int64_t j = 0; j < row; ++j) {
                    const u32x8 v = {ct[j], ct[row + j], ct[2 * row + j], ct[3 * row + j], ct[4 * row + j],
                                     ct[5 * row + j], ct[6 * row + j], ct[7 * row + j]};
                    refine_planes(acc, v, per, bits, mask, w + j * per, R, M);
                }
            }
            for (int64_t m = 0; m < M; ++m) {
                f32x8 o;
                memcpy(&o, sc + m * ld + (t - t0), sizeof o);
                o += acc[m];
                memcpy(sc + m * ld + (t - t0), &o, sizeof o);
            }
        }
    }
}

enum { MAX_SEGMENTS = 8 };

/* One decode step over packed segments and a full-precision window, under one softmax: q (B, H,
 * M, D) fp32 contiguous, already scaled, M <= 8; the window rows [w_starts[b], W) of kw / vw (fp32
 * (B, H, W_cap, D), dense (W, D) dims; w_starts NULL: all). out (B, H, M, D) fp32; lse (B, H, M)
 * (-inf when nothing is attended).
 *
 * Split like flash-decoding: each piece (row, KV head, span of one segment's tokens, or the window)
 * keeps its own running max, sum of exponentials and unnormalised value sum; the pieces of a (row,
 * KV head) are merged in a fixed order. Returns 0; -1 inputs it cannot read, -3 out of memory, -4 a
 * GEAR outlier offset outside its group, -5 a refined key channel id outside [0, D). */
int kvp_quant_attend(const float *q, int64_t B, int64_t H, int64_t M, int64_t D,
                     const kvp_segment *seg, int64_t nseg,
                     const float *kw, const float *vw, int64_t w_sb, int64_t w_sh, int64_t W, const int32_t *w_starts,
                     float *out, float *lse) {
    if (M < 1 || M > 8 || W < 0 || nseg < 0 || nseg > MAX_SEGMENTS) return -1;
    int64_t per_bh = 1, smax = W > D ? W : D, vmax = 0, total_n = 0;
    for (int64_t i = 0; i < nseg; ++i) {
        const kvp_segment *g = seg + i;
        if (!(g->bits == 2 || g->bits == 4 || g->bits == 8) || g->G <= 0 || g->Gv <= 0 || g->n < 0 || g->n % g->G
            || D % g->Gv || (D * g->bits) % 8 || (g->gear && !gear_ok(g->gear, g->n))
            || (g->rc && (g->R <= 0 || g->R > D || g->R > REFINE_MAX || g->G % 8 || (g->R * g->bits) % 8 || g->bits > 4 || !g->rs || !g->ridx))) return -1;
        for (int64_t b = 0; g->rc && b < B; ++b)  /* the query is indexed by the refined channel ids */
            for (int64_t h = 0; h < H; ++h)
                for (int64_t r = 0; r < g->R; ++r) {
                    const int64_t c = g->ridx[b * g->ri_sb + h * g->ri_sh + r];
                    if (c < 0 || c >= D) return -5;
                }
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
                if (g->rc) refine_span(g, b, h, qh, M, D, t0, t1, sc, t1 - t0);
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
