"""Packed low-bit KV storage: quantize / pack / unpack, a dequantizing reference, and the torch
fast path that attends over packed codes without rebuilding a full-precision cache.

Formats (asymmetric min/max quantization, ``x ~= code * scale + zero``, codes in ``[0, 2^bits)``):

* **per-channel** (KIVI keys): a group is ``group_size`` consecutive tokens of one channel.
  ``codes`` uint8 ``(B, H, T, D * bits / 8)``, ``scale`` / ``zero`` fp16 ``(B, H, T / group_size, D)``.
* **per-token** (values; ZipCache's normalised keys): a group is ``group_size`` consecutive
  channels of one token. ``codes`` uint8 ``(B, H, T, D * bits / 8)``, ``scale`` / ``zero`` fp16
  ``(B, H, T, D / group_size)``.

Codes are packed along the channel axis, ``8 / bits`` per byte, channel ``j * (8 / bits) + i``
in bits ``[i * bits, (i + 1) * bits)`` of byte ``j``; so codes stay token-major like a dense
cache and appending tokens is a slice write.

Torch fast path (CPU): attention walks the packed tokens in chunks of about ``CHUNK_BYTES`` of
fp32; only one chunk's codes are unpacked at a time and no dequantized K/V is ever built: the
scale and zero point are folded into the query / probabilities instead. For per-channel keys
``q . k_t = sum_d (q_d s_gd) c_td + sum_d q_d z_gd`` (one batched matmul over the chunk's
token groups plus one bias per group); for per-token values ``sum_t p_t v_td = sum_t (p_t s_tg)
c_td + sum_t p_t z_tg`` (one matmul for all channel groups). Codes become fp32 in the order
cheapest to produce (``unpack_planes``: bit plane 0 of every byte of a row, then plane 1, ...;
shift and mask four bytes at a time), and the query, scales and outputs are permuted to match.
Unpacking still dominates on CPU: one decode step over 8k tokens (H_q=32, H_kv=8, D=128, one
thread) takes ~29 ms at 4 or 2 bits vs ~19 ms for fp32 SDPA over the dense cache (~54 ms at 4
bits with lookup-table unpacking; ``python -m kvpress.evals.bench_quant kernel --device cpu
--contexts 8k --threads 1 --clock cpu``). So a
decode step on CPU (up to 8 query rows per KV head) goes to the compiled kernels of
`kvpress.kernels.native` instead when they are built (``backend="auto"``; ``"torch"`` keeps this
path, their reference): each packed row is unpacked in registers once for the whole GQA group,
never written out. A forward of a few tokens (up to
`native.QUANT_NATIVE_READ_ROWS` rows per KV head: an assisted-decoding verification) reads
natively too, eight rows per call. On GPU the Triton kernel (``triton_quant.py``)
dequantizes each K/V tile in registers.
"""
from __future__ import annotations

import torch

from .backend import quant_read_backend
from .quant_format import (ALLOWED_BITS, ALLOWED_GROUP_SIZES, _quantize, _shifts, check_quant_config,  # noqa: F401
                           pack_codes, unpack_codes)
# refined key channels (zipcache's refine_key_channels), re-exported here where their readers look
from .quant_refine import dequantize_refinement, quantize_refined_keys, refined_scores  # noqa: F401

CHUNK_BYTES = 4 << 20  # fp32 bytes of codes unpacked at a time by the torch path (all rows and heads together)
# on a GPU each chunk costs a dozen small launches of host time and memory is plentiful: one
# chunk covers 64k tokens of 8 KV heads at D=128 (gear's and zipcache's torch reads there)
CUDA_CHUNK_BYTES = 256 << 20


_ORDERS: dict = {}


