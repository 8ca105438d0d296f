"""kvpress.kernels: one selection format (`SparseIndex`), one sparse decode kernel, score functions.

Triton is optional: it is imported only when the triton backend runs.

Backends. Every entry point takes ``backend=`` ("auto", "torch", "native", "triton") and
`kvpress.kernels.backend` alone decides which implementation runs (from shapes, dtypes, devices,
strides and availability, never tensor values), with a ValueError naming why when a forced one
cannot run; policies ask it too (``*_backend`` functions) instead of testing availability.

Torch ops. The compiled CPU kernels are ``kvpress::native_*`` ops (`torch.library.custom_op`
with fake implementations, `native_ops`), the Triton launches ``kvpress::triton_*`` ops
(`torch.library.triton_op`, kernels through `torch.library.wrap_triton`); the public functions
keep their signatures and call the ops while `torch.compile` traces (so a ``fullgraph=True``
trace of a decode step never enters ctypes or launcher Python) and the ops' bodies directly in
eager (an op's dispatch costs ~25 us of host time a call).

Imports run one way, so the graph of this package is acyclic: leaves (`index`, `quant_format`,
`checks`, `backend`, `_native_lib`) <- torch implementations (``torch_*``, `quant`) and ``triton_x``
launchers <- the entry points (``x`` imports ``triton_x``, never back) <- this ``__init__``, which
only re-exports.
"""
from .decode import BACKENDS, sparse_decode, triton_available
from .index import ALLOWED_BLOCK_SIZES, SparseIndex, select_topk, topk_ids
from .merge import merge_states
from .reference import reference_sparse_decode
from .scores import (REDUCTIONS, build_labels, chunk_landmarks, exact_scores, label_scores, landmark_scores,
                     page_min_max, pool_blocks, quest_scores, reduce_over_group)

__all__ = [
    "ALLOWED_BLOCK_SIZES", "BACKENDS", "SparseIndex", "merge_states", "reference_sparse_decode",
    "select_topk", "sparse_decode", "topk_ids", "triton_available",
    "REDUCTIONS", "build_labels", "chunk_landmarks", "exact_scores", "label_scores", "landmark_scores",
    "page_min_max", "pool_blocks", "quest_scores", "reduce_over_group",
]
from .shadowkv_rebuild import SHADOWKV_CHUNK_SIZES, shadowkv_rebuild, torch_shadowkv_rebuild  # noqa: E402
# one softmax over several row sets (a decode step over split stores: ShadowKV's)
from .rows import attend_rows, torch_attend_rows  # noqa: E402

__all__ += ["attend_rows", "torch_attend_rows"]

__all__ += ["SHADOWKV_CHUNK_SIZES", "shadowkv_rebuild", "torch_shadowkv_rebuild"]

# packed KV quantization (kivi / zipcache / gear)
from .packed_decode import quant_decode, reference_quant_decode  # noqa: E402
from .quant import (ALLOWED_BITS, ALLOWED_GROUP_SIZES, dequantize_per_channel, dequantize_per_token,  # noqa: E402
                    pack_codes, quantize_per_channel, quantize_per_token, unpack_codes)

__all__ += ["ALLOWED_BITS", "ALLOWED_GROUP_SIZES", "dequantize_per_channel", "dequantize_per_token", "pack_codes",
            "quant_decode", "quantize_per_channel", "quantize_per_token", "reference_quant_decode", "unpack_codes"]

# chunk-mean estimate of the tokens a sparse step leaves out (``tail_chunk`` of the selection policies)
from .tail import (chunk_attention, landmark_tail_estimate, reference_landmark_tail_estimate, reference_tail_estimate,  # noqa: E402
                   sparse_decode_tail, tail_estimate)

__all__ += ["chunk_attention", "landmark_tail_estimate", "reference_landmark_tail_estimate", "reference_tail_estimate",
            "sparse_decode_tail", "tail_estimate"]
