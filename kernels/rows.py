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

import torch

from .backend import rows_backend, triton_available, triton_unsupported  # noqa: F401
from .checks import (ALLOWED_DTYPES, MAX_GROUP, TRITON_HEAD_DIMS, TRITON_MAX_SETS, RowDims,  # noqa: F401
                     check_row_sets)  # (importable from here, as before)
from .triton_rows import triton_attend_rows

ROW_BACKENDS = ("auto", "triton", "native", "torch")


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
    return (1 <= num_sets <= TRITON_MAX_SETS and num_kv_heads > 0 and q.shape[1] % num_kv_heads == 0
            and triton_unsupported(q, q.shape[-1], q.shape[1] // num_kv_heads, forced=False) is None)


def native_rows_supported(q: torch.Tensor, sets) -> bool:
    """Whether `native.attend_rows` (the compiled CPU twin) takes these inputs: fp32 CPU, G <= 8,
    up to 8 sets, k and v of one shape and strides with dense (n, D) rows, the library built."""
    try:
        return rows_backend(q, list(sets), "native") == "native"
    except ValueError:
        return False


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
        else native, where they apply, else torch (`kvpress.kernels.backend.attend_rows` decides).

    Returns
    -------
    out : fp32 ``(B, H_q, D)``, zeros where no row is in use; lse : fp32 ``(B, H_q)`` natural-log
    sum-exp of the scaled scores, ``-inf`` there -- as `sparse_decode` of each set merged with
    `merge_states`.
    """
    if backend not in ROW_BACKENDS:
        raise ValueError(f"backend must be one of {ROW_BACKENDS}, got {backend!r}")
    sets = list(sets)
    check_row_sets(q, sets)
    choice = rows_backend(q, sets, backend)
    if choice == "triton":
        return triton_attend_rows(q, sets, scale=scale)
    if choice == "native":
        from .native import attend_rows as native_attend_rows

        return native_attend_rows(q, [(k, v, None if c is None else c.clamp(max=n), n) for k, v, c, n in sets],
                                  scale=scale)
    return torch_attend_rows(q, sets, scale=scale)
