"""ShadowKV's host tier read and written by the device: rows of a host table gathered by device ids,
device rows scattered into it, both as torch custom ops (a compiled decode step calls them as one
opaque op each; their fake implementations give the shapes without entering launcher code).

On CPU the host tier is ordinary memory and the ops are ``index_select`` / ``index_copy_``. On CUDA
the table is pinned host memory and a Triton kernel reads or writes it through unified virtual
addressing, so the ids never travel to the host and no host synchronisation happens: the step
stays capturable by CUDA graphs. The CUDA kernels were written without a GPU at hand; their
indexing is tested under ``TRITON_INTERPRET=1`` on CPU (`triton_host_gather` / `triton_host_scatter`
take CPU tensors there), not on a device.
"""
from __future__ import annotations

import torch

from .triton_decode import interpreting, require_cuda_or_interpreter

BLOCK = 256  # table columns per program


def _check(table: torch.Tensor, rows: torch.Tensor) -> None:
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"table must be a 2-D (rows, width) tensor with contiguous rows, got shape "
                         f"{tuple(table.shape)} and strides {table.stride()}")
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be a 1-D int32/int64 tensor, got {rows.dtype} of shape {tuple(rows.shape)}")


@torch.library.custom_op("kvpress::shadowkv_host_gather", mutates_args=())
def host_gather(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (M,) of the host table ``table`` (N, W), on ``rows``' device: (M, W).

    Every id must lie in ``[0, N)``. CUDA ids with a pinned CPU table: the device reads the table
    (`triton_host_gather`); otherwise ``index_select`` on the host and a copy to ``rows``' device.
    """
    _check(table, rows)
    if rows.is_cuda and table.device.type == "cpu":
        return triton_host_gather(table, rows)
    return table.index_select(0, rows.to(table.device)).to(rows.device)


@host_gather.register_fake
def _(table, rows):
    return torch.empty(rows.shape[0], table.shape[1], dtype=table.dtype, device=rows.device)


@torch.library.custom_op("kvpress::shadowkv_host_scatter", mutates_args=("table",))
def host_scatter(table: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, enabled: torch.Tensor) -> None:
    """Write ``values`` (M, W) into rows ``rows`` (M,) of the host table ``table`` (N, W) when the
    [1] bool ``enabled`` is True (read on the device: a step writes or skips without a sync).
    Ids must be distinct and in ``[0, N)``."""
    _check(table, rows)
    if values.shape != (rows.shape[0], table.shape[1]):
        raise ValueError(f"values must have shape (M, W) = ({rows.shape[0]}, {table.shape[1]}), got "
                         f"{tuple(values.shape)}")
    if values.is_cuda and table.device.type == "cpu":
        triton_host_scatter(table, rows, values, enabled)
    elif bool(enabled):  # host memory: reading the flag here costs nothing
        table.index_copy_(0, rows.to(table.device), values.to(table.device, table.dtype))


@host_scatter.register_fake
def _(table, rows, values, enabled):
    return None


def triton_host_gather(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The device-side gather of `host_gather`: ``table`` pinned host memory (or any CPU tensor
    under ``TRITON_INTERPRET=1``), ``rows`` on the device; returns (M, W) on ``rows``' device."""
    _check(table, rows)
    require_cuda_or_interpreter(rows, "the triton host-tier gather")
    if rows.is_cuda and not table.is_pinned():
        raise ValueError("the host table must be pinned memory for the device to read it")
    from . import triton_shadowkv_host_kernel as kern

    M, W = rows.shape[0], table.shape[1]
    out = torch.empty(M, W, dtype=table.dtype, device=rows.device)
    if M and W:
        kern._host_gather_kernel[(M, -(-W // BLOCK))](_pointer(table), rows, out, table.stride(0), out.stride(0),
                                                      W, BLOCK=BLOCK)
    return out


def triton_host_scatter(table: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
                        enabled: torch.Tensor) -> None:
    """The device-side scatter of `host_scatter` (same arguments; ``table`` pinned host memory)."""
    _check(table, rows)
    require_cuda_or_interpreter(rows, "the triton host-tier scatter")
    if rows.is_cuda and not table.is_pinned():
        raise ValueError("the host table must be pinned memory for the device to write it")
    if values.dtype != table.dtype:
        raise ValueError(f"values ({values.dtype}) must have the table's dtype ({table.dtype})")
    from . import triton_shadowkv_host_kernel as kern

    M, W = rows.shape[0], table.shape[1]
    values = values if values.stride(1) == 1 else values.contiguous()
    if M and W:
        kern._host_scatter_kernel[(M, -(-W // BLOCK))](_pointer(table), rows, values, enabled.to(torch.int8),
                                                       table.stride(0), values.stride(0), W, BLOCK=BLOCK)


class _HostPointer:
    """A pinned CPU tensor handed to a Triton launch as a raw pointer: under unified virtual
    addressing its host address is valid on the device too (Triton rejects CPU tensors as such)."""

    def __init__(self, t: torch.Tensor):
        self.tensor, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def _pointer(table: torch.Tensor):
    # the interpreter runs on CPU tensors as they are
    return table if interpreting() else _HostPointer(table)
