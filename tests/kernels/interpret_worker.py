"""Runs Triton `sparse_decode` cases under TRITON_INTERPRET=1 in a child process.

Reads a JSON list of case dicts on stdin, writes a JSON list of error summaries on stdout.
Kept out of the pytest process so the interpreter setting never leaks into other tests.
"""
import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvpress.kernels import reference_sparse_decode  # noqa: E402
from kvpress.kernels.triton_decode import triton_sparse_decode  # noqa: E402
from kvpress_kernel_cases import build  # noqa: E402


def summarize(c):
    q, k, v, index = build(c)
    out, lse = triton_sparse_decode(q, k, v, index, num_splits=c["num_splits"])
    ref_out, ref_lse = reference_sparse_decode(q, k, v, index)
    finite = torch.isfinite(ref_lse)
    res = {
        "out_err": (out.float() - ref_out.float()).abs().max().item() if out.numel() else 0.0,
        "lse_err": (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0,
        "inf_match": bool((torch.isfinite(lse) == finite).all()),
        "empty_out_zero": bool((out[~finite] == 0).all()),
        "dtype_ok": out.dtype == q.dtype and lse.dtype == torch.float32,
        "n_empty": int((~finite).sum()),
    }
    if c["sdpa"]:
        dense = F.scaled_dot_product_attention(q.float()[:, :, None], k.float(), v.float(), enable_gqa=True)
        res["sdpa_err"] = (out.float() - dense[:, :, 0]).abs().max().item()
    return res


if __name__ == "__main__":
    print(json.dumps([summarize(c) for c in json.load(sys.stdin)]))
