"""``zipcache``'s static decode step, as functions of a `kvpress.policies.zipcache.ZipCacheLayer`
(its store hooks for `kvpress.policies._quant_static`) and the bookkeeping that moves its probes
between the eager paths and the device.

The eager paths keep the probe queries in a set of varying size chosen on the host
(``probe_pos`` / ``probe_rand``). A static step keeps them in fixed slots (`StaticState`): the
random probes first (``n_rand`` slots, the eager set's; none while no static step can flush), then
a ring of ``probe_recent`` slots where the query at sequence index ``p`` sits at ``p %
probe_recent``. Every slot carries its sequence index on the device (``pos``, -1 when empty), so
which probes the eager path would keep follows from the step's position alone: a random probe
while it sees an unflushed token (``pos >= n``), a recent one while it is among the latest
``probe_recent`` queries too. With a planned capacity the eager paths write the slots that change
after each of their probe updates (`mirror_probes`: one slot per decode step); after static steps
`probes_from_static` gives the eager path its set back (the ring's queries, and its own random
probes that static steps only drop).

How many of a flush's tokens go to the high-precision store depends only on how many were flushed
before it (``salient_target``), so a table of those counts, made on the host when the stores are
reserved, gives a static flush its split on the device; the split itself is a rank of the
saliency against that count, and each store takes its tokens at its own device fill, committed by
the flush's mask.
"""
from __future__ import annotations

import torch

from kvpress.kernels.quant import (dequantize_per_channel, dequantize_per_token, quantize_per_channel,
                                   quantize_per_token, quantize_refined_keys)
from kvpress.kernels.quant_refine import dequantize_refinement
from kvpress.plan import static_address

from ._quant_static import masked_write
from ._quant_storage import resized

# the packed store's buffers: per token (True) or per key group (False)
_PER_TOKEN = {"kc": True, "ks": False, "kz": False, "vc": True, "vs": True, "vz": True, "rc": True, "rs": False}


def salient_target(policy, tokens: int) -> int:
    """Tokens the high-precision store holds once ``tokens`` tokens are flushed: ``salient_ratio``
    of them in whole key groups (each flush takes what brings it there, so this is also its count)."""
    g = policy.group_size
    return int(policy.salient_ratio * tokens / g + 0.5) * g


