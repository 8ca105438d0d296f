"""`PolicyCache`: the transformers ``Cache`` whose per-layer objects are a policy's layers.

The layer contract is documented in ``kvpress.cache``, which re-exports ``PolicyCache`` and
``left_padding`` from here with the layer base classes of ``kvpress.cache_layer``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from transformers.cache_utils import Cache

from .buffers import PromptStage
from .cache_layer import crop_count
from .plan import ForwardKind, ForwardPlan, classify, static_address
from .window_layers import SlidingWindowLayer

QUERY_TAIL = 64  # prompt queries `dense_prefill` keeps per layer (SnapKV's observation window is 32 by default)

PLAN_STEP = 128  # a planned capacity is a multiple of this (the slack is under PLAN_STEP tokens)


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
        self.plan: ForwardPlan | None = None  # the forward in flight, decided once in `begin_forward`
        self.capacity: int | None = None  # tokens to preallocate for (`plan_capacity`), None: grow in buckets
        self._start: torch.Tensor | None = None  # device copies of the plan's positions, advanced in place
        self.defer_counts = False  # static steps leave host counts to `count_deferred` (a compiled caller)
        self._static_marked = False  # `before_static_step` ran since the last eager forward
        self._dynamic_sources: str | None = None
        # `dense_prefill`'s: {layer index: (last QUERY_TAIL queries, scaling)} of the prompt forward
        self.query_tails: dict[int, tuple[torch.Tensor, float]] | None = None
        self._end: torch.Tensor | None = None

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

    def attend(self, layer, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scaling: float) -> torch.Tensor:
        """Run ``layer.attend`` for the forward in flight (the attention function calls this with the
        layer's pending keys / values; a layer made of layers calls it for its parts).

        A verification (``ForwardKind.VERIFY``) of a layer that declares ``verify_as_steps`` runs as
        one-token decode steps: the layer sees each token alone under a DECODE plan of its own
        (``plan.step`` its index in the forward), so it only ever handles the kinds it knows and
        assisted decoding keeps plain decoding's tokens.
        """
        plan = self.plan
        if self.query_tails is not None and plan is not None and plan.kind is ForwardKind.PROMPT \
                and not isinstance(layer, SlidingWindowLayer):  # a copy: a view would keep all of q alive
            self.query_tails[layer.layer_idx] = (q[:, :, -QUERY_TAIL:].clone(), scaling)
        if plan is not None and plan.kind is ForwardKind.PIECE and layer.stages_prompt:
            return self._attend_piece(layer, q, k_new, v_new, scaling)
        if plan is None or plan.kind is not ForwardKind.VERIFY or not layer.verify_as_steps:
            return layer.attend(q, k_new, v_new, scaling)
        outs = []
        try:
            for t, step in enumerate(plan.decode_steps()):
                self.plan = step
                outs.append(layer.attend(q[:, :, t:t + 1], k_new[:, :, t:t + 1], v_new[:, :, t:t + 1], scaling))
        finally:
            self.plan = plan
        return torch.cat(outs, dim=2)

    @staticmethod
    def _attend_piece(layer, q, k_new, v_new, scaling: float) -> torch.Tensor:
        """A piece of an open prompt for a layer that compresses the prompt as a whole
        (``stages_prompt``): held in the layer's ``prompt_stage`` (with its latest ``prompt_queries``
        queries) and attended by ``layer.attend_staged``; :meth:`end_prompt` hands the stage over."""
        stage = layer.prompt_stage
        if stage is None:
            stage = layer.prompt_stage = PromptStage(keep_queries=layer.prompt_queries)
        q_start = stage.add(q, k_new, v_new, scaling)
        layer.seen += k_new.shape[2]
        return layer.attend_staged(q, stage, q_start, scaling)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        """True when every layer's decode step is static (``CacheLayer.static_decode``): fixed shapes,
        positions read from device tensors, no host synchronisation; transformers' ``generate``
        then may run its compiled decode (on CUDA by default)."""
        return all(layer.static_decode for layer in self.layers)

    def plan_capacity(self, total_tokens: int) -> int:
        """Preallocate for ``total_tokens`` (prompt + new tokens; ``generate`` under ``apply`` calls
        this with its ``max_length``), rounded up to a multiple of 128. Layers with static decode
        size their buffers to it when they first store, so decode steps write in place and keep one
        shape; a cache that outgrows it grows to the next bucket (:func:`kvpress.plan.capacity_bucket`)."""
        if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 1:
            raise ValueError(f"plan_capacity takes a positive number of tokens, got {total_tokens!r}")
        self.capacity = -(-total_tokens // PLAN_STEP) * PLAN_STEP
        return self.capacity

    def sync_positions(self, device: torch.device | str | None = None) -> None:
        """Set the device positions from the host count (after anything that changes the cache
        outside a forward: ``crop``, a dense prefill handed over, a prompt closed); ``device``
        creates them if no forward did yet."""
        if self._end is None and device is not None:
            self._make_positions(device)
        if self._end is not None:
            seen = self.get_seq_length()
            self._start.fill_(seen)
            self._end.fill_(seen)

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
        """Take back the latest tokens of every layer (see :meth:`kvpress.cache.CacheLayer.crop`)."""
        n = crop_count(tokens_to_remove, self.get_seq_length())
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
        self.sync_positions()

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
            stage, layer.prompt_stage = layer.prompt_stage, None
            if stage is not None:
                layer.take_prompt(stage)
            layer.end_prompt()
        self.step_shared.clear()
        self.sync_positions()

    def reset(self) -> None:
        raise RuntimeError("kvpress caches are built fresh for each generation; make a new one instead of reset()")

    # ------------------------------------------------------------ padding bookkeeping
    def begin_forward(self, attention_mask: torch.Tensor | None, batch: int, new_tokens: int,
                      device: torch.device | str | None = None) -> ForwardPlan:
        """Plan the forward about to run (:attr:`plan`): classify it once for every layer, record the
        batch's left padding (first forward) and check that later masks agree.

        A decode step (one token per row after the prompt) reads nothing on the host: its mask is
        checked for shape only, and its device positions advance in place, so the step can be
        captured as one graph.
        """
        if not torch.compiler.is_compiling():
            self._static_marked = False  # an eager forward may replace state tensors
        seen = self.get_seq_length()
        recording = new_tokens > 1 and seen > 0 and any(layer.record_past for layer in self.layers)
        kind = classify(seen=seen, new_tokens=new_tokens, prompt_open=self.prompt_open, recording=recording)
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"kvpress needs a 2D attention mask [batch, tokens] (left padding); got shape "
                    f"{tuple(attention_mask.shape)}")
            if attention_mask.shape != (batch, seen + new_tokens):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({batch}, {seen + new_tokens}) "
                    f"= (batch, cached tokens + new tokens)")
            if kind is not ForwardKind.DECODE:
                mask = attention_mask.to(torch.bool)
                if seen == 0:
                    self._set_row_start(left_padding(mask))
                elif not bool(mask[:, seen:].all()):
                    if not self.prompt_open:
                        raise ValueError("new tokens after the prompt must not be padding (left padding only)")
                    self._extend_padding(left_padding(mask), seen)
        elif self._row_start is None:
            self._set_row_start(None)
        if device is None:
            device = attention_mask.device if attention_mask is not None else "cpu"
        static = kind is ForwardKind.DECODE and torch.compiler.is_compiling()
        if self._end is None:
            self._make_positions(device)
        if static:  # in place from the previous forward's end: no host integer enters the graph
            self._start.copy_(self._end)
            self._end.add_(new_tokens)
        else:
            self._start.fill_(seen)
            self._end.fill_(seen + new_tokens)
        self.plan = ForwardPlan(kind, new_tokens, self._start, self._end, static=static,
                                defer_counts=static and self.defer_counts)
        return self.plan

    def _make_positions(self, device) -> None:
        self._start = torch.zeros(1, dtype=torch.long, device=device)
        self._end = torch.zeros(1, dtype=torch.long, device=device)
        static_address(self._start, self._end)

    def dynamic_sources(self) -> str:
        """The sources (dynamo's names, comma-separated) of every layer's :attr:`CacheLayer.step_ints`
        as a compiled ``generate`` call passes the cache (``cache`` or ``past_key_values``), for
        ``torch.compiler.config.dynamic_sources``; made again by :meth:`before_static_step`."""
        if self._dynamic_sources is None:
            self._dynamic_sources = ",".join(
                f"L['kwargs']['{arg}'].layers[{i}].{name}" for arg in ("cache", "past_key_values")
                for i, layer in enumerate(self.layers) for name in layer.step_int_paths())
        return self._dynamic_sources

    def before_static_step(self) -> None:
        """Every layer's :meth:`CacheLayer.before_static_step`, once after each eager forward (the
        caller of a compiled decode step runs this before it)."""
        if self._static_marked:
            return
        for layer in self.layers:
            layer.before_static_step()
        self._dynamic_sources = None  # (an eager forward may have split a layer by rows)
        self._static_marked = True

    def count_deferred(self) -> None:
        """Count the token each layer's static step stored with its host counts deferred (the caller
        of a compiled decode step runs this after it; see ``ForwardPlan.defer_counts``)."""
        for layer in self.layers:
            if layer.counts_deferred:
                layer.counts_deferred = False
                layer.count_tokens(1)

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
