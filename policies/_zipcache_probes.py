"""``zipcache``'s probes on the eager paths, as functions of a
`kvpress.policies.zipcache.ZipCacheLayer`: which queries are kept as probes (chosen on the host),
the prompt's probes, putting them back after a crop, and the saliency and refined key channels a
flush reads from them."""
from __future__ import annotations

import torch

from ._zipcache_static import mirror_probes
from ._zipcache_store import _joined, _runs


def random_probes(layer, q_start: int, T: int) -> torch.Tensor:
    """bool (T,) on the host: ``probe_random`` random rows among a step's queries older than the
    recent ones."""
    older = max(0, T - layer.p.probe_recent)
    mask = torch.zeros(T, dtype=torch.bool)
    if older:
        gen = torch.Generator().manual_seed(layer.p.seed * 1_000_003 + layer.layer_idx * 8191 + q_start)
        mask[torch.randperm(older, generator=gen)[: layer.p.probe_random]] = True
    return mask


def keep_probes(layer, parts, pos: list[int], rand: list[bool]) -> None:
    """Keep the ``probe_recent`` latest queries and the random probes that can still attend
    an unflushed token (probe at position p sees tokens <= p). ``parts``: ``(q, lse, pos_dev)``
    device tensors whose rows (dim 2, dim 2, dim 0) follow one another in sequence order;
    ``pos`` / ``rand`` (host) describe all those rows. The kept rows are joined from slices
    of the parts (one ``cat`` per tensor): no index or mask on the device. With a planned
    capacity the static step's probe slots follow (`mirror_probes`)."""
    lo, flushed = layer.seen - layer.p.probe_recent, layer.n_quant
    keep = [(r or p >= lo) and p >= flushed for p, r in zip(pos, rand)]
    pieces, start = [], 0
    for part in parts:
        n = part[0].shape[2]
        pieces += [(part, a - start, b - a) for a, b in _runs(keep, start, start + n)]
        start += n
    layer.probe_q, layer.probe_lse = _joined(parts, pieces, 0, 2), _joined(parts, pieces, 1, 2)
    layer.probe_pos_dev = _joined(parts, pieces, 2, 0)
    layer.probe_pos = [p for p, k in zip(pos, keep) if k]
    layer.probe_rand = [r for r, k in zip(rand, keep) if k]
    mirror_probes(layer)


