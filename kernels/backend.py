"""The one place that decides which implementation runs a kernel: torch, native or triton.

Every kernel entry point of `kvpress.kernels` takes ``backend=`` and asks a function here which
implementation runs; the policies do too (`quant_step_backend`, `label_select_backend`,
`shadowkv_step_backend`, `residual_backend`, `fused_quant_backend`), so none of them tests
availability or limits itself.

* ``"torch"``: plain torch operators on any device (the reference of the other two).
* ``"native"``: the compiled CPU kernels (`kvpress.kernels.native`, fp32 CPU tensors, the library
  built; a GQA group of at most 8 except for `sparse_decode`).
* ``"triton"``: the Triton kernels (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``,
  the tests' way; triton importable, head_dim 64 or 128, a GQA group of at most 16).
* ``"auto"``: the first of triton, native, torch that can run the inputs.

A forced backend that cannot run the inputs raises a ValueError naming why and what is allowed.
Every check here reads shapes, dtypes, devices and strides only, never tensor values, so a
choice made while `torch.compile` traces is the choice eager makes (availability is a constant
for the tracer). The one value-dependent limit, the native `sparse_decode`'s clean index, is
checked after the choice: in eager by `kvpress.kernels.decode.native_decode` (the torch path runs
instead), while tracing by the native op itself, which then runs the torch path inside.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from ._native_lib import available as _library_loaded, unavailable_reason
from .native_quant import quant_unsupported
from .checks import (MAX_GROUP, NATIVE_MAX_GROUP, NATIVE_MAX_SETS, TRITON_HEAD_DIMS, TRITON_MAX_SETS,
                     TRITON_QUANT_HEAD_DIMS, interpreting)

BACKENDS = ("auto", "triton", "torch", "native")
ORDER = ("triton", "native", "torch")  # what "auto" tries, first that can run wins
# under TRITON_INTERPRET=1, "auto" picks the Triton kernels for CPU tensors as it would for CUDA ones
# (the op-count benchmark's --cuda-path sets it, with `native_available` off, to walk a GPU step's routes)
AUTO_TRITON_ON_CPU = False


@torch.compiler.assume_constant_result
@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


@torch.compiler.assume_constant_result
def native_available() -> bool:
    """Whether the compiled CPU kernels are built and loaded (built on the first call)."""
    return _library_loaded()


def _native_reason() -> str:
    return f"the native library is not available: {unavailable_reason()}"


def choose(op: str, backend: str, allowed: tuple[str, ...], why_not: dict) -> str:
    """The backend that runs ``op``: ``backend`` itself when forced, else the first of `ORDER`
    in ``allowed`` whose ``why_not`` is None.

    ``why_not`` maps a backend name to a function of no arguments giving why it cannot run the
    inputs (a string) or None; a backend without an entry can always run. Raises ValueError for a
    ``backend`` not in ``("auto",) + allowed``, or a forced one that cannot run the inputs.
    """
    names = ("auto",) + allowed
    if backend not in names:
        raise ValueError(f"{op}: backend must be one of {names}, got {backend!r}")
    if backend != "auto":
        check = why_not.get(backend)
        why = None if check is None else check()
        if why is not None:
            raise ValueError(f"{op}: backend={backend!r} cannot run these inputs: {why}; "
                             f"use backend='auto' or 'torch'")
        return backend
    for name in ORDER:
        if name in allowed:
            check = why_not.get(name)
            if check is None or check() is None:
                return name
    return "torch"


# ----------------------------------------------------------------------------- shared limits
def triton_unsupported(t: torch.Tensor, head_dim: int, group: int, head_dims=TRITON_HEAD_DIMS, *,
                       forced: bool = True) -> str | None:
    """Why the Triton kernels cannot run on ``t``'s device with this head_dim and GQA group, or None.
    CPU tensors run under ``TRITON_INTERPRET=1`` when the backend is ``forced`` (the tests' way), for
    ``"auto"`` only with `AUTO_TRITON_ON_CPU`."""
    if head_dim not in head_dims:
        return f"it takes head_dim in {head_dims}, got {head_dim}"
    if not 1 <= group <= MAX_GROUP:
        return f"it takes GQA groups of 1..{MAX_GROUP} query heads per KV head, got {group}"
    if not t.is_cuda and not ((forced or AUTO_TRITON_ON_CPU) and interpreting()):
        return f"it needs CUDA tensors (got {t.device}; TRITON_INTERPRET=1 runs CPU tensors in the tests)"
    if not triton_available():
        return "triton is not installed"
    return None


def _fp32_cpu(*tensors) -> bool:
    return all(t.is_cpu and t.dtype is torch.float32 for t in tensors)


def _dense_rows(t: torch.Tensor) -> bool:
    """(B, H, T, D) with rows of D contiguous and consecutive (the last two dims dense)."""
    stride, shape = t.stride(), t.shape
    return stride[3] == 1 and (shape[2] <= 1 or stride[2] == shape[3])


def _native_why(group: int, *fp32: torch.Tensor, max_group: int | None = NATIVE_MAX_GROUP) -> str | None:
    if not _fp32_cpu(*fp32):
        return "it needs fp32 CPU tensors"
    if group < 1 or (max_group is not None and group > max_group):
        return f"it takes GQA groups of 1..{NATIVE_MAX_GROUP} query heads per KV head, got {group}"
    if not native_available():
        return _native_reason()
    return None


def _group(q: torch.Tensor, num_kv_heads: int) -> int:
    return q.shape[1] // num_kv_heads if num_kv_heads and q.shape[1] % num_kv_heads == 0 else 0


# ----------------------------------------------------------------------------- per operation
def sparse_decode_backend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_idx: torch.Tensor,
                  backend: str, tail: tuple | None = None) -> str:
    """`kvpress.kernels.sparse_decode` / `sparse_decode_tail` (``tail`` = ``(k_sum, v_sum, count)``)."""
    G = _group(q, k_cache.shape[1])

    def native():  # the compiled sparse decode takes any GQA group
        why = _native_why(G, q, k_cache, v_cache, max_group=None)
        if why is None and not (_dense_rows(k_cache) and _dense_rows(v_cache)):
            why = "it needs caches whose (T, D) dims are dense"
        if why is None and block_idx.dtype != torch.int32:
            why = "it needs int32 block ids"
        if why is None and tail is not None:
            k_sum, v_sum, count = tail
            if not (_fp32_cpu(k_sum, v_sum, count) and _dense_rows(k_sum) and v_sum.stride() == k_sum.stride()
                    and count.stride(-1) == 1):
                why = "it needs fp32 chunk sums with dense (N, D) dims"
        return why

    return choose("sparse_decode", backend, ORDER,
                  {"triton": lambda: triton_unsupported(q, q.shape[-1], G, forced=backend == "triton"),
                   "native": native})


def merge_backend(out_a: torch.Tensor, backend: str) -> str:
    """`kvpress.kernels.merge_states`: triton on CUDA; native only when asked for (``"auto"`` keeps
    the torch path on CPU, whose results the callers' references are)."""
    def native():
        return _native_why(1, out_a)

    def triton():
        return triton_unsupported(out_a, 64, 1, forced=backend == "triton")

    choice = choose("merge_states", backend, ORDER, {"triton": triton, "native": native})
    return "torch" if backend == "auto" and choice == "native" else choice


def rows_backend(q: torch.Tensor, sets, backend: str) -> str:
    """`kvpress.kernels.attend_rows` over ``sets`` of ``(k, v, cnt, n)``."""
    H = sets[0][0].shape[1]
    G = _group(q, H)

    def triton():
        if len(sets) > TRITON_MAX_SETS:
            return f"it takes up to {TRITON_MAX_SETS} row sets, got {len(sets)}"
        return triton_unsupported(q, q.shape[-1], G, forced=backend == "triton")

    def native():
        if len(sets) > NATIVE_MAX_SETS:
            return f"it takes up to {NATIVE_MAX_SETS} row sets, got {len(sets)}"
        for i, (k, v, _, _) in enumerate(sets):
            if not (_fp32_cpu(k, v) and k.stride() == v.stride() and _dense_rows(k)):
                return f"row set {i} must be fp32 CPU k / v of one layout with dense (n, D) dims"
        return _native_why(G, q)

    return choose("attend_rows", backend, ORDER, {"triton": triton, "native": native})


def quant_decode_backend(q: torch.Tensor, k_codes: torch.Tensor, refine, backend: str) -> str:
    """`kvpress.kernels.quant_decode`: the fused Triton kernel or the torch path."""
    def triton():
        R = 0 if refine is None else refine[2].shape[-1]
        if R & (R - 1):
            return f"it reads a power-of-two count of refined key channels, got {R}"
        return triton_unsupported(q, q.shape[-1], _group(q, k_codes.shape[1]), TRITON_QUANT_HEAD_DIMS,
                                  forced=backend == "triton")

    return choose("quant_decode", backend, ("triton", "torch"), {"triton": triton})


def quant_read_unsupported(x: torch.Tensor, codes, scale, zero) -> str | None:
    """Why the native packed-store reads cannot take query rows / probabilities ``x`` (B, H, M, *)
    over this store, or None when they can (library availability not included)."""
    return quant_unsupported(x, codes, scale, zero)


def quant_read_backend(x: torch.Tensor, codes, scale, zero, backend: str, max_rows: int) -> str:
    """A read of a packed store (`channel_quant_scores` / `token_quant_values`): ``"native"`` or
    ``"torch"``. Reads of more than ``max_rows`` query rows per KV head (prefill chunks) run on
    torch under either ``"auto"`` or ``"native"``."""
    if backend in ("auto", "native") and x.dim() == 4 and x.shape[2] > max_rows:
        return "torch"
    if backend == "auto" and x.is_cuda:
        return "torch"

    def native():
        why = quant_read_unsupported(x, codes, scale, zero)
        return why if why is not None else (None if native_available() else _native_reason())

    return choose("packed-store read", backend, ("torch", "native"), {"native": native})


DECODE_BACKENDS = ("auto", "triton", "torch")  # a quantized layer's ``decode_backend`` (`fused_quant_backend`)


def fused_quant_backend(q: torch.Tensor, num_kv_heads: int, *, n_quant: int, decode_backend: str = "auto") -> str:
    """Whether a quantized policy's decode step runs on the fused dequantize-attention kernel
    (`kvpress.kernels.quant_decode`): ``"triton"``, or ``"torch"`` (its other paths: native or torch,
    `quant_step_backend`).

    q : (B, H_q, M, D), the step's queries; the fused kernel takes a one-token step (M = 1) over
    ``n_quant`` > 0 packed tokens, head_dim in `TRITON_QUANT_HEAD_DIMS` and a GQA group of 1..16.
    ``decode_backend``: ``"auto"`` (the kernel on CUDA when it can run these shapes), ``"triton"``
    (forced: CPU tensors under ``TRITON_INTERPRET=1``, the tests' way; raises when the kernel cannot
    run the step) or ``"torch"`` (never the kernel).
    """
    if decode_backend not in DECODE_BACKENDS:
        raise ValueError(f"decode_backend must be one of {DECODE_BACKENDS}, got {decode_backend!r}")
    if decode_backend == "torch" or q.shape[2] != 1 or not n_quant:
        return "torch"
    why = triton_unsupported(q, q.shape[-1], _group(q, num_kv_heads), TRITON_QUANT_HEAD_DIMS,
                             forced=decode_backend == "triton")
    if why is None:
        return "triton"
    if decode_backend == "triton":
        raise ValueError(f"quantized decode step: decode_backend='triton' cannot run these inputs: {why}; "
                         f"use decode_backend='auto' or 'torch'")
    return "torch"


def quant_step_backend(q: torch.Tensor, num_kv_heads: int, stores, *, n_quant: int, backend: str,
               decode_backend: str = "auto") -> str:
    """How a quantized policy's one-token decode step over packed tokens runs: ``"triton"`` (the
    fused `quant_decode`), ``"native"`` (one `native.quant_attend` call) or ``"torch"``.

    q : (B, H_q, M, D), the step's queries (M = 1 for a decode step); ``stores``: the packed
    stores as ``((k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero))`` pairs; ``n_quant``:
    packed tokens (0: nothing packed yet, torch); ``backend``: the policy's read backend
    (``"auto"`` / ``"torch"`` / ``"native"``); ``decode_backend``: its fused-decode backend
    (``"auto"`` / ``"torch"`` / ``"triton"``). A forced backend that cannot run raises.
    """
    if q.shape[2] != 1 or not n_quant:
        return "torch"
    G = _group(q, num_kv_heads)
    if fused_quant_backend(q, num_kv_heads, n_quant=n_quant, decode_backend=decode_backend) == "triton":
        return "triton"
    if backend not in ("auto", "torch", "native"):
        raise ValueError(f"backend must be one of ('auto', 'torch', 'native'), got {backend!r}")
    if backend == "torch" or q.is_cuda or not 1 <= G <= NATIVE_MAX_GROUP:
        return "torch"
    if backend == "auto" and not native_available():
        return "torch"
    probe = q.float().view(q.shape[0], num_kv_heads, -1, q.shape[-1]) if q.dtype != torch.float32 else \
        q.reshape(q.shape[0], num_kv_heads, -1, q.shape[-1])
    why = next((w for keys, values in stores
                for w in (quant_read_unsupported(probe, *keys), quant_read_unsupported(probe, *values))
                if w is not None), None)
    if why is None and not native_available():
        why = _native_reason()
    if why is not None and backend == "native":
        raise ValueError(f"backend='native' cannot read this packed store: {why}; use backend='auto' or 'torch'")
    return "native" if why is None else "torch"


def label_select_backend(q: torch.Tensor, num_kv_heads: int, labels: torch.Tensor, k_cache: torch.Tensor,
                 backend: str) -> str:
    """Double Sparsity's decode selection (`native.label_select` or its torch path): native for
    ``"auto"`` on fp32 CPU labels and keys with a contiguous cache, G <= 8, the library built.
    ``backend`` is the policy's (any of `BACKENDS`): ``"triton"`` names the attention kernel, the
    selection then runs on torch."""
    if backend == "triton":
        return "torch"

    def native():
        if not (k_cache.is_contiguous() and labels.dtype == torch.float32):
            return "it needs fp32 labels and a contiguous fp32 K cache"
        return _native_why(_group(q, num_kv_heads), q, k_cache)

    return choose("label_select", backend, ("native", "torch"), {"native": native})


def shadowkv_step_backend(q: torch.Tensor, gen_k: torch.Tensor, backend: str, landmarks=None, factor=None,
                  basis=None) -> str:
    """ShadowKV's compiled decode step (`native.shadowkv_select` + `native.attend_rows`) or torch.
    ``backend`` is the policy's (any of `BACKENDS`); ``"triton"`` means the torch / Triton step."""
    if backend == "triton":
        return "torch"

    def native():
        why = _native_why(_group(q, gen_k.shape[1]), q, gen_k)
        if why is None and landmarks is not None:
            from .native import shadowkv_unsupported

            why = shadowkv_unsupported(q, landmarks, factor, basis)
        return why

    return choose("shadowkv step", backend, ("native", "torch"), {"native": native})


def residual_backend(keys: torch.Tensor, table: torch.Tensor, backend: str) -> str:
    """ShadowKV's residual correction of rebuilt keys (`native.add_residual` or torch). ``backend``
    is the policy's (any of `BACKENDS`); only ``"torch"`` keeps fp32 CPU keys off the native pass."""
    if backend == "triton":
        backend = "auto"

    def native():
        if table.device.type != "cpu" or table.dtype != torch.uint8:
            return "it needs a uint8 CPU residual table"
        return _native_why(1, keys)

    return choose("add_residual", backend, ("native", "torch"), {"native": native})
