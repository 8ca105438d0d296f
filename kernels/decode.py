"""`sparse_decode`: one decode step of attention over the tokens a `SparseIndex` selects."""
from __future__ import annotations

import functools
import importlib.util

import torch

from .checks import MAX_GROUP
from .index import SparseIndex
from .torch_decode import torch_sparse_decode
from .triton_decode import TRITON_HEAD_DIMS

BACKENDS = ("auto", "triton", "torch", "native")


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked once, without importing it: the
    decode paths ask on every call)."""
    return importlib.util.find_spec("triton") is not None


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
        head_dim when triton is importable; native for inputs it runs when it is built; else
        torch.
    out : torch.Tensor, optional
        Preallocated ``(B, H_q, D)`` output in q's dtype.
    validate_index : bool
        Check index values against the cache (a device sync); pass False in hot loops once the
        index was validated at plan time.

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
    if _native_first(q, backend):
        done = _native_decode(q, k_cache, v_cache, index, scale, out, validate_index, backend == "native")
        if done is not None:
            return done
        backend, validate_index = "torch", False  # validated by _native_decode
    if backend == "auto":
        use_triton = (isinstance(q, torch.Tensor) and q.is_cuda and q.dim() == 3
                      and q.shape[-1] in TRITON_HEAD_DIMS and isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4
                      and k_cache.shape[1] and q.shape[1] // k_cache.shape[1] <= MAX_GROUP and triton_available())
        backend = "triton" if use_triton else "torch"
    if backend == "triton":
        from .triton_decode import triton_sparse_decode

        return triton_sparse_decode(q, k_cache, v_cache, index, scale=scale, out=out,
                                    validate_index=validate_index)
    return torch_sparse_decode(q, k_cache, v_cache, index, scale=scale, out=out,
                               validate_index=validate_index)


def _native_first(q, backend: str) -> bool:
    """Whether to try the native kernels: ``backend="native"``, or ``"auto"`` with fp32 CPU q and
    the kernels built (otherwise the torch / triton path runs and validates as before)."""
    if backend == "native":
        return True
    if backend != "auto" or not isinstance(q, torch.Tensor) or q.is_cuda or q.dtype != torch.float32:
        return False
    from . import native

    return native.available()


def _native_decode(q, k_cache, v_cache, index, scale, out, validate_index, required: bool, tail=None, chunk_size=0):
    """Validate the inputs and run `kvpress.kernels.native.sparse_decode` when it can run them;
    else None (validated, not runnable natively), or with ``required`` a ValueError naming why."""
    from . import native
    from .checks import check_decode_inputs

    check_decode_inputs(q, k_cache, v_cache, index, out, validate_index)
    why = native.decode_unsupported(q, k_cache, v_cache, index, tail)
    if why is not None:
        if required:
            raise ValueError(f"backend='native' cannot run these inputs: {why}; use backend='auto' or 'torch'")
        return None
    scale = 1.0 / (q.shape[-1] ** 0.5) if scale is None else float(scale)
    return native.sparse_decode(q, k_cache, v_cache, index, scale=scale, tail=tail, chunk_size=chunk_size, out=out)
