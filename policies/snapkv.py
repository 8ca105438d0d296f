"""``snapkv``: evict at the end of prefill by the observation window's attention (SnapKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpress.attention import dense_causal_attention, masked_group_attention
from kvpress.cache import PROMPT_CROP_TOKENS, CacheLayer
from kvpress.policy_cache import QUERY_TAIL
from kvpress.kernels import SparseIndex, sparse_decode
from kvpress.policies._snapkv_plan import (GROW as _GROW, apply_plan, attend_planned, grow_if_full, plan_slots,
                                           static_step, store_token)
from kvpress.policies._sparse import check_budget
from kvpress.registry import Policy, check_tokens, register_policy


@register_policy
@dataclass(frozen=True)
class SnapKVPolicy(Policy):
    """SnapKV: each KV head keeps the prompt tokens its last queries attend to; the rest is freed.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469.
    Prefill is exact causal attention (a shared dense prefill keeps each layer's last 64 queries, so
    it serves ``window_size`` up to 64). Then the last ``window_size`` (32) prompt queries (the
    observation window) score every earlier token by their summed attention, max-pooled over
    ``kernel_size`` (21) neighbouring positions and averaged over each KV head's query group; every KV
    head keeps the window plus its own top ``budget - window_size`` tokens (``budget`` 256), and the
    other keys and values are dropped. ``kernel_size`` is three times the paper's 7 because tokenizers
    that split numbers into digits (SmolLM2, Llama-3) spread a 7-digit value over 7+ tokens: on 4k
    niah_single (32 samples) 15 keeps 9 / 22 / 75% of ``full``'s needles at budgets 128 / 256 / 1024,
    21 keeps 72 / 84 / 100% (BENCHMARKS.md "Selection and eviction at budgets 128-1024"). A value
    longer than the pool is cut: on Gemma 3 270M at 16k (32 samples per task) it answers 29 / 32 /
    32 of 32 7-digit needles and none of 31 UUIDs at budgets 512 / 1024 / 2048, keeping each UUID's
    first characters (BENCHMARKS.md "Gemma 3 270M at 16k tokens" and "... the selecting policies at
    budgets 512, 1024 and 2048").

    Decode (our choice; the paper lets the cache grow): the budget is a hard cap. Once a row holds
    ``budget`` tokens, each new token replaces, per KV head, the lowest-scored kept prompt token until
    ``window_size`` tokens have been generated, then the generated token leaving the ``window_size``
    latest; the observation window is never evicted. Attention runs through
    ``kvpress.kernels.sparse_decode``; a compiled step chooses the same slot on the device and
    attends through masked SDPA.

    A new turn (several tokens after the prompt, past recording off) is selected as a prompt is, by its
    own last queries (``reselect_turns``, default True; the paper compresses one prompt): they score the
    kept tokens and the turn's together (evicted ones counting 0), each KV head keeps its top ``budget``
    with the turn's window, and decode evicts by these scores. A first turn's token the first selection
    dropped stays lost. With a 3k-token first turn and a 1024-token second turn on SmolLM2 (budget 256,
    ``python -m kvpress.evals.two_turns``) it answers 6 of 8 needles placed in the second turn (0 of 8
    without, 3 of 8 with the 15-token pool) and none of the first turn's.

    A verification (assisted decoding), or with ``reselect_turns=False`` any forward of several tokens
    after the prompt, equals as many decode steps: each token's slot does not depend on the queries, so
    the slots are planned first and the queries attend at once (a 256-token turn after a 4085-token
    prompt on SmolLM2: 0.77 s, 0.61x ``full``'s time, against 3.7 s as one step per token; ``python -m
    kvpress.evals.bench_turn``); more evictions by score than a row has scored prompt tokens falls back
    to one step per token. The turn's tokens then pass through the window as generated ones do: the
    two-turn eval answers none of either turn's 8 needles. A prompt in several forwards (or a new turn)
    is held densely with its last ``window_size`` queries until it ends, then selected as one forward's.
    """

    budget: int = 256
    window_size: int = 32
    kernel_size: int = 21
    reselect_turns: bool = True

    name = "snapkv"
    description = "prompt tokens picked by the observation window's attention, rest evicted (SnapKV)"
    paper = "arXiv 2404.14469"
    full_prefill = True  # a dense prefill keeps the last QUERY_TAIL queries its selection needs
    keeps_full_cache = False
    croppable = True

    def validate(self):
        check_tokens("budget", self.budget, 1)
        check_tokens("window_size", self.window_size, 1)
        check_tokens("kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={self.kernel_size} must be odd (pooling is centred on each token)")
        check_budget(self.budget, self.window_size, f"the recent window_size={self.window_size}")

    def prefills_densely(self) -> bool:
        return self.window_size <= QUERY_TAIL  # a shared dense prefill keeps that many queries per layer

    def make_layer(self, cache, layer_idx):
        return SnapKVLayer(cache, layer_idx, self)

    @classmethod
    def example(cls, adapter):
        return cls(budget=24, window_size=8, kernel_size=3)


def snap_scores(q: torch.Tensor, k: torch.Tensor, scaling: float, row_start: torch.Tensor | None,
                window: int, kernel_size: int) -> torch.Tensor:
    """SnapKV token scores per KV head, ``(B, H_kv, T)`` fp32.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, W, D)`` the last ``W <= window`` prompt queries (sequence indices T - W .. T - 1).
    k : torch.Tensor
        ``(B, H_kv, T, D)`` every prompt key.
    row_start : torch.Tensor or None
        long ``(B,)`` first real token per row.

    Returns
    -------
    torch.Tensor
        Attention of the window's queries summed over the window, max-pooled over
        ``kernel_size`` positions and averaged over the GQA group; 0 for padding.
    """
    W, T = q.shape[2], k.shape[2]
    key_pos = torch.arange(T, device=k.device)
    visible = key_pos[None, :] <= torch.arange(T - W, T, device=k.device)[:, None]  # (W, T) causal
    visible = visible[None, None]
    if row_start is not None:
        visible = visible & (key_pos[None, None, None, :] >= row_start[:, None, None, None])
    votes = _window_votes(q, k, visible, scaling)
    pooled = F.max_pool1d(votes.reshape(-1, 1, T), kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.reshape(votes.shape).mean(2)  # (B, H_kv, T)


def _window_votes(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention the ``W`` window queries ``q`` ``(B, H_q, W, D)`` give each key of ``k``
    ``(B, H_kv, L, D)``, summed over the window: ``(B, H_kv, G, L)`` fp32. ``visible``: bool,
    broadcastable to ``(B, H_kv, W, L)``; a query that sees nothing (padding) gives 0."""
    B, H_q, W, D = q.shape
    H_kv = k.shape[1]
    G = H_q // H_kv
    qg = q.float().reshape(B, H_kv, G, W, D)  # query head h * G + g reads KV head h
    logits = (qg @ k.float()[:, :, None].transpose(-1, -2)) * scaling  # (B, H_kv, G, W, L)
    probs = torch.softmax(logits.masked_fill(~visible[:, :, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return probs.sum(3)


def turn_scores(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, end: int, scaling: float,
                kernel_size: int) -> torch.Tensor:
    """SnapKV scores of a new turn's candidates: the tokens a layer kept plus the turn's, ``(B, H_kv, L)``.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, W, D)`` the turn's last ``W`` queries (positions ``end - W .. end - 1``).
    k : torch.Tensor
        ``(B, H_kv, L, D)`` the candidates' keys, in any order.
    positions : torch.Tensor
        long ``(B, H_kv, L)`` each candidate's sequence position, -1 for a free slot (score 0).

    The window's attention is pooled over neighbouring *positions*, as over a prompt: a token
    whose neighbours were evicted takes no score from them.
    """
    W = q.shape[2]
    q_pos = torch.arange(end - W, end, device=k.device)
    visible = (positions[:, :, None, :] >= 0) & (positions[:, :, None, :] <= q_pos[:, None])  # (B, H, W, L)
    votes = _window_votes(q, k, visible, scaling)  # (B, H_kv, G, L)
    B, H, G, L = votes.shape
    at = torch.where(positions >= 0, positions, end)[:, :, None].expand(B, H, G, L)  # free slots: a spare column
    dense = votes.new_zeros(B, H, G, end + 1).scatter_(3, at, votes)[..., :end]
    pooled = F.max_pool1d(dense.reshape(-1, 1, end), kernel_size, stride=1, padding=kernel_size // 2)
    pooled = F.pad(pooled.reshape(B, H, G, end), (0, 1))
    return pooled.gather(3, at).mean(2)


class SnapKVLayer(CacheLayer):
    """Compact per-head storage: ``k``/``v`` ``(B, H_kv, cap, D)`` and ``pos`` ``(B, H_kv, cap)``.

    Slots ``[0, filled)`` are in use; row ``b``'s tokens occupy ``[filled - kept[b], filled)``
    (shorter, left-padded rows leave free slots at the front; ``pos = -1`` there). Slot order
    carries no meaning for attention (keys are post-RoPE), so eviction overwrites in place.

    Croppable by recording (``rollback = "record"``: the core copies the slots before each
    forward). The prompt's forward is taken back by scoring the kept prompt again, for which it
    keeps its last ``window_size + PROMPT_CROP_TOKENS`` queries while recording: up to
    ``PROMPT_CROP_TOKENS`` of its tokens can be taken back.

    Static decode: a compiled decode step chooses its slot on the device (``_snapkv_plan.static_step``).
    """

    static_decode = True
    rollback = "record"
    rollback_state = ("k", "v", "pos", "kept", "score", "prompt_len", "filled")

    def __init__(self, cache, layer_idx: int, policy: SnapKVPolicy):
        super().__init__(cache, layer_idx)
        self.policy = policy
        self.k = self.v = self.pos = self.kept = self.score = None
        self.prompt_len = 0
        self.filled = 0
        self._validated = False
        self._prompt_q = None  # (last queries, scaling, prompt length) of a recorded prompt forward

    # ------------------------------------------------------------------ prefill
    def attend(self, q, k_new, v_new, scaling):
        plan = self.cache.plan
        if plan is not None and plan.static and self.k is not None:
            return static_step(self, q, k_new, v_new, scaling, plan)
        if self.k is None:
            out = dense_causal_attention(q, k_new, v_new, scaling, q_start=0, row_start=self.row_start)
            T = k_new.shape[2]
            self._compress(q[:, :, T - min(self.policy.window_size, T):], k_new, v_new, scaling)
            if self._record is not None:
                self._prompt_q = (q[:, :, max(0, T - self.policy.window_size - PROMPT_CROP_TOKENS):], scaling, T)
            self.seen += T
            return out
        self._prompt_q = None  # (a crop of the prompt's forward is no longer possible)
        n = k_new.shape[2]
        if self.policy.reselect_turns and n > 1 and not self.record_past:
            return self._turn(q, k_new, v_new, scaling)  # a new turn: selected again
        if n > 1:  # several tokens after the prompt (a verification, a turn as steps): planned at once
            slots = plan_slots(self, n)
            if slots is not None:
                out = attend_planned(self, q, k_new, v_new, scaling, slots)
                apply_plan(self, k_new, v_new, slots)
                return out
        if n == 1:
            return self._decode(q, k_new, v_new, scaling)
        return self.attend_as_steps(self._decode, q, k_new, v_new, scaling)  # where the plan does not apply

    # ------------------------------------------------------------------ a prompt in pieces
    # The core holds the pieces (``stages_prompt``): a first prompt always, a later turn with
    # ``reselect_turns``; each piece attends as one forward of the whole would, and the whole is
    # selected at the end.
    @property
    def stages_prompt(self) -> bool:
        return self.k is None or self.policy.reselect_turns

    @property
    def prompt_queries(self) -> int:
        return self.policy.window_size

    def attend_staged(self, q, stage, q_start, scaling):
        if self.k is None:
            return super().attend_staged(q, stage, q_start, scaling)
        return self._attend_turn(q, stage.buffer.keys, stage.buffer.values, q_start, scaling)

    def take_prompt(self, stage) -> None:
        select = self._compress if self.k is None else self._reselect
        select(stage.window_queries(self.policy.window_size), stage.buffer.keys, stage.buffer.values, stage.scaling)

    # ------------------------------------------------------------------ crop
    def removable(self) -> int:
        n = super().removable()
        if n and self._record[0] == 0:  # the prompt's forward: as far as its kept queries reach
            n = min(n, PROMPT_CROP_TOKENS, self._record[1].shape[2] - 1)
        return n

    def store_again(self, k, v):
        if self.k is None:  # the prompt, shorter: score it again with the queries it keeps
            q, scaling, length = self._prompt_q  # q: the last queries of a `length`-token prompt
            T, w = k.shape[2], min(self.policy.window_size, k.shape[2])
            kept_q = q[:, :, : q.shape[2] - (length - T)]  # those of the kept prompt's end
            self._compress(kept_q[:, :, kept_q.shape[2] - w:], k, v, scaling)
            self.seen += T
            return
        slots = plan_slots(self, k.shape[2]) if k.shape[2] > 1 else None
        if slots is not None:
            apply_plan(self, k, v, slots)
            return
        for t in range(k.shape[2]):
            self._store(k[:, :, t : t + 1], v[:, :, t : t + 1])

    def _compress(self, q_window, k, v, scaling) -> None:
        """Keep each KV head's best prompt tokens; ``q_window``: the last ``min(window_size, T)`` queries."""
        p = self.policy
        B, H, T, _ = k.shape
        row_start = self.row_start
        starts = torch.zeros(B, dtype=torch.long, device=k.device) if row_start is None else row_start
        self.kept = T - starts  # (B,) real tokens per row
        first = int(starts.min())
        keep = min(p.budget, T - first)
        pos = torch.arange(T, device=k.device).expand(B, H, T)  # (B, H, T)
        real = pos >= starts[:, None, None]
        scores = snap_scores(q_window, k, scaling, row_start, p.window_size, p.kernel_size)
        scores = scores.masked_fill(pos >= T - p.window_size, float("inf"))  # the window stays
        scores = scores.masked_fill(~real, float("-inf"))
        if T - first <= p.budget:  # every row fits: keep everything
            chosen = pos[:, :, first:]
        else:
            top = torch.topk(scores, keep, dim=-1)
            chosen = torch.where(top.values > float("-inf"), top.indices, torch.full_like(top.indices, -1))
            chosen = chosen.sort(dim=-1).values  # free slots (-1) first, then ascending positions
            self.kept = self.kept.clamp(max=p.budget)
        chosen = torch.where(chosen >= starts[:, None, None], chosen, torch.full_like(chosen, -1))
        self._hold(k, v, scores, chosen.clamp(min=0), chosen)  # (free slots: a copy of token 0)
        self.prompt_len = T

    def _hold(self, keys, values, scores, index, pos) -> None:
        """Make the chosen candidates the layer's buffers: ``index`` (B, H, keep) into ``keys`` /
        ``values`` / ``scores`` (B, H, L, ...), ``pos`` their positions, -1 for a row's free slots
        (they hold some candidate, never attended). Capacity: the budget, or whole ``_GROW`` steps
        below it. Retention score per slot: the selection's (the observation window +inf),
        generated tokens +inf; a full row evicts its lowest-scored token until ``window_size``
        tokens have been generated, then the generated token leaving the window."""
        p = self.policy
        B, H, keep = index.shape
        D = keys.shape[3]
        cap = keep if keep == p.budget else min(p.budget, -(-keep // _GROW) * _GROW)
        if self.cache.capacity:  # a planned generation: room for all it keeps (static steps keep one shape)
            cap = max(cap, min(p.budget, self.cache.capacity))
        self.k, self.v = keys.new_zeros(B, H, cap, D), values.new_zeros(B, H, cap, D)
        rows = index[..., None].expand(B, H, keep, D)
        self.k[:, :, :keep] = keys.gather(2, rows)
        self.v[:, :, :keep] = values.gather(2, rows)
        self.pos = torch.full((B, H, cap), -1, dtype=torch.long, device=keys.device)
        self.pos[:, :, :keep] = pos
        self.score = torch.full((B, H, cap), float("inf"), device=keys.device)
        self.score[:, :, :keep] = torch.where(pos >= 0, scores.gather(2, index), float("inf"))
        self.filled = keep

    # ------------------------------------------------------------------ a new turn
    # With ``reselect_turns`` a forward of several tokens after the prompt without past recording
    # (a new turn; assisted decoding's verifications record) is a prompt again: its queries attend
    # exactly over the kept tokens and the turn's (as a prefill over the kept cache would), then
    # the turn's last ``window_size`` queries score the kept tokens and the turn's together and each
    # KV head keeps its top ``budget`` of them. Given in pieces (`PolicyCache.prompt`), the turn is
    # held densely until its end and selected as one forward of it would be.

    def _turn(self, q, k_new, v_new, scaling):
        self.seen += k_new.shape[2]
        out = self._attend_turn(q, k_new, v_new, 0, scaling)
        self._reselect(q[:, :, max(0, q.shape[2] - self.policy.window_size):], k_new, v_new, scaling)
        return out

    def _used(self) -> torch.Tensor:
        """bool ``(B, cap)``: the slots holding a row's tokens."""
        slot = torch.arange(self.k.shape[2], device=self.k.device)
        return (slot >= (self.filled - self.kept)[:, None]) & (slot < self.filled)

    def _attend_turn(self, q, k_turn, v_turn, q_start: int, scaling: float) -> torch.Tensor:
        """Queries at turn indices ``q_start ..`` over every kept token and the turn's keys up to their own."""
        B, H, cap, D = self.k.shape
        H_q, m = q.shape[1], q.shape[2]
        used = self._used()[:, None, None, :]  # (B, 1, 1, cap)
        qg = q.reshape(B, H, H_q // H, m, D)
        out = torch.empty_like(qg)
        block = 256  # queries at a time: bounds the (queries x keys) mask of a long turn
        for t0 in range(0, m, block):
            t1 = min(m, t0 + block)
            end = q_start + t1  # turn keys the block's last query sees
            causal = torch.arange(end, device=q.device) <= torch.arange(q_start + t0, end, device=q.device)[:, None]
            visible = torch.cat([used.expand(B, 1, t1 - t0, cap), causal.expand(B, 1, t1 - t0, end)], dim=-1)
            keys = torch.cat([self.k, k_turn[:, :, :end]], dim=2).to(q.dtype)
            values = torch.cat([self.v, v_turn[:, :, :end]], dim=2).to(q.dtype)
            out[:, :, :, t0:t1] = masked_group_attention(qg[:, :, :, t0:t1], keys, values,
                                                         visible.expand(B, H, -1, -1), scaling)
        return out.reshape(B, H_q, m, D)

    def _reselect(self, q_window, k_turn, v_turn, scaling) -> None:
        """Select each KV head's ``budget`` tokens among the kept ones and the turn's (``self.seen``
        already counts the turn); ``q_window``: the turn's last ``min(window_size, n)`` queries."""
        p = self.policy
        B, H = self.k.shape[:2]
        n, end = k_turn.shape[2], self.seen
        dev = self.k.device
        turn_pos = torch.arange(end - n, end, device=dev).expand(B, H, n)
        positions = torch.cat([torch.where(self._used()[:, None], self.pos, -1), turn_pos], dim=2)  # (B, H, cap + n)
        keys = torch.cat([self.k, k_turn.to(self.k.dtype)], dim=2)
        values = torch.cat([self.v, v_turn.to(self.v.dtype)], dim=2)
        scores = turn_scores(q_window, keys, positions, end, scaling, p.kernel_size)
        scores = scores.masked_fill(positions >= end - p.window_size, float("inf"))  # the window stays
        scores = scores.masked_fill(positions < 0, float("-inf"))
        total = self.kept + n  # (B,) real tokens per row
        keep = min(p.budget, int(total.max()))
        top = torch.topk(scores, keep, dim=-1)
        chosen_pos = torch.where(top.values > float("-inf"), positions.gather(2, top.indices), -1)
        order = chosen_pos.sort(dim=-1).indices  # free slots (-1) first, then ascending positions
        self._hold(keys, values, scores, top.indices.gather(2, order), chosen_pos.gather(2, order))
        self.kept = total.clamp(max=p.budget)
        self.prompt_len = end  # decode evicts by these scores until window_size tokens are generated

    # ------------------------------------------------------------------ decode
    def _decode(self, q, k_new, v_new, scaling):
        self._store(k_new, v_new)
        out, _ = sparse_decode(q[:, :, 0], self.k, self.v, self._index(), scale=scaling,
                               validate_index=not self._validated)
        self._validated = True
        return out[:, :, None]

    def _store(self, k_new, v_new) -> None:
        """One new token into its slot (`_snapkv_plan.store_token`)."""
        grow_if_full(self)
        self.filled = store_token(self, k_new, v_new, self.seen, self.filled)
        self.seen += 1

    def count_tokens(self, n: int) -> None:
        self.seen += n
        self.filled = min(self.policy.budget, self.filled + n)

    def _index(self) -> SparseIndex:
        """Dense index over the used slots, shared by every layer of the step (same layout)."""
        key = (self.seen, self.filled, self.k.shape[2])
        cached = self.cache.step_shared.get("snapkv_index")
        if cached is not None and cached[0] == key:
            return cached[1]
        B = self.k.shape[0]
        lens = torch.full((B,), self.filled, dtype=torch.int32, device=self.k.device)
        starts = (self.filled - self.kept).to(torch.int32)
        index = SparseIndex.dense(lens, self.k.shape[1], seq_starts=starts, capacity=self.k.shape[2])
        self.cache.step_shared["snapkv_index"] = (key, index)
        return index

    def _grow(self, cap: int) -> None:
        B, H, old, D = self.k.shape
        for name, fill in (("k", 0), ("v", 0), ("pos", -1), ("score", float("inf"))):
            t = getattr(self, name)
            new = t.new_full((B, H, cap) + tuple(t.shape[3:]), fill)
            new[:, :, :old] = t
            setattr(self, name, new)

    # ------------------------------------------------------------------ accounting
    def state_tensors(self):
        return {"k": self.k, "v": self.v, "pos": self.pos, "kept": self.kept, "score": self.score}

    def stored_tokens(self) -> int:
        return self.filled if self.k is not None else 0

    def cached_elements(self) -> int:
        if self.k is None:
            return 0
        b, h, _, d = self.k.shape
        return 2 * b * h * self.filled * d
