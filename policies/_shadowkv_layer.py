"""The cache layer of ``shadowkv`` (`kvpress.policies.shadowkv`): it holds the state, runs the eager
decode step and routes the other forwards -- a prompt to `ingest`, a new turn to `attend_turn`
(``_shadowkv_prefill``), a static step to its `StaticStore` (``_shadowkv_static``). The core stages
a prompt given in pieces and takes tokens back."""

from __future__ import annotations

from functools import partial

import torch

from kvpress.attention import dense_causal_attention
from kvpress.buffers import KVBuffer
from kvpress.cache import CacheLayer
from kvpress.kernels import merge_states, native
from kvpress.kernels.backend import shadowkv_step_backend
from kvpress.kernels.rows import attend_rows

from ._shadowkv_prefill import attend_turn, ingest, query_squares
from ._shadowkv_select import select_chunks, tail_estimate
from ._shadowkv_static import StaticStore
from ._shadowkv_store import TransferCounters, attended_keys, fetch_tables


class ShadowKVLayer(CacheLayer):
    """Per-layer ShadowKV state (see :class:`ShadowKVPolicy`).

    Token axis of the prompt state: the prompt of ``T`` tokens is padded at the front by
    ``shift = (-T) % chunk_size`` so chunks align with the end of the prompt; padded token
    ``t`` is sequence index ``t - shift``, and row ``b``'s RoPE position is ``t - rope_start[b]``.
    Aligning on the end (not on index 0) makes a left-padded row chunk exactly like the same
    prompt run alone.

    Device state: ``landmarks`` (B, H_kv, C, D), ``selectable`` bool (B, H_kv, C), ``factor``
    (B, T_pad, R), ``basis`` (B, R, H_kv, D), exact tokens ``exact_k``/``exact_v`` (B, H_kv, E, D)
    and their counts ``exact_cnt``, generated tokens ``gen`` (a `KVBuffer`; ``gen_k``/``gen_v``/
    ``gen_len``), the previous step's fetched chunks ``sel_idx``/``sel_values`` (``sel_keys``: their
    exact keys with ``fetch_keys``, their residual rows with ``residual_bits``), and with
    ``tail_chunk`` the value sums per group ``tail_v_sum`` (B, H_kv, N, D) fp32. Host tier:
    ``v_host`` (B, H_kv, C, chunk_size, D), with ``fetch_keys`` the exact post-RoPE keys ``k_host``
    in the same layout, with ``residual_bits`` the quantized residual of the rebuilt keys
    ``kr_host`` (B, H_kv, C, chunk_size, W; `residual_table`). Transfers: ``counters``.
    While a `StaticStore` holds the state (``_static``), the attributes in ``_MOVED`` are None.

    Rollback (``"record"``): a recorded forward is undone by putting back the attributes it
    replaced (a prompt's factorisation, a step's fold) and storing its kept tokens again; past it,
    the generated tokens not yet folded are truncated (``rollback_truncate``).
    """

    static_decode = True  # `StaticStore`: after a prompt or a turn on a planned cache, or at the first static step
    verify_as_steps = True  # assisted decoding's verification attends as decode steps (the core splits it)
    rollback = "record"
    rollback_truncate = ("gen",)
    _STATE = ("landmarks", "selectable", "factor", "basis", "rope_start", "row_exact", "has_basis", "exact_k",
              "exact_v", "exact_cnt", "gen_k", "gen_v", "sel_idx", "sel_values", "sel_keys", "tail_v_sum", "key_weight")
    _HOST = ("v_host", "k_host", "kr_host")
    # what a forward replaces (never changes in place; `gen` only grows): recorded by reference
    rollback_state = tuple(n for n in _STATE if n not in ("gen_k", "gen_v")) + _HOST + (
        "exact_max", "max_selectable", "n_chunks", "_exact_cnt_cpu", "_sel_cnt_cpu")
    # held by the `StaticStore` while it lives (the previous step's fetch is dropped: a static step reuses none)
    _MOVED = tuple(n for n in _STATE if n not in ("rope_start", "key_weight", "gen_k", "gen_v")) + _HOST
    gen_k = property(lambda self: self.gen.k, lambda self, t: setattr(self.gen, "k", t))
    gen_v = property(lambda self: self.gen.v, lambda self, t: setattr(self.gen, "v", t))
    gen_len = property(lambda self: self.gen.length)

    def __init__(self, cache, layer_idx: int, policy):
        super().__init__(cache, layer_idx)
        self.policy = policy
        self.max_attended = 0  # most tokens one KV head attended in a decode step
        self.counters = TransferCounters()
        self._inv_freq = None
        self._prompt_qsq = None  # with svd="query": a recorded prompt forward's query squares (`query_squares`)
        self._stage_qsq = None  # with svd="query": the staged prompt's query squares
        self.gen = KVBuffer(64)
        for name in self.rollback_state:
            setattr(self, name, None)
        self.exact_max = self.max_selectable = self.n_chunks = 0  # n_chunks: the store's chunk grid
        self._static = None  # the state at fixed shapes while static steps may come (`StaticStore`)

    # ------------------------------------------------------------------ forwards
    def attend(self, q, k_new, v_new, scaling):
        plan = self.cache.plan
        # (a step recording its past for a crop takes the eager path: only there a fold is undone)
        if plan is not None and plan.static and self.rope_start is not None and not self.record_past:
            if self._static is None:
                self._enter_static()
            return self._static.step(self, q, k_new, v_new, scaling)
        self._leave_static()
        if self.rope_start is None:  # the prompt (one in pieces is staged by the core: `take_prompt`)
            out = dense_causal_attention(q, k_new, v_new, scaling, q_start=0, row_start=self.row_start)
            q_sq = query_squares(self.policy, q, k_new.shape[1])
            self._prompt_qsq = q_sq if self._record is not None else None
            self._ingest(k_new, v_new, q_sq)
            return out
        self._prompt_qsq = None
        if self.cache.prompt_open or q.shape[2] > 1:
            # a new turn (any piece of one, a one-token last piece included): a prompt continuation
            out = attend_turn(self, q, k_new, v_new, scaling)
            if not self.cache.prompt_open:
                self._enter_static(planned=True)
            return out
        return self.decode(q, k_new, v_new, scaling)  # (a verification arrives as such steps)

    def ingest_prefill(self, k, v):
        if self.policy.svd == "query":
            raise ValueError("shadowkv:svd='query' weights its SVD by the prompt's queries, which a shared dense "
                             "prefill does not keep: run the prompt through the model under the policy (its "
                             "prefills_densely() is False, so kvpress eval and bench do)")
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        self._ingest(k, v)

    @property
    def stages_prompt(self) -> bool:
        return self.rope_start is None  # a first prompt is factorised as a whole; a turn's pieces attend densely

    def attend_staged(self, q, stage, q_start, scaling):
        q_sq = query_squares(self.policy, q, stage.buffer.k.shape[1])
        if q_sq is not None:
            self._stage_qsq = q_sq if self._stage_qsq is None else torch.cat([self._stage_qsq, q_sq], dim=2)
        return super().attend_staged(q, stage, q_start, scaling)

    def take_prompt(self, stage) -> None:
        q_sq, self._stage_qsq = self._stage_qsq, None
        self._ingest(stage.buffer.keys, stage.buffer.values, q_sq)

    def end_prompt(self) -> None:
        self._enter_static(planned=True)  # after a turn in pieces

    def _ingest(self, k, v, q_sq=None) -> None:
        ingest(self, k, v, q_sq)
        self._enter_static(planned=True)

    # ------------------------------------------------------------------ eager decode
    def store_step(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one token per row ``k``/``v`` (B, H_kv, 1, D) as a decode step does: first, when the
        generated tokens reach ``local_window + fold_size``, the oldest fold into the store (the device
        fold of a `StaticStore` built for it, given back; see `ShadowKVPolicy.fold_size`)."""
        p = self.policy
        if p.fold_tokens and self.gen_len >= p.local_window + p.fold_tokens:
            store = StaticStore(self, tokens=self.seen + 1)
            store.fold()
            store.to_layer(self)  # (the previous step's fetch stays: chunk ids are stable)
        self.gen.append(k, v)
        self.seen += 1

    def decode(self, q, k_new, v_new, scaling):
        """One eager decode step of the layer: store, select, fetch, attend (B, H_q, 1, D). On fp32 CPU
        (`kvpress.kernels.backend.shadowkv_step_backend`) selection and tail are compiled calls;
        `attend_rows` chooses its own backend (one Triton launch on CUDA)."""
        p = self.policy
        self.store_step(k_new, v_new)
        q0 = q[:, :, 0].contiguous()  # (B, H_q, D)
        # chunks each (row, KV head) may add: what its own exact tokens and the generated ones leave
        allow = ((p.budget - self._exact_cnt_cpu - self.gen_len) // p.chunk_size).clamp(min=0)
        allow = torch.minimum(allow, self._sel_cnt_cpu)  # (B, H) on the host
        k_sel = int(allow.max()) if allow.numel() else 0
        compiled = shadowkv_step_backend(q0, self.gen_k, p.backend, self.landmarks, self.factor,
                                         self.basis) == "native"
        sets = [(self.gen_k, self.gen_v, None, self.gen_len)]
        if self.exact_max:
            sets.append((self.exact_k, self.exact_v, self.exact_cnt, self.exact_max))
        ids = values = None
        if k_sel:
            keys, rows, ids, values, cnt = self.selected_rows(q0, k_sel, allow.to(q0.device, non_blocking=True),
                                                              scaling, compiled)
            sets.append((keys, rows, cnt, keys.shape[2]))
        out, lse = attend_rows(q0, sets, scale=scaling, backend="torch" if p.backend == "torch" else "auto")
        out = out.to(q0.dtype)
        if p.tail_chunk and self.max_selectable:
            tokens = p.select == "tokens"
            # the token tail in one compiled call on fp32 CPU (`tail_estimate` is its reference)
            estimate = native.shadowkv_tail if compiled and tokens else partial(tail_estimate, tokens=tokens)
            o, l = estimate(q0, self.landmarks, self.selectable, self.tail_v_sum, ids, values,
                            chunk_size=p.chunk_size, tail_chunk=p.tail_chunk, scale=scaling)
            out, lse = merge_states(out, lse, o.to(out.dtype), l, backend="native" if compiled else "auto")
        attended = int((self._exact_cnt_cpu + allow * p.chunk_size).max()) if allow.numel() else 0
        self.max_attended = max(self.max_attended, attended + self.gen_len)
        return out[:, :, None]

    def selected_rows(self, q0, k_sel, allow, scaling, compiled: bool = False):
        """Top ``allow[b, h]`` (<= ``k_sel``) chunks per KV head -- or as many single tokens with
        ``select="tokens"`` -- chosen (`select_chunks`, or with ``compiled`` `native.shadowkv_select`),
        their values fetched from the host tier reusing the previous step's, and the keys to attend
        them with (`attended_keys`). Returns keys and values (B, H, k_sel * cs, D), the ids, the values
        as the tail estimate reads them and the rows in use per (row, KV head), int32 (B, H)."""
        p = self.policy
        B, H, _, D = self.landmarks.shape
        cs, tokens = p.chunk_size, p.select == "tokens"
        shortlist = max(min(k_sel * p.rerank, self.max_selectable), k_sel)
        args = (q0, self.landmarks, self.selectable, self.factor, self.basis, self._rope_inv_freq(q0.device),
                self.rope_start, allow)
        kwargs = dict(k=k_sel, shortlist=shortlist, chunk_size=cs, scale=scaling, reduction=p.score_reduction,
                      tokens=tokens)
        select = native.shadowkv_select if compiled else partial(select_chunks, backend=p.backend)
        ids, keys = select(*args, **kwargs)
        as_units = (lambda t: t.view(B, H, -1, 1, t.shape[-1])) if tokens else (lambda t: t)  # noqa: E731
        table = self.k_host if p.fetch_keys else self.kr_host
        hosts = [as_units(t) for t in (self.v_host, table) if t is not None]  # one plan, one step
        values, *fetched = fetch_tables(hosts, ids, self.sel_idx, [self.sel_values, self.sel_keys][: len(hosts)],
                                        self.counters, q0.device)
        fetched = fetched[0] if fetched else None
        self.sel_idx, self.sel_values, self.sel_keys = ids, values, fetched
        rows = values.reshape(B, H, k_sel * cs, D)
        cnt = (ids >= 0).sum(-1).to(torch.int32) * (1 if tokens else cs)  # (B, H)
        return attended_keys(self, ids, fetched, keys), rows, ids, rows if tokens else values, cnt

    # ------------------------------------------------------------------ static decode
    def _enter_static(self, planned: bool = False) -> None:
        """Move the state into a `StaticStore` (fixed shapes) for the static steps; with ``planned``
        only on a cache whose capacity is planned (the static path's steps are traced, so the
        store must exist before the first of them). `_leave_static` gives the state back."""
        if self._static is None and self.rope_start is not None and (self.cache.capacity or not planned):
            self._static = StaticStore(self)
            for name in self._MOVED:
                setattr(self, name, None)
            self.gen = KVBuffer(64)

    def before_static_step(self) -> None:
        self._enter_static(planned=True)  # an eager step left it (e.g. generate's first after a shared prefill)
        super().before_static_step()

    def _leave_static(self) -> None:
        """The eager paths need the state as attributes again (host counts read once)."""
        if self._static is not None:
            store, self._static = self._static, None
            store.to_layer(self)

    def _rope_inv_freq(self, device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = self.cache.adapter.inv_freq(device, self.layer_idx)
        return self._inv_freq

    # ------------------------------------------------------------------ rollback (run by the core)
    def snapshot(self) -> dict:
        self._leave_static()  # references, not copies: a forward replaces these, and only appends to `gen`
        return {"seen": self.seen, "gen": (self.gen, self.gen.length),
                **{name: getattr(self, name) for name in self.rollback_state}}

    def restore(self, saved: dict) -> None:
        self._static = None  # (built after the recorded forward)
        for name, value in saved.items():
            setattr(self, name, value)
        self.gen, length = saved["gen"]
        self.gen.truncate(length)  # the slots the forward appended, zeroed

    def store_again(self, k, v) -> None:
        if self.rope_start is None:  # the prompt's forward, shorter: factorised again
            q_sq, self._prompt_qsq = self._prompt_qsq, None
            self._ingest(k, v, None if q_sq is None else q_sq[:, :, : k.shape[2]])
            return
        for t in range(k.shape[2]):  # as decode steps store them (folds included)
            self.store_step(k[:, :, t : t + 1], v[:, :, t : t + 1])

    def removable(self) -> int:
        self._leave_static()
        return super().removable()

    def _removable_hint(self) -> str:
        return (" (the generated tokens not yet folded into the store, see fold_size; the prompt only right after "
                "its forward, with past recording on)")

    # ------------------------------------------------------------------ bookkeeping
    def state_tensors(self):
        own = {**{name: getattr(self, name) for name in self._STATE}, "_stage_qsq": self._stage_qsq}
        return own if self._static is None else {**own, **self._static.device_tensors()}

    def host_tensors(self):
        holder = self if self._static is None else self._static
        return {name: getattr(holder, name) for name in self._HOST}

    def batch_select(self, indices: torch.Tensor) -> None:
        self._leave_static()
        super().batch_select(indices)
        # the per-head budget tables live on the host (read each step without a device sync)
        host_idx = indices.cpu()
        if self._exact_cnt_cpu is not None:
            self._exact_cnt_cpu = self._exact_cnt_cpu.index_select(0, host_idx)
            self._sel_cnt_cpu = self._sel_cnt_cpu.index_select(0, host_idx)

    def stored_tokens(self) -> int:
        # every token is represented (exactly, low-rank + host, or generated); a staged prompt the core counts
        return 0 if self.rope_start is None else self.seen

    def cached_elements(self) -> int:
        if self.rope_start is None:
            return 0
        adapter = self.cache.adapter
        return 2 * self.rope_start.shape[0] * adapter.num_kv_heads * self.seen * adapter.head_dim
