"""The cache layer of ``shadowkv`` (`kvpress.policies.shadowkv`): it holds the state and routes each
forward -- a prompt to `ingest`, a new turn to `attend_turn` (``_shadowkv_prefill``), an eager
decode step to `decode` (``_shadowkv_step``), a static one to its `StaticStore`
(``_shadowkv_static``) -- and takes tokens back (crop)."""

from __future__ import annotations

import torch

from kvpress.attention import dense_causal_attention
from kvpress.cache import CacheLayer, PromptStage

from ._shadowkv_prefill import attend_turn, ingest, query_squares
from ._shadowkv_static import StaticStore
from ._shadowkv_step import decode
from ._shadowkv_store import TransferCounters


class ShadowKVLayer(CacheLayer):
    """Per-layer ShadowKV state (see :class:`ShadowKVPolicy`).

    Token axis of the prompt state: the prompt of ``T`` tokens is padded at the front by
    ``shift = (-T) % chunk_size`` so chunks align with the end of the prompt; padded token
    ``t`` is sequence index ``t - shift``, and row ``b``'s RoPE position is ``t - rope_start[b]``.
    Aligning on the end (not on index 0) makes a left-padded row chunk exactly like the same
    prompt run alone.

    Device state: ``landmarks`` (B, H_kv, C, D), ``selectable`` bool (B, H_kv, C), ``factor``
    (B, T_pad, R), ``basis`` (B, R, H_kv, D), exact tokens ``exact_k``/``exact_v`` (B, H_kv, E, D)
    with ``exact_idx``/``exact_cnt``, generated tokens ``gen_k``/``gen_v`` (B, H_kv, cap, D), and
    the previous step's fetched chunks ``sel_idx``/``sel_values`` (``sel_keys``: their exact keys
    with ``fetch_keys``, their residual rows with ``residual_bits``), and with ``tail_chunk`` the
    value sums per group ``tail_v_sum`` (B, H_kv, N, D) fp32. Host tier: ``v_host`` (B, H_kv, C,
    chunk_size, D), with ``fetch_keys`` the exact post-RoPE keys ``k_host`` in the same layout,
    with ``residual_bits`` the quantized residual of the rebuilt keys ``kr_host`` (B, H_kv, C,
    chunk_size, W; `residual_table`). Transfers: ``counters`` (:class:`TransferCounters`).
    While a `StaticStore` holds the state (``_static``), the attributes in ``_MOVED`` are None.
    """

    croppable = True  # generated tokens; the prompt's own forward by ingesting what it keeps again
    static_decode = True  # `StaticStore`, built after a prompt or a turn when the capacity is planned
    verify_as_steps = True  # assisted decoding's verification attends as decode steps (the core splits it)
    _STATE = ("landmarks", "selectable", "factor", "basis", "rope_start", "row_exact", "has_basis", "exact_k",
              "exact_v", "exact_idx", "exact_cnt", "gen_k", "gen_v", "sel_idx", "sel_values", "sel_keys",
              "tail_v_sum", "key_weight")
    # what a fold replaces (`fold_generated`), held while a recorded forward may still be cropped
    _FOLDED = _STATE + ("v_host", "k_host", "kr_host", "gen_len", "exact_max", "max_selectable", "exact_mode",
                        "n_chunks", "_exact_cnt_cpu", "_sel_cnt_cpu")

    def __init__(self, cache, layer_idx: int, policy):
        super().__init__(cache, layer_idx)
        self.policy = policy
        self.max_attended = 0  # most tokens one KV head attended in a decode step
        self.counters = TransferCounters()
        self._inv_freq = None
        self._prompt_record = None  # (k, v) of the prompt's forward while it can still be cropped
        self._prompt_qsq = None  # with svd="query": that forward's query squares (`query_squares`)
        self._stage_qsq = None  # with svd="query": the staged prompt's query squares
        self._stage = None  # a prompt arriving in several forwards (`PolicyCache.prompt`)
        self._fold_undo: list[tuple[int, dict]] = []  # folds of the recorded forward: (seen before, state)
        self._clear()

    def _clear(self) -> None:
        """No prompt, no generated tokens (a new layer, or a prompt forward taken back)."""
        for name in self._STATE:
            setattr(self, name, None)
        self.v_host = self.k_host = self.kr_host = None
        self.gen_len = 0
        self.exact_max = 0  # most exact tokens of any (row, KV head)
        self.max_selectable = 0
        self.exact_mode = False
        self.n_chunks = 0  # chunks of the store's token axis: the padded prompt's, then folded ones
        self._exact_cnt_cpu = self._sel_cnt_cpu = None
        self._static = None  # the state at fixed shapes while static steps may come (`StaticStore`)
        self.seen = 0

    # ------------------------------------------------------------------ prefill
    def attend(self, q, k_new, v_new, scaling):
        plan = self.cache.plan
        # (a step recording its past for a crop takes the eager path: only that one can undo its fold)
        if plan is not None and plan.static and self._static is not None and not self.record_past:
            return self._static.step(self, q, k_new, v_new, scaling)
        self._leave_static()
        if self.cache.prompt_open and (self.seen == 0 or self._stage is not None):  # factorised at its end
            if self._stage is None:
                self._stage = PromptStage()
            self.seen += k_new.shape[2]
            q_sq = query_squares(self.policy, q, k_new.shape[1])
            if q_sq is not None:
                self._stage_qsq = q_sq if self._stage_qsq is None else torch.cat([self._stage_qsq, q_sq], dim=2)
            return self._stage.attend(q, k_new, v_new, scaling, self.row_start)
        if self.seen == 0:
            out = dense_causal_attention(q, k_new, v_new, scaling, q_start=0, row_start=self.row_start)
            q_sq = query_squares(self.policy, q, k_new.shape[1])
            if self._prompt_record is not None:
                self._prompt_qsq = q_sq
            self._ingest(k_new, v_new, q_sq)
            return out
        if self.cache.prompt_open or q.shape[2] > 1:
            # a new turn (any piece of one, a one-token last piece included): a prompt continuation
            return self._attend_turn(q, k_new, v_new, scaling)
        # a decode step (assisted decoding's verification arrives as such steps: verify_as_steps)
        return decode(self, q, k_new, v_new, scaling)

    def ingest_prefill(self, k, v):
        if self.policy.svd == "query":
            raise ValueError("shadowkv:svd='query' weights its SVD by the prompt's queries, which a shared dense "
                             "prefill does not keep: run the prompt through the model under the policy (its "
                             "prefills_densely() is False, so kvpress eval and bench do)")
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        self._ingest(k, v)

    def end_prompt(self) -> None:
        self._leave_static()
        stage, self._stage = self._stage, None
        q_sq, self._stage_qsq = self._stage_qsq, None
        if stage is not None:  # the whole prompt, as one forward would have left it
            self.seen = 0
            self._ingest(stage.buffer.keys, stage.buffer.values, q_sq)

    def _ingest(self, k, v, q_sq=None) -> None:
        ingest(self, k, v, q_sq)
        self._enter_static()

    def _attend_turn(self, q, k_new, v_new, scaling):
        out = attend_turn(self, q, k_new, v_new, scaling)
        self._enter_static()
        return out

    # ------------------------------------------------------------------ static decode
    _MOVED = ("gen_k", "gen_v", "exact_k", "exact_v", "exact_idx", "landmarks", "selectable", "factor", "v_host",
              "k_host", "kr_host", "tail_v_sum")  # held by the `StaticStore` while it lives

    def _enter_static(self) -> None:
        """After a prompt or a turn, with the cache's capacity planned: move the state into a
        `StaticStore` (fixed shapes), which the static steps use and `_leave_static` gives back."""
        if self.cache.capacity and self.exact_k is not None:
            self._static = StaticStore(self)
            for name in self._MOVED:
                setattr(self, name, None)

    def _leave_static(self) -> None:
        """The eager paths need the state as attributes again (host counts read once)."""
        if self._static is not None:
            store, self._static = self._static, None
            store.to_layer(self)

    # ------------------------------------------------------------------ decode
    def _rope_inv_freq(self, device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = self.cache.adapter.inv_freq(device, self.layer_idx)
        return self._inv_freq

    # ------------------------------------------------------------------ crop
    def record_forward(self, k, v):
        # the prompt's forward (assisted decoding's first one also holds draft tokens) is taken
        # back by ingesting the kept tokens again; later forwards only add generated tokens
        self._prompt_record = (k, v) if self.seen == 0 else None
        self._prompt_qsq = None  # set by the forward's attention when it is the prompt's
        self._fold_undo = []  # an earlier forward's folds are final

    def removable(self) -> int:
        self._leave_static()
        if self._prompt_record is not None:
            return self._prompt_record[0].shape[2]
        if self._fold_undo:  # undoing the forward's folds gives back the tokens they took
            seen, state = self._fold_undo[0]
            return self.seen - seen + state["gen_len"]
        return self.gen_len

    def _removable_hint(self) -> str:
        return (" (the generated tokens not yet folded into the store, see fold_size; the prompt only right after "
                "its forward, with past recording on)")

    def remove_latest(self, n):
        self._leave_static()
        record, self._prompt_record = self._prompt_record, None
        q_sq, self._prompt_qsq = self._prompt_qsq, None
        undo, self._fold_undo = self._fold_undo, []  # the forward's folds, oldest first
        if not n:
            return
        if record is not None:  # the whole latest forward was the prompt: ingest what it keeps again
            k, v = record
            self._clear()
            if k.shape[2] > n:
                keep = k.shape[2] - n
                self._ingest(k[:, :, :keep], v[:, :, :keep], None if q_sq is None else q_sq[:, :, :keep])
            return
        kept = self.seen - n
        while undo and undo[-1][0] >= kept:  # a fold made by a step that is taken back
            self.seen, state = undo.pop()
            for name, value in state.items():
                setattr(self, name, value)
        n = self.seen - kept
        self.gen_len -= n
        self.gen_k[:, :, self.gen_len : self.gen_len + n] = 0
        self.gen_v[:, :, self.gen_len : self.gen_len + n] = 0
        self.seen -= n

    # ------------------------------------------------------------------ bookkeeping
    def state_tensors(self):
        if self._static is not None:
            return {**{name: getattr(self, name) for name in self._STATE}, **self._static.device_tensors()}
        staged = {} if self._stage is None else {**self._stage.state_tensors(), "_stage_qsq": self._stage_qsq}
        return {**{name: getattr(self, name) for name in self._STATE}, **staged}

    def host_tensors(self):
        if self._static is not None:
            return self._static.host_tensors()
        return {"v_host": self.v_host, "k_host": self.k_host, "kr_host": self.kr_host}

    def batch_select(self, indices: torch.Tensor) -> None:
        self._leave_static()
        super().batch_select(indices)
        # the per-head budget tables live on the host (read each step without a device sync)
        host_idx = indices.cpu()
        if self._exact_cnt_cpu is not None:
            self._exact_cnt_cpu = self._exact_cnt_cpu.index_select(0, host_idx)
            self._sel_cnt_cpu = self._sel_cnt_cpu.index_select(0, host_idx)

    def transfer_stats(self) -> dict:
        """Host -> device traffic of this layer: steps, chunks, bytes per step, reuse rate."""
        return self.counters.as_dict()

    def stored_tokens(self) -> int:
        return self.seen  # every token is represented (exactly, low-rank + host, or generated)

    def cached_elements(self) -> int:
        if self._stage is not None:
            return self._stage.cached_elements()
        exact_k = self.exact_k if self._static is None else self._static.exact_k
        if exact_k is None:
            return 0
        b, h, _, d = exact_k.shape
        return 2 * b * h * self.seen * d

