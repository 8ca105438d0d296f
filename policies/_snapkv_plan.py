"""``snapkv``'s slot planning, functions of a ``SnapKVLayer`` (its state: ``k``, ``v``, ``pos``,
``score``, ``kept``, ``filled``, ``seen``, ``prompt_len``, ``policy``; ``_grow``): a forward of
several tokens as that many decode steps (a verification; any forward after the prompt with
``reselect_turns=False``), the steps' slots planned first and the queries attending at once
(:func:`plan_slots`, :func:`attend_planned`, :func:`apply_plan`); and the slot rule of one decode
token (:func:`store_token`), eager or in a compiled step that chooses it on the device
(:func:`static_step`)."""

from __future__ import annotations

import torch

from kvpress.attention import masked_decode_attention, masked_group_attention

GROW = 64  # slots added at a time while a short cache grows towards the budget


# ------------------------------------------------- several tokens after the prompt
# A forward of n tokens after the prompt must equal n decode steps when it is a verification
# (assisted generation checks its drafts with one), or a new turn with reselect_turns=False.
# Which slot each token takes does not depend on the queries: growing appends, then the
# lowest-scored prompt tokens in score order, then the generated token leaving the recent
# window. So the n steps' slots are planned first, each key gets the steps it is visible in (a
# kept key until the step that overwrites its slot, a new token from its own step until its
# slot is reused), and the n queries attend at once under that mask, instead of one decode
# step per token.


def plan_slots(layer, n: int) -> torch.Tensor | None:
    """Slot of each of the next ``n`` tokens, as ``n`` calls of `_store` would choose them.

    Returns long ``(B, H_kv, n)``, after growing the buffers as those calls would; or None
    (nothing changed) where a row has fewer scored prompt tokens than the steps that evict one
    by score, and the caller stores token by token. Per row, once the rows stop growing: a
    shorter left-padded row first fills the free slots before its tokens (last first), then,
    as a full row, evicts its lowest-scored prompt tokens while the token leaving the recent
    window is a prompt token, then the generated token leaving it.
    """
    p = layer.policy
    W, seen = p.window_size, layer.seen
    grow = min(n, p.budget - layer.filled)  # steps that append while the rows grow
    free = (layer.filled - layer.kept).clamp(min=0)  # (B,) free slots before each row's tokens
    full_at = grow + free  # (B,) first step at which each row evicts
    by_prompt = layer.prompt_len + W - seen  # steps before this one see a prompt token leave the window
    by_score = (min(n, by_prompt) - full_at).clamp(min=0)  # (B,) evictions by score per row
    need = int(by_score.max()) if n > grow else 0
    if need and bool((torch.isfinite(layer.score).sum(-1) < by_score[:, None]).any()):
        return None  # the observation window or generated tokens would be evicted: token by token
    cap = layer.k.shape[2]
    while cap < layer.filled + grow:
        cap = min(p.budget, cap + GROW)
    if cap > layer.k.shape[2]:
        layer._grow(cap)
    B, H, _ = layer.pos.shape
    dev = layer.pos.device
    slots = torch.empty(B, H, n, dtype=torch.long, device=dev)
    slots[:, :, :grow] = layer.filled + torch.arange(grow, device=dev)
    if n == grow:
        return slots
    steps = torch.arange(grow, n, device=dev)  # (m,)
    filling = steps[None, :] < full_at[:, None]  # (B, m) a free slot: the one before the row's tokens
    free_slot = free[:, None] - 1 - (steps[None, :] - grow)
    scored = ~filling & (steps[None, :] < by_prompt)  # (B, m) the next lowest-scored prompt token
    score_slot = free_slot  # (placeholder where no row evicts by score)
    if need:  # lowest score first, ties by slot (argmin's order); evicted slots score +inf
        order = torch.sort(layer.score, dim=-1, stable=True).indices  # (B, H, cap)
        rank = (steps[None, :] - full_at[:, None]).clamp(0, need - 1)  # (B, m)
        score_slot = order.gather(2, rank[:, None, :].expand(B, H, -1))
    t = grow
    while t < n:  # otherwise the generated token at position seen + t - W leaves: its slot
        leaving = seen + t - W
        if leaving < seen:  # stored before this forward: where it is
            c = min(n - t, seen - leaving)
            wanted = torch.arange(leaving, leaving + c, device=dev)
            leave = (layer.pos[:, :, None, :] == wanted[:, None]).to(torch.int8).argmax(-1)
        else:  # a token of this forward: the slot it took
            c = min(n - t, W)
            leave = slots[:, :, t - W:t - W + c]
        a, b = t - grow, t - grow + c
        pick = lambda x: x[:, None, a:b] if x.dim() == 2 else x[:, :, a:b]  # noqa: E731
        slots[:, :, t:t + c] = torch.where(pick(filling), pick(free_slot),
                                           torch.where(pick(scored), pick(score_slot), leave))
        t += c
    return slots

