"""The policy cache: a transformers ``Cache`` whose per-layer objects are the policy's.

transformers calls ``cache.update(k, v, layer_idx)`` with the new post-RoPE keys/values, then the
attention function registered by :func:`kvpress.apply` calls ``layer.attend(q, scaling)``. A
layer therefore sees each step's (q, k, v) together and decides what to store, what to evict,
what to select and how to attend. All per-generation state lives in the layer objects, which
are created fresh for every cache.

Layer contract (subclass :class:`CacheLayer`):

``attend(q, k_new, v_new, scaling) -> out``
    Attention output [B, H_q, T, D] for the new queries over stored + new tokens; the layer
    stores the new tokens (compressing, evicting, offloading as it likes).
``state_tensors() -> dict[str, Tensor]`` / ``host_tensors()``
    Every tensor the layer keeps on the device / in the host tier; ``cache_stats`` sums their
    bytes, and batch reordering (beam search) index-selects them along dim 0.
``cached_elements() -> int``
    How many K/V scalar elements the stored state represents (for bits per element).
``removable() -> int`` / ``remove_latest(n)`` (optional: a layer that sets ``croppable = True``)
    How many of the latest tokens the layer can take back now, and taking them back
    (transformers' ``crop``, which assisted decoding calls after each draft verification). A
    layer that keeps every token truncates; a layer that evicts or compresses as tokens arrive
    records its state before each forward once ``activate_past_recording`` was called
    (:class:`RecordingLayer`) and rolls the latest forward back.
``end_prompt()`` (optional)
    A prompt given in several forwards is complete (:meth:`PolicyCache.prompt`, which
    ``generate(prefill_chunk_size=...)`` opens under ``apply``). While ``cache.prompt_open`` is
    set, every forward continues the prompt; a layer that compresses the whole prompt at once
    (SnapKV's selection, ShadowKV's factorisation) holds it in a :class:`PromptStage` until then.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .buffers import KVBuffer, PromptStage  # noqa: F401  (re-exported: the layers' storage)


class CacheLayer(CacheLayerMixin):
    """Base class of policy cache layers (one per decoder layer)."""

    is_compileable = False
    is_sliding = False
    croppable = False  # transformers reads ``is_croppable``; see ``crop``

    def __init__(self, cache: "PolicyCache", layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.seen = 0  # tokens this layer has processed (left padding included)
        self.record_past = False  # set by activate_past_recording (assisted decoding)
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

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise RuntimeError("kvpress caches are built fresh for each generation; make a new one instead of reset()")

    # ------------------------------------------------------------ rollback (assisted decoding)
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
        n = _tokens_to_remove(tokens_to_remove, self.seen)
        if n and not self.croppable:
            raise ValueError(f"{type(self).__name__} cannot take tokens back")
        limit = self.removable()
        if n > limit:
            raise ValueError(f"cannot remove {n} tokens from layer {self.layer_idx} ({type(self).__name__}): "
                             f"at most {limit} can be taken back now{self._removable_hint()}")
        self.remove_latest(n)

    def removable(self) -> int:
        """How many of the latest tokens :meth:`remove_latest` can take back now."""
        return 0

    def remove_latest(self, n: int) -> None:
        """Take back the latest ``n`` tokens (``0 <= n <= removable()``); ``n = 0`` ends a record."""
        if n:
            raise NotImplementedError

    def record_forward(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Called before each forward's new tokens ``k``/``v`` are stored while ``record_past`` is on."""

    def verifies_as_steps(self, n_new: int) -> bool:
        """Whether a forward of ``n_new`` tokens is assisted decoding's verification: several tokens
        after the prompt while past recording is on. Layers whose multi-token forward would attend
        more than their decode steps do (a dense continuation) run it as steps instead
        (:meth:`attend_as_steps`), so prompt lookup keeps plain decoding's tokens; without past
        recording (a new turn) they keep attending it as a prompt continuation."""
        return n_new > 1 and self.seen > 0 and self.record_past and not self.cache.prompt_open

    @staticmethod
    def attend_as_steps(step, q, k_new, v_new, scaling) -> torch.Tensor:
        """``step`` (an ``attend`` of one token) for each new token in order; outputs concatenated."""
        return torch.cat([step(q[:, :, t:t + 1], k_new[:, :, t:t + 1], v_new[:, :, t:t + 1], scaling)
                          for t in range(k_new.shape[2])], dim=2)

    def end_prompt(self) -> None:
        """The prompt given in several forwards is complete (see :meth:`PolicyCache.prompt`)."""

    def _removable_hint(self) -> str:
        return ""

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


