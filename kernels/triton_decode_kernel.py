"""Triton code for `sparse_decode` (only ``@triton.jit`` functions; see ``triton_decode.py``).

Virtual token list of one (row, KV head), walked in tiles of BLOCK_N::

    v in [0, n_sink)                      -> position seq_start + v
    v in [n_sink, n_sink + n_tail)        -> position tail_start + (v - n_sink)
    v in [n_sink + n_tail, n_virtual)     -> block block_idx[e] at offset o, e, o = divmod(v', BLOCK_SIZE)

A block token is kept only inside [sink_end, tail_start), which deduplicates it against the
sinks and the tail. Split ``s`` walks ``[s * tokens_per_split, (s + 1) * tokens_per_split)``.
"""
import triton
import triton.language as tl


@triton.jit
def _sparse_decode_split_kernel(
    Q, K, V, BLOCK_IDX, BLOCK_CNT, SEQ_LENS, SEQ_STARTS, OUT_PART, LSE_PART,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ib, stride_ih,
    stride_cb, stride_ch,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    scale_log2, sinks, dense_tail, tokens_per_split,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_STARTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # 64-bit row/head offsets: B * H_kv * T_cap * D overflows int32 at long contexts
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq_len = tl.load(SEQ_LENS + b)
    if HAS_STARTS:
        seq_start = tl.load(SEQ_STARTS + b)
    else:
        seq_start = seq_len * 0
    sink_end = tl.minimum(seq_start + sinks, seq_len)
    tail_start = tl.maximum(seq_len - dense_tail, sink_end)
    n_sink = sink_end - seq_start
    n_tail = seq_len - tail_start
    cnt = tl.load(BLOCK_CNT + b * stride_cb + hk * stride_ch)
    n_virtual = n_sink + n_tail + cnt * BLOCK_SIZE
    v_begin = split * tokens_per_split
    v_end = tl.minimum(v_begin + tokens_per_split, n_virtual)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    q_rows = hk * GROUP + offs_g  # query heads of this group
    q = tl.load(Q + b * stride_qb + q_rows[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)

    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    idx_base = BLOCK_IDX + b * stride_ib + hk * stride_ih

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

    for v0 in range(v_begin, v_end, BLOCK_N):
        vi = v0 + offs_n
        in_range = vi < v_end
        is_sink = vi < n_sink
        is_tail = (vi >= n_sink) & (vi < n_sink + n_tail)
        bv = vi - n_sink - n_tail
        is_blk = in_range & (bv >= 0)
        bv = tl.where(is_blk, bv, 0)
        blk = tl.load(idx_base + bv // BLOCK_SIZE, mask=is_blk, other=0)
        pos_blk = blk * BLOCK_SIZE + bv % BLOCK_SIZE
        pos = tl.where(is_sink, seq_start + vi, tl.where(is_tail, tail_start + (vi - n_sink), pos_blk))
        valid = in_range & (is_sink | is_tail | (is_blk & (pos_blk >= sink_end) & (pos_blk < tail_start)))
        pos = tl.where(valid, pos, 0).to(tl.int64)

        k = tl.load(k_base + pos[:, None] * stride_kt + offs_d[None, :], mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_G, BLOCK_N), log2 units
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # a fully masked tile keeps m at -inf; shift by 0 instead so exp2 never sees (-inf) - (-inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + pos[:, None] * stride_vt + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    # natural-log LSE of the scaled scores: (m + log2 l) * ln 2
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptr = OUT_PART + b * stride_ob + q_rows[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptr, out, mask=g_mask[:, None])
    tl.store(LSE_PART + b * stride_lb + q_rows * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    OUT_PART, LSE_PART, OUT, LSE,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    stride_rb, stride_rh,
    num_splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    lse = tl.load(LSE_PART + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for empty splits
    total = tl.sum(w, 0)
    parts = tl.load(OUT_PART + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_mask[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    lse_out = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))
    tl.store(LSE + b * stride_rb + h * stride_rh, lse_out)