def attend_planned(layer, q, k_new, v_new, scaling, slots) -> torch.Tensor:
    """The ``n`` queries of a planned forward, each over the keys its decode step would see."""
    B, H, cap, D = layer.k.shape
    H_q, n = q.shape[1], q.shape[2]
    G = H_q // H
    dev = q.device
    steps = torch.arange(n, device=dev)
    # a slot's current key is visible until the first step that writes the slot
    end_old = torch.full((B, H, cap), n, dtype=torch.long, device=dev)
    end_old.scatter_reduce_(2, slots, steps.expand(B, H, n), "amin")
    slot_ids = torch.arange(cap, device=dev)
    used = (slot_ids >= (layer.filled - layer.kept)[:, None]) & (slot_ids < layer.filled)  # (B, cap)
    # token t's key is visible from step t until the next step that writes its slot
    order = (slots * n + steps).sort(dim=-1).values
    slot_sorted, step_sorted = order // n, order % n
    reused = slot_sorted[:, :, 1:] == slot_sorted[:, :, :-1]
    end_sorted = torch.cat([torch.where(reused, step_sorted[:, :, 1:], n),
                            torch.full((B, H, 1), n, dtype=torch.long, device=dev)], dim=2)
    end_new = torch.empty_like(end_sorted).scatter_(2, step_sorted, end_sorted)
    qg = q.float().reshape(B, H, G, n, D)
    k_old, v_old = layer.k.float(), layer.v.float()
    out = torch.empty(B, H, G, n, D, device=dev)
    block = 128
    for t0 in range(0, n, block):
        t1 = min(n, t0 + block)
        t_q = steps[t0:t1]
        # new tokens some query of the block still sees: from the first one alive at t0
        lo = int(torch.where(end_new > t0, steps, n).amin())
        t_k = steps[lo:t1]
        see_old = used[:, None, None, :] & (t_q[:, None] < end_old[:, :, None, :])  # (B, H, b, cap)
        see_new = (t_k[None, None, None, :] <= t_q[:, None]) & (t_q[:, None] < end_new[:, :, None, lo:t1])
        keys = torch.cat([k_old, k_new[:, :, lo:t1].float()], dim=2)  # (B, H, cap + m, D)
        values = torch.cat([v_old, v_new[:, :, lo:t1].float()], dim=2)
        out[:, :, :, t0:t1] = masked_group_attention(qg[:, :, :, t0:t1], keys, values,
                                                     torch.cat([see_old, see_new], dim=-1), scaling)
    return out.reshape(B, H_q, n, D).to(q.dtype)

def apply_plan(layer, k_new, v_new, slots) -> None:
    """Store the planned tokens: each slot ends with the last token written to it."""
    B, H, cap, D = layer.k.shape
    n = slots.shape[2]
    last = torch.full((B, H, cap), -1, dtype=torch.long, device=slots.device)
    last.scatter_reduce_(2, slots, torch.arange(n, device=slots.device).expand(B, H, n), "amax")
    written = last >= 0
    src = last.clamp(min=0)
    layer.k = torch.where(written[..., None], k_new.gather(2, src[..., None].expand(B, H, cap, D)), layer.k)
    layer.v = torch.where(written[..., None], v_new.gather(2, src[..., None].expand(B, H, cap, D)), layer.v)
    layer.pos = torch.where(written, src + layer.seen, layer.pos)
    layer.score = layer.score.masked_fill(written, float("inf"))
    layer.filled += min(n, layer.policy.budget - layer.filled)
    layer.kept = (layer.kept + n).clamp(max=layer.filled)
    layer.seen += n


