"""The cache layer of ``shadowkv`` (`kvpress.policies.shadowkv`): prefill factorisation, per-step
sparse rebuild with the host value tier, a new turn's dense pass, crop."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvpress.attention import dense_causal_attention, masked_group_attention
from kvpress.cache import CacheLayer, PromptStage
from kvpress.kernels import chunk_landmarks, merge_states, native
from kvpress.kernels.shadowkv_rebuild import shadowkv_rebuild

from ._shadowkv_select import tail_estimate, tail_estimate_tokens, tail_value_sums
from ._shadowkv_fold import FoldedChunks
from ._shadowkv_static import StaticStore
from ._shadowkv_step import SelectedSteps
from ._shadowkv_store import (TransferCounters, add_residual, default_rank, fetch_tables, low_rank,
                              query_pair_weights, residual_table, to_host)

if TYPE_CHECKING:
    from .shadowkv import ShadowKVPolicy


class ShadowKVLayer(SelectedSteps, FoldedChunks, CacheLayer):
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
    """

    croppable = True  # generated tokens; the prompt's own forward by ingesting what it keeps again
    static_decode = True  # `StaticStore`, built after a prompt or a turn when the capacity is planned
    _STATE = ("landmarks", "selectable", "factor", "basis", "rope_start", "row_exact", "has_basis", "exact_k",
              "exact_v", "exact_idx", "exact_cnt", "gen_k", "gen_v", "sel_idx", "sel_values", "sel_keys",
              "tail_v_sum", "key_weight")
    # what a fold replaces (`_fold`), held while a recorded forward may still be cropped
    _FOLDED = _STATE + ("v_host", "k_host", "kr_host", "gen_len", "exact_max", "max_selectable", "exact_mode",
                        "n_chunks", "_exact_cnt_cpu", "_sel_cnt_cpu")

    def __init__(self, cache, layer_idx: int, policy: ShadowKVPolicy):
        super().__init__(cache, layer_idx)
        self.policy = policy
        self.max_attended = 0  # most tokens one KV head attended in a decode step
        self.counters = TransferCounters()
        self._inv_freq = None
        self._prompt_record = None  # (k, v) of the prompt's forward while it can still be cropped
        self._prompt_qsq = None  # with svd="query": that forward's query squares (`_query_squares`)
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
        if plan is not None and plan.static and self._static is not None:
            return self._static.step(self, q, k_new, v_new, scaling)
        self._leave_static()
        if self.cache.prompt_open and (self.seen == 0 or self._stage is not None):  # factorised at its end
            if self._stage is None:
                self._stage = PromptStage()
            self.seen += k_new.shape[2]
            q_sq = self._query_squares(q, k_new.shape[1])
            if q_sq is not None:
                self._stage_qsq = q_sq if self._stage_qsq is None else torch.cat([self._stage_qsq, q_sq], dim=2)
            return self._stage.attend(q, k_new, v_new, scaling, self.row_start)
        if self.seen == 0:
            out = dense_causal_attention(q, k_new, v_new, scaling, q_start=0, row_start=self.row_start)
            q_sq = self._query_squares(q, k_new.shape[1])
            if self._prompt_record is not None:
                self._prompt_qsq = q_sq
            self._ingest(k_new, v_new, q_sq)
            return out
        if self.cache.prompt_open or (q.shape[2] > 1 and not self.verifies_as_steps(q.shape[2])):
            # a new turn (any piece of one, a one-token last piece included): a prompt continuation
            return self._attend_turn(q, k_new, v_new, scaling)
        # a decode step, or assisted decoding's verification: one causal step per token
        return self.attend_as_steps(self._decode, q, k_new, v_new, scaling)

    def _query_squares(self, q: torch.Tensor, num_kv_heads: int) -> torch.Tensor | None:
        """With ``svd="query"``: the squares of a forward's queries (B, H_q, T, D), averaged over
        each KV head's group, fp32 (B, H_kv, T, D); else None."""
        if self.policy.svd != "query":
            return None
        B, H_q, T, D = q.shape
        return q.float().square().view(B, num_kv_heads, H_q // num_kv_heads, T, D).mean(2)

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

    @torch.no_grad()
    def _ingest(self, k: torch.Tensor, v: torch.Tensor, q_sq: torch.Tensor | None = None) -> None:
        p, adapter = self.policy, self.cache.adapter
        B, H, T, D = k.shape
        cs, dev = p.chunk_size, k.device
        shift = (-T) % cs
        C = (T + shift) // cs
        rs = self.row_start
        rs = torch.zeros(B, dtype=torch.long, device=dev) if rs is None else rs.to(dev)
        rope_start = rs + shift  # (B,) padded index of each row's first real token
        kp = F.pad(k, (0, 0, shift, 0))  # (B, H, T_pad, D)
        vp = F.pad(v, (0, 0, shift, 0))
        tok = torch.arange(C * cs, device=dev)
        real = tok[None, :] >= rope_start[:, None]  # (B, T_pad)
        chunk = torch.arange(C, device=dev)
        n_win = -(-p.local_window // cs)
        win_first = max(C - n_win, 0)
        first_full = (rope_start + cs - 1) // cs  # (B,) first chunk without padding
        middle = (chunk[None, :] >= first_full[:, None]) & (chunk[None, :] < win_first)  # (B, C)
        # A row whose prompt fits the budget keeps every chunk exact (decided per row, so a padded
        # row of a batch behaves like the same prompt alone); other rows keep `outlier_chunks`.
        row_exact = p.budget >= T - rs  # (B,)
        out_cnt = torch.where(row_exact, middle.sum(1), middle.sum(1).clamp(max=p.outlier_chunks))  # (B,)
        n_out = int(out_cnt.max()) if B else 0
        self.exact_mode = bool(row_exact.all())
        self.row_exact, self.rope_start, self.n_chunks = row_exact, rope_start, C

        landmarks = chunk_landmarks(kp, cs, seq_starts=rope_start)  # (B, H, C, D)
        # Outliers: chunks whose landmark represents its keys worst (lowest min cosine similarity).
        cos = F.cosine_similarity(kp.float().view(B, H, C, cs, D), landmarks.float()[:, :, :, None], dim=-1)
        cos = cos.masked_fill(~real.view(B, 1, C, cs), float("inf")).amin(-1)  # (B, H, C)
        cos = cos.masked_fill(~middle[:, None], float("inf"))
        out_score, out_ids = torch.topk(-cos, n_out, dim=-1)  # (B, H, n_out)
        out_ok = torch.isfinite(out_score) & (torch.arange(n_out, device=dev) < out_cnt[:, None, None])
        is_outlier = torch.zeros(B, H, C + 1, dtype=torch.bool, device=dev)
        is_outlier.scatter_(2, torch.where(out_ok, out_ids, torch.full_like(out_ids, C)), True)
        selectable = middle[:, None] & ~is_outlier[:, :, :C]  # (B, H, C)

        # Exact tokens: the partial chunk at the row start, the outliers, the window chunks.
        head = (first_full - 1)[:, None, None].expand(B, H, 1)
        head_ok = (head >= 0) & (head < win_first)
        win = torch.arange(win_first, C, device=dev).view(1, 1, -1).expand(B, H, -1)
        ex_chunks = torch.cat([head, out_ids, win], dim=2)  # (B, H, N_ex)
        ex_ok = torch.cat([head_ok, out_ok, torch.ones_like(win, dtype=torch.bool)], dim=2)
        pos = (ex_chunks.clamp(min=0)[..., None] * cs + torch.arange(cs, device=dev)).flatten(2)  # (B, H, N_ex*cs)
        ok = ex_ok.repeat_interleave(cs, dim=2) & torch.gather(real[:, None].expand(B, H, -1), 2, pos)
        order = torch.sort((~ok).to(torch.int8), dim=2, stable=True).indices  # valid slots first
        cnt = ok.sum(2)  # (B, H)
        E = int(cnt.max()) if B else 0
        pos = torch.gather(pos, 2, order[..., :E])  # (B, H, E)
        gidx = pos[..., None].expand(B, H, E, D)
        self.exact_k = torch.gather(kp, 2, gidx).contiguous()
        self.exact_v = torch.gather(vp, 2, gidx).contiguous()
        slots = torch.arange(E, device=dev)
        self.exact_idx = torch.where(slots < cnt[..., None], slots, -1).to(torch.int32)  # (B, H, E)
        self.exact_cnt = cnt.to(torch.int32)
        self.exact_max = E
        self._exact_cnt_cpu = cnt.cpu()  # (B, H) per-head budgets, read on the host: no sync per step
        self._sel_cnt_cpu = selectable.sum(-1).cpu()

        self.max_selectable = int(selectable.sum(-1).max()) if B else 0
        # a row that keeps its prompt exact takes its basis from the first tokens it folds, as alone
        self.has_basis = ~row_exact if self.max_selectable else torch.zeros_like(row_exact)
        self.key_weight = None  # svd="query": the SVD's channel metric, from the prompt's queries (folds use it too)
        if p.svd == "query":
            if q_sq is None:
                raise ValueError("shadowkv:svd='query' needs the prompt's queries")
            self.key_weight = query_pair_weights(q_sq, torch.arange(T, device=dev)[None, :] >= rs[:, None])
        if self.max_selectable:
            self.landmarks, self.selectable = landmarks, selectable
            # Pre-RoPE keys (exact inverse rotation), padding zeroed.
            k_pre = adapter.invert_rope(kp, (tok[None, :] - rope_start[:, None])[:, None, :], self.layer_idx)  # (B, H, T_pad, D)
            k_pre = (k_pre.float() * real[:, None, :, None]).permute(0, 2, 1, 3).reshape(B, C * cs, H * D)
            rank = default_rank(H * D) if p.rank is None else p.rank
            self.factor, self.basis = low_rank(k_pre, rope_start, min(rank, H * D), H, k.dtype, self.key_weight)
            self.v_host = to_host(vp.view(B, H, C, cs, D))
            if p.fetch_keys:
                self.k_host = to_host(kp.view(B, H, C, cs, D))
            if p.residual_bits:
                self.kr_host = to_host(self._residual_rows(kp, 0).view(B, H, C, cs, -1))
            if p.tail_chunk:
                self.tail_v_sum = tail_value_sums(vp.view(B, H, C, cs, D), selectable, p.tail_chunk)
        self.seen += T
        self._enter_static()

    # ------------------------------------------------------------------ a new turn
    def _attend_turn(self, q, k_new, v_new, scaling):
        """Several tokens after the prompt without past recording (a new turn, a continuation):
        they attend densely, as any policy's prompt continuation does -- every exact token, every
        selectable chunk (keys rebuilt from the factors with RoPE, values fetched from the host
        tier, counted as one fetch), the generated tokens and their own earlier tokens -- and are
        then kept as generated tokens. One pass instead of a decode step per token; the rebuilt
        keys and fetched values are transient (a layer's worth, like a prefill's)."""
        p = self.policy
        B, H_q, T, D = q.shape
        H, dev = k_new.shape[1], q.device
        keys, values, seen_by_all = [], [], []  # keys every query of the turn may see, and which are real
        if self.exact_max:
            keys.append(self.exact_k)
            values.append(self.exact_v)
            seen_by_all.append(torch.arange(self.exact_max, device=dev) < self.exact_cnt[..., None].to(dev))
        if self.max_selectable:
            C, cs = self.selectable.shape[-1], p.chunk_size
            order = torch.where(self.selectable, torch.arange(C, device=dev), C).sort(dim=-1).values
            ids = torch.where(order < C, order, -1)[..., : self.max_selectable].to(torch.int32)  # (B, H, K)
            key_table = self._key_table()
            tables = [self.v_host] if key_table is None else [self.v_host, key_table]
            fetched, *extra = fetch_tables(tables, ids, None, [None] * len(tables), self.counters, dev)
            if p.fetch_keys:
                keys.append(extra[0].view(B, H, self.max_selectable * cs, D))
            else:
                rebuilt = shadowkv_rebuild(self.factor, self.basis, ids, self._rope_inv_freq(dev), self.rope_start,
                                           chunk_size=cs, backend=p.backend)
                if p.residual_bits:
                    rebuilt = add_residual(rebuilt, extra[0].view(B, H, self.max_selectable * cs, -1),
                                           p.residual_bits, p.residual_group_for(D), backend=p.backend)
                keys.append(rebuilt)
            values.append(fetched.view(B, H, self.max_selectable * cs, D))
            seen_by_all.append((ids >= 0).repeat_interleave(cs, dim=-1))
        if self.gen_len:
            keys.append(self.gen_k[:, :, : self.gen_len])
            values.append(self.gen_v[:, :, : self.gen_len])
            seen_by_all.append(torch.ones(B, H, self.gen_len, dtype=torch.bool, device=dev))
        keys, values = torch.cat(keys + [k_new], dim=2), torch.cat(values + [v_new], dim=2)
        seen_by_all = torch.cat(seen_by_all + [torch.zeros(B, H, 0, dtype=torch.bool, device=dev)], dim=2)  # (B, H, N0)
        qg = q.reshape(B, H, H_q // H, T, D)
        out = q.new_empty(B, H, H_q // H, T, D)
        steps = torch.arange(T, device=dev)
        block = 128
        for t0 in range(0, T, block):
            t1 = min(T, t0 + block)
            own = steps[None, :t1] <= steps[t0:t1, None]  # (b, t1) causal over the turn's tokens
            visible = torch.cat([seen_by_all[:, :, None].expand(-1, -1, t1 - t0, -1),
                                 own.expand(B, H, -1, -1)], dim=-1)
            n0 = seen_by_all.shape[2]
            out[:, :, :, t0:t1] = masked_group_attention(qg[:, :, :, t0:t1], keys[:, :, : n0 + t1],
                                                         values[:, :, : n0 + t1], visible, scaling)
        self._append_generated(k_new, v_new)
        self.seen += T
        self._enter_static()
        return out.reshape(B, H_q, T, D).to(q.dtype)

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
    def _append_generated(self, k: torch.Tensor, v: torch.Tensor) -> None:
        B, H, n, D = k.shape
        if self.gen_k is None or self.gen_len + n > self.gen_k.shape[2]:
            cap = -(-(self.gen_len + n) // 64) * 64  # grow in 64-token steps: one copy every 64 tokens
            # zeros, not empty: a backend reading the unused slots under a -inf mask must not meet NaN (0 * NaN)
            new_k, new_v = k.new_zeros(B, H, cap, D), v.new_zeros(B, H, cap, D)
            if self.gen_len:
                new_k[:, :, : self.gen_len] = self.gen_k[:, :, : self.gen_len]
                new_v[:, :, : self.gen_len] = self.gen_v[:, :, : self.gen_len]
            self.gen_k, self.gen_v = new_k, new_v
        self.gen_k[:, :, self.gen_len : self.gen_len + n] = k
        self.gen_v[:, :, self.gen_len : self.gen_len + n] = v
        self.gen_len += n

    def _decode(self, q, k_new, v_new, scaling):
        p = self.policy
        fold = p.fold_tokens
        if fold and self.gen_len >= p.local_window + fold:
            if self.record_past:  # a verification's step: `crop` may take it back
                self._fold_undo.append((self.seen, {name: getattr(self, name) for name in self._FOLDED}))
            self._fold((self.gen_len - p.local_window) // fold * fold)
        self._append_generated(k_new, v_new)
        self.seen += 1
        q0 = q[:, :, 0].contiguous()  # (B, H_q, D)
        # chunks each (row, KV head) may add: what its own exact tokens and the generated ones leave
        allow = ((p.budget - self._exact_cnt_cpu - self.gen_len) // p.chunk_size).clamp(min=0)
        allow = torch.minimum(allow, self._sel_cnt_cpu)  # (B, H) on the host
        k_sel = int(allow.max()) if allow.numel() else 0
        compiled = self._native_step_ok(q0)
        if compiled:
            out, lse, ids, values = self._native_step(q0, k_sel, allow, scaling)
        else:
            out, lse, ids, values = self._torch_step(q0, k_sel, allow, scaling)
        if p.tail_chunk and self.max_selectable:
            estimate = tail_estimate_tokens if p.select == "tokens" else tail_estimate
            if compiled and p.select == "tokens":  # the same math in one call (torch: the reference)
                estimate = native.shadowkv_tail
            o, l = estimate(q0, self.landmarks, self.selectable, self.tail_v_sum, ids, values,
                            chunk_size=p.chunk_size, tail_chunk=p.tail_chunk, scale=scaling)
            if compiled and out.dtype == torch.float32:
                out, lse = native.merge_states(out, lse, o, l)  # (torch: `merge_states`, the reference)
            else:
                out, lse = merge_states(out, lse, o.to(out.dtype), l)
        attended = int((self._exact_cnt_cpu + allow * p.chunk_size).max()) if allow.numel() else 0
        self.max_attended = max(self.max_attended, attended + self.gen_len)
        return out[:, :, None]

    @property
    def _decode_backend(self) -> str:
        # "triton" for the rebuild still lets sparse_decode fall back to torch for unsupported head_dims
        return "torch" if self.policy.backend == "torch" else "auto"

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

    def _key_table(self):
        """The host table fetched beside the values: exact keys (``fetch_keys``), the rebuilt keys'
        quantized residual (``residual_bits``) or None."""
        return self.k_host if self.policy.fetch_keys else self.kr_host

    def _residual_rows(self, k: torch.Tensor, c0: int) -> torch.Tensor:
        """`residual_table` rows (B, H_kv, n, W) of the post-RoPE keys ``k`` (B, H_kv, n, D) of the
        whole chunks from chunk ``c0`` of the store's grid on, less their rebuild from the current
        factors and basis."""
        p, cs = self.policy, self.policy.chunk_size
        B, H, n, _ = k.shape
        ids = torch.arange(c0, c0 + n // cs, dtype=torch.int32, device=k.device).expand(B, H, -1).contiguous()
        rebuilt = shadowkv_rebuild(self.factor, self.basis, ids, self._rope_inv_freq(k.device), self.rope_start,
                                   chunk_size=cs, backend=p.backend)
        return residual_table(k, rebuilt, p.residual_bits, p.residual_group_for(k.shape[-1]))

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

