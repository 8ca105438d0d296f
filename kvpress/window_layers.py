"""Sinks + recent-window cache layers (StreamingLLM-style) and the model's own sliding window.

Split from ``kvpress.layers`` (which re-exports both classes): :class:`SinkWindowLayer` keeps
the first ``sinks`` tokens and a ring of the last ``window``; :class:`SlidingWindowLayer` is the
exact sliding window of a model's own sliding-window layers.
"""

from __future__ import annotations

import functools

import torch

from .attention import masked_decode_attention, sliding_causal_attention, streaming_attention, whole_cache_index
from .buffers import doubled_slots
from .cache_layer import CacheLayer
from .chunk_tail import ChunkTail
from .plan import static_address
from .window_prefill import ChunkedPrefill
from .kernels import SparseIndex, chunk_attention, merge_states, sparse_decode

RING_STEP = 128  # the fewest sink / ring slots a SinkWindowLayer allocates; they double up to sinks / window


def slot_index(visible: torch.Tensor, kv_heads: int, all_visible: bool = False) -> SparseIndex:
    """Token-level :class:`SparseIndex` of the visible slots ``visible`` [B, slots] (bool), the
    same for every KV head of a row. ``all_visible=True`` (the caller knows every slot is
    visible, without asking the device) gives the dense index."""
    batch, slots = visible.shape
    if all_visible:
        return SparseIndex.dense(torch.full((batch,), slots, device=visible.device), kv_heads, capacity=slots)
    ids = torch.arange(slots, device=visible.device, dtype=torch.int32).expand(batch, slots)
    packed = torch.where(visible, ids, slots).sort(dim=-1).values  # visible slot ids first
    packed = torch.where(packed < slots, packed, -1)
    count = visible.sum(dim=-1, dtype=torch.int32)
    return SparseIndex(1, packed[:, None, :].expand(batch, kv_heads, slots).contiguous(),
                       count[:, None].expand(batch, kv_heads).contiguous(),
                       torch.full((batch,), slots, dtype=torch.int32, device=visible.device))


def _grown(tokens: int, limit: int) -> int:
    """Slots of a part holding at most ``limit`` for ``tokens`` tokens: ``RING_STEP`` doubled until
    they fit, at most ``limit``."""
    return doubled_slots(tokens, limit, RING_STEP)


