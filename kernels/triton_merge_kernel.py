"""Triton code for `merge_states` on CUDA (only ``@triton.jit`` functions; see ``triton_merge.py``)."""
import triton
import triton.language as tl


@triton.jit
def _merge_two_kernel(OUT_A, LSE_A, OUT_B, LSE_B, OUT, LSE, n_rows,
                      HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``[pid * BLOCK_R, ...)`` of two (n_rows, HEAD_DIM) partial states merged by their LSE."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    r_ok = rows < n_rows
    ok = r_ok[:, None] & (cols[None, :] < HEAD_DIM)
    la = tl.load(LSE_A + rows, mask=r_ok, other=float("-inf")).to(tl.float32)
    lb = tl.load(LSE_B + rows, mask=r_ok, other=float("-inf")).to(tl.float32)
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # both empty: shift by 0
    wa = tl.exp(la - m_safe)  # 0 for an empty part
    wb = tl.exp(lb - m_safe)
    total = wa + wb
    empty = total == 0.0
    denom = tl.where(empty, 1.0, total)
    offs = rows[:, None] * HEAD_DIM + cols[None, :]
    oa = tl.load(OUT_A + offs, mask=ok, other=0.0).to(tl.float32)
    ob = tl.load(OUT_B + offs, mask=ok, other=0.0).to(tl.float32)
    # where() rather than a product: an empty part's out may hold anything, NaN too
    out = tl.where((wa > 0.0)[:, None], oa * (wa / denom)[:, None], 0.0) \
        + tl.where((wb > 0.0)[:, None], ob * (wb / denom)[:, None], 0.0)
    tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=ok)
    tl.store(LSE + rows, tl.where(empty, float("-inf"), m_safe + tl.log(denom)), mask=r_ok)
