"""How often does ``shadowkv``'s token tail estimate hold a group with under one chunk's tokens left?

    OMP_NUM_THREADS=1 python benchmarks/shadowkv_tail_groups.py eval --model smollm2 \\
        --policies shadowkv:rerank=32:tail_chunk=64:select=tokens:residual_bits=2 --budgets 256 \\
        --tasks niah_single --lengths 4096 --samples 2 --sample-ids 1 --out results/tail_groups

Runs the ``kvpress`` command line given (any ``kvpress eval`` whose policy takes the compiled
``select="tokens"`` step) with `kvpress.kernels.native.shadowkv_tail` wrapped: each call also
works out, in torch, how much of every group of ``tail_chunk // chunk_size`` chunks the estimate
stands for (a chunk counts for the share of its tokens not attended) and counts the groups with
something left and those with less than one chunk's worth (0 < kept < 1), whose mean key must be
divided by ``kept``, not by one chunk (which would shrink it toward zero).
Prints ``TAIL_GROUPS {calls, groups, under_one_chunk}`` after the command's own output.
"""
import json
import sys

import torch
import torch.nn.functional as F

import kvpress.policies._shadowkv_layer as shadowkv_step
from kvpress.cli import main

_estimate = shadowkv_step.native.shadowkv_tail
counts = {"calls": 0, "groups": 0, "under_one_chunk": 0}


def counted(q, landmarks, selectable, v_sum, ids, values, *, chunk_size, tail_chunk, scale):
    B, H, C, _ = landmarks.shape
    m, N = tail_chunk // chunk_size, v_sum.shape[2]
    off = N * m - C
    keep = selectable.float()
    if ids is not None:
        ok = ids >= 0
        chunk = torch.where(ok, ids.long() // chunk_size, C)
        keep = keep * (1 - keep.new_zeros(B, H, C + 1).scatter_add_(2, chunk, ok.float())[..., :C] / chunk_size)
    kept = F.pad(keep, (off, N * m - C - off)).view(B, H, N, m).sum(-1)
    counts["calls"] += 1
    counts["groups"] += int((kept > 1e-6).sum())
    counts["under_one_chunk"] += int(((kept > 1e-6) & (kept < 1 - 1e-6)).sum())
    return _estimate(q, landmarks, selectable, v_sum, ids, values, chunk_size=chunk_size, tail_chunk=tail_chunk,
                     scale=scale)


if __name__ == "__main__":
    shadowkv_step.native.shadowkv_tail = counted
    rc = main(sys.argv[1:])
    print("TAIL_GROUPS", json.dumps(counts))
    sys.exit(rc)