class SinkWindowLayer(CacheLayer):
    """Keeps the first ``sinks`` real tokens of each row and the most recent ``window`` tokens.

    Every query attends exactly as if tokens had arrived one at a time into ``sinks + window``
    slots, during prefill too, so resident memory and per-token attention cost are bounded at
    any length.

    Storage: k/v [B, H_kv, S + ring, D] and ``pos`` [B, S + ring] (long), the sequence index
    held by each slot (-1: empty). Slots ``[0, S)`` hold each row's sinks; slots ``[S, S + ring)``
    are a ring: the token at sequence index i lives in slot ``S + i % window``, so a decode step
    writes one slot in place instead of copying the window. A sink token that is still inside the
    window also has a ring copy; the ring copy is never attended (no double counting). Both parts
    grow with the tokens seen, not with the configured sizes: each is ``RING_STEP`` slots, doubled
    whenever a token would land past its end, up to ``sinks`` (``S``) and ``window`` (``ring``);
    before the window is full no index wraps, so growing moves the ring whole. A 40-token prompt
    under ``window_size=65536`` holds 128 ring slots.

    With ``rerotate=True`` the sinks are scored at StreamingLLM's in-cache positions (right
    before the window) rather than at their true distance; see :func:`streaming_attention`.

    With ``dense_prefill=True`` a forward of several tokens attends densely instead: each of
    its queries sees every kept slot and every earlier token of the same forward (a one-shot
    prefill is then plain causal attention); only sinks + window are stored afterwards, and
    one-token decode steps are streaming as above.

    With ``prefill_chunk=K`` (and ``dense_prefill=True``) a forward of several tokens is cut into
    chunks of K tokens counted from each row's first real token (a left-padded row is cut where
    its prompt alone would be; rows whose padding differs modulo K run as separate groups of rows),
    and each chunk attends as a dense-prefill
    forward of its own: its queries see the slots kept after the earlier chunks (sinks + the last
    ``window`` tokens before the chunk) and the chunk's own earlier tokens. This is DuoAttention's
    chunked pre-filling: at most ``sinks + window + K`` keys per query, O(T * (sinks + window + K))
    work, and the layer never holds more than one chunk beyond its slots. Only the slots survive
    between forwards, so a caller's own forwards cut the chunks too. ``K=1`` is the per-token
    streaming pattern with one more window slot; ``K=None`` one chunk per forward. In a prompt
    given in several forwards (:meth:`~kvpress.cache.PolicyCache.prompt`) the chunks are the
    prompt's, not the forwards': a chunk a forward ends in is held (at most one chunk, or the
    whole prompt with ``K=None``) and continued by the next, so the layer ends as after one forward.

    Croppable by recording (``rollback = "record"``): with past recording on, the core copies the
    slots (and the tail sums) before a forward, so ``crop`` can take back any of its tokens.

    With ``tail_chunk=N`` (needs ``dense_prefill``, not ``rerotate``) the tokens the ring evicts
    are not forgotten entirely: each is added, as it leaves, to fp32 key / value sums of its
    ``N``-token chunk (a :class:`ChunkTail`; sinks are never summed), and every later query also
    sees each chunk as one key ``mean k`` of value ``mean v`` standing for its token count
    (`kvpress.kernels.chunk_attention`; RetroInfer's estimation zone, arXiv 2505.02922). A chunked
    prefill's chunk sees the chunks evicted before it; a decode step those evicted before it.
    Resident bytes grow by ``2 * 4 * D / N`` per evicted token and head (fp32 sums: 1/N of an
    fp32 cache, 2/N of a 16-bit one), counted in ``cache_stats``. ``N=1`` keeps every evicted
    token's key and value (as sums of one), so attention equals dense attention.
    """

    rollback = "record"
    rollback_state = ("k", "v", "pos", "_ring_at", "tail")

    def __init__(self, cache, layer_idx: int, sinks: int, window: int, rerotate: bool = False,
                 dense_prefill: bool = False, prefill_chunk: int | None = None, tail_chunk: int = 0):
        super().__init__(cache, layer_idx)
        if prefill_chunk is not None and (not dense_prefill or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk={prefill_chunk!r} needs dense_prefill=True and must be >= 1")
        if tail_chunk and (rerotate or not dense_prefill or tail_chunk < 0):
            raise ValueError(f"tail_chunk={tail_chunk!r} needs dense_prefill=True, rerotate=False and must be >= 0")
        self.tail = ChunkTail(tail_chunk, skip=sinks) if tail_chunk else None
        # a dense-prefill chunk would let a verification's queries see its earlier tokens beyond the window
        self.verify_as_steps = dense_prefill
        self.sinks = sinks
        self.window = window
        self._ring_at = 0  # S: the sink slots allocated (sinks, once that many tokens were seen)
        self.rerotate = rerotate
        self.dense_prefill = dense_prefill
        self.prefill_chunk = prefill_chunk
        self.k = self.v = self.pos = None
        self.prefill = ChunkedPrefill(self, prefill_chunk) if dense_prefill else None
        self._rows_row_start = None  # while one group of rows runs alone (`ChunkedPrefill.only_rows`)

    @property
    def row_start(self):
        # (not ``super().row_start``: torch.compile's tracer reads a property through super() as the property)
        return self._rows_row_start if self._rows_row_start is not None else self.cache.row_start_on(self.device)

    def _reserve(self, k_new, v_new, tokens: int) -> None:
        """Slots for every sequence index below ``tokens`` (a row's sink j is token row_start + j,
        so ``min(sinks, tokens)`` sink slots hold every sink seen): allocate, or grow. A cache planned
        for a generation's length (``cache.capacity``) gets room for all of it at once, so its decode
        steps keep one shape."""
        tokens = max(tokens, self.cache.capacity or 0)
        old_sinks = self._ring_at
        old_ring = 0 if self.k is None else self.k.shape[2] - old_sinks
        sinks, ring = max(old_sinks, _grown(tokens, self.sinks)), max(old_ring, _grown(tokens, self.window))
        if self.k is not None and (sinks, ring) == (old_sinks, old_ring):
            return
        batch, heads, _, dim = k_new.shape
        old = (self.k, self.v, self.pos)
        self.k = k_new.new_zeros(batch, heads, sinks + ring, dim)
        self.v = v_new.new_zeros(batch, heads, sinks + ring, dim)
        self.pos = torch.full((batch, sinks + ring), -1, dtype=torch.long, device=k_new.device)
        self._ring_at = sinks
        static_address(self.k, self.v, self.pos)
        if old[0] is not None:  # no ring index has wrapped yet: the ring moves whole
            self.k[:, :, :old_sinks], self.v[:, :, :old_sinks] = old[0][:, :, :old_sinks], old[1][:, :, :old_sinks]
            self.pos[:, :old_sinks] = old[2][:, :old_sinks]
            end = sinks + old_ring
            self.k[:, :, sinks:end], self.v[:, :, sinks:end] = old[0][:, :, old_sinks:], old[1][:, :, old_sinks:]
            self.pos[:, sinks:end] = old[2][:, old_sinks:]

    @property
    def _slot(self) -> torch.Tensor:
        """long ``(slots,)``: ``0 .. slots - 1`` for the current storage."""
        slots, device = self.k.shape[2], self.k.device
        if torch.compiler.is_compiling():  # (a cache made while tracing would change the next step's guards)
            return torch.arange(slots, device=device)
        cached = getattr(self, "_slot_ids", None)
        if cached is None or cached.shape[0] != slots or cached.device != device:
            cached = self._slot_ids = torch.arange(slots, device=device)
        return cached

    def _row_start(self, batch, device):
        row_start = self.row_start
        return torch.zeros(batch, dtype=torch.long, device=device) if row_start is None else row_start

    def _visible_pos(self, row_start):
        """``pos`` with ring copies of sink tokens (and padding) hidden: each token counted once."""
        real = self.pos - row_start[:, None]
        duplicate = (self._slot[None, :] >= self._ring_at) & (real < self.sinks)
        return torch.where(duplicate | (real < 0), torch.full_like(self.pos, -1), self.pos)

    @property
    def static_decode(self) -> bool:  # the re-rotated sinks and the tail estimate are not static yet
        return self.tail is None and not self.rerotate

    def attend(self, q, k_new, v_new, scaling):
        batch, _, n_new, _ = k_new.shape
        plan = self.cache.plan
        if plan is not None and plan.static and self.static_decode and self.seen >= self.cache.max_row_start + self.sinks:
            if self.k.shape[2] < self.sinks + self.window:  # (a ring sized by a planned capacity does not grow)
                self._reserve(k_new, v_new, self.seen + 1)
            return self._static_step(q, k_new, v_new, scaling, plan)
        self._reserve(k_new, v_new, self.seen + n_new)
        if n_new == 1 and self.seen > 0 and not (self.dense_prefill and self.cache.prompt_open):
            out = self._decode(q, k_new, v_new, scaling)
            self.seen += n_new
            return out
        row_start = self._row_start(batch, k_new.device)
        if self.dense_prefill:
            return self.prefill.attend(q, k_new, v_new, scaling, row_start)
        else:
            out = streaming_attention(
                q, self.k, self.v, self._visible_pos(row_start), k_new, v_new, scaling,
                q_start=self.seen, row_start=row_start, sinks=self.sinks, window=self.window,
                sink_query_fn=functools.partial(self.cache.adapter.rotate, layer_idx=self.layer_idx) if self.rerotate else None,
            )
            self._write(k_new, v_new, row_start)
        self.seen += n_new
        return out

    def end_prompt(self) -> None:
        if self.prefill is not None:
            self.prefill.end_prompt()

    def ingest_prefill(self, k, v):
        """Keep sinks + window of a prompt that attended densely (``dense_prefill`` layers only)."""
        if not self.dense_prefill:
            raise NotImplementedError("a streaming-prefill SinkWindowLayer cannot take a dense prefill")
        self.store_again(k, v)

    def _write(self, k_new, v_new, row_start) -> None:
        """Store new tokens (sequence indices seen .. seen+T-1): the last ``window`` into the ring,
        each row's sink tokens into its sink slots (``row_start`` None: the rows' own, made only if
        a sink is among the new tokens)."""
        batch, heads, n_new, dim = k_new.shape
        if self.tail is not None:
            self._evict_to_tail(k_new, v_new)
        if n_new == 1:  # a decode step: its slot is known on the host (one copy each, no index tensors)
            slot = self._ring_at + self.seen % self.window
            self.k[:, :, slot] = k_new[:, :, 0]
            self.v[:, :, slot] = v_new[:, :, 0]
            self.pos[:, slot].fill_(self.seen)
        else:
            keep = min(n_new, self.window)
            idx = torch.arange(self.seen + n_new - keep, self.seen + n_new, device=k_new.device)
            slots = self._ring_at + idx % self.window
            self.k[:, :, slots] = k_new[:, :, n_new - keep :]
            self.v[:, :, slots] = v_new[:, :, n_new - keep :]
            self.pos[:, slots] = idx
        if self.sinks:
            # a row's sink is among the new tokens only while seen < its row_start + sinks; decided
            # on the host (no device sync per layer and step)
            if self.seen < self.cache.max_row_start + self.sinks:
                if row_start is None:
                    row_start = self._row_start(batch, k_new.device)
                S = self._ring_at  # (the sinks not allocated yet come after these new tokens)
                local = row_start[:, None] - self.seen + torch.arange(S, device=k_new.device)  # (B, S)
                fresh = (local >= 0) & (local < n_new)
                src = local.clamp(0, n_new - 1)[:, None, :, None].expand(batch, heads, S, dim)
                take = fresh[:, None, :, None]
                self.k[:, :, :S] = torch.where(take, torch.gather(k_new, 2, src), self.k[:, :, :S])
                self.v[:, :, :S] = torch.where(take, torch.gather(v_new, 2, src), self.v[:, :, :S])
                self.pos[:, :S] = torch.where(fresh, local + self.seen, self.pos[:, :S])

    def _evict_to_tail(self, k_new, v_new) -> None:
        """Add the tokens this write pushes out of the window (sequence indices
        ``[seen - window, seen + n - window)``, from the ring or from the new tokens) to the tail sums."""
        n, w = k_new.shape[2], self.window
        lo, hi = max(0, self.seen - w), self.seen + n - w
        if hi <= lo:
            return
        ks, vs = [], []
        if lo < self.seen:  # ring slots about to be overwritten (they hold indices lo .. )
            old_hi = min(self.seen, hi)
            if old_hi - lo == 1:
                slot = self._ring_at + lo % w
                ks.append(self.k[:, :, slot:slot + 1])
                vs.append(self.v[:, :, slot:slot + 1])
            else:
                slots = self._ring_at + torch.arange(lo, old_hi, device=k_new.device) % w
                ks.append(self.k[:, :, slots])
                vs.append(self.v[:, :, slots])
        if hi > self.seen:  # new tokens that never enter the ring
            ks.append(k_new[:, :, : hi - self.seen])
            vs.append(v_new[:, :, : hi - self.seen])
        k_ev = ks[0] if len(ks) == 1 else torch.cat(ks, dim=2)
        v_ev = vs[0] if len(vs) == 1 else torch.cat(vs, dim=2)
        self.tail.append(k_ev, v_ev, lo, self.row_start)

    def _static_step(self, q, k_new, v_new, scaling, plan):
        """A decode step at the plan's device position (every row's sinks already stored): the ring
        slot and the visible slots come from device tensors, so the step keeps one graph."""
        batch = k_new.shape[0]
        slot = plan.start % self.window + self._ring_at  # [1] (every sink slot is there by now)
        self.k.index_copy_(2, slot, k_new)
        self.v.index_copy_(2, slot, v_new)
        self.pos.index_copy_(1, slot, plan.start.expand(batch, 1))
        self.count_static_step()
        pos = self._visible_pos(self._row_start(batch, q.device))
        visible = (pos >= 0) & ((plan.start - pos < self.window) | (self._slot[None, :] < self.sinks))
        return masked_decode_attention(q, self.k, self.v, scaling, visible)

    def _decode(self, q, k_new, v_new, scaling):
        """One new token: write it into its ring slot, then attend over the slots in place."""
        self._write(k_new, v_new, None)
        q_pos = self.seen
        batch, h_q, _, dim = q.shape
        h_kv = self.k.shape[1]
        # without padding every slot is visible once the sinks and the window are full
        full = self.row_start is None and q_pos >= self.sinks + self.window - 1
        if not self.rerotate and full:  # the dense index over every slot, shared with other layers and steps
            index = whole_cache_index(self.k, None, q.device)
        else:
            row_start = self._row_start(batch, q.device)
            pos = self._visible_pos(row_start)
            visible = (pos >= 0) & (q_pos - pos < self.window) | (pos >= 0) & (self._slot[None, :] < self._ring_at)
            index = None if self.rerotate else slot_index(visible, h_kv)
        if not self.rerotate:
            # the decode kernel over the visible slots (attention is order-free: keys carry RoPE)
            out, lse = sparse_decode(q[:, :, 0], self.k, self.v, index, scale=scaling, validate_index=False)
            if self.tail is not None and self.tail.chunks:
                t_out, t_lse = chunk_attention(q[:, :, 0], *self.tail.means(), scale=scaling)
                out, _ = merge_states(out, lse, t_out.to(out.dtype), t_lse)
            return out[:, :, None]
        # Sink slots are scored with the query rotated to its in-cache slot (see streaming_attention).
        q_real = (q_pos - row_start).to(torch.float32)  # (B,)
        shift = (q_real.clamp(max=self.sinks + self.window - 1) - q_real).view(batch, 1, 1)
        q_sink = self.cache.adapter.rotate(q, shift, self.layer_idx)
        qg = q.to(torch.float32).reshape(batch, h_kv, h_q // h_kv, dim)  # (B, H_kv, G, D)
        qs = q_sink.to(torch.float32).reshape(batch, h_kv, h_q // h_kv, dim)
        keys = self.k.to(torch.float32)
        scores = torch.cat(
            [qs @ keys[:, :, : self._ring_at].transpose(-1, -2), qg @ keys[:, :, self._ring_at :].transpose(-1, -2)],
            dim=-1
        ) * scaling  # (B, H_kv, G, slots)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ self.v.to(torch.float32)  # (B, H_kv, G, D)
        return out.reshape(batch, h_q, 1, dim).to(q.dtype)

    def state_tensors(self):
        held = {} if self.prefill is None else self.prefill.state_tensors()
        return {"k": self.k, "v": self.v, "pos": self.pos,
                **({} if self.tail is None else self.tail.state_tensors()), **held}

    def store_again(self, k, v):
        """Store ``k``/``v`` at sequence indices ``seen ..`` without attending: sinks + window of a
        dense prefill, the kept tokens of a cropped forward."""
        self._reserve(k, v, self.seen + k.shape[2])
        self._write(k, v, self._row_start(k.shape[0], k.device))
        self.seen += k.shape[2]

    def batch_select(self, indices):
        for name in ("k", "v", "pos"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, indices.to(t.device)))
        if self.tail is not None:
            self.tail.batch_select(indices)

    def stored_tokens(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def cached_elements(self) -> int:
        if self.k is None:
            return 0
        b, h, t, d = self.k.shape
        return 2 * b * h * t * d


class SlidingWindowLayer(SinkWindowLayer):
    """A layer the *model* limits to a sliding window (``config.layer_types``: ``"sliding_attention"``):
    kept exactly as the model runs it, whatever the policy.

    A query at sequence index ``p`` sees the tokens ``p - window + 1 .. p`` (transformers'
    ``sliding_window_overlay``), during prefill too, and the layer stores the last ``window``
    tokens (`SinkWindowLayer` without sinks). Such a layer's cache is already bounded, so
    :class:`~kvpress.cache.PolicyCache` gives it this class and the policy the full-attention
    layers (``ModelAdapter.policy_layers``).
    """

    def __init__(self, cache, layer_idx: int, window: int):
        super().__init__(cache, layer_idx, sinks=0, window=window)

    def attend(self, q, k_new, v_new, scaling):
        if self.seen or k_new.shape[2] == 1:  # decode, or a later chunk that also reads the ring
            return super().attend(q, k_new, v_new, scaling)
        self._reserve(k_new, v_new, k_new.shape[2])
        # the first forward: SDPA over each query chunk's reachable keys (the model's own kernels)
        out = sliding_causal_attention(q, k_new, v_new, scaling, window=self.window, row_start=self.row_start)
        self._write(k_new, v_new, self._row_start(k_new.shape[0], k_new.device))
        self.seen += k_new.shape[2]
        return out

    def ingest_prefill(self, k, v):
        """Keep the last ``window`` tokens of a prompt whose attention already ran (with the window)."""
        self.store_again(k, v)

    def copy_from(self, other: "SlidingWindowLayer") -> None:
        """This layer's state from ``other`` (the same layer of another cache; tensors cloned)."""
        if other.window != self.window:
            raise ValueError(f"cannot copy a {other.window}-token sliding window into a {self.window}-token one")
        for name in ("k", "v", "pos"):
            t = getattr(other, name)
            setattr(self, name, None if t is None else t.clone())
        self._ring_at = other._ring_at
        if self.k is not None:
            self.lazy_initialization(self.k, self.v)
        self.seen = other.seen
