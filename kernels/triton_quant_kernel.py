"""Triton code for packed KV quantization (only ``@triton.jit`` functions; see ``triton_quant.py``).

Code layout (``kernels/quant.py``): uint8 codes, ``PER = 8 // BITS`` per byte along the channel
axis, channel ``d`` in byte ``d // PER`` at bit offset ``(d % PER) * BITS``; fp16 scale / zero.
"""
import triton
import triton.language as tl


@triton.jit
def _key_part_scores(q_part, kb, ks_base, kz_base, grp, g_ok, stride_ksg, offs_byte,
                     J: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, TOKEN_GROUPS: tl.constexpr,
                     GROUP_SIZE: tl.constexpr, BYTES: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores from channels ``byte * PER + J`` of a key tile: codes at bit offset J * BITS of each
    packed byte, their per-channel scale / zero rows, dotted with the matching query channels."""
    code = ((kb >> (J * BITS)) & ((1 << BITS) - 1)).to(tl.float32)  # (BLOCK_N, BYTES)
    off = grp[:, None].to(tl.int64) * stride_ksg + (offs_byte * PER + J)[None, :]
    ks = tl.load(ks_base + off, mask=g_ok[:, None], other=0.0).to(tl.float32)  # (TOKEN_GROUPS, BYTES)
    kz = tl.load(kz_base + off, mask=g_ok[:, None], other=0.0).to(tl.float32)
    if TOKEN_GROUPS == 1:
        k = code * ks + kz  # (BLOCK_N, BYTES) * (1, BYTES)
    else:  # repeat each group's row over its GROUP_SIZE tokens
        rows: tl.constexpr = TOKEN_GROUPS * GROUP_SIZE
        k = code * tl.reshape(tl.broadcast_to(ks[:, None, :], (TOKEN_GROUPS, GROUP_SIZE, BYTES)), (rows, BYTES)) \
            + tl.reshape(tl.broadcast_to(kz[:, None, :], (TOKEN_GROUPS, GROUP_SIZE, BYTES)), (rows, BYTES))
    return tl.dot(q_part, tl.trans(k), input_precision=DOT_PRECISION)


@triton.jit
def _value_part(p, vb, vs, vz, J: tl.constexpr, BITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """p @ (values of channels ``byte * PER + J``), dequantized with per-token scale / zero."""
    code = ((vb >> (J * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    return tl.dot(p, code * vs + vz, input_precision=DOT_PRECISION)


@triton.jit
def _quant_decode_split_kernel(
    Q, KC, KS, KZ, VC, VS, VZ, SEQ_STARTS, OUT_PART, LSE_PART,
    stride_qb, stride_qh,
    stride_kcb, stride_kch, stride_kct,
    stride_ksb, stride_ksh, stride_ksg,
    stride_vcb, stride_vch, stride_vct,
    stride_vsb, stride_vsh, stride_vst,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    scale_log2, seq_len, tokens_per_split,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, VALUE_GROUP_SIZE: tl.constexpr, HAS_STARTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (row, KV head, split): online softmax over tokens [split * tokens_per_split, ...),
    dequantizing each K/V tile in registers (keys per channel in groups of GROUP_SIZE tokens,
    values per token in groups of VALUE_GROUP_SIZE channels).

    The packed bytes of a tile are read as whole rows (``HEAD_DIM / PER`` bytes per token) and
    never interleaved back into channel order: channel ``byte * PER + j`` sits at bit offset
    ``j * BITS``, so the tile is handled as PER parts (j = 0 .. PER - 1), each a plain
    (tokens, bytes) matrix. The query is loaded in the same PER parts, key scores are the sum of
    the parts' dot products, and the output is accumulated per part and written back to channel
    order by a strided store. Key scales / zeros are read once per token group, value scales /
    zeros once per token. ``BLOCK_N`` is a multiple of ``GROUP_SIZE``; tiles start at multiples
    of ``BLOCK_N``."""
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = HEAD_DIM // PER  # packed bytes per token
    TOKEN_GROUPS: tl.constexpr = BLOCK_N // GROUP_SIZE  # key scale rows per tile
    CHANNEL_GROUPS: tl.constexpr = HEAD_DIM // VALUE_GROUP_SIZE  # value scales per token
    BYTES_PER_GROUP: tl.constexpr = VALUE_GROUP_SIZE // PER

    if HAS_STARTS:
        seq_start = tl.load(SEQ_STARTS + b)
    else:
        seq_start = 0
    t_begin = split * tokens_per_split
    t_end = tl.minimum(t_begin + tokens_per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_byte = tl.arange(0, BYTES)
    offs_tg = tl.arange(0, TOKEN_GROUPS)
    offs_cg = tl.arange(0, CHANNEL_GROUPS)
    g_mask = offs_g < GROUP
    q_rows = hk * GROUP + offs_g
    q_ptr = Q + b * stride_qb + q_rows[:, None] * stride_qh + offs_byte[None, :] * PER
    q0 = tl.load(q_ptr, mask=g_mask[:, None], other=0.0).to(tl.float32)  # channels byte * PER + 0
    q1 = q0
    q2 = q0
    q3 = q0
    if PER > 1:
        q1 = tl.load(q_ptr + 1, mask=g_mask[:, None], other=0.0).to(tl.float32)
    if PER > 2:
        q2 = tl.load(q_ptr + 2, mask=g_mask[:, None], other=0.0).to(tl.float32)
        q3 = tl.load(q_ptr + 3, mask=g_mask[:, None], other=0.0).to(tl.float32)

    kc_base = KC + b * stride_kcb + hk * stride_kch
    ks_base = KS + b * stride_ksb + hk * stride_ksh
    kz_base = KZ + b * stride_ksb + hk * stride_ksh
    vc_base = VC + b * stride_vcb + hk * stride_vch
    vs_base = VS + b * stride_vsb + hk * stride_vsh
    vz_base = VZ + b * stride_vsb + hk * stride_vsh

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_G, BYTES], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_G, BYTES], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_G, BYTES], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_G, BYTES], dtype=tl.float32)

    for t0 in range(t_begin, t_end, BLOCK_N):
        t = t0 + offs_n
        valid = (t < t_end) & (t >= seq_start)
        in_range = t < t_end
        tt = tl.where(in_range, t, 0).to(tl.int64)
        kb = tl.load(kc_base + tt[:, None] * stride_kct + offs_byte[None, :], mask=in_range[:, None], other=0)
        grp = t0 // GROUP_SIZE + offs_tg  # the tile's key token groups
        g_ok = grp * GROUP_SIZE < t_end
        qk = _key_part_scores(q0, kb, ks_base, kz_base, grp, g_ok, stride_ksg, offs_byte, 0, BITS, PER,
                              TOKEN_GROUPS, GROUP_SIZE, BYTES, DOT_PRECISION)
        if PER > 1:
            qk += _key_part_scores(q1, kb, ks_base, kz_base, grp, g_ok, stride_ksg, offs_byte, 1, BITS, PER,
                                   TOKEN_GROUPS, GROUP_SIZE, BYTES, DOT_PRECISION)
        if PER > 2:
            qk += _key_part_scores(q2, kb, ks_base, kz_base, grp, g_ok, stride_ksg, offs_byte, 2, BITS, PER,
                                   TOKEN_GROUPS, GROUP_SIZE, BYTES, DOT_PRECISION)
            qk += _key_part_scores(q3, kb, ks_base, kz_base, grp, g_ok, stride_ksg, offs_byte, 3, BITS, PER,
                                   TOKEN_GROUPS, GROUP_SIZE, BYTES, DOT_PRECISION)
        qk = tl.where(valid[None, :], qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(vc_base + tt[:, None] * stride_vct + offs_byte[None, :], mask=in_range[:, None], other=0)
        v_off = tt[:, None] * stride_vst + offs_cg[None, :]
        vs = tl.load(vs_base + v_off, mask=in_range[:, None], other=0.0).to(tl.float32)  # (BLOCK_N, CG)
        vz = tl.load(vz_base + v_off, mask=in_range[:, None], other=0.0).to(tl.float32)
        if CHANNEL_GROUPS > 1:  # repeat each group's scale over its bytes (VALUE_GROUP_SIZE / PER per part)
            vs = tl.reshape(tl.broadcast_to(vs[:, :, None], (BLOCK_N, CHANNEL_GROUPS, BYTES_PER_GROUP)),
                            (BLOCK_N, BYTES))
            vz = tl.reshape(tl.broadcast_to(vz[:, :, None], (BLOCK_N, CHANNEL_GROUPS, BYTES_PER_GROUP)),
                            (BLOCK_N, BYTES))
        acc0 = acc0 * alpha[:, None] + _value_part(p, vb, vs, vz, 0, BITS, DOT_PRECISION)
        if PER > 1:
            acc1 = acc1 * alpha[:, None] + _value_part(p, vb, vs, vz, 1, BITS, DOT_PRECISION)
        if PER > 2:
            acc2 = acc2 * alpha[:, None] + _value_part(p, vb, vs, vz, 2, BITS, DOT_PRECISION)
            acc3 = acc3 * alpha[:, None] + _value_part(p, vb, vs, vz, 3, BITS, DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    inv = 1.0 / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptr = OUT_PART + b * stride_ob + q_rows[:, None] * stride_oh + split * stride_os + offs_byte[None, :] * PER
    tl.store(o_ptr, acc0 * inv, mask=g_mask[:, None])
    if PER > 1:
        tl.store(o_ptr + 1, acc1 * inv, mask=g_mask[:, None])
    if PER > 2:
        tl.store(o_ptr + 2, acc2 * inv, mask=g_mask[:, None])
        tl.store(o_ptr + 3, acc3 * inv, mask=g_mask[:, None])
    tl.store(LSE_PART + b * stride_lb + q_rows * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _unpack_codes(packed, BITS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DT: tl.constexpr):
    """(BLOCK_N, HEAD_DIM // PER) packed bytes -> (BLOCK_N, HEAD_DIM) codes in channel order, as DT.

    Channel ``byte * PER + j`` sits at bit offset ``j * BITS``: the PER code planes are joined on
    a new last axis (in-register) and the axes flattened, which puts plane j after plane j - 1."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if BITS == 8:
        codes = packed
    elif BITS == 4:
        codes = tl.reshape(tl.join(packed & MASK, packed >> 4), (BLOCK_N, HEAD_DIM))
    else:  # 2 bits: join(join(c0, c2), join(c1, c3))[..., i, k] = c(2i + k)
        codes = tl.reshape(tl.join(tl.join(packed & MASK, (packed >> 4) & MASK),
                                   tl.join((packed >> 2) & MASK, packed >> 6)), (BLOCK_N, HEAD_DIM))
    return codes.to(DT)


@triton.jit
def _load_packed_tile(t0, t_end, kc_base, ks_base, kz_base, vc_base, vs_base, vz_base,
                      stride_kct, stride_ksg, stride_vct, stride_vst,
                      BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BYTES: tl.constexpr, GROUP_SIZE: tl.constexpr,
                      TG: tl.constexpr, CG: tl.constexpr):
    """The packed key / value bytes of tokens [t0, t0 + BLOCK_N) (zeros past t_end), the key scale
    / zero rows of their token groups (TG, D) and the values' per-token scales / zeros (BLOCK_N, CG)."""
    t = t0 + tl.arange(0, BLOCK_N)
    in_range = t < t_end
    tt = tl.where(in_range, t, 0).to(tl.int64)
    offs_byte = tl.arange(0, BYTES)
    kb = tl.load(kc_base + tt[:, None] * stride_kct + offs_byte[None, :], mask=in_range[:, None], other=0)
    vb = tl.load(vc_base + tt[:, None] * stride_vct + offs_byte[None, :], mask=in_range[:, None], other=0)
    grp = t0 // GROUP_SIZE + tl.arange(0, TG)
    s_off = grp[:, None].to(tl.int64) * stride_ksg + tl.arange(0, HEAD_DIM)[None, :]
    g_ok = (grp * GROUP_SIZE < t_end)[:, None]
    ks = tl.load(ks_base + s_off, mask=g_ok, other=0.0)
    kz = tl.load(kz_base + s_off, mask=g_ok, other=0.0)
    v_off = tt[:, None] * stride_vst + tl.arange(0, CG)[None, :]
    vs = tl.load(vs_base + v_off, mask=in_range[:, None], other=0.0)
    vz = tl.load(vz_base + v_off, mask=in_range[:, None], other=0.0)
    return kb, ks, kz, vb, vs, vz


@triton.jit
def _quant_decode_folded_kernel(
    Q, KC, KS, KZ, VC, VS, VZ, SEQ_STARTS, OUT_PART, LSE_PART,
    stride_qb, stride_qh,
    stride_kcb, stride_kch, stride_kct,
    stride_ksb, stride_ksh, stride_ksg,
    stride_vcb, stride_vch, stride_vct,
    stride_vsb, stride_vsh, stride_vst,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    scale_log2, seq_len, tokens_per_split,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, VALUE_GROUP_SIZE: tl.constexpr, HAS_STARTS: tl.constexpr,
    FOLD_KEYS: tl.constexpr, FOLD_VALUES: tl.constexpr, PREFETCH: tl.constexpr, DT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (row, KV head, split) of the fused decode, with the scales folded out of the tiles.

    A key tile's codes are never dequantized (``FOLD_KEYS``): with per-channel scale s and zero z
    of a token group, ``q . k = (q * s) . code + q . z``, so each group's query is scaled once
    (BLOCK_G x D products instead of BLOCK_N x D) and its zero term is one small sum; the tile is
    one batched dot over its token groups. Values likewise (``FOLD_VALUES``): with per-token
    scales of a channel group, ``sum_t p_t v_t = (p * s) @ code + p @ z``. Codes are unpacked to
    channel order in registers and the dots run in DT (fp16 on a GPU, codes exact) with fp32
    accumulation. Without folding a tile is dequantized in DT and dotted (groups under 16 tokens
    or channels, below the dot's smallest tile, need this). ``PREFETCH`` loads the next tile's
    packed bytes and scales before the current tile is computed (a register double buffer: Triton
    does not pipeline loads whose consumers are not dots)."""
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = HEAD_DIM // PER
    TG: tl.constexpr = BLOCK_N // GROUP_SIZE  # key token groups per tile
    CG: tl.constexpr = HEAD_DIM // VALUE_GROUP_SIZE  # value channel groups per token

    if HAS_STARTS:
        seq_start = tl.load(SEQ_STARTS + b)
    else:
        seq_start = 0
    t_begin = split * tokens_per_split
    t_end = tl.minimum(t_begin + tokens_per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    q_rows = hk * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + q_rows[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None],
                other=0.0).to(tl.float32)  # (BLOCK_G, D)

    kc_base = KC + b * stride_kcb + hk * stride_kch
    ks_base = KS + b * stride_ksb + hk * stride_ksh
    kz_base = KZ + b * stride_ksb + hk * stride_ksh
    vc_base = VC + b * stride_vcb + hk * stride_vch
    vs_base = VS + b * stride_vsb + hk * stride_vsh
    vz_base = VZ + b * stride_vsb + hk * stride_vsh

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if FOLD_VALUES and CG > 1:
        acc = tl.zeros([CG, BLOCK_G, VALUE_GROUP_SIZE], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

    if PREFETCH:
        kb, ks, kz, vb, vs, vz = _load_packed_tile(t_begin, t_end, kc_base, ks_base, kz_base, vc_base, vs_base,
                                                   vz_base, stride_kct, stride_ksg, stride_vct, stride_vst,
                                                   BLOCK_N, HEAD_DIM, BYTES, GROUP_SIZE, TG, CG)
    for t0 in range(t_begin, t_end, BLOCK_N):
        if PREFETCH:  # the next tile (all masked past the split's end) while this one is computed
            kb_n, ks_n, kz_n, vb_n, vs_n, vz_n = _load_packed_tile(
                t0 + BLOCK_N, t_end, kc_base, ks_base, kz_base, vc_base, vs_base, vz_base,
                stride_kct, stride_ksg, stride_vct, stride_vst, BLOCK_N, HEAD_DIM, BYTES, GROUP_SIZE, TG, CG)
        else:
            kb, ks, kz, vb, vs, vz = _load_packed_tile(
                t0, t_end, kc_base, ks_base, kz_base, vc_base, vs_base, vz_base,
                stride_kct, stride_ksg, stride_vct, stride_vst, BLOCK_N, HEAD_DIM, BYTES, GROUP_SIZE, TG, CG)
        t = t0 + offs_n
        valid = (t < t_end) & (t >= seq_start)
        kcode = _unpack_codes(kb, BITS, BLOCK_N, HEAD_DIM, DT)  # (BLOCK_N, D)
        ksf = ks.to(tl.float32)  # (TG, D)
        kzf = kz.to(tl.float32)
        if FOLD_KEYS:
            if TG == 1:
                qk = tl.dot((q * ksf).to(DT), tl.trans(kcode), input_precision=DOT_PRECISION) \
                    + tl.sum(q * kzf, 1)[:, None]
            else:
                qs = (q[None, :, :] * ksf[:, None, :]).to(DT)  # (TG, BLOCK_G, D)
                kc3 = tl.permute(tl.reshape(kcode, (TG, GROUP_SIZE, HEAD_DIM)), (0, 2, 1))  # (TG, D, GS)
                s3 = tl.dot(qs, kc3, input_precision=DOT_PRECISION) \
                    + tl.sum(q[None, :, :] * kzf[:, None, :], 2)[:, :, None]  # (TG, BLOCK_G, GS)
                qk = tl.reshape(tl.permute(s3, (1, 0, 2)), (BLOCK_G, BLOCK_N))
        else:
            if TG > 1:  # repeat each group's row over its GROUP_SIZE tokens
                ksf = tl.reshape(tl.broadcast_to(ksf[:, None, :], (TG, GROUP_SIZE, HEAD_DIM)), (BLOCK_N, HEAD_DIM))
                kzf = tl.reshape(tl.broadcast_to(kzf[:, None, :], (TG, GROUP_SIZE, HEAD_DIM)), (BLOCK_N, HEAD_DIM))
            k = (kcode * ksf.to(DT) + kzf.to(DT)).to(DT)
            qk = tl.dot(q.to(DT), tl.trans(k), input_precision=DOT_PRECISION)
        qk = tl.where(valid[None, :], qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])  # (BLOCK_G, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vcode = _unpack_codes(vb, BITS, BLOCK_N, HEAD_DIM, DT)
        vsf = vs.to(tl.float32)  # (BLOCK_N, CG)
        vzf = vz.to(tl.float32)
        if FOLD_VALUES:
            zt = tl.sum(p[:, :, None] * vzf[None, :, :], 1)  # (BLOCK_G, CG): p @ zero
            if CG == 1:
                o = tl.dot((p * tl.trans(vsf)).to(DT), vcode, input_precision=DOT_PRECISION) + zt
                acc = acc * alpha[:, None] + o
            else:
                ps = (p[None, :, :] * tl.trans(vsf)[:, None, :]).to(DT)  # (CG, BLOCK_G, BLOCK_N)
                vc3 = tl.permute(tl.reshape(vcode, (BLOCK_N, CG, VALUE_GROUP_SIZE)), (1, 0, 2))  # (CG, N, VG)
                o3 = tl.dot(ps, vc3, input_precision=DOT_PRECISION) + tl.trans(zt)[:, :, None]
                acc = acc * alpha[None, :, None] + o3
        else:
            if CG > 1:  # repeat each token's group scale over its channels
                vsf = tl.reshape(tl.broadcast_to(vsf[:, :, None], (BLOCK_N, CG, VALUE_GROUP_SIZE)), (BLOCK_N, HEAD_DIM))
                vzf = tl.reshape(tl.broadcast_to(vzf[:, :, None], (BLOCK_N, CG, VALUE_GROUP_SIZE)), (BLOCK_N, HEAD_DIM))
            v = (vcode * vsf.to(DT) + vzf.to(DT)).to(DT)
            acc = acc * alpha[:, None] + tl.dot(p.to(DT), v, input_precision=DOT_PRECISION)
        m_i = m_new
        if PREFETCH:
            kb, ks, kz, vb, vs, vz = kb_n, ks_n, kz_n, vb_n, vs_n, vz_n

    if FOLD_VALUES and CG > 1:
        out = tl.reshape(tl.permute(acc, (1, 0, 2)), (BLOCK_G, HEAD_DIM))
    else:
        out = acc
    empty = l_i == 0.0
    inv = 1.0 / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptr = OUT_PART + b * stride_ob + q_rows[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptr, out * inv, mask=g_mask[:, None])
    tl.store(LSE_PART + b * stride_lb + q_rows * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _quantize_pack_kernel(
    X, CODES, SCALE, ZERO,
    stride_xr, stride_xt,
    stride_cr, stride_ct,
    stride_sr, stride_st,
    num_tokens,
    BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    """Quantize and pack one tile of tokens of one (row * head) ``r``.

    PER_CHANNEL: the tile is one token group (BLOCK_T == GROUP_SIZE); min / max over tokens,
    scale / zero written at row ``tile`` of (R, T / GROUP_SIZE, D). Otherwise: BLOCK_T tokens,
    min / max over each group of GROUP_SIZE channels, scale / zero (R, T, D / GROUP_SIZE).
    Scale and zero are rounded to fp16 before the codes are computed (as the torch reference).
    """
    r = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    t_mask = offs_t < num_tokens
    x = tl.load(X + r * stride_xr + offs_t[:, None].to(tl.int64) * stride_xt + offs_d[None, :],
                mask=t_mask[:, None], other=0.0).to(tl.float32)
    if PER_CHANNEL:
        mn = tl.min(x, 0)  # (D,)
        mx = tl.max(x, 0)
        scale = ((mx - mn) / LEVELS).to(tl.float16)
        zero = mn.to(tl.float16)
        s32 = scale.to(tl.float32)
        s32 = tl.where(s32 > 0, s32, 1.0)
        codes = tl.floor((x - zero.to(tl.float32)[None, :]) / s32[None, :] + 0.5)
        tl.store(SCALE + r * stride_sr + tile * stride_st + offs_d, scale)
        tl.store(ZERO + r * stride_sr + tile * stride_st + offs_d, zero)
    else:
        NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
        xg = tl.reshape(x, (BLOCK_T, NG, GROUP_SIZE))
        mn = tl.min(xg, 2)  # (BLOCK_T, NG)
        mx = tl.max(xg, 2)
        scale = ((mx - mn) / LEVELS).to(tl.float16)
        zero = mn.to(tl.float16)
        s32 = scale.to(tl.float32)
        s32 = tl.where(s32 > 0, s32, 1.0)
        codes = tl.floor((xg - zero.to(tl.float32)[:, :, None]) / s32[:, :, None] + 0.5)
        codes = tl.reshape(codes, (BLOCK_T, HEAD_DIM))
        offs_g = tl.arange(0, NG)
        s_ptr = r * stride_sr + offs_t[:, None].to(tl.int64) * stride_st + offs_g[None, :]
        tl.store(SCALE + s_ptr, scale, mask=t_mask[:, None])
        tl.store(ZERO + s_ptr, zero, mask=t_mask[:, None])
    codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS).to(tl.int32)
    shifts = tl.arange(0, PER) * BITS
    packed = tl.sum(tl.reshape(codes, (BLOCK_T, HEAD_DIM // PER, PER)) << shifts[None, None, :], 2)
    offs_b = tl.arange(0, HEAD_DIM // PER)
    tl.store(CODES + r * stride_cr + offs_t[:, None].to(tl.int64) * stride_ct + offs_b[None, :],
             packed.to(tl.uint8), mask=t_mask[:, None])
