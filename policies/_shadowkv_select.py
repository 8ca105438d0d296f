"""ShadowKV's chunk selection of one decode step, in torch (the reference of `native.shadowkv_select`),
and the ``tail_chunk`` estimate of the chunks a step leaves out.

Same arguments and results as `kvpress.kernels.native.shadowkv_select`, plus the ``backend`` of
the key rebuild (`kvpress.kernels.shadowkv_rebuild`): landmark scores (GQA group reduced), the
top chunks per KV head -- or, with ``shortlist > k``, a landmark shortlist whose rebuilt keys are
re-scored exactly -- and the chosen chunks' rebuilt post-RoPE keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpress.kernels import landmark_scores, landmark_tail_estimate
from kvpress.kernels.shadowkv_rebuild import shadowkv_rebuild


def chunk_scores(q: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, *, scale: float,
                 reduction: str) -> torch.Tensor:
    """Landmark scores (B, H_kv, C), GQA group reduced, -inf where a chunk is not selectable."""
    scores = landmark_scores(q, landmarks, scale=scale, reduction=reduction, mask=selectable.any(1))
    return scores.masked_fill(~selectable, float("-inf"))


def select_chunks(q: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, factor: torch.Tensor,
                  basis: torch.Tensor, inv_freq: torch.Tensor, rope_start: torch.Tensor, allow: torch.Tensor, *,
                  k: int, shortlist: int, chunk_size: int, scale: float, reduction: str,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``allow[b, h]`` (<= ``k``) chunks per KV head: ids int32 (B, H_kv, k) ascending, -1 after,
    and their rebuilt keys (B, H_kv, k * chunk_size, D), zeros in empty slots."""
    scores = chunk_scores(q, landmarks, selectable, scale=scale, reduction=reduction)
    if shortlist > k:
        return _rerank(q, scores, factor, basis, inv_freq, rope_start, allow, k=k, shortlist=shortlist,
                       chunk_size=chunk_size, scale=scale, reduction=reduction, backend=backend)
    ids = top_chunks(scores, k, allow)
    return ids, shadowkv_rebuild(factor, basis, ids, inv_freq, rope_start, chunk_size=chunk_size, backend=backend)


def _shortlist(q, scores, factor, basis, inv_freq, rope_start, *, shortlist, chunk_size, scale, reduction, backend):
    """The landmark shortlist's chunk ids ``cand`` (B, H, M) ascending, -1 last, their rebuilt
    keys (B, H, M * cs, D) and each token's exact score (B, H, M * cs) (`token_scores`)."""
    allow_all = torch.full(scores.shape[:2], shortlist, dtype=torch.long, device=scores.device)
    cand = top_chunks(scores, shortlist, allow_all)  # (B, H, M) ascending, -1 last
    keys = shadowkv_rebuild(factor, basis, cand, inv_freq, rope_start, chunk_size=chunk_size, backend=backend)
    return cand, keys, token_scores(q, cand, keys, chunk_size=chunk_size, scale=scale, reduction=reduction)


def token_scores(q: torch.Tensor, cand: torch.Tensor, keys: torch.Tensor, *, chunk_size: int, scale: float,
                 reduction: str) -> torch.Tensor:
    """Exact score (B, H_kv, M * cs) of each token of the candidate chunks ``cand`` (B, H_kv, M; -1
    empty) from their rebuilt keys (B, H_kv, M * cs, D), GQA group reduced, -inf on empty slots."""
    B, H, M = cand.shape
    D = q.shape[-1]
    G = q.shape[1] // H
    logits = (q.float().view(B, H, G, D) * scale) @ keys.float().transpose(-1, -2)  # (B, H, G, M*cs)
    tok_ok = (cand >= 0).repeat_interleave(chunk_size, dim=-1)[:, :, None]  # (B, H, 1, M*cs)
    logits = logits.masked_fill(~tok_ok, float("-inf"))
    if reduction.startswith("softmax"):  # normalise per query head before the group reduction
        logits = torch.softmax(logits, dim=-1).nan_to_num(0.0).masked_fill(~tok_ok, float("-inf"))
    return logits.mean(2) if reduction.endswith("mean") else logits.amax(2)  # (B, H, M*cs)


def _rerank(q, scores, factor, basis, inv_freq, rope_start, allow, *, k, shortlist, chunk_size, scale, reduction,
            backend):
    """Landmarks shortlist ``shortlist`` chunks; their rebuilt keys' exact scores pick the top ``allow``.

    A landmark is a chunk's mean key, so a chunk holding one key the query matches strongly
    (a needle among filler) can score below chunks of uniformly mediocre keys. The rebuilt
    low-rank keys cost ``rank`` MACs per element, and only the kept chunks' values are fetched.
    """
    cand, keys, tok = _shortlist(q, scores, factor, basis, inv_freq, rope_start, shortlist=shortlist,
                                 chunk_size=chunk_size, scale=scale, reduction=reduction, backend=backend)
    return pick_chunks(cand, keys, tok, allow, k=k, chunk_size=chunk_size, num_chunks=scores.shape[-1])


