"""Triton code for `shadowkv_rebuild` (only ``@triton.jit`` functions; see ``triton_shadowkv.py``).

One program per (row * KV head, selected chunk): gather the chunk's ``CHUNK`` factor rows, multiply
by the head's slice of the basis in ``BLOCK_R``-wide steps (two dots: the low and high halves of
head_dim, so the ``rotate_half`` RoPE needs no register shuffle), rotate, store.
"""
import triton
import triton.language as tl


@triton.jit
def _shadowkv_rebuild_kernel(
    FACTOR, BASIS, CHUNK_IDX, INV_FREQ, ROPE_START, OUT,
    stride_fb, stride_ft,
    stride_bb, stride_br, stride_bh,
    stride_cb, stride_ch,
    stride_ob, stride_oh, stride_ot,
    num_kv_heads, rank,
    CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, HALF_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    # 64-bit offsets: B * T_pad * R and B * H * K * CHUNK * D overflow int32 at long contexts
    b = (pid // num_kv_heads).to(tl.int64)
    h = (pid % num_kv_heads).to(tl.int64)
    slot = tl.program_id(1).to(tl.int64)
    cid = tl.load(CHUNK_IDX + b * stride_cb + h * stride_ch + slot).to(tl.int64)

    offs_t = tl.arange(0, BLOCK_T)  # BLOCK_T >= 16 for tl.dot; rows >= CHUNK are masked
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HALF_D)
    t_ok = offs_t < CHUNK
    tok = cid * CHUNK + offs_t
    valid = t_ok & (tok >= 0)  # a -1 id gives negative tokens: the empty slot stays zeros
    tok_safe = tl.where(valid, tok, 0)

    lo = tl.zeros([BLOCK_T, HALF_D], dtype=tl.float32)
    hi = tl.zeros([BLOCK_T, HALF_D], dtype=tl.float32)
    f_base = FACTOR + b * stride_fb + tok_safe[:, None] * stride_ft
    b_base = BASIS + b * stride_bb + h * stride_bh
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + offs_r
        r_ok = r < rank
        u = tl.load(f_base + r[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)  # (BLOCK_T, BLOCK_R)
        w_ptr = b_base + r[:, None] * stride_br + offs_d[None, :]
        w_lo = tl.load(w_ptr, mask=r_ok[:, None], other=0.0)  # (BLOCK_R, HALF_D)
        w_hi = tl.load(w_ptr + HALF_D, mask=r_ok[:, None], other=0.0)
        lo += tl.dot(u, w_lo, input_precision=DOT_PRECISION)
        hi += tl.dot(u, w_hi, input_precision=DOT_PRECISION)

    pos = (tok - tl.load(ROPE_START + b)).to(tl.float32)  # RoPE position of each token
    theta = pos[:, None] * tl.load(INV_FREQ + offs_d)[None, :]  # (BLOCK_T, HALF_D)
    c = tl.cos(theta)
    s = tl.sin(theta)
    out_lo = lo * c - hi * s
    out_hi = hi * c + lo * s  # invalid rows: lo = hi = 0, so the slot is zeros

    o_ptr = OUT + b * stride_ob + h * stride_oh + (slot * CHUNK + offs_t)[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptr, out_lo.to(OUT.dtype.element_ty), mask=t_ok[:, None])
    tl.store(o_ptr + HALF_D, out_hi.to(OUT.dtype.element_ty), mask=t_ok[:, None])
