"""kvpress.kernels: one selection format (`SparseIndex`), one sparse decode kernel, score functions.

Triton is optional: it is imported only when the triton backend runs.
"""
from .decode import BACKENDS, sparse_decode, triton_available
from .index import ALLOWED_BLOCK_SIZES, SparseIndex, select_topk
from .merge import merge_states
from .reference import reference_sparse_decode

__all__ = [
    "ALLOWED_BLOCK_SIZES", "BACKENDS", "SparseIndex", "merge_states", "reference_sparse_decode",
    "select_topk", "sparse_decode", "triton_available",
]
