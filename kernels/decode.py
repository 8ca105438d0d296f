"""`sparse_decode`: one decode step of attention over the tokens a `SparseIndex` selects."""
from __future__ import annotations

import torch

from .backend import BACKENDS, sparse_decode_backend, triton_available  # noqa: F401  (importable from here, as before)
from .checks import MAX_GROUP, TRITON_HEAD_DIMS, check_decode_inputs  # noqa: F401
from .index import SparseIndex
from .torch_decode import torch_sparse_decode
from .triton_decode import triton_sparse_decode


def sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: SparseIndex,
                  *, scale: float | None = None, backend: str = "auto", out: torch.Tensor | None = None,
                  validate_index: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend one query token per head to the cached tokens selected by ``index``.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)``, fp16 / bf16 / fp32, last dim contiguous. ``H_q = G * H_kv``; query head
        ``h`` uses KV head ``h // G`` (HF ``repeat_kv`` order). The triton kernels take G up to
        ``MAX_GROUP`` (16), the native ones up to 8; ``"auto"`` runs larger groups on the torch path.
    k_cache, v_cache : torch.Tensor
        ``(B, H_kv, T_cap, D)``, q's dtype and device. Only the last dim must be contiguous
        (stride 1); batch, head and token strides are free, so the tokens of one head are rows
        ``k_cache[b, h, t, :]`` of a strided view (HF caches are fully contiguous).
    index : SparseIndex
        Tokens to attend per (row, KV head): sinks U tail U selected blocks, deduplicated,
        restricted to ``[seq_start, seq_len)``.
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    backend : {"auto", "triton", "torch", "native"}
        ``"triton"``: CUDA tensors, head_dim 64 or 128, G <= 16. ``"torch"``: any device (the fast path
        on CPU: it gathers only the selected rows). ``"native"``: fp32 CPU tensors and a clean
        index (no padding slots), one compiled C call (`kvpress.kernels.native`; an error when
        it cannot run the inputs). ``"auto"``: triton for CUDA tensors with a supported
        head_dim when triton is importable; native for inputs it runs when it is built (torch for an
        index that is not clean); else torch. The choice
        is `kvpress.kernels.backend.sparse_decode`'s.
    out : torch.Tensor, optional
        Preallocated ``(B, H_q, D)`` output in q's dtype.
    validate_index : bool
        Check index values against the cache (a device sync); pass False in hot loops once the
        index was validated at plan time. Not checked while `torch.compile` traces.

    Returns
    -------
    out : torch.Tensor
        ``(B, H_q, D)`` in q's dtype; zeros for a (row, head) that attends to nothing.
    lse : torch.Tensor
        fp32 ``(B, H_q)``, natural log-sum-exp of the scaled scores; -inf when nothing is attended
        (ready for `merge_states`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_decode_inputs(q, k_cache, v_cache, index, out, validate_index and not torch.compiler.is_compiling())
    choice = sparse_decode_backend(q, k_cache, v_cache, index.block_idx, backend)
    if choice == "native":
        done = native_decode(q, k_cache, v_cache, index, scale, out, required=backend == "native")
        if done is not None:
            return done
        choice = "torch"
    if choice == "triton":
        return triton_sparse_decode(q, k_cache, v_cache, index, scale=scale, out=out, validate_index=False)
    return torch_sparse_decode(q, k_cache, v_cache, index, scale=scale, out=out, validate_index=False)


def native_decode(q, k_cache, v_cache, index, scale, out, *, required: bool, tail=None, chunk_size=0):
    """`kvpress.kernels.native.sparse_decode` of validated inputs, or None for an index that is not
    clean (the caller runs the torch path; with ``required``, a forced ``backend="native"``, a
    ValueError). While `torch.compile` traces, the index is not read: the op itself runs the torch
    path for an index that is not clean."""
    from .native import sparse_decode as native_sparse_decode

    if not torch.compiler.is_compiling():
        from .torch_fast import clean_rows

        if clean_rows(index) is None:
            if required:
                raise ValueError("sparse_decode: backend='native' cannot run these inputs: it needs a clean index (no "
                                 "padding slots; every row holds its sinks, tail and blocks); use backend='auto' or "
                                 "'torch'")
            return None
    scale = 1.0 / (q.shape[-1] ** 0.5) if scale is None else float(scale)
    return native_sparse_decode(q, k_cache, v_cache, index, scale=scale, tail=tail, chunk_size=chunk_size, out=out)
