"""Pure-torch reference for `sparse_decode`: a dense token mask and an fp32 softmax.

Slow (O(T_cap) per head) and deliberately simple; both backends are tested against it.
"""
from __future__ import annotations

import math

import torch

from .checks import check_decode_inputs
from .index import SparseIndex


def reference_sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            index: SparseIndex, *, scale: float | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one decode query over the tokens ``index`` selects, computed densely.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)``; query head ``h`` reads KV head ``h // G`` with ``G = H_q // H_kv``.
    k_cache, v_cache : torch.Tensor
        ``(B, H_kv, T_cap, D)``.
    index : SparseIndex
        Selection; see `SparseIndex.token_mask`.
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.

    Returns
    -------
    out : torch.Tensor
        ``(B, H_q, D)`` in ``q.dtype``; zeros where nothing is attended.
    lse : torch.Tensor
        fp32 ``(B, H_q)``, natural log-sum-exp of the scaled scores; -inf where nothing is attended.
    """
    B, H_q, H_kv, G, T_cap, D = check_decode_inputs(q, k_cache, v_cache, index)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    mask = index.token_mask(T_cap)  # (B, H_kv, T)
    qf = q.float().reshape(B, H_kv, G, D)  # (B, H_kv, G, D)
    scores = torch.einsum("bhgd,bhtd->bhgt", qf, k_cache.float()) * scale  # (B, H_kv, G, T)
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H_kv, G); -inf when the mask is empty
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])  # exp(-inf) = 0 on masked tokens
    out = torch.einsum("bhgt,bhtd->bhgd", p, v_cache.float())  # (B, H_kv, G, D)
    return out.reshape(B, H_q, D).to(q.dtype), lse.reshape(B, H_q)
