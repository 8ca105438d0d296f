"""`attend_rows`: one decode query per head attends the union of a few row sets under one softmax.

A decode step that keeps its tokens in several stores (ShadowKV: generated tokens, exact outlier /
window tokens, the selected chunks) can attend each store with `sparse_decode` and combine the
partial states with `merge_states`; that is a handful of launches per store and per merge, which
is what bounds a decode step on a host-bound GPU machine. `attend_rows` takes the stores as they
are and does it in one pass: on CUDA one Triton launch (``triton_rows.py``), elsewhere the torch
path below, which is also the reference the kernel is tested against; on fp32 CPU tensors the
compiled twin `native.attend_rows` where it applies.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .checks import ALLOWED_DTYPES, MAX_GROUP
from .decode import triton_available
from .triton_decode import TRITON_HEAD_DIMS

ROW_BACKENDS = ("auto", "triton", "native", "torch")
TRITON_MAX_SETS = 4  # row sets one Triton launch takes


class RowDims(NamedTuple):
    batch_size: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    head_dim: int


def check_row_sets(q: torch.Tensor, sets) -> RowDims:
    """Validate `attend_rows` arguments; a ValueError names the set and what is allowed."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in ALLOWED_DTYPES:
        raise ValueError(f"q must be a (B, H_q, D) tensor of {ALLOWED_DTYPES}, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    sets = list(sets)
    if not sets:
        raise ValueError("attend_rows needs at least one row set (k, v, cnt, n)")
    B, H_q, D = q.shape
    H = None
    for i, s in enumerate(sets):
        if len(s) != 4:
            raise ValueError(f"row set {i} must be (k, v, cnt, n), got {len(s)} items")
        k, v, cnt, n = s
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
            raise ValueError(f"row set {i}: k and v must both be (B={B}, H_kv, n_cap, D={D}), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.device != q.device or v.device != q.device or k.dtype not in ALLOWED_DTYPES or v.dtype != k.dtype:
            raise ValueError(f"row set {i}: k and v must share q's device ({q.device}) and one dtype of "
                             f"{ALLOWED_DTYPES}, got {k.device}/{k.dtype} and {v.device}/{v.dtype}")
        if H is None:
            H = k.shape[1]
        if k.shape[1] != H:
            raise ValueError(f"row set {i} has {k.shape[1]} KV heads, the first set {H}: every set must have the same")
        if not isinstance(n, int) or not 0 <= n <= k.shape[2]:
            raise ValueError(f"row set {i}: n must be an int in 0..n_cap={k.shape[2]}, got {n!r}")
        if cnt is not None and (not isinstance(cnt, torch.Tensor) or cnt.shape != (B, H) or cnt.is_floating_point()
                                or cnt.device != q.device):
            raise ValueError(f"row set {i}: cnt must be None or an integer (B, H_kv) = {(B, H)} tensor on "
                             f"{q.device}, got {tuple(cnt.shape) if isinstance(cnt, torch.Tensor) else cnt!r}")
    if H == 0 or H_q % H:
        raise ValueError(f"query heads ({H_q}) must be a multiple of the sets' KV heads ({H})")
    return RowDims(B, H_q, H, H_q // H, D)


def torch_attend_rows(q: torch.Tensor, sets, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path and reference of `attend_rows`: the rows in use of every set side by side,
    one masked softmax in fp32. Rows not in use may hold anything (NaN too): they never count."""
    B, H_q, H, G, D = check_row_sets(q, sets)
    ks, vs, masks = [], [], []
    for k, v, cnt, n in sets:
        in_use = (torch.arange(n, device=q.device) < cnt[..., None]) if cnt is not None else \
            torch.ones(B, H, n, dtype=torch.bool, device=q.device)
        ks.append(k[:, :, :n])
        vs.append(v[:, :, :n])
        masks.append(in_use.expand(B, H, n))
    mask = torch.cat(masks, dim=2)  # (B, H, N)
    keys = torch.cat(ks, dim=2).float()
    values = torch.cat(vs, dim=2).float().masked_fill(~mask[..., None], 0.0)
    s = (q.float().view(B, H, G, D) * scale) @ keys.transpose(-1, -2)  # (B, H, G, N)
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for a (row, head) that attends nothing
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return (p @ values).reshape(B, H_q, D), lse.reshape(B, H_q)


def triton_rows_supported(q: torch.Tensor, num_kv_heads: int, num_sets: int) -> bool:
    """Whether the Triton launch takes these inputs (CUDA, head_dim 64 / 128, G <= 16, 1-4 sets)."""
    return (q.is_cuda and triton_available() and q.shape[-1] in TRITON_HEAD_DIMS and 1 <= num_sets <= TRITON_MAX_SETS
            and num_kv_heads > 0 and q.shape[1] % num_kv_heads == 0 and q.shape[1] // num_kv_heads <= MAX_GROUP)


def native_rows_supported(q: torch.Tensor, sets) -> bool:
    """Whether `native.attend_rows` (the compiled CPU twin) takes these inputs: fp32 CPU, G <= 8,
    up to 8 sets, k and v of one shape and strides with dense (n, D) rows, the library built."""
    from . import native
    from ._native_lib import _fp32_cpu, _rows_contiguous

    H = sets[0][0].shape[1]
    return (len(sets) <= 8 and _fp32_cpu(q) and q.shape[1] % H == 0 and q.shape[1] // H <= 8
            and all(_fp32_cpu(k, v) and k.stride() == v.stride() and _rows_contiguous(k) for k, v, _, _ in sets)
            and native.available())


def attend_rows(q: torch.Tensor, sets, *, scale: float, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of ``q`` over the union of ``sets``, one softmax.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)``, one decode query per head; query head ``h`` reads KV head ``h // G``.
    sets : sequence of ``(k, v, cnt, n)``
        ``k``, ``v``: ``(B, H_kv, n_cap, D)`` of one dtype on q's device (strides free but the last);
        the rows in use are the first ``cnt[b, h]`` (an integer ``(B, H_kv)`` tensor, clipped to
        ``n``) or, with ``cnt=None``, the first ``n`` of every (row, KV head). Rows past them are
        never read by the kernel and never counted by the torch path.
    scale : float
        Score scale.
    backend : {"auto", "triton", "native", "torch"}
        ``"triton"``: CUDA tensors, head_dim 64 or 128, G <= 16, at most 4 sets. ``"native"``: the
        compiled CPU twin (`native.attend_rows`: fp32, G <= 8, dense rows). ``"auto"``: triton,
        else native, where they apply, else torch.

    Returns
    -------
    out : fp32 ``(B, H_q, D)``, zeros where no row is in use; lse : fp32 ``(B, H_q)`` natural-log
    sum-exp of the scaled scores, ``-inf`` there -- as `sparse_decode` of each set merged with
    `merge_states`.
    """
    if backend not in ROW_BACKENDS:
        raise ValueError(f"backend must be one of {ROW_BACKENDS}, got {backend!r}")
    sets = list(sets)
    if backend != "triton":  # (the launcher checks its own)
        H = check_row_sets(q, sets).num_kv_heads
    if backend == "triton" or (backend == "auto" and triton_rows_supported(q, H, len(sets))):
        from .triton_rows import triton_attend_rows
        return triton_attend_rows(q, sets, scale=scale)
    if backend == "native" or (backend == "auto" and native_rows_supported(q, sets)):
        from . import native
        return native.attend_rows(q, [(k, v, None if c is None else c.clamp(max=n), n) for k, v, c, n in sets],
                                  scale=scale)
    return torch_attend_rows(q, sets, scale=scale)
