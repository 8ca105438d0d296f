"""Triton code for the ShadowKV host tier (only ``@triton.jit`` functions; see ``triton_shadowkv_host.py``).

One program per (row, ``BLOCK``-wide column block). ``TABLE`` points at pinned host memory, read or
written by the GPU through unified virtual addressing (the host tier never leaves the host).
"""
import triton
import triton.language as tl


@triton.jit
def _host_gather_kernel(TABLE, ROWS, OUT, stride_t, stride_o, width, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    row = tl.load(ROWS + i).to(tl.int64)
    x = tl.load(TABLE + row * stride_t + cols, mask=ok, other=0)
    tl.store(OUT + i * stride_o + cols, x, mask=ok)


@triton.jit
def _host_scatter_kernel(TABLE, ROWS, VALUES, ENABLED, stride_t, stride_v, width, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = tl.where(tl.load(ENABLED) != 0, width, 0)  # disabled: nothing crosses the link
    ok = cols < live
    row = tl.load(ROWS + i).to(tl.int64)
    x = tl.load(VALUES + i * stride_v + cols, mask=ok, other=0)
    tl.store(TABLE + row * stride_t + cols, x, mask=ok)