class StaticState:
    """What a static step keeps beside the two stores: the probes in fixed slots (``q`` (B, H_q, S,
    D) in the model dtype, ``lse`` fp32 (B, H_q, S), ``pos`` long (S,)) and ``host`` (S ints: the
    sequence index each slot holds as far as the host knows, up to the steps since ``synced``);
    ``counts`` long (K,), the high-precision store's size after ``k`` flush units (``salient_target``);
    ``vn`` fp16 (B, H, D) / ``ridx`` long (B, H, R): the value normaliser and refined channels a
    first flush inside static steps sets (the layer's own once an eager flush set them);
    ``slots``: packed tokens the stores are reserved for (0: not reserved)."""

    def __init__(self):
        self.q = self.lse = self.pos = None
        self.host: list[int] = []
        self.n_rand = 0
        self.synced = 0
        self.counts = self.vn = self.ridx = None
        self.slots = 0
        self.caps = (0, 0)

    def tensors(self) -> dict:
        return {"probe_slots_q": self.q, "probe_slots_lse": self.lse, "probe_slots_pos": self.pos,
                "salient_counts": self.counts, "static_vn": self.vn, "static_ridx": self.ridx}

    def select(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (beam search)."""
        for name in ("q", "lse", "vn", "ridx"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, indices.to(t.device)))


# ---------------------------------------------------------------------- probes: eager <-> device
def _allocate_probes(layer, like_q: torch.Tensor, n_rand: int) -> None:
    """Empty probe slots: ``n_rand`` random ones and the ring, shaped after queries ``like_q``."""
    zs = layer.zs
    B, H_q, _, D = like_q.shape
    S = n_rand + layer.p.probe_recent
    zs.q = like_q.new_zeros(B, H_q, S, D)
    zs.lse = torch.zeros(B, H_q, S, dtype=torch.float32, device=like_q.device)
    zs.pos = torch.full((S,), -1, dtype=torch.long, device=like_q.device)
    zs.host, zs.n_rand = [-1] * S, n_rand
    static_address(zs.q, zs.lse, zs.pos)


def _random_slots(layer, count: int) -> int:
    """Random probe slots for ``count`` random probes: none while the stores are not reserved (no
    static step can flush, and after static steps the eager path still holds its random probes)."""
    return max(layer.p.probe_random, count) if layer.zs.slots else 0


def mirror_probes(layer, full: bool = False) -> None:
    """After the eager path changed the probes: write the slots whose probe changed (``full``:
    every slot, after a crop re-made the probes). Only with a planned capacity, or slots already
    made; a decode step writes one slot."""
    zs = layer.zs
    if layer.probe_q is None or (zs.q is None and not layer.cache.capacity):
        return
    pos, rand = layer.probe_pos, layer.probe_rand
    rand_rows = [i for i, r in enumerate(rand) if r]
    n_rand = _random_slots(layer, len(rand_rows))
    if zs.q is None or n_rand > zs.n_rand or zs.q.shape[0] != layer.probe_q.shape[0]:
        _allocate_probes(layer, layer.probe_q, n_rand)
        full = True
    R, n_quant, host = layer.p.probe_recent, layer.n_quant, zs.host
    writes = []  # (slot, probe row or None to empty it, sequence index)
    wanted = [pos[i] for i in rand_rows]
    if zs.n_rand and (full or [p for p in host[: zs.n_rand] if p >= n_quant] != wanted):
        writes += [(j, rand_rows[j], pos[rand_rows[j]]) if j < len(rand_rows) else (j, None, -1)
                   for j in range(zs.n_rand)]
    ring = {pos[i] % R: i for i, r in enumerate(rand) if not r}  # the recent probes: one sequence index each
    live = max(n_quant, layer.seen - R)  # a slot's index from here on would read as a kept probe
    for s in range(R):
        slot, i = zs.n_rand + s, ring.get(s)
        if i is not None and (full or host[slot] != pos[i]):
            writes.append((slot, i, pos[i]))
        elif i is None and host[slot] != -1 and (full or host[slot] >= live):
            writes.append((slot, None, -1))
    _write_slots(layer, writes)
    zs.synced = layer.seen


def _add_random_slots(layer) -> None:
    """Random probe slots in front of the ring, filled from the eager path's random probes, for a
    traced step that reserves the stores (the ring keeps what static steps wrote)."""
    zs = layer.zs
    rows = [i for i, r in enumerate(layer.probe_rand or []) if r]
    n_rand = _random_slots(layer, len(rows))
    B, H_q, _, D = zs.q.shape
    q = zs.q.new_zeros(B, H_q, n_rand, D)
    lse = zs.lse.new_zeros(B, H_q, n_rand)
    pos = torch.full((n_rand,), -1, dtype=torch.long, device=zs.q.device)
    if rows:
        idx = torch.tensor(rows, device=zs.q.device)
        q[:, :, : len(rows)] = layer.probe_q.index_select(2, idx)
        lse[:, :, : len(rows)] = layer.probe_lse.index_select(2, idx)
        pos[: len(rows)] = layer.probe_pos_dev.index_select(0, idx)
    zs.q, zs.lse, zs.pos = torch.cat([q, zs.q], 2), torch.cat([lse, zs.lse], 2), torch.cat([pos, zs.pos])
    zs.host = [layer.probe_pos[i] for i in rows] + [-1] * (n_rand - len(rows)) + zs.host[zs.n_rand :]
    zs.n_rand = n_rand


def _write_slots(layer, writes) -> None:
    zs = layer.zs
    for slot, _, p in writes:
        zs.host[slot] = p
    filled = [(slot, i) for slot, i, _ in writes if i is not None]
    if len(writes) == 1:  # a decode step's one slot: plain slices, no index tensor
        slot, i, p = writes[0]
        zs.pos[slot : slot + 1].fill_(p)
        if i is not None:
            zs.q[:, :, slot : slot + 1] = layer.probe_q[:, :, i : i + 1]
            zs.lse[:, :, slot : slot + 1] = layer.probe_lse[:, :, i : i + 1]
        return
    if writes:
        dev = zs.pos.device
        zs.pos.index_copy_(0, torch.tensor([w[0] for w in writes], device=dev), torch.tensor([w[2] for w in writes],
                                                                                                device=dev))
    if filled:
        slots = torch.tensor([s for s, _ in filled], device=zs.q.device)
        rows = torch.tensor([i for _, i in filled], device=zs.q.device)
        zs.q.index_copy_(2, slots, layer.probe_q.index_select(2, rows).to(zs.q.dtype))
        zs.lse.index_copy_(2, slots, layer.probe_lse.index_select(2, rows).float())


def probes_from_static(layer) -> None:
    """After static steps (their counts taken): the stores' sizes, the normaliser and refined
    channels of a first flush, and the probe set as the eager path keeps it, read from the slots."""
    zs, p = layer.zs, layer.p
    R, n_quant, seen = p.probe_recent, layer.n_quant, layer.seen
    layer.hi.n = salient_target(p, n_quant)
    layer.lo.n = n_quant - layer.hi.n
    if n_quant and layer.vn is None:
        layer.vn = zs.vn
    if n_quant and layer.lo.refine and layer.lo.ridx is None:
        layer.lo.ridx = zs.ridx
    if zs.q is None:
        return
    for pos in range(max(zs.synced, seen - R), seen):  # the static steps' queries
        zs.host[zs.n_rand + pos % R] = pos
    zs.synced = seen
    live = max(n_quant, seen - R)
    recent = sorted((zs.host[zs.n_rand + s], zs.n_rand + s) for s in range(R) if zs.host[zs.n_rand + s] >= live)
    ring = torch.tensor([slot for _, slot in recent], dtype=torch.long, device=zs.q.device)
    q, lse, pos_dev = zs.q.index_select(2, ring), zs.lse.index_select(2, ring), zs.pos.index_select(0, ring)
    # the random probes: still the eager path's (static steps add none), less those flushed past
    rows = [i for i, (p, r) in enumerate(zip(layer.probe_pos or [], layer.probe_rand or [])) if r and p >= n_quant]
    if rows:
        idx = torch.tensor(rows, dtype=torch.long, device=zs.q.device)
        q = torch.cat([layer.probe_q.index_select(2, idx), q], 2)
        lse = torch.cat([layer.probe_lse.index_select(2, idx), lse], 2)
        pos_dev = torch.cat([layer.probe_pos_dev.index_select(0, idx), pos_dev])
    layer.probe_q, layer.probe_lse, layer.probe_pos_dev = q, lse, pos_dev
    layer.probe_pos = [layer.probe_pos[i] for i in rows] + [p for p, _ in recent]
    layer.probe_rand = [True] * len(rows) + [False] * len(recent)


# ---------------------------------------------------------------------- store hooks of _quant_static
def store_slots(layer) -> int:
    """``ZipCacheLayer._store_slots``: packed tokens both stores are reserved for, 0 when not (or
    an eager flush outgrew them)."""
    zs = layer.zs
    if not zs.slots:
        return 0
    for store, cap in zip((layer.hi, layer.lo), zs.caps):
        if store.t["kc"] is None or store.t["kc"].shape[2] != cap:
            return 0
    return zs.slots


def reserve_store(layer, like_k: torch.Tensor, like_v: torch.Tensor, slots: int) -> None:
    """``ZipCacheLayer._reserve_store``: each store at the most tokens it can hold while at most
    ``slots`` are packed, the table of high-precision counts, the first flush's normaliser and
    refined channels (ones / zeros until set), and the probe slots when queries have been seen."""
    p, zs, F, g = layer.p, layer.zs, layer.flush_unit, layer.p.group_size
    B, H, _, D = like_k.shape
    counts = [salient_target(p, k * F) for k in range(slots // F + 2)]  # one past: a step that does not flush
    caps = (max(counts[:-1]), max(k * F - c for k, c in enumerate(counts[:-1])))
    widths = {"ks": D, "kz": D, "vs": D // p.value_group_size, "vz": D // p.value_group_size,
              "rs": p.refine_key_channels}
    for store, cap in zip((layer.hi, layer.lo), caps):
        widths.update(kc=D * store.bits // 8, vc=D * store.bits // 8, rc=p.refine_key_channels * store.bits // 8)
        for name in store.t:
            per_token = _PER_TOKEN[name]
            dtype = torch.uint8 if name in ("kc", "vc", "rc") else torch.float16
            like = like_k.new_empty(B, H, 0, widths[name], dtype=dtype)
            rows, old = cap if per_token else cap // g, store.t[name]
            # every row kept (the host's `store.n` lags behind static steps' flushes); a store never
            # holds more than its cap
            store.t[name] = resized(old, 0 if old is None else min(old.shape[2], rows), rows, like)
        if store.pad is None:  # no padding: a static step's layer never has any
            store.pad = torch.zeros(B, H, dtype=torch.int32, device=like_k.device)
        static_address(*store.t.values(), store.pad)
    zs.counts = torch.tensor(counts, dtype=torch.long, device=like_k.device)
    zs.slots, zs.caps = slots, caps
    if zs.vn is None:
        zs.vn = like_v.new_ones(B, H, D, dtype=torch.float16)
    if layer.lo.refine and zs.ridx is None:
        zs.ridx = torch.zeros(B, H, layer.lo.refine, dtype=torch.long, device=like_k.device)
    static_address(zs.vn, zs.ridx)
    if not torch.compiler.is_compiling():
        mirror_probes(layer)  # the random probe slots a flush reads (the ring too, if none yet)
    elif zs.q is not None and not zs.n_rand:  # a traced step outgrowing an unplanned cache: one graph
        _add_random_slots(layer)


def _store_keys(store, ridx, C: int) -> torch.Tensor:
    t = store.t
    k = dequantize_per_channel(t["kc"], t["ks"], t["kz"], store.bits, store.group_size)  # (B, H, C, D)
    if store.refine:  # zero codes until the first flush: adds nothing
        fine = dequantize_refinement(t["rc"], t["rs"], store.bits, store.group_size)  # (B, H, C, R)
        k = k.scatter_add(3, ridx[:, :, None, :].expand(-1, -1, C, -1), fine)
    return k


def static_packed(layer, n: torch.Tensor) -> list:
    """``ZipCacheLayer._static_packed``: both stores dequantized over their capacity (values with
    the normaliser undone), each visible up to its size after ``n`` packed tokens."""
    zs = layer.zs
    hi_n = zs.counts.index_select(0, n // layer.flush_unit)  # [1]
    vn = (layer.vn if layer.vn is not None else zs.vn).float()[:, :, None]
    ridx = layer.lo.ridx if layer.lo.ridx is not None else zs.ridx
    parts = []
    for store, size in ((layer.hi, hi_n), (layer.lo, n - hi_n)):
        C, t = store.t["kc"].shape[2], store.t
        if C == 0:  # (salient_ratio 0 or 1: one store stays empty)
            continue
        v = dequantize_per_token(t["vc"], t["vs"], t["vz"], store.bits, store.value_group_size) * vn
        i = torch.arange(C, device=n.device)
        visible = (i < size) & (i >= store.pad[:, :, None])  # (B, H, C): a store's padding rows come first
        parts.append((_store_keys(store, ridx, C), v, visible[:, :, None]))
    return parts


def _kept_probes(layer, n: torch.Tensor) -> torch.Tensor:
    """bool (S,): the probe slots the eager path holds at the flush of a step whose window starts
    at ``n`` ([1]): random probes that see an unflushed token, and the latest ``probe_recent``
    queries among those."""
    zs, R = layer.zs, layer.p.probe_recent
    pos = n + layer.residual_length + layer.flush_unit - 1  # the flushing step's own index
    slot = torch.arange(zs.pos.shape[0], device=n.device)
    return torch.where(slot < zs.n_rand, zs.pos >= n, zs.pos >= torch.maximum(n, pos + 1 - R))


def _saliency(layer, k: torch.Tensor, n: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``ZipCacheLayer.saliency`` over the probe slots ``kept``: (B, H, F) for keys k (B, H, F, D)
    at sequence indices ``n ..``; +inf where no probe sees the token."""
    zs = layer.zs
    B, H, F, D = k.shape
    H_q, S = zs.q.shape[1], zs.q.shape[2]
    G = H_q // H
    s = (zs.q.float().view(B, H, G, S, D) @ k.float()[:, :, None].transpose(-1, -2)) * layer._scaling  # (B, H, G, S, F)
    prob = torch.exp(s - zs.lse.view(B, H, G, S)[..., None])
    seen_by = kept[:, None] & (zs.pos[:, None] >= n + torch.arange(F, device=k.device))  # (S, F)
    total = torch.where(seen_by, prob, 0.0).sum((2, 3))  # (B, H, F); empty slots may hold anything
    sal = total / (seen_by.sum(0).clamp(min=1) * G)
    return torch.where(seen_by.any(0), sal, float("inf"))


def _refine_channels(layer, k: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``ZipCacheLayer.refine_channels`` with the probes of the slots ``kept``."""
    zs, p = layer.zs, layer.p
    B, H, n, D = k.shape
    g, G, S = p.group_size, zs.q.shape[1] // H, zs.q.shape[2]
    kg = k.float().view(B, H, n // g, g, D)
    spread = (kg.amax(3) - kg.amin(3)).pow(2).mean(2)  # (B, H, D)
    q2 = torch.where(kept[:, None], zs.q.float().pow(2).view(B, H, G, S, D), 0.0).sum((2, 3))
    spread = spread * (q2 / (kept.sum() * G))
    return spread.topk(p.refine_key_channels, dim=-1).indices.sort(-1).values


def static_flush(layer, n: torch.Tensor, due: torch.Tensor) -> None:
    """``ZipCacheLayer._static_flush``: the window's first ``flush_size`` tokens split by saliency
    (the high-precision count from ``counts``), each part quantized at its store's precision and
    written at its store's fill, where ``due``; a first flush also sets the normaliser (and the
    refined channels)."""
    zs, F, g = layer.zs, layer.flush_unit, layer.p.group_size
    k, v = layer.k_win[:, :, :F], layer.v_win[:, :, :F]  # (B, H, F, D): what `_flush` gets
    D = k.shape[3]
    first = n == 0  # [1]: no flush before this one (the eager path's `vn is None`)
    kept = _kept_probes(layer, n)
    vn = layer.vn
    if vn is None:
        vabs = v.float().abs().amax(2)  # (B, H, D)
        vn = torch.where(first, torch.where(vabs > 0, vabs.sqrt(), 1.0).half(), zs.vn)
        zs.vn.copy_(torch.where(due, vn, zs.vn))
    ridx = layer.lo.ridx
    if layer.lo.refine and ridx is None:
        ridx = torch.where(first, _refine_channels(layer, k, kept), zs.ridx)
        zs.ridx.copy_(torch.where(due, ridx, zs.ridx))
    v_norm = v.float() / vn.float()[:, :, None]
    unit = n // F
    hi_before = zs.counts.index_select(0, unit)
    n_hi = zs.counts.index_select(0, (unit + 1).clamp(max=zs.counts.shape[0] - 1)) - hi_before  # [1]
    order = _saliency(layer, k, n, kept).argsort(dim=-1, descending=True, stable=True)  # (B, H, F)
    i = torch.arange(F, device=n.device)
    rank = torch.empty_like(order).scatter_(-1, order, i.expand_as(order))
    salient = rank < n_hi  # (B, H, F)
    groups = torch.arange(F // g, device=n.device)
    for store, chosen, before, count in ((layer.hi, salient, hi_before, n_hi),
                                         (layer.lo, ~salient, n - hi_before, F - n_hi)):
        cap = store.t["kc"].shape[2]
        if cap == 0:
            continue
        perm = torch.where(chosen, i, i + F).argsort(-1)  # the store's tokens first, in sequence order
        gi = perm[..., None].expand(-1, -1, -1, D)
        ks = k.gather(2, gi)
        if store.refine:
            kc, kscale, kz, rc, rs = quantize_refined_keys(ks, store.bits, g, ridx)
        else:
            kc, kscale, kz = quantize_per_channel(ks, store.bits, g)
        vc, vs, vz = quantize_per_token(v_norm.gather(2, gi), store.bits, store.value_group_size)
        tokens = (before + i).clamp(max=cap - 1)  # repeats only where not committed
        token_commit = (due & (i < count)).view(1, 1, F, 1)
        group_index = (before // g + groups).clamp(max=cap // g - 1)
        group_commit = (due & (groups * g < count)).view(1, 1, F // g, 1)
        writes = [("kc", kc), ("ks", kscale), ("kz", kz), ("vc", vc), ("vs", vs), ("vz", vz)]
        if store.refine:
            writes += [("rc", rc), ("rs", rs)]
        for name, x in writes:
            if _PER_TOKEN[name]:
                masked_write(store.t[name], 2, tokens, x, token_commit)
            else:
                masked_write(store.t[name], 2, group_index, x, group_commit)


def static_after_attend(layer, q: torch.Tensor, lse: torch.Tensor, pos: torch.Tensor) -> None:
    """``ZipCacheLayer._static_after_attend``: the step's query (B, H_q, 1, D) and its log-sum-exp
    (B, H_q, 1) into its ring slot."""
    zs = layer.zs
    if zs.q is None:  # a cache never planned: slots made and filled by this traced step, a new graph follows
        _allocate_probes(layer, q, _random_slots(layer, 0))
        mirror_probes(layer, full=True)
    slot = zs.n_rand + pos % layer.p.probe_recent  # [1]
    zs.q.index_copy_(2, slot, q.to(zs.q.dtype))
    zs.lse.index_copy_(2, slot, lse.float())
    zs.pos.index_copy_(0, slot, pos)
