"""Triton code for `attend_rows` (only ``@triton.jit`` functions; see ``triton_rows.py``).

One program per (row, KV head) walks up to four row sets in turn -- each the first ``cnt[b, h]``
(or ``n``) rows of its own (B, H_kv, n_cap, D) keys and values -- in tiles of BLOCK_N, keeping one
online softmax for the GQA group's query heads: the union of the sets under one softmax, without
the per-set partial states and their merges.
"""
import triton
import triton.language as tl


@triton.jit
def _attend_set(q, m_i, l_i, acc, K, V, CNT, n, b, hk,
                stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_cb, stride_ch,
                scale_log2, HAS_CNT: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """Fold one set's rows into the running (max, sum, accumulator) of the group's queries."""
    if HAS_CNT:
        rows = tl.minimum(tl.load(CNT + b * stride_cb + hk * stride_ch), n)
    else:
        rows = n
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    for t0 in range(0, rows, BLOCK_N):
        t = t0 + offs_n
        valid = t < rows
        t64 = tl.where(valid, t, 0).to(tl.int64)
        k = tl.load(k_base + t64[:, None] * stride_kt + offs_d[None, :], mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_G, BLOCK_N), log2 units
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # never (-inf) - (-inf)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + t64[:, None] * stride_vt + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# the row counts change from step to step (the generated tokens grow by one): specializing on them
# (== 1, multiple of 16) would compile the kernel again at such steps
@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3"])
def _attend_rows_kernel(
    Q, OUT, LSE,
    K0, V0, C0, K1, V1, C1, K2, V2, C2, K3, V3, C3,
    n0, n1, n2, n3,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_lb, stride_lh,
    sk0b, sk0h, sk0t, sv0b, sv0h, sv0t, sc0b, sc0h,
    sk1b, sk1h, sk1t, sv1b, sv1h, sv1t, sc1b, sc1h,
    sk2b, sk2h, sk2t, sv2b, sv2h, sv2t, sc2b, sc2h,
    sk3b, sk3h, sk3t, sv3b, sv3h, sv3t, sc3b, sc3h,
    scale_log2,
    NUM_SETS: tl.constexpr, CNT0: tl.constexpr, CNT1: tl.constexpr, CNT2: tl.constexpr, CNT3: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # 64-bit row/head offsets: B * H_kv * n_cap * D can overflow int32
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    q_rows = hk * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + q_rows[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    m_i, l_i, acc = _attend_set(q, m_i, l_i, acc, K0, V0, C0, n0, b, hk, sk0b, sk0h, sk0t, sv0b, sv0h, sv0t,
                                sc0b, sc0h, scale_log2, CNT0, BLOCK_N, HEAD_DIM, DOT_PRECISION)
    if NUM_SETS > 1:
        m_i, l_i, acc = _attend_set(q, m_i, l_i, acc, K1, V1, C1, n1, b, hk, sk1b, sk1h, sk1t, sv1b, sv1h, sv1t,
                                    sc1b, sc1h, scale_log2, CNT1, BLOCK_N, HEAD_DIM, DOT_PRECISION)
    if NUM_SETS > 2:
        m_i, l_i, acc = _attend_set(q, m_i, l_i, acc, K2, V2, C2, n2, b, hk, sk2b, sk2h, sk2t, sv2b, sv2h, sv2t,
                                    sc2b, sc2h, scale_log2, CNT2, BLOCK_N, HEAD_DIM, DOT_PRECISION)
    if NUM_SETS > 3:
        m_i, l_i, acc = _attend_set(q, m_i, l_i, acc, K3, V3, C3, n3, b, hk, sk3b, sk3h, sk3t, sv3b, sv3h, sv3t,
                                    sc3b, sc3h, scale_log2, CNT3, BLOCK_N, HEAD_DIM, DOT_PRECISION)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    # natural-log LSE of the scaled scores: (m + log2 l) * ln 2
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(OUT + b * stride_ob + q_rows[:, None] * stride_oh + offs_d[None, :], out, mask=g_mask[:, None])
    tl.store(LSE + b * stride_lb + q_rows * stride_lh, lse, mask=g_mask)
