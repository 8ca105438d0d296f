"""Merge attention states computed over disjoint token sets (split-K, sinks/tail, offloaded parts)."""
from __future__ import annotations

import torch

from .backend import merge_backend
from .triton_merge import triton_merge_states

MERGE_BACKENDS = ("auto", "triton", "native", "torch")


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                 *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial attentions into the attention over their union.

    Parameters
    ----------
    out_a, out_b : torch.Tensor
        ``(..., D)`` partial outputs (each already normalised by its own softmax sum).
    lse_a, lse_b : torch.Tensor
        ``(...)`` natural log-sum-exp of each part's scaled scores; ``-inf`` marks an empty part
        (its ``out`` is ignored).

    Returns
    -------
    out : torch.Tensor
        ``(..., D)`` in ``out_a.dtype``; zeros where both parts are empty.
    lse : torch.Tensor
        fp32 ``(...)``; ``-inf`` where both parts are empty. Never NaN for finite inputs.

    ``backend``: ``"triton"`` is one launch (CUDA tensors); ``"native"`` one compiled call (fp32
    CPU, `kvpress.kernels.native.merge_states`); ``"torch"`` the reference below, ~25 small ops;
    ``"auto"`` takes triton for CUDA tensors when it is importable, else torch
    (`kvpress.kernels.backend.merge_states` decides).
    """
    if backend not in MERGE_BACKENDS:
        raise ValueError(f"backend must be one of {MERGE_BACKENDS}, got {backend!r}")
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"merge_states needs out (..., D) and lse (...) of matching shapes, got "
                         f"out {tuple(out_a.shape)}/{tuple(out_b.shape)}, "
                         f"lse {tuple(lse_a.shape)}/{tuple(lse_b.shape)}")
    choice = merge_backend(out_a, backend)
    if choice != "torch" and len({t.device for t in (out_a, lse_a, out_b, lse_b)}) != 1:
        raise ValueError("merge_states: the four tensors must be on one device")
    if choice == "triton":
        return triton_merge_states(out_a, lse_a, out_b, lse_b)
    if choice == "native":
        from .native import merge_states as native_merge_states

        return native_merge_states(out_a, lse_a, out_b, lse_b)
    return torch_merge_states(out_a, lse_a, out_b, lse_b)


def torch_merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path and reference of `merge_states` (same arguments, shapes not checked)."""
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)  # both empty: shift by 0
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)  # (...); exp(-inf) = 0 for an empty part
    total = wa + wb
    empty = total == 0
    denom = torch.where(empty, torch.ones_like(total), total)
    # where() rather than multiply: an empty part's out may hold garbage (even NaN)
    contrib_a = torch.where((wa > 0)[..., None], out_a.float() * (wa / denom)[..., None], 0.0)
    contrib_b = torch.where((wb > 0)[..., None], out_b.float() * (wb / denom)[..., None], 0.0)
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(denom))
    return (contrib_a + contrib_b).to(out_a.dtype), lse
