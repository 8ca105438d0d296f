"""ShadowKV key reconstruction: gather chunks of a low-rank pre-RoPE key factor, rebuild, rotate.

ShadowKV (Sun et al., "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM
Inference", arXiv 2410.21465) keeps the pre-RoPE keys of a layer as a truncated SVD
``K_pre[t, h*D:(h+1)*D] ~= factor[t] @ basis[:, h]`` and, per decode step, rebuilds only the
keys of the selected chunks and applies RoPE at their original positions::

    for each selected chunk j of (row b, KV head h), token t = j * chunk_size + o:
        k_pre = factor[b, t] @ basis[b, :, h]                     # (D,)
        k[b, h, slot * chunk_size + o] = rope(k_pre, t - rope_start[b])

`shadowkv_rebuild` dispatches to the pure-torch reference here or to the fused Triton kernel
(``triton_shadowkv.py``); both take and return the same tensors.
"""
from __future__ import annotations

import torch

from .backend import triton_unsupported
from .checks import SHADOWKV_CHUNK_SIZES, TRITON_REBUILD_HEAD_DIMS, check_rebuild_inputs  # noqa: F401 (re-exported)


def torch_shadowkv_rebuild(factor: torch.Tensor, basis: torch.Tensor, chunk_idx: torch.Tensor,
                           inv_freq: torch.Tensor, rope_start: torch.Tensor, *, chunk_size: int) -> torch.Tensor:
    """Reference: gather the chunks' factor rows, multiply by the basis, apply RoPE (fp32 math).

    Parameters
    ----------
    factor : Tensor (B, T_pad, R)
        Per-token low-rank factor (``U * S`` of the SVD), token axis padded to whole chunks.
    basis : Tensor (B, R, H_kv, D)
        Shared right singular vectors, split per KV head.
    chunk_idx : int32 Tensor (B, H_kv, K)
        Chunk ids per (row, KV head); -1 marks an empty slot (its keys are zeros).
    inv_freq : fp32 Tensor (D / 2,)
        RoPE inverse frequencies (``rotate_half`` layout).
    rope_start : int Tensor (B,)
        Padded-token index of each row's RoPE position 0 (position of token t is ``t - rope_start``).
    chunk_size : int
        One of ``SHADOWKV_CHUNK_SIZES``.

    Returns
    -------
    Tensor (B, H_kv, K * chunk_size, D) in factor's dtype.
    """
    B, T_pad, R, H_kv, D, K = check_rebuild_inputs(factor, basis, chunk_idx, inv_freq, rope_start, chunk_size)
    ids = chunk_idx.long()
    valid = ids >= 0  # (B, H, K)
    tok = (ids.clamp(min=0)[..., None] * chunk_size + torch.arange(chunk_size, device=ids.device))  # (B, H, K, cs)
    tok = tok.reshape(B, H_kv * K * chunk_size)  # (B, H*K*cs)
    rows = torch.gather(factor.float(), 1, tok[..., None].expand(B, tok.shape[1], R))  # (B, H*K*cs, R)
    rows = rows.view(B, H_kv, K * chunk_size, R)
    pre = rows @ basis.float().permute(0, 2, 1, 3)  # (B, H, K*cs, R) @ (B, H, R, D) -> (B, H, K*cs, D)
    pos = (tok.view(B, H_kv, K * chunk_size) - rope_start.long()[:, None, None]).float()  # (B, H, K*cs)
    theta = pos[..., None] * inv_freq.float()  # (B, H, K*cs, D/2)
    cos, sin = theta.cos(), theta.sin()
    lo, hi = pre[..., : D // 2], pre[..., D // 2:]
    out = torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)  # rotate_half RoPE
    keep = valid[..., None].expand(B, H_kv, K, chunk_size).reshape(B, H_kv, K * chunk_size, 1)
    return torch.where(keep, out, torch.zeros_like(out)).to(factor.dtype)


def shadowkv_rebuild(factor: torch.Tensor, basis: torch.Tensor, chunk_idx: torch.Tensor,
                     inv_freq: torch.Tensor, rope_start: torch.Tensor, *, chunk_size: int,
                     backend: str = "auto") -> torch.Tensor:
    """Rebuild post-RoPE keys of selected chunks from a low-rank pre-RoPE factorisation.

    Same arguments and result as `torch_shadowkv_rebuild`. ``backend``: ``"torch"`` (any device),
    ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``; head_dim in
    ``TRITON_REBUILD_HEAD_DIMS``) or ``"auto"`` (triton on CUDA when it is importable and the
    head_dim is supported, else torch).
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be one of ('auto', 'triton', 'torch'), got {backend!r}")
    if backend == "auto":
        ok = (isinstance(factor, torch.Tensor) and basis.dim() == 4
              and triton_unsupported(factor, basis.shape[-1], 1, TRITON_REBUILD_HEAD_DIMS, forced=False) is None)
        backend = "triton" if ok else "torch"
    if backend == "triton":
        from .triton_shadowkv import triton_shadowkv_rebuild

        return triton_shadowkv_rebuild(factor, basis, chunk_idx, inv_freq, rope_start, chunk_size=chunk_size)
    return torch_shadowkv_rebuild(factor, basis, chunk_idx, inv_freq, rope_start, chunk_size=chunk_size)
