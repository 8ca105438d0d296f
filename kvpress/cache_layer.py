"""The base of every policy cache layer: :class:`CacheLayer` (the contract, the rollback
strategies the core runs for a layer that declares one) and :class:`RecordingLayer`.

Documented in ``kvpress.cache``, which re-exports these names with the cache itself.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .plan import static_address


ROLLBACKS = (None, "truncate", "record")  # the ways a layer can declare to take tokens back (`CacheLayer.rollback`)


class CacheLayer(CacheLayerMixin):
    """Base class of policy cache layers (one per decoder layer)."""

    is_compileable = False
    is_sliding = False
    # How the layer takes tokens back (``crop``), run by this class: None (it cannot); "truncate" (it
    # keeps every token: the objects named in ``rollback_state``, each with ``length`` / ``truncate``,
    # lose the latest tokens and :meth:`after_truncate` rebuilds derived state); "record" (bounded
    # state: while ``record_past`` is on, the attributes named in ``rollback_state`` are copied before
    # each forward (:func:`snapshot_value`); a crop puts them back and hands the kept tokens to
    # :meth:`store_again`). ``seen`` is always part of the state. A truncating layer that keeps only
    # its latest tokens as they came (the quantizers' full-precision window) says how many it can
    # take back in :meth:`truncatable`; every layer hears in :meth:`end_record` that a crop ended
    # the latest forward's record (work deferred while recording, e.g. a flush, runs there).
    rollback: str | None = None
    rollback_state: tuple[str, ...] = ()
    # ("record") objects that keep the layer's latest tokens whole, each with ``length`` / ``truncate``
    # (ShadowKV's generated tokens): a crop may then reach past the recorded forward, the rest of it
    # truncated from them as ``"truncate"`` does (:meth:`after_truncate` follows)
    rollback_truncate: tuple[str, ...] = ()
    # True when the layer's decode step is static (``plan.static``): it writes and attends at the plan's
    # device positions over buffers sized in advance, so ``torch.compile`` captures it as one graph
    static_decode = False
    # True when a verification (``ForwardKind.VERIFY``: several tokens while the cache records its past)
    # must attend as one-token decode steps would, because the layer's multi-token forward sees more
    # than its decode steps do (a dense continuation). The core then hands the layer each token under
    # a DECODE plan of its own (``PolicyCache.attend``), so prompt lookup keeps plain greedy's tokens
    verify_as_steps = False
    # True when the layer compresses a prompt as a whole: while a prompt given in several forwards is
    # open (``ForwardKind.PIECE``) the core holds its pieces in ``prompt_stage`` (a PromptStage keeping
    # the latest ``prompt_queries`` queries), attends each through :meth:`attend_staged` and hands the
    # whole prompt to :meth:`take_prompt` when it ends
    stages_prompt = False
    prompt_queries = 0
    # host integers (attribute paths) that advance every decode step: a compiled step reads them as
    # symbols from its first trace (`PolicyCache.dynamic_sources`), so it compiles one graph, not a
    # specialised one first and a general one at the second step
    step_ints: tuple[str, ...] = ("seen",)

    def __init__(self, cache, layer_idx: int):  # cache: the PolicyCache of the generation
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.seen = 0  # tokens this layer has processed (left padding included)
        self.record_past = False  # set by activate_past_recording (assisted decoding)
        self.counts_deferred = False  # a static step stored a token its caller still has to count
        self._record: tuple[int, torch.Tensor, torch.Tensor, dict] | None = None  # the latest recorded forward
        self._whole_before = 0  # (``rollback_truncate``) tokens kept whole before the recorded forward
        self.prompt_stage = None  # an open prompt's pieces, held by the core (``stages_prompt``)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.batch_size = 0

    # ------------------------------------------------------------ transformers' layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size = key_states.shape[0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Receive the step's new post-RoPE keys/values [B, H_kv, T, D]; stored in :meth:`attend`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None:
            raise RuntimeError(
                "a kvpress cache layer received two updates without an attention call in between: "
                "run the model inside `with kvpress.apply(model, policy):`"
            )
        self._pending = (key_states, value_states)
        if self.record_past:
            self.record_forward(key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def count_tokens(self, n: int) -> None:
        """Advance the host counts by ``n`` stored tokens (a static step's, maybe deferred: see
        :attr:`kvpress.plan.ForwardPlan.defer_counts`)."""
        self.seen += n

    def step_int_paths(self) -> tuple[str, ...]:
        """:attr:`step_ints` of this layer and of the layers it delegates to (attribute paths)."""
        return self.step_ints

    def before_static_step(self) -> None:
        """Called outside a compiled decode step, before it (after an eager forward): the state a
        static step updates in place is tagged as living at a fixed address (`static_address`), else
        a CUDA graph of the step is skipped (inductor: "mutated inputs"); eager forwards may have
        replaced those tensors. A layer that builds its fixed-shape state lazily builds it here
        first, since state made while dynamo traces would be part of the graph (after a shared
        prefill, ``generate``'s first decode step runs eagerly and the next compiled)."""
        static_address(*(t for t in self.state_tensors().values() if isinstance(t, torch.Tensor)))

    def count_static_step(self) -> None:
        """A static decode step stored one token: count it now, or mark it for the caller."""
        if self.cache.plan.defer_counts:
            self.counts_deferred = True
        else:
            self.count_tokens(1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise RuntimeError("kvpress caches are built fresh for each generation; make a new one instead of reset()")

    # ------------------------------------------------------------ rollback (assisted decoding)
    @property
    def croppable(self) -> bool:
        """Whether the layer can take tokens back (a ``rollback`` strategy; a layer with its own
        ``removable`` / ``remove_latest`` sets it as a class attribute)."""
        return self.rollback is not None

    @property
    def is_croppable(self) -> bool:
        return self.croppable

    def activate_past_recording(self) -> None:
        """From now on record enough before each forward to take its tokens back (``crop``)."""
        if not self.croppable:
            raise ValueError(f"{type(self).__name__} cannot take tokens back")
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the latest tokens: ``-n`` removes ``n``; ``0`` removes none (it ends the
        latest forward's record); a positive value is the length to keep (transformers' older form).

        What the layer keeps afterwards equals what it would keep had those tokens never come
        (left padding, sinks, windows, page and chunk statistics included). Raises ValueError when
        the layer cannot remove that many (:meth:`removable`).
        """
        n = crop_count(tokens_to_remove, self.seen)
        if n and not self.croppable:
            raise ValueError(f"{type(self).__name__} cannot take tokens back")
        limit = self.removable()
        if n > limit:
            raise ValueError(f"cannot remove {n} tokens from layer {self.layer_idx} ({type(self).__name__}): "
                             f"at most {limit} can be taken back now{self._removable_hint()}")
        self.remove_latest(n)

    def removable(self) -> int:
        """How many of the latest tokens :meth:`remove_latest` can take back now: those the layer
        still holds as they came (``rollback = "truncate"``, :meth:`truncatable`), the recorded
        forward's (``"record"``), or none."""
        if self.rollback not in ROLLBACKS:
            raise ValueError(f"{type(self).__name__}.rollback is {self.rollback!r}; allowed: "
                             f"{', '.join(map(repr, ROLLBACKS))}")
        if self.rollback == "truncate":
            return self.truncatable()
        if self.rollback == "record":
            if self._record is None:
                return self._kept_whole()
            return self._record[1].shape[2] + self._whole_before
        return 0

    def _kept_whole(self) -> int:
        """(``rollback_truncate``) How many of the latest tokens the named objects keep whole."""
        parts = [getattr(self, name) for name in self.rollback_truncate]
        return min((part.length for part in parts if part is not None), default=0)

    def _truncate(self, names: tuple[str, ...], n: int) -> None:
        for name in names:
            part = getattr(self, name)
            if part is not None:
                part.truncate(part.length - n)
        self.seen -= n
        self.after_truncate()

    def remove_latest(self, n: int) -> None:
        """Take back the latest ``n`` tokens (``0 <= n <= removable()``), then :meth:`end_record`;
        ``n = 0`` only ends the latest forward's record."""
        if self.rollback == "truncate":
            if n:
                self._truncate(self.rollback_state, n)
            self.end_record()
            return
        if self.rollback == "record":
            record, self._record = self._record, None
            if n and record is not None:
                _seen, k, v, saved = record
                self.restore(saved)
                keep = k.shape[2] - n
                if keep > 0:
                    self.store_again(k[:, :, :keep], v[:, :, :keep])
                n = max(0, -keep)
            if n:  # past the recorded forward (``rollback_truncate``)
                self._truncate(self.rollback_truncate, n)
            self.end_record()
            return
        if n:
            raise NotImplementedError

    def truncatable(self) -> int:
        """(``rollback = "truncate"``) How many of the latest tokens the layer can truncate now: every
        token (``seen``), unless it compresses older tokens and returns those it still holds as they
        came (the quantizers: the latest recorded forward's, whose flush waits for the crop)."""
        return self.seen

    def end_record(self) -> None:
        """A crop (of 0 tokens or more) ended the latest forward's record, after the strategy took
        its tokens back (``seen`` already cut): a layer that defers work while recording runs it now."""

    def record_forward(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Called with a forward's new tokens ``k``/``v`` before they are stored, while ``record_past``
        is on: a ``"record"`` layer saves its state (:meth:`snapshot`) with them."""
        if self.rollback == "record":
            self._record = (self.seen, k, v, self.snapshot())
            self._whole_before = self._kept_whole()

    def snapshot(self) -> dict:
        """The state a forward may change (``seen`` and ``rollback_state``), as copies."""
        return {name: snapshot_value(getattr(self, name)) for name in ("seen", *self.rollback_state)}

    def restore(self, saved: dict) -> None:
        """Put back what :meth:`snapshot` saved."""
        for name, value in saved.items():
            setattr(self, name, restore_value(getattr(self, name), value))

    def store_again(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """(``rollback = "record"``) Store ``k``/``v`` [B, H_kv, n, D] at sequence indices ``seen ..``
        as a forward would (no attention), and advance ``seen``: the kept tokens of a cropped forward."""
        raise NotImplementedError(f"{type(self).__name__} records its state but cannot store tokens again")

    def after_truncate(self) -> None:
        """(``rollback = "truncate"``) The stored tokens lost their latest ones: bring derived state in
        line with them (page bounds, chunk sums, labels)."""

    def verifies_as_steps(self, n_new: int) -> bool:
        """Whether a forward of ``n_new`` tokens is assisted decoding's verification (several tokens
        after the prompt while past recording is on). For layers that run a verification themselves;
        a layer whose verification equals decode steps declares ``verify_as_steps`` instead."""
        return n_new > 1 and self.seen > 0 and self.record_past and not self.cache.prompt_open

    @staticmethod
    def attend_as_steps(step, q, k_new, v_new, scaling) -> torch.Tensor:
        """``step`` (an ``attend`` of one token) for each new token in order; outputs concatenated.
        (The plan stays the forward's: ``verify_as_steps`` layers get DECODE plans from the core.)"""
        return torch.cat([step(q[:, :, t:t + 1], k_new[:, :, t:t + 1], v_new[:, :, t:t + 1], scaling)
                          for t in range(k_new.shape[2])], dim=2)

    def attend_staged(self, q: torch.Tensor, stage, q_start: int, scaling: float) -> torch.Tensor:
        """(``stages_prompt``) Attention of a piece's queries ``q`` [B, H_q, T, D], at stage indices
        ``q_start ..``, once the core staged its keys / values: causal attention over the stage."""
        from .attention import dense_causal_attention  # kvpress.attention imports the kernels

        return dense_causal_attention(q, stage.buffer.keys, stage.buffer.values, scaling, q_start=q_start,
                                      row_start=self.row_start)

    def take_prompt(self, stage) -> None:
        """(``stages_prompt``) The open prompt ended: compress the whole of it, ``stage`` (a
        :class:`~kvpress.buffers.PromptStage`: keys, values, latest queries, scaling)."""
        raise NotImplementedError(f"{type(self).__name__} stages a prompt but does not take it")

    def end_prompt(self) -> None:
        """The prompt given in several forwards is complete (see :meth:`PolicyCache.prompt`)."""

    def _removable_hint(self) -> str:
        limited = self.rollback == "record" or (self.rollback == "truncate" and self.truncatable() < self.seen)
        return self._record_hint() if limited else ""

    def _record_hint(self) -> str:
        """For layers that take back only a recorded forward: what to do when nothing is recorded."""
        return "" if self.record_past else " (call activate_past_recording() before the forward to take it back)"

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select(beam_idx)

    def batch_select(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (dim 0) of every state tensor (beam search, batch pruning)."""
        for name, tensor in {**self.state_tensors(), **self.host_tensors()}.items():
            if tensor is not None and tensor.dim() > 0:
                setattr(self, name, tensor.index_select(0, indices.to(tensor.device)))

    # ------------------------------------------------------------ policy API
    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pending is None:
            raise RuntimeError("kvpress attention ran without a cache update for this layer")
        k, v = self._pending
        self._pending = None
        return k, v

    def attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scaling: float) -> torch.Tensor:
        raise NotImplementedError

    def ingest_prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a whole prompt's post-RoPE K/V [B, H_kv, T, D] whose attention already ran densely.

        Required for policies with ``full_prefill = True``: a runner prefills a context once with
        ``full`` and hands each such policy a copy, which must end in the same state as running
        that policy's own one-shot prefill.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot ingest a dense prefill")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Device-resident state, by attribute name."""
        return {}

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """Host-tier state (offloaded), by attribute name."""
        return {}

    def cached_elements(self) -> int:
        raise NotImplementedError

    def stored_tokens(self) -> int:
        """Tokens per row and KV head this layer keeps (max over heads/rows)."""
        raise NotImplementedError

    @property
    def row_start(self) -> torch.Tensor | None:
        return self.cache.row_start_on(self.device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer={self.layer_idx}, seen={self.seen})"


# How many tokens of a recorded prompt forward the layers that need the prompt's queries to store
# it (snapkv's observation window, zipcache's probes) keep enough of them to take back.
PROMPT_CROP_TOKENS = 64


def crop_count(tokens_to_remove: int, seen: int) -> int:
    """transformers' ``crop`` argument as a count: ``-n`` -> ``n``; a positive value is a length to keep.

    transformers 5.17's assisted decoding passes a one-element integer tensor."""
    if torch.is_tensor(tokens_to_remove) and tokens_to_remove.numel() == 1 and not tokens_to_remove.is_floating_point():
        tokens_to_remove = int(tokens_to_remove)
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
        raise TypeError(f"crop takes an int (-n removes n tokens), got {tokens_to_remove!r}")
    if tokens_to_remove > 0:
        return max(0, seen - tokens_to_remove)
    return -tokens_to_remove


class RecordingLayer(CacheLayer):
    """A layer croppable by recording (``rollback = "record"``): it names its bounded state in
    ``rollback_state`` (or overrides :meth:`snapshot` / :meth:`restore`) and implements
    :meth:`store_again`. Only the latest forward can be taken back; a record costs about one copy
    of the state, held until the next ``crop`` (transient, like a forward's activations: not in
    ``cache_stats``)."""

    rollback = "record"


def snapshot_value(value):
    """A copy of one piece of recorded state: tensors are cloned, objects with a ``snapshot()``
    method (a :class:`KVBuffer`: its length; a ``ChunkTail``; a layer inside a layer) save
    themselves, plain values are kept."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if hasattr(value, "snapshot"):
        return _Saved(value.snapshot())
    return value


def restore_value(current, saved):
    """The value an attribute takes back from :func:`snapshot_value`'s ``saved`` (an object that
    saved itself restores itself in place)."""
    if isinstance(saved, _Saved):
        current.restore(saved.state)
        return current
    return saved


class _Saved:
    """What an object's own ``snapshot()`` returned (restored through its ``restore``)."""

    __slots__ = ("state",)

    def __init__(self, state):
        self.state = state