def _tokens_to_remove(tokens_to_remove: int, seen: int) -> int:
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
    """A layer that evicts or compresses as tokens arrive, made croppable by recording.

    While ``record_past`` is on, each forward first saves the layer's state (:meth:`snapshot`,
    tensors cloned) with the forward's new keys / values; ``crop`` then puts that state back and
    stores again the tokens it keeps (:meth:`store_again`), so the result equals a forward that
    never had the removed tokens. Only the latest forward can be taken back. Meant for layers
    whose state is bounded (sinks + window, a fixed budget): a record costs about one copy of it,
    held until the next ``crop`` (transient, like a forward's activations: not in ``cache_stats``).
    """

    croppable = True

    def __init__(self, cache: "PolicyCache", layer_idx: int):
        super().__init__(cache, layer_idx)
        self._record: tuple[int, torch.Tensor, torch.Tensor, dict] | None = None

    def snapshot(self) -> dict:
        """The state a forward may change, as copies (restored by :meth:`restore`)."""
        raise NotImplementedError

    def restore(self, saved: dict) -> None:
        raise NotImplementedError

    def store_again(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` [B, H_kv, n, D] at sequence indices ``seen ..`` as a forward would
        (no attention), and advance ``seen``."""
        raise NotImplementedError

    def record_forward(self, k, v):
        self._record = (self.seen, k, v, self.snapshot())

    def removable(self) -> int:
        return 0 if self._record is None else self._record[1].shape[2]

    def _removable_hint(self) -> str:
        return self._record_hint()

    def remove_latest(self, n: int) -> None:
        record, self._record = self._record, None
        if n == 0 or record is None:
            return
        seen, k, v, saved = record
        self.restore(saved)
        self.seen = seen
        keep = k.shape[2] - n
        if keep:
            self.store_again(k[:, :, :keep], v[:, :, :keep])


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """First real token per row [B] (long) of a 2D left-padded mask; None when nothing is padded.

    Raises ValueError for masks with holes or right padding.
    """
    mask = attention_mask.to(torch.bool)
    row_start = mask.shape[1] - mask.sum(dim=1)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] >= row_start[:, None]
    if not torch.equal(mask, expected):
        raise ValueError("kvpress supports left padding only: each mask row must be 0...0 1...1")
    return row_start.to(torch.long) if bool((row_start > 0).any()) else None


class PolicyCache(Cache):
    """A transformers ``Cache`` holding one policy layer per decoder layer.

    Build it with :func:`kvpress.make_cache` (or let :func:`kvpress.apply` build one per
    ``generate``/forward call). It tracks left padding for the batch from the 2D attention mask
    of the first forward; only left padding is supported.
    """

    def __init__(self, policy, adapter):
        self.policy = policy
        self.adapter = adapter
        self.shared: dict[str, Any] = {}  # cross-layer per-generation state (e.g. TidalDecode)
        self.step_shared: dict[str, Any] = {}  # cross-layer state of the current step; cleared by `crop`
        self._row_start: torch.Tensor | None = None
        self._row_start_by_device: dict[torch.device, torch.Tensor] = {}
        self._min_row_start = self._max_row_start = 0
        self._session = None
        self.prompt_open = False  # forwards continue a prompt given in several pieces (`prompt`)
        from .window_layers import SlidingWindowLayer  # kvpress.window_layers builds on this module

        # layers the model itself slides keep its window exactly; the policy runs the others
        layers = [policy.make_layer(self, i) if adapter.sliding_window(i) is None
                  else SlidingWindowLayer(self, i, adapter.sliding_window(i)) for i in range(adapter.num_layers)]
        super().__init__(layers=layers)

    # ------------------------------------------------------------ transformers' cache API
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self._session is None or not self._session.active:
            raise RuntimeError(
                "this kvpress cache is used outside `kvpress.apply(model, policy)`: its layers only attend "
                "through kvpress' attention function, so run the model inside the `with` block"
            )
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)
        if self._row_start is not None:
            self._set_row_start(self._row_start.index_select(0, beam_idx.to(self._row_start.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    @property
    def is_croppable(self) -> bool:
        return all(layer.is_croppable for layer in self.layers)

    def activate_past_recording(self) -> None:
        """transformers calls this before assisted decoding: every layer must be able to take back
        its latest forward (``crop``). Policies that cannot raise here, before any work is done."""
        if not self.is_croppable:
            from .registry import list_policies, policy_class

            can = [name for name in list_policies() if policy_class(name).croppable]
            raise ValueError(
                f"policy {self.policy.name!r} cannot take back the tokens of a forward (transformers' `crop`), "
                f"which assisted decoding (`assistant_model=...`, `prompt_lookup_num_tokens=...`) does after "
                f"each draft verification; policies that can: {', '.join(can)}"
            )
        for layer in self.layers:
            layer.activate_past_recording()

    def end_past_recording(self) -> None:
        """Stop recording and drop the latest forward's record, on every layer that records.

        transformers' assisted decoding turns recording on and leaves it on when ``generate``
        returns the cache; :func:`kvpress.apply`'s ``generate`` ends it then, so a later turn on
        the cache is a new turn (not a verification) and no forward copies the state any more.
        """
        for layer in self.layers:
            if layer.record_past:
                layer.remove_latest(0)
                layer.record_past = False
        self.step_shared.clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the latest tokens of every layer (see :meth:`CacheLayer.crop`)."""
        n = _tokens_to_remove(tokens_to_remove, self.get_seq_length())
        short = next((layer for layer in self.layers if layer.removable() < n), None)
        if short is not None:  # checked on every layer first: a refused crop changes nothing
            short.crop(-n)  # raises, naming the layer and what it can take back
        new_len = self.get_seq_length() - n
        if n and self._row_start is not None and new_len <= self._max_row_start:
            raise ValueError(f"cannot crop to {new_len} tokens: a row's prompt starts at index {self._max_row_start} "
                             "(left padding); keep at least one real token per row")
        for layer in self.layers:
            layer.crop(-n)
        self.step_shared.clear()

    # ------------------------------------------------------------ a prompt in several forwards
    @contextlib.contextmanager
    def prompt(self) -> Iterator["PolicyCache"]:
        """Feed one prompt in several forwards (chunked prefill) inside this block::

            with cache.prompt():
                for chunk in input_ids.split(1024, dim=1):
                    model(chunk, past_key_values=cache, use_cache=True)

        The cache then holds what one forward of the whole prompt would have left: policies
        that compress the prompt as a whole (``snapkv``'s selection by the last queries,
        ``shadowkv``'s factorisation) wait for the block's end, holding the prompt's K/V until
        then; the others store each piece as it comes (the quantizers' later pieces read the
        earlier ones quantized: ``Policy.chunked_prompt_exact``). ``generate(..., prefill_chunk_size=N)``
        under :func:`kvpress.apply` opens this block itself. On a cache that already holds tokens
        (a new turn) the pieces continue it as one forward of them would: the layers that
        compress only the first prompt as a whole take them as they take any later forward, and
        ``duo``'s streaming heads continue the chunk a piece ends in. Not while the cache records
        its past; the prompt is closed on normal exit only.
        """
        self.begin_prompt()
        yield self
        self.end_prompt()

    def prompt_refusal(self) -> str | None:
        """Why a prompt in several forwards cannot be opened now, or None when it can."""
        if self.prompt_open:
            return "a prompt is already open on this cache"
        if any(layer.record_past for layer in self.layers):
            return "a prompt in several forwards cannot be opened while the cache records its past (assisted decoding)"
        return None

    def begin_prompt(self) -> None:
        """Open a prompt given in several forwards (see :meth:`prompt`)."""
        refusal = self.prompt_refusal()
        if refusal is not None:
            raise ValueError(refusal)
        self.prompt_open = True

    def end_prompt(self) -> None:
        """Close the open prompt: layers that wait for the whole prompt compress it now."""
        if not self.prompt_open:
            raise ValueError("no prompt is open on this cache (begin_prompt)")
        self.prompt_open = False
        for layer in self.layers:
            layer.end_prompt()
        self.step_shared.clear()

    def reset(self) -> None:
        raise RuntimeError("kvpress caches are built fresh for each generation; make a new one instead of reset()")

    # ------------------------------------------------------------ padding bookkeeping
    def begin_forward(self, attention_mask: torch.Tensor | None, batch: int, new_tokens: int) -> None:
        """Record the batch's left padding (first forward) and check later masks agree."""
        seen = self.get_seq_length()
        if attention_mask is None:
            if self._row_start is None:
                self._set_row_start(None)
            return
        if attention_mask.dim() != 2:
            raise ValueError(
                f"kvpress needs a 2D attention mask [batch, tokens] (left padding); got shape {tuple(attention_mask.shape)}"
            )
        if attention_mask.shape != (batch, seen + new_tokens):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({batch}, {seen + new_tokens}) "
                f"= (batch, cached tokens + new tokens)"
            )
        mask = attention_mask.to(torch.bool)
        if seen == 0:
            self._set_row_start(left_padding(mask))
        elif not bool(mask[:, seen:].all()):
            if not self.prompt_open:
                raise ValueError("new tokens after the prompt must not be padding (left padding only)")
            self._extend_padding(left_padding(mask), seen)

    def _extend_padding(self, row_start: torch.Tensor, seen: int) -> None:
        """A later piece of an open prompt continues the padding of rows that were all padding so
        far (a row padded by more than the pieces before it): their first real token moves on.
        The layers saw those rows' ``seen`` tokens as padding either way, and nothing at or after
        a row's first real token has arrived yet, so no stored state depends on the old value."""
        old = self._row_start if self._row_start is not None else torch.zeros_like(row_start)
        moved = row_start != old.to(row_start.device)
        if not bool((old.to(row_start.device)[moved] == seen).all()):
            raise ValueError("this piece's attention mask disagrees with the earlier pieces' left padding")
        self._set_row_start(row_start)

    def _set_row_start(self, row_start: torch.Tensor | None) -> None:
        self._row_start = None if row_start is None else row_start.to(torch.long)
        self._row_start_by_device = {}
        self._min_row_start = 0 if row_start is None else int(self._row_start.min())
        self._max_row_start = 0 if row_start is None else int(self._row_start.max())

    def set_left_padding(self, row_start: torch.Tensor | None) -> None:
        """Declare each row's first real token [B] (long) — for callers that build caches by hand."""
        self._set_row_start(row_start)

    @property
    def min_row_start(self) -> int:
        """Smallest first-real-token index over the rows (0 without padding); no device sync."""
        return self._min_row_start

    @property
    def max_row_start(self) -> int:
        """Largest first-real-token index over the rows (0 without padding); no device sync."""
        return self._max_row_start

    def row_start_on(self, device) -> torch.Tensor | None:
        """First real token of each row [B] (long) on ``device``; None when nothing is padded."""
        if self._row_start is None:
            return None
        key = torch.device(device)
        if key not in self._row_start_by_device:
            self._row_start_by_device[key] = self._row_start.to(key)
        return self._row_start_by_device[key]

    def __repr__(self) -> str:
        return f"PolicyCache(policy={self.policy.name!r}, layers={len(self.layers)}, seen={self.get_seq_length()})"
