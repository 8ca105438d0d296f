/* kvpress native CPU kernels: the readers of packed low-bit K/V (kvpress.kernels.quant's format),
 * scores against per-channel keys and probabilities applied to per-token values. scores_span /
 * values_span / plane_groups / plane_to_channel are shared with quant_attend.c. */
#include "kvp.h"

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

/* Scores of packed tokens [t0, t1) (multiples of G) of one (row, KV head) against per-channel
 * keys: out[m * o_sm + t - t0]. ch / sh / zh point at the head's codes, scales and zero points;
 * qs is scratch of M * D + 2 * D floats. */
void scores_span(const float *qh, int64_t M, int64_t D, const uint8_t *ch, const uint16_t *sh,
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
void values_span(const float *w, int64_t w_sm, int64_t M, int64_t D, const uint8_t *ch, const uint16_t *sh,
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
void plane_groups(int32_t *gidx, int64_t D, int bits, int64_t Gv) {
    int per = 8 / bits;
    int64_t nb = D * bits / 8;
    for (int pl = 0; pl < per; ++pl)
        for (int64_t j = 0; j < nb; ++j) gidx[pl * nb + j] = (int32_t)((j * per + pl) / Gv);
}

/* out (M, D) channel order = acc (M, D) plane order (a permutation). */
void plane_to_channel(float *out, const float *acc, int64_t M, int64_t D, int bits) {
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