def pick_chunks(cand: torch.Tensor, keys: torch.Tensor, tok: torch.Tensor, allow: torch.Tensor, *, k: int,
                chunk_size: int, num_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``allow[b, h]`` (<= ``k``) candidate chunks by their best token's score ``tok``
    (`token_scores`): ids int32 (B, H, k) ascending, -1 after, and their keys (B, H, k * cs, D)
    taken from the candidates' ``keys``, zeros in empty slots."""
    B, H, M = cand.shape
    D, cs, dev = keys.shape[-1], chunk_size, keys.device
    exact = tok.view(B, H, M, cs).amax(-1)  # (B, H, M) best token of each candidate chunk
    exact = exact.masked_fill(cand < 0, float("-inf"))
    top, slot = torch.topk(exact, k, dim=-1)  # (B, H, k)
    ok = torch.isfinite(top) & (torch.arange(k, device=dev) < allow[..., None])
    ids = torch.gather(cand, 2, slot)
    # ascending chunk order, empty slots last (as `top_chunks`); keys follow their chunk
    order = torch.where(ok, ids, num_chunks).sort(dim=-1)
    ids = torch.where(order.values < num_chunks, order.values, -1).to(torch.int32)
    slot = torch.gather(slot, 2, order.indices)  # (B, H, k) candidate slot of each chosen chunk
    tok_idx = (slot[..., None] * cs + torch.arange(cs, device=dev)).flatten(2)  # (B, H, k*cs)
    chosen = torch.gather(keys, 2, tok_idx[..., None].expand(B, H, k * cs, D))
    chosen = chosen * (ids >= 0).repeat_interleave(cs, dim=-1)[..., None].to(chosen.dtype)  # empty slots: zeros
    return ids, chosen


def select_tokens(q: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, factor: torch.Tensor,
                  basis: torch.Tensor, inv_freq: torch.Tensor, rope_start: torch.Tensor, allow: torch.Tensor, *,
                  k: int, shortlist: int, chunk_size: int, scale: float, reduction: str,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``select="tokens"``: the top ``allow[b, h] * chunk_size`` single tokens per KV head among the
    landmark shortlist's, by their rebuilt keys' exact scores (the same tokens and budget as
    chunks, without whole-chunk granularity). Token ids int32 (B, H_kv, k * cs) ascending (chunk
    ``c``'s tokens are ``c * cs ...``), -1 after; their rebuilt keys (B, H_kv, k * cs, D), zeros
    in empty slots."""
    scores = chunk_scores(q, landmarks, selectable, scale=scale, reduction=reduction)
    cand, keys, tok = _shortlist(q, scores, factor, basis, inv_freq, rope_start, shortlist=max(shortlist, k),
                                 chunk_size=chunk_size, scale=scale, reduction=reduction, backend=backend)
    return pick_tokens(cand, keys, tok, allow, k=k, chunk_size=chunk_size, num_chunks=scores.shape[-1])


def pick_tokens(cand: torch.Tensor, keys: torch.Tensor, tok: torch.Tensor, allow: torch.Tensor, *, k: int,
                chunk_size: int, num_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``allow[b, h] * chunk_size`` (<= ``k * chunk_size``) candidate tokens by ``tok``: token
    ids int32 (B, H, k * cs) ascending, -1 after, and their keys (B, H, k * cs, D), zeros in empty slots."""
    B, H, _ = cand.shape
    D, cs, dev = keys.shape[-1], chunk_size, keys.device
    K = k * cs
    top, slot = torch.topk(tok, K, dim=-1)  # (B, H, K) slots in the shortlist's tokens
    ok = torch.isfinite(top) & (torch.arange(K, device=dev) < allow[..., None] * cs)
    ids = torch.gather(cand.long(), 2, slot // cs) * cs + slot % cs  # token ids in the store
    order = torch.where(ok, ids, num_chunks * cs).sort(dim=-1)
    ids = torch.where(order.values < num_chunks * cs, order.values, -1).to(torch.int32)
    slot = torch.gather(slot, 2, order.indices)
    chosen = torch.gather(keys, 2, slot[..., None].expand(B, H, K, D))
    return ids, chosen * (ids >= 0)[..., None].to(chosen.dtype)


def top_chunks(scores: torch.Tensor, k: int, allow: torch.Tensor) -> torch.Tensor:
    """Top ``allow[b, h]`` (<= ``k``) finite-scored chunks, int32 ``(B, H, k)``: ascending ids, -1 last.

    Ascending order gives contiguous host reads and keeps a chunk's slot stable across steps.
    """
    C = scores.shape[-1]
    top, ids = torch.topk(scores, k, dim=-1)  # (B, H, k)
    ok = torch.isfinite(top) & (torch.arange(k, device=scores.device) < allow[..., None])
    ids = torch.where(ok, ids, C).sort(dim=-1).values
    return torch.where(ids < C, ids, -1).to(torch.int32)


def tail_value_sums(v: torch.Tensor, selectable: torch.Tensor, tail_chunk: int) -> torch.Tensor:
    """fp32 value sums (B, H, N, D) of the selectable chunks per ``tail_chunk``-token group.

    ``v`` (B, H, C, chunk_size, D) chunked values. Groups align with the end of the prompt, as
    the chunks do: chunk ``c`` is in group ``(c + offset) // m`` with ``offset = (-C) % m``.
    """
    B, H, C, cs, D = v.shape
    m = tail_chunk // cs
    off = (-C) % m
    N = (C + off) // m
    sums = v.float().sum(3) * selectable[..., None]  # (B, H, C, D)
    return F.pad(sums, (0, 0, off, 0)).view(B, H, N, m, D).sum(3)


def _minus_group_sums(v_sum: torch.Tensor, grp: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """``v_sum`` (B, H, N, D) less the rows ``sel`` (B, H, k, D) added into their groups ``grp``
    (B, H, k); group ``N`` is the spare one that empty slots point at."""
    B, H, N, D = v_sum.shape
    spare = v_sum.new_zeros(B, H, N + 1, D).scatter_add_(2, grp[..., None].expand(-1, -1, -1, D), sel)
    return v_sum - spare[:, :, :N]


def tail_estimate(q0: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, v_sum: torch.Tensor,
                  ids: torch.Tensor | None, values: torch.Tensor | None, *, chunk_size: int, tail_chunk: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Estimate of the selectable chunks a step does not attend (`landmark_tail_estimate`).

    ``ids`` (B, H, k) are the chunks attended exactly (-1 empty) and ``values`` (B, H, k, cs, D)
    their fetched values: they leave the estimate, their values subtracted from their group's
    sum ``v_sum`` (from `tail_value_sums`).
    """
    B, H, C, D = landmarks.shape
    cs = chunk_size
    m = tail_chunk // cs
    N = v_sum.shape[2]
    off = N * m - C
    keep = selectable
    if ids is not None:
        ok = ids >= 0
        chunk = torch.where(ok, ids.long(), C)  # empty slots to a spare chunk C
        keep = torch.ones(B, H, C + 1, dtype=torch.bool, device=q0.device).scatter_(2, chunk, False)[..., :C]
        keep = keep & selectable
        grp = torch.where(ok, (ids.long() + off) // m, N)  # (B, H, k); spare group N
        sel = values.float().sum(3) * ok[..., None]  # (B, H, k, D)
        v_sum = _minus_group_sums(v_sum, grp, sel)
    return landmark_tail_estimate(q0, landmarks, keep, v_sum, chunk_size=cs, group=m, scale=scale, offset=off)


def tail_estimate_tokens(q0: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, v_sum: torch.Tensor,
                         ids: torch.Tensor | None, values: torch.Tensor | None, *, chunk_size: int, tail_chunk: int,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`tail_estimate` when single tokens are attended (``select="tokens"``): ``ids`` (B, H, K)
    token ids (-1 empty) and ``values`` (B, H, K, D) leave the estimate -- their values subtracted
    from their group's sum, and each chunk counted for the tokens it has left (its landmark, the
    mean of all its keys, still stands for them)."""
    B, H, C, D = landmarks.shape
    cs = chunk_size
    m = tail_chunk // cs
    N = v_sum.shape[2]
    off = N * m - C
    keep = selectable.float()
    if ids is not None:
        ok = ids >= 0
        chunk = torch.where(ok, ids.long() // cs, C)  # empty slots to a spare chunk C
        taken = keep.new_zeros(B, H, C + 1).scatter_add_(2, chunk, ok.float())[..., :C]
        keep = keep * (1 - taken / cs)
        grp = torch.where(ok, (chunk + off) // m, N)
        sel = values.float() * ok[..., None]
        v_sum = _minus_group_sums(v_sum, grp, sel)
    return landmark_tail_estimate(q0, landmarks, keep, v_sum, chunk_size=cs, group=m, scale=scale, offset=off)