def grow_if_full(layer) -> None:
    """Grow the buffers by ``GROW`` slots (up to the budget) when a short cache has no free slot
    left for the next token (read from the host count ``filled``)."""
    budget = layer.policy.budget
    if layer.k.shape[2] < budget and layer.filled == layer.k.shape[2]:
        layer._grow(min(budget, layer.filled + GROW))


def store_token(layer, k_new: torch.Tensor, v_new: torch.Tensor, position, filled):
    """Store one token per row k_new / v_new [B, H_kv, 1, D] at sequence ``position`` in the slot a
    decode step takes, ``filled`` slots being in use before it; returns the new ``filled``.

    Growing (``filled < budget``), every row appends; else a shorter left-padded row fills the free
    slot just before its tokens, and a full row replaces, per KV head, its lowest-scored prompt
    token until ``window_size`` tokens have been generated, then the generated token leaving the
    recent window. ``position`` / ``filled`` are host ints in an eager step (the growing and
    leaving cases are then decided on the host) and device tensors in a static one (every case a
    ``torch.where``, nothing read on the host). The caller grows the buffers first (:func:`grow_if_full`).
    """
    p = layer.policy
    B, H, _, D = layer.k.shape
    leaving = position - p.window_size
    static = torch.is_tensor(filled)
    if static or filled >= p.budget:
        if static:
            slot = torch.where(leaving >= layer.prompt_len, (layer.pos == leaving).to(torch.int8).argmax(-1),
                               layer.score.argmin(-1))  # (B, H)
        elif leaving >= layer.prompt_len:  # a generated token leaves the recent window: replace it
            slot = (layer.pos == leaving).to(torch.int8).argmax(-1)
        else:  # too few tokens generated yet: each head's lowest-scored prompt token
            slot = layer.score.argmin(-1)
        if static or layer.row_start is not None:  # a shorter (left-padded) row: the free slot before its tokens
            kept = layer.kept[:, None]  # (B, 1)
            slot = torch.where(kept < filled, filled - kept - 1, slot)
    if static:
        slot = torch.where(filled < p.budget, filled, slot)
        filled = (filled + 1).clamp(max=p.budget)
        layer.kept.copy_(torch.minimum(layer.kept + 1, filled))  # in place: the graph's fixed address
    else:
        if filled < p.budget:  # growing: every row appends (and keeps one more)
            slot = torch.full((B, H), filled, dtype=torch.long, device=layer.k.device)
            layer.kept = layer.kept + 1
        elif layer.row_start is not None:  # a shorter row keeps one more; a full one keeps the budget
            layer.kept = (layer.kept + 1).clamp(max=filled)
        filled = min(filled + 1, p.budget)
    index = slot[:, :, None]  # (B, H, 1)
    rows = index[..., None].expand(B, H, 1, D)
    layer.k.scatter_(2, rows, k_new.to(layer.k.dtype))
    layer.v.scatter_(2, rows, v_new.to(layer.v.dtype))
    layer.pos.scatter_(2, index, position.view(1, 1, 1).expand(B, H, 1) if static else position)
    layer.score.scatter_(2, index, float("inf"))
    return filled


def static_step(layer, q, k_new, v_new, scaling, plan) -> torch.Tensor:
    """The static decode step of a ``SnapKVLayer`` (``plan.static``: a step ``torch.compile`` captures).

    It stores the token where the eager step would (:func:`store_token`) and attends over the same
    slots, with every choice made from device tensors: the position is the plan's, and the slots in
    use come from ``pos`` (each row's tokens end at the last slot in use, so the latest slot whose
    ``pos`` is set is the eager ``filled - 1``). The buffers keep their capacity
    (``SnapKVLayer._hold`` sizes them to ``min(budget, cache.capacity)`` when the cache is planned),
    and the attention masks the unused slots, so every step of a generation has the same shapes.
    """
    grow_if_full(layer)  # outgrown (an unplanned cache): a new shape; a planned cache's step reads no count
    slot_ids = torch.arange(layer.k.shape[2], device=layer.k.device)
    filled = torch.where(layer.pos[:, 0] >= 0, slot_ids + 1, 0).amax()  # () the eager `filled`
    filled = store_token(layer, k_new, v_new, plan.start, filled)
    layer.count_static_step()
    visible = (slot_ids >= filled - layer.kept[:, None]) & (slot_ids < filled)  # (B, cap)
    return masked_decode_attention(q, layer.k, layer.v, scaling, visible)
