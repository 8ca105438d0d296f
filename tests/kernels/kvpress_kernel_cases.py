"""Shared case builder for the kernel tests (imported by the tests and by the interpreter worker).

A case is a plain dict so it can cross a process boundary as JSON.
"""
from __future__ import annotations

import torch

from kvpress.kernels import SparseIndex, select_topk

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def case(B=1, H_kv=2, G=2, D=64, T_cap=67, lens=None, starts=None, block_size=8, mode="random",
         budget=4, sinks=0, tail=0, dtype="fp32", seed=0, num_splits=None, sdpa=False):
    """Describe one decode problem; ``mode`` in {"random", "topk", "all", "none", "cnt0"}."""
    return dict(B=B, H_kv=H_kv, G=G, D=D, T_cap=T_cap, lens=lens or [T_cap] * B, starts=starts,
                block_size=block_size, mode=mode, budget=budget, sinks=sinks, tail=tail, dtype=dtype,
                seed=seed, num_splits=num_splits, sdpa=sdpa)


def case_id(c: dict) -> str:
    return (f"B{c['B']}-Hkv{c['H_kv']}-G{c['G']}-D{c['D']}-T{c['T_cap']}-bs{c['block_size']}-{c['mode']}"
            f"{c['budget']}-s{c['sinks']}t{c['tail']}{'-pad' if c['starts'] else ''}-{c['dtype']}"
            f"{'-sp' + str(c['num_splits']) if c['num_splits'] else ''}")


def build(c: dict, device="cpu"):
    """Return ``q, k_cache, v_cache, index`` for a case dict."""
    gen = torch.Generator().manual_seed(c["seed"])
    B, H_kv, G, D, T = c["B"], c["H_kv"], c["G"], c["D"], c["T_cap"]
    dt = DTYPES[c["dtype"]]
    q = torch.randn(B, H_kv * G, D, generator=gen).to(device, dt)
    k = torch.randn(B, H_kv, T, D, generator=gen).to(device, dt)
    v = torch.randn(B, H_kv, T, D, generator=gen).to(device, dt)
    lens = torch.tensor(c["lens"], dtype=torch.int32, device=device)
    starts = None if c["starts"] is None else torch.tensor(c["starts"], dtype=torch.int32, device=device)
    bs = c["block_size"]
    n_blocks = -(-T // bs)
    mode = c["mode"]
    if mode == "all":
        index = SparseIndex.dense(lens, H_kv, block_size=bs, seq_starts=starts)
        index = SparseIndex(bs, index.block_idx, index.block_cnt, lens, starts, c["sinks"], c["tail"])
    elif mode == "topk":
        scores = torch.randn(B, H_kv, n_blocks, generator=gen).to(device)
        index = select_topk(scores, c["budget"], block_size=bs, seq_lens=lens, seq_starts=starts,
                            sinks=c["sinks"], dense_tail=c["tail"])
    elif mode in ("random", "none", "cnt0"):
        # any blocks of the capacity, including ones that overlap the sinks/tail or lie
        # outside [seq_start, seq_len): those tokens must be deduplicated / ignored
        k_max = 0 if mode == "none" else min(c["budget"], n_blocks)
        ids = torch.stack([torch.randperm(n_blocks, generator=gen)[:k_max] for _ in range(B * H_kv)])
        ids = ids.reshape(B, H_kv, k_max)
        cnt = torch.randint(0, k_max + 1, (B, H_kv), generator=gen) if mode == "random" else \
            torch.zeros(B, H_kv, dtype=torch.long)
        if mode == "random" and k_max:
            cnt[0, 0] = k_max  # at least one full row
        ids = torch.where(torch.arange(k_max) < cnt[..., None], ids, -1)
        index = SparseIndex(bs, ids.to(device, torch.int32), cnt.to(device, torch.int32), lens, starts,
                            c["sinks"], c["tail"])
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return q, k, v, index
