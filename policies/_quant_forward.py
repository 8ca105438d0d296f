"""The quantizers' multi-token forward over [packed store | full-precision window]
(`kvpress.policies._quant.QuantWindowLayer._attend_forward`): functions of the layer.

A forward of `DEQUANT_MIN_QUERIES` tokens or more reads a transient dequantized copy
(`dequantized`) through SDPA; shorter ones read the codes (`attend_over_store`) in query blocks of
at most `SCORE_BYTES` of fp32 scores (`blocked_attend`).
"""
from __future__ import annotations

import torch

SCORE_BYTES = 32 * 2**20  # fp32 scores of one block of a multi-token forward's queries (a few such live at once)


def dequantized(layer, kw, vw):
    """The packed tokens dequantized into a transient fp32 copy, followed by the window
    ``kw`` / ``vw`` (B, H, W, D): ``(k, v)`` (B, H, N + W, D) for a forward of
    ``DEQUANT_MIN_QUERIES`` tokens or more; None when nothing is packed or the layer cannot
    (its `_dequantize_into`).

    Reading the codes block by block materialises fp32 scores and unpacks the whole store
    once per query block; the copy is unpacked once per forward, and SDPA's fused kernel over
    it never holds a score matrix. It (2 x N x D fp32 per KV head) lives until the layer
    returns, like the forward's other activations.
    """
    n = layer.n_quant
    if not n:
        return None
    B, H, W, D = kw.shape
    k, v = kw.new_empty(B, H, n + W, D), vw.new_empty(B, H, n + W, D)
    if not layer._dequantize_into(k[:, :, :n], v[:, :, :n]):
        return None
    k[:, :, n:], v[:, :, n:] = kw, vw
    return k, v


def blocked_attend(layer, q, q_start: int, kw, vw, scaling, packed=None):
    """`attend_over_store` over queries in blocks, so a forward never holds more than SCORE_BYTES of
    fp32 scores at once: fp32 output (B, H_q, T, D) and log-sum-exp (B, H_q, T)."""
    B, H_q, T, _ = q.shape
    factor = 1 if packed is not None else layer.score_block_factor
    step = max(1, SCORE_BYTES // (4 * B * H_q * (layer.n_quant + layer.win_len) * factor))
    parts = [attend_over_store(layer, q[:, :, i:i + step], q_start + i, kw, vw, scaling, packed) for i in range(0, T, step)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([o for o, _ in parts], dim=2), torch.cat([l for _, l in parts], dim=2)


def attend_over_store(layer, q, q_start, kw, vw, scaling, packed=None):
    """Queries ``q`` (B, H_q, T, D) at sequence indices ``q_start ..`` (an int, or a long
    tensor (T,) of each row's index) over [packed | window]: fp32 output (B, H_q, T, D) and
    log-sum-exp (B, H_q, T). The packed tokens are read from the codes, or from ``packed``:
    their dequantized ``(k, v)`` (B, H, N, D) as `_dequantize_into` lays them out."""
    B, H_q, T, D = q.shape
    H = kw.shape[1]
    qg = q.float().view(B, H, H_q // H, T, D).reshape(B, H, H_q // H * T, D)  # row m = g * T + i
    s_win = (qg @ kw.transpose(-1, -2)) * scaling  # (B, H, M, W)
    k_pos = torch.arange(layer.n_quant, layer.seen, device=q.device)
    if not torch.is_tensor(q_start):
        q_start = torch.arange(q_start, q_start + T, device=q.device)
    q_pos = q_start.repeat(H_q // H)  # (M,)
    hidden = k_pos[None, :] > q_pos[:, None]  # (M, W) causal
    rs = layer.row_start
    if rs is not None:
        hidden = hidden[None] | (k_pos[None, None, :] < rs[:, None, None])  # (B, M, W)
        # a padding query (a prompt padded beyond its first piece) attends only to itself, as
        # in `dense_causal_attention`: every packed column is padding to it, and an empty row
        # would be NaN
        own = (k_pos[None, :] == q_pos[:, None])[None] & (q_pos[None, :, None] < rs[:, None, None])
        hidden = (hidden & ~own)[:, None]
    s_win = s_win.masked_fill(hidden, float("-inf"))
    # one softmax over [packed | window], each part exponentiated in place (no concatenated copy)
    if not layer.n_quant:
        s_q = None
    elif packed is None:
        s_q = layer._quant_scores(qg, scaling)  # (B, H, M, N)
    else:  # the copy's padding columns come first: column c < row_start is hidden
        s_q = (qg @ packed[0].transpose(-1, -2)) * scaling
        if rs is not None:
            pad = torch.arange(layer.n_quant, device=q.device)[None, :] < rs[:, None]  # (B, N)
            s_q = s_q.masked_fill(pad[:, None, None], float("-inf"))
    top = s_win.amax(-1, keepdim=True)
    if s_q is not None:
        top = torch.maximum(top, s_q.amax(-1, keepdim=True))
    p_win = s_win.sub_(top).exp_()
    total = p_win.sum(-1, keepdim=True)
    if s_q is not None:
        p_q = s_q.sub_(top).exp_()
        total = total + p_q.sum(-1, keepdim=True)
    lse = (top + total.log()).squeeze(-1)  # (B, H, M)
    out = p_win.div_(total) @ vw
    if s_q is not None:
        p_q = p_q.div_(total)
        out = out + (layer._quant_output(p_q) if packed is None else p_q @ packed[1])
    return out.view(B, H, H_q // H, T, D).reshape(B, H_q, T, D), lse.view(B, H_q, T)