def plane_order(dim: int, bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The channel order of :func:`unpack_planes`' rows: ``(order, inverse)``, long ``(dim,)``
    each; position ``i`` holds channel ``order[i]``, channel ``c`` sits at ``inverse[c]``."""
    key = (dim, bits, device)
    if key not in _ORDERS:
        per = 8 // bits
        order = torch.arange(dim, device=device).view(dim // per, per).transpose(0, 1).reshape(dim)
        _ORDERS[key] = order, torch.argsort(order)
    return _ORDERS[key]


def unpack_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 codes of ``packed`` (..., D * bits / 8) as ``(..., D)`` in bit-plane order
    (:func:`plane_order`): plane ``i`` of every byte, for ``i`` in
    ``0 .. 8/bits - 1``, one after the other. Each plane is one shift and one mask over the
    bytes, four at a time through an int32 view, then one contiguous conversion (at 4 bits ~3x
    faster on CPU than the 256-entry lookup table it replaced, which went through a long index
    per byte). Callers permute the query / scales instead (a dot product does not depend on the
    order of its terms) and un-permute outputs."""
    if bits == 8:
        return packed.float()
    per, nbytes = 8 // bits, packed.shape[-1]
    mask = (1 << bits) - 1
    try:  # four bytes per element; bit planes never cross a byte, so any byte order works
        words, mask = packed.view(torch.int32), mask * 0x01010101
    except RuntimeError:  # a view that is not 4-byte aligned
        words = packed
    planes = torch.stack([(words >> (i * bits) if i else words) & mask for i in range(per)], dim=-2)
    return planes.view(torch.uint8).float().view(*packed.shape[:-1], nbytes * per)


def quantize_per_channel(x: torch.Tensor, bits: int, group_size: int):
    """Per-channel quantization, groups of ``group_size`` tokens (KIVI keys).

    Parameters
    ----------
    x : Tensor (B, H, T, D), any float dtype; ``T`` a multiple of ``group_size``.

    Returns
    -------
    codes : uint8 (B, H, T, D * bits / 8)
    scale, zero : fp16 (B, H, T / group_size, D)
    """
    check_quant_config(bits, group_size)
    B, H, T, D = x.shape
    if T % group_size:
        raise ValueError(f"per-channel quantization needs a token count divisible by group_size={group_size}, got {T}")
    xg = x.float().reshape(B, H, T // group_size, group_size, D)  # (B, H, NG, G, D)
    codes, scale, zero = _quantize(xg, bits, reduce_dim=3)
    return pack_codes(codes.reshape(B, H, T, D), bits), scale.squeeze(3), zero.squeeze(3)


def quantize_per_token(x: torch.Tensor, bits: int, group_size: int):
    """Per-token quantization, groups of ``group_size`` channels (values).

    Parameters
    ----------
    x : Tensor (B, H, T, D), any float dtype; ``D`` a multiple of ``group_size``.

    Returns
    -------
    codes : uint8 (B, H, T, D * bits / 8)
    scale, zero : fp16 (B, H, T, D / group_size)
    """
    check_quant_config(bits, group_size, x.shape[-1])
    B, H, T, D = x.shape
    xg = x.float().reshape(B, H, T, D // group_size, group_size)  # (B, H, T, NGd, Gs)
    codes, scale, zero = _quantize(xg, bits, reduce_dim=4)
    return pack_codes(codes.reshape(B, H, T, D), bits), scale.squeeze(4), zero.squeeze(4)


def dequantize_per_channel(codes, scale, zero, bits: int, group_size: int) -> torch.Tensor:
    """fp32 (B, H, T, D) from :func:`quantize_per_channel` output (reference / tests only)."""
    c = unpack_codes(codes, bits).float()  # (B, H, T, D)
    B, H, T, D = c.shape
    c = c.view(B, H, T // group_size, group_size, D)
    return (c * scale.float()[:, :, :, None] + zero.float()[:, :, :, None]).reshape(B, H, T, D)


def dequantize_per_token(codes, scale, zero, bits: int, group_size: int) -> torch.Tensor:
    """fp32 (B, H, T, D) from :func:`quantize_per_token` output (reference / tests only)."""
    c = unpack_codes(codes, bits).float()
    B, H, T, D = c.shape
    c = c.view(B, H, T, D // group_size, group_size)
    return (c * scale.float()[..., None] + zero.float()[..., None]).reshape(B, H, T, D)


# ----------------------------------------------------------------------------- torch fast path
def _chunk(group_size: int, codes: torch.Tensor, bits: int) -> int:
    """Tokens per chunk: about ``CHUNK_BYTES`` of unpacked fp32 over the batch and heads of
    ``codes`` (B, H, T, D * bits / 8), a multiple of ``group_size`` (``CUDA_CHUNK_BYTES`` on a
    GPU). Fewer, larger chunks mean fewer small torch calls, which dominate a decode step."""
    B, H, _, nbytes = codes.shape
    row = B * H * nbytes * (8 // bits) * 4
    budget = CUDA_CHUNK_BYTES if codes.is_cuda else CHUNK_BYTES
    return max(group_size, budget // row // group_size * group_size)


SPLIT_K_LEN = 1024  # tokens per slice of `long_matmul` on a GPU


def long_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a`` (..., m, K), ``b`` (..., K, n) with a long K (tokens) and small m, n.

    On a GPU the token axis is cut into slices of `SPLIT_K_LEN` that are multiplied as one batch
    and summed (`split_k_matmul`): cuBLAS runs such a skinny product as one block per output tile
    walking all of K (a decode step's ``p @ codes`` over 32k tokens took ~1 ms per call on an
    H200). On CPU, or a short K, the plain product."""
    if not a.is_cuda or a.shape[-1] < 2 * SPLIT_K_LEN:
        return a @ b
    return split_k_matmul(a, b, SPLIT_K_LEN)


def split_k_matmul(a: torch.Tensor, b: torch.Tensor, length: int) -> torch.Tensor:
    """``a @ b`` as the sum of the products of K-slices of ``length`` (one batched product), plus
    the product of what is left over."""
    K = a.shape[-1]
    S = K // length
    main = S * length
    a_parts = a[..., :main].unflatten(-1, (S, length)).transpose(-3, -2)  # (..., S, m, length)
    out = (a_parts @ b[..., :main, :].unflatten(-2, (S, length))).sum(-3)  # (..., S, m, n) -> (..., m, n)
    return out if main == K else out + a[..., main:] @ b[..., main:, :]


READ_BACKENDS = ("auto", "torch", "native")


def reads_natively(x: torch.Tensor, codes, scale, zero, backend: str) -> bool:
    """Whether a packed-store read goes through `kvpress.kernels.native`: ``"auto"`` on CPU with
    the kernels built and inputs they take, ``"native"`` always (a ValueError naming why when it
    cannot). Reads for more than `native.QUANT_NATIVE_READ_ROWS` query rows per KV head (prefill
    chunks, not decode steps or short verifications) take the torch path under either
    (`kvpress.kernels.backend.quant_read` decides)."""
    from .native_quant import QUANT_NATIVE_READ_ROWS

    return quant_read_backend(x, codes, scale, zero, backend, QUANT_NATIVE_READ_ROWS) == "native"


def channel_quant_scores(q: torch.Tensor, codes, scale, zero, bits: int, group_size: int,
                         backend: str = "auto") -> torch.Tensor:
    """``q @ dequant(k)^T`` for per-channel-quantized keys, chunk by chunk.

    Parameters
    ----------
    q : fp32 (B, H, M, D)
        M query rows per KV head (GQA group x query tokens).
    codes, scale, zero : per-channel format, T tokens.
    backend : "auto" (the native CPU kernels for up to `native.QUANT_NATIVE_READ_ROWS` rows, eight
        per call, when built; else torch), "torch"
        or "native" (`READ_BACKENDS`).

    Returns
    -------
    fp32 (B, H, M, T), unscaled dot products.
    """
    if reads_natively(q, codes, scale, zero, backend):
        from .native import channel_scores

        return channel_scores(q, codes, scale, zero, bits, group_size)
    B, H, M, D = q.shape
    T = codes.shape[2]
    out = q.new_empty(B, H, M, T)
    order, _ = plane_order(D, bits, q.device)  # keys are grouped over tokens: any channel order
    qo = q[..., order]
    step = _chunk(group_size, codes, bits)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        g0, g1 = t0 // group_size, t1 // group_size
        c = unpack_planes(codes[:, :, t0:t1], bits)  # (B, H, t, D) in plane order: one chunk, never the cache
        s, z = scale[:, :, g0:g1].float(), zero[:, :, g0:g1].float()  # (B, H, ng, D)
        so = s[..., order]
        if M < group_size:
            # fold the scale into the query: (B, H, ng, M, D) @ (B, H, ng, D, G)
            qs = qo[:, :, None] * so[:, :, :, None]
            part = qs @ c.view(B, H, g1 - g0, group_size, D).transpose(-1, -2)  # (B, H, ng, M, G)
            part = part + (q[:, :, None] * z[:, :, :, None]).sum(-1, keepdim=True)
            out[:, :, :, t0:t1] = part.permute(0, 1, 3, 2, 4).reshape(B, H, M, t1 - t0)
        else:  # many query rows (chunked prefill): dequantizing the chunk is cheaper
            k = (c.view(B, H, g1 - g0, group_size, D) * so[:, :, :, None] + z[..., order][:, :, :, None])
            out[:, :, :, t0:t1] = qo @ k.view(B, H, t1 - t0, D).transpose(-1, -2)
    return out


_GROUP_SELECTS: dict = {}


def _group_select(dim: int, bits: int, group_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows in :func:`unpack_planes`' order: ``(inverse, group, onehot)``: where each channel
    sits, the value-group of each position (long ``(D,)``) and that as fp32 ``(D / G, 1, D)``.
    Built once per shape and device (every decode step of every layer asks for it)."""
    key = (dim, bits, group_size, device)
    if key not in _GROUP_SELECTS:
        order, inverse = plane_order(dim, bits, device)
        group = order // group_size
        onehot = (torch.arange(dim // group_size, device=device)[:, None] == group[None]).float()[:, None]
        _GROUP_SELECTS[key] = inverse, group, onehot
    return _GROUP_SELECTS[key]


def token_quant_scores(q: torch.Tensor, codes, scale, zero, bits: int, group_size: int) -> torch.Tensor:
    """``q @ dequant(k)^T`` for per-token-quantized keys: fp32 (B, H, M, T), unscaled.

    Few query rows: the query is split by channel group (zeros elsewhere) so that one matmul
    scores every group against the unpacked chunk, then each group's scores take their scale;
    many rows: the chunk is dequantized."""
    B, H, M, D = q.shape
    T = codes.shape[2]
    ng = D // group_size
    out = q.new_empty(B, H, M, T)
    order = plane_order(D, bits, q.device)[0]
    group, onehot = _group_select(D, bits, group_size, q.device)[1:]
    qo = q[..., order]  # positions of the unpacked rows
    few = M < group_size
    if few:
        qsum = q.view(B, H, M, ng, group_size).sum(-1)  # (B, H, M, NGd)
        q_groups = (qo[:, :, None] * onehot).view(B, H, ng * M, D)  # (B, H, NGd * M, D)
    step = _chunk(group_size, codes, bits)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        c = unpack_planes(codes[:, :, t0:t1], bits)  # (B, H, t, D)
        s, z = scale[:, :, t0:t1].float(), zero[:, :, t0:t1].float()  # (B, H, t, NGd)
        if few:
            sg = (q_groups @ c.transpose(-1, -2)).view(B, H, ng, M, t1 - t0)
            out[:, :, :, t0:t1] = (sg * s.transpose(-1, -2)[:, :, :, None]).sum(2) + qsum @ z.transpose(-1, -2)
        else:
            out[:, :, :, t0:t1] = qo @ (c * s[..., group] + z[..., group]).transpose(-1, -2)
    return out


def token_quant_values(p: torch.Tensor, codes, scale, zero, bits: int, group_size: int,
                       backend: str = "auto") -> torch.Tensor:
    """``p @ dequant(v)`` for per-token-quantized values.

    Parameters
    ----------
    p : fp32 (B, H, M, T) attention weights.
    backend : as for `channel_quant_scores`.

    Returns
    -------
    fp32 (B, H, M, D)

    Few rows: the probabilities are scaled once per value group and one matmul applies all of
    them to the unpacked chunk (each group's block of the result is kept); many rows: the chunk
    is dequantized.
    """
    if reads_natively(p, codes, scale, zero, backend):
        from .native import token_values

        return token_values(p, codes, scale, zero, bits, group_size)
    B, H, M, T = p.shape
    D = codes.shape[-1] * 8 // bits
    ng = D // group_size
    inverse, group, onehot = _group_select(D, bits, group_size, p.device)
    few = M < group_size
    acc = p.new_zeros(B, H, ng, M, D) if few else p.new_zeros(B, H, M, D)  # positions of the unpacked rows
    zacc = p.new_zeros(B, H, M, ng)
    step = _chunk(group_size, codes, bits)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        pc = p[..., t0:t1]
        c = unpack_planes(codes[:, :, t0:t1], bits)  # (B, H, t, D)
        s, z = scale[:, :, t0:t1].float(), zero[:, :, t0:t1].float()  # (B, H, t, NGd)
        if few:
            pw = pc[:, :, None] * s.transpose(-1, -2)[:, :, :, None]  # (B, H, NGd, M, t)
            acc += long_matmul(pw.reshape(B, H, ng * M, t1 - t0), c).view(B, H, ng, M, D)
            zacc += long_matmul(pc, z)
        else:
            acc += pc @ (c * s[..., group] + z[..., group])
    out = (acc * onehot).sum(2) + zacc[..., group] if few else acc
    return out[..., inverse]


def channel_quant_values(p: torch.Tensor, codes, scale, zero, bits: int, group_size: int) -> torch.Tensor:
    """``p @ dequant(v)`` for per-channel-quantized tensors: fp32 (B, H, M, D)."""
    B, H, M, T = p.shape
    D = codes.shape[-1] * 8 // bits
    out = p.new_zeros(B, H, M, D)  # channels in plane order
    order, inverse = plane_order(D, bits, p.device)
    step = _chunk(group_size, codes, bits)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        g0, g1 = t0 // group_size, t1 // group_size
        c = unpack_planes(codes[:, :, t0:t1], bits).view(B, H, g1 - g0, group_size, D)
        pg = p[..., t0:t1].reshape(B, H, M, g1 - g0, group_size).transpose(2, 3)  # (B, H, ng, M, G)
        out += ((pg @ c) * scale[:, :, g0:g1, None][..., order].float()).sum(2)
        out += (pg.sum(-1, keepdim=True) * zero[:, :, g0:g1, None][..., order].float()).sum(2)
    return out[..., inverse]