def prompt_probe_rows(layer, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``T``-token prompt's probes: sequence indices (P,) and whether each is a random one (host)."""
    rand = random_probes(layer, 0, T)
    pos_all = torch.arange(T)
    sel = rand | (pos_all >= T - layer.p.probe_recent)
    return pos_all[sel], rand[sel]


def set_prompt_probes(layer, qp, pos, rand, k, scaling) -> None:
    """Probes from prompt queries ``qp`` (B, H_q, P, D) at sequence indices ``pos`` over the
    prompt's keys ``k`` (B, H, T, D), each with its own log-sum-exp (``pos``, ``rand``: host)."""
    B, H_q, P, D = qp.shape
    H, T = k.shape[1], k.shape[2]
    pos_dev = pos.to(k.device)
    s = (qp.float().view(B, H, H_q // H, P, D) @ k.float()[:, :, None].transpose(-1, -2)) * scaling  # (B, H, G, P, T)
    hidden = torch.arange(T, device=k.device)[None, :] > pos_dev[:, None]  # (P, T)
    pad = layer.padding_mask(0, T, k.device)
    if pad is not None:
        hidden = (hidden[None] | pad[:, None, :])[:, None, None]  # (B, 1, 1, P, T)
    lse = s.masked_fill(hidden, float("-inf")).logsumexp(-1).view(B, H_q, -1)
    seen, layer.seen = layer.seen, T  # keep_probes reads the sequence length
    keep_probes(layer, [(qp, lse, pos_dev)], pos.tolist(), rand.tolist())
    layer.seen = seen
    layer._scaling = scaling


def crop_probes(layer, n: int) -> None:
    """The latest forward lost its last ``n`` tokens (window and ``seen`` already cut): the probes
    from before it, joined again by its kept queries (a prompt's drawn anew for its kept length)."""
    record, layer._forward_q = layer._forward_q, None
    if n == 0 or record is None:
        return
    layer.set_probe_state(layer._probes_before)
    if record[0] == "prompt":
        _, rows, q_rows, scaling = record
        pos, rand = prompt_probe_rows(layer, layer.seen)
        set_prompt_probes(layer, q_rows[:, :, torch.searchsorted(rows, pos).to(q_rows.device)], pos, rand,
                          layer.k_win[:, :, : layer.seen], scaling)
    else:
        _, q, lse, q_start, scaling = record
        keep = layer.seen - q_start
        after_attend(layer, q[:, :, :keep], lse[:, :, :keep], q_start, scaling, as_steps=True)


def after_attend(layer, q, lse, q_start: int, scaling: float, as_steps: bool = False) -> None:
    """``ZipCacheLayer._after_attend``: a forward's queries (B, H_q, T, D) and their log-sum-exp
    (B, H_q, T) join the probes (``as_steps``: as decode steps', no random probe)."""
    verification = bool(layer._recorded and q_start)  # assisted decoding's: probes as its decode steps'
    if verification:
        prev = layer._forward_q
        if prev is not None and prev[0] == "step" and prev[3] + prev[1].shape[2] == q_start:
            # a later segment of the same verification (`_attend_across_flushes`): all its queries
            layer._forward_q = ("step", torch.cat([prev[1], q], 2), torch.cat([prev[2], lse], 2), prev[3], scaling)
        else:
            layer._forward_q = ("step", q, lse, q_start, scaling)
    T = q.shape[2]
    pos, pos_dev = list(range(q_start, q_start + T)), torch.arange(q_start, q_start + T, device=q.device)
    if verification or as_steps or T <= layer.p.probe_recent:  # no random probe (none of the rows is older)
        rand = [False] * T
    else:
        rand = random_probes(layer, q_start, T).tolist()
    if layer.probe_q is None:
        keep_probes(layer, [(q, lse, pos_dev)], pos, rand)
        return
    before = (layer.probe_q, layer.probe_lse, layer.probe_pos_dev)
    keep_probes(layer, [before, (q.to(layer.probe_q.dtype), lse, pos_dev)], layer.probe_pos + pos,
                layer.probe_rand + rand)


def saliency(layer, k: torch.Tensor, start: int) -> torch.Tensor:
    """Normalised attention (B, H, n) received by tokens ``start ..`` with keys k (B, H, n, D);
    +inf where no probe sees the token (kept precise), -inf on left padding."""
    B, H, n, D = k.shape
    if layer.probe_q is None:  # no queries seen (shared prefill): no evidence, all equal
        sal = torch.zeros(B, H, n, device=k.device)
    else:
        H_q, P = layer.probe_q.shape[1], layer.probe_q.shape[2]
        qp = layer.probe_q.float().view(B, H, H_q // H, P, D)
        s = (qp @ k.float()[:, :, None].transpose(-1, -2)) * layer._scaling  # (B, H, G, P, n)
        prob = torch.exp(s - layer.probe_lse.view(B, H, H_q // H, P)[..., None])
        pos = torch.arange(start, start + n, device=k.device)
        seen_by = layer.probe_pos_dev[:, None] >= pos[None, :]  # (P, n) probe can attend token
        rs = layer.row_start
        probe_real = torch.ones(B, P, dtype=torch.bool, device=k.device) if rs is None else \
            layer.probe_pos_dev[None, :] >= rs[:, None]  # padded probes attended only to themselves
        valid = seen_by[None] & probe_real[:, :, None]  # (B, P, n)
        total = (prob * valid[:, None, None]).sum((2, 3))  # (B, H, n)
        count = valid.sum(1).clamp(min=1) * (H_q // H)  # (B, n)
        sal = total / count[:, None, :]
        sal = torch.where(valid.any(1)[:, None, :], sal, torch.full_like(sal, float("inf")))
    pad = layer.padding_mask(start, n, k.device)
    return sal if pad is None else sal.masked_fill(pad[:, None, :], float("-inf"))


def refine_channels(layer, k: torch.Tensor) -> torch.Tensor:
    """The ``refine_key_channels`` key channels of each KV head whose coarse codes would move
    the probes' scores most, long (B, H, R): mean squared probe query channel (over the
    probes and the KV head's query heads; 1 without probes) times the channel's mean squared
    range over the token groups of keys ``k`` (B, H, n, D) -- the variance of a code's
    rounding error is proportional to the squared range of its group."""
    B, H, n, D = k.shape
    g = layer.p.group_size
    kg = k.float().view(B, H, n // g, g, D)
    spread = (kg.amax(3) - kg.amin(3)).pow(2).mean(2)  # (B, H, D)
    if layer.probe_q is not None:
        spread = spread * layer.probe_q.float().pow(2).view(B, H, -1, D).mean(2)
    return spread.topk(layer.p.refine_key_channels, dim=-1).indices.sort(-1).values
