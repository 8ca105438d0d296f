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

import importlib.util

import torch

SHADOWKV_CHUNK_SIZES = (8, 16, 32, 64)
TRITON_REBUILD_HEAD_DIMS = (32, 64, 128, 256)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_rebuild_inputs(factor: torch.Tensor, basis: torch.Tensor, chunk_idx: torch.Tensor,
                         inv_freq: torch.Tensor, rope_start: torch.Tensor, chunk_size: int) -> tuple[int, ...]:
    """Validate `shadowkv_rebuild` arguments; return ``(B, T_pad, R, H_kv, D, K)``.

    Raises
    ------
    ValueError
        Naming the argument and what is allowed (shapes, dtypes, devices, chunk size).
    """
    if isinstance(chunk_size, bool) or chunk_size not in SHADOWKV_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {SHADOWKV_CHUNK_SIZES}, got {chunk_size!r}")
    named = (("factor", factor, 3, "(B, T_pad, R)"), ("basis", basis, 4, "(B, R, H_kv, D)"),
             ("chunk_idx", chunk_idx, 3, "(B, H_kv, K)"), ("inv_freq", inv_freq, 1, "(D / 2,)"),
             ("rope_start", rope_start, 1, "(B,)"))
    for name, t, ndim, layout in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
        if t.device != factor.device:
            raise ValueError(f"{name} is on {t.device} but factor is on {factor.device}; use one device")
    if factor.dtype not in _DTYPES or basis.dtype != factor.dtype:
        raise ValueError(f"factor and basis must share one float dtype (fp16/bf16/fp32), got "
                         f"{factor.dtype} and {basis.dtype}")
    if chunk_idx.dtype != torch.int32:
        raise ValueError(f"chunk_idx must be int32, got {chunk_idx.dtype}")
    if inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be float32, got {inv_freq.dtype}")
    if rope_start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope_start must be int32 or int64, got {rope_start.dtype}")
    B, T_pad, R = factor.shape
    _, R_b, H_kv, D = basis.shape
    if basis.shape[0] != B or R_b != R:
        raise ValueError(f"basis must have shape (B, R, H_kv, D) = ({B}, {R}, H_kv, D), got {tuple(basis.shape)}")
    if D % 2 or inv_freq.shape[0] != D // 2:
        raise ValueError(f"inv_freq must have head_dim / 2 = {D // 2} entries (head_dim even), got "
                         f"{inv_freq.shape[0]} for head_dim {D}")
    if chunk_idx.shape[:2] != (B, H_kv):
        raise ValueError(f"chunk_idx must have shape (B, H_kv, K) = ({B}, {H_kv}, K), got {tuple(chunk_idx.shape)}")
    if rope_start.shape[0] != B:
        raise ValueError(f"rope_start must have shape (B,) = ({B},), got {tuple(rope_start.shape)}")
    if T_pad % chunk_size:
        raise ValueError(f"factor's token axis ({T_pad}) must be a multiple of chunk_size={chunk_size}")
    return B, T_pad, R, H_kv, D, chunk_idx.shape[2]


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
        ok = (isinstance(factor, torch.Tensor) and factor.is_cuda and basis.dim() == 4
              and basis.shape[-1] in TRITON_REBUILD_HEAD_DIMS and importlib.util.find_spec("triton") is not None)
        backend = "triton" if ok else "torch"
    if backend == "triton":
        from .triton_shadowkv import triton_shadowkv_rebuild

        return triton_shadowkv_rebuild(factor, basis, chunk_idx, inv_freq, rope_start, chunk_size=chunk_size)
    return torch_shadowkv_rebuild(factor, basis, chunk_idx, inv_freq, rope_start, chunk_size=chunk_size)
