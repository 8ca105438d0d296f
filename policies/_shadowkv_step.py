"""``shadowkv``'s decode step over the selected part (`ShadowKVLayer` mixes it in): generated and
exact tokens plus the selected chunks (or tokens), on the torch path or as two compiled calls."""

from __future__ import annotations

import torch

from kvpress.kernels import SparseIndex, merge_states, native, sparse_decode
from kvpress.kernels.rows import attend_rows, triton_rows_supported

from ._shadowkv_select import select_chunks, select_tokens
from ._shadowkv_store import add_residual, fetch_chunks, fetch_tables


class SelectedSteps:
    """Methods of `ShadowKVLayer` (its state: ``gen_k``/``gen_v``, the exact part, landmarks,
    factors, the host tier, ``sel_idx``/``sel_values``, ``counters``)."""

    def _torch_step(self, q0, k_sel, allow, scaling):
        """Generated tokens, exact tokens and selected chunks: on CUDA one `attend_rows` launch over
        the three stores; else each through `sparse_decode`, merged (the reference path)."""
        B, _, D = q0.shape
        H, dev = self.gen_k.shape[1], q0.device
        allow = allow.to(dev, non_blocking=True) if k_sel else allow
        ids = values = None
        if self._decode_backend == "auto" and triton_rows_supported(q0, H, 1 + bool(self.exact_max) + bool(k_sel)):
            sets = [(self.gen_k, self.gen_v, None, self.gen_len)]
            if self.exact_max:
                sets.append((self.exact_k, self.exact_v, self.exact_cnt, self.exact_max))
            if k_sel:
                keys, vals, ids, values, unit, cnt = self._selected_rows(q0, k_sel, allow, scaling)
                sets.append((keys, vals, cnt * unit, keys.shape[2]))
            out, lse = attend_rows(q0, sets, scale=scaling, backend="triton")
            return out.to(q0.dtype), lse, ids, values
        full = lambda n: torch.full((B,), n, dtype=torch.int32, device=dev)  # noqa: E731
        gen_index = SparseIndex.dense(full(self.gen_len), H, block_size=64, capacity=self.gen_k.shape[2])  # no sync
        out, lse = sparse_decode(q0, self.gen_k, self.gen_v, gen_index, scale=scaling, backend=self._decode_backend,
                                 validate_index=False)
        if self.exact_max:
            index = SparseIndex(1, self.exact_idx, self.exact_cnt, full(self.exact_max))
            o, l = sparse_decode(q0, self.exact_k, self.exact_v, index, scale=scaling, backend=self._decode_backend,
                                 validate_index=False)
            out, lse = merge_states(out, lse, o, l)
        if k_sel:
            o, l, ids, values = self._attend_selected(q0, k_sel, allow, scaling)
            out, lse = merge_states(out, lse, o, l)
        return out, lse, ids, values

    def _native_step_ok(self, q0: torch.Tensor) -> bool:
        """Whether this step runs as two compiled calls (``backend="auto"``, fp32 CPU, the library built)."""
        return (self.policy.backend == "auto" and q0.device.type == "cpu"
                and q0.dtype == torch.float32
                and self.gen_k.dtype == torch.float32 and q0.shape[1] // self.gen_k.shape[1] <= 8 and native.available()
                and (self.landmarks is None
                     or native.shadowkv_unsupported(q0, self.landmarks, self.factor, self.basis) is None))

    def _native_step(self, q0, k_sel, allow, scaling):
        """`native.shadowkv_select` (selection and the chosen chunks' keys), the values fetched, then
        `native.attend_rows` over generated tokens, exact tokens and chosen chunks (or single
        tokens, ``select="tokens"``) under one softmax."""
        p = self.policy
        B, _, D = q0.shape
        H, cs = self.gen_k.shape[1], p.chunk_size
        sets = [(self.gen_k, self.gen_v, None, self.gen_len)]
        if self.exact_max:
            sets.append((self.exact_k, self.exact_v, self.exact_cnt, self.exact_max))
        ids = values = None
        if k_sel:
            n_cand = min(k_sel * p.rerank, self.max_selectable)
            tokens = p.select == "tokens"
            ids, keys = native.shadowkv_select(q0, self.landmarks, self.selectable, self.factor, self.basis,
                                               self._rope_inv_freq(q0.device), self.rope_start, allow, k=k_sel,
                                               shortlist=max(n_cand, k_sel), chunk_size=cs, scale=scaling,
                                               reduction=p.score_reduction, tokens=tokens)
            keys, values = self._fetch_selected(ids, tokens, q0.device, keys)
            rows = (ids >= 0).sum(-1).to(torch.int32) * (1 if tokens else cs)
            sets.append((keys, values.reshape(B, H, k_sel * cs, D).contiguous(), rows, k_sel * cs))
            if tokens:
                values = values.view(B, H, k_sel * cs, D)
        out, lse = native.attend_rows(q0, sets, scale=scaling)
        return out, lse, ids, values

    def _fetch_selected(self, ids, tokens: bool, device, rebuilt):
        """The chosen chunks' (``tokens``: single tokens') values from the host tier, reusing the
        previous step's, and the keys to attend them with (B, H, rows, D): ``rebuilt`` (their
        low-rank keys), with ``residual_bits`` plus their residual fetched beside the values, with
        ``fetch_keys`` their exact keys fetched instead. Returns ``(keys, values)``."""
        p = self.policy
        B, H = ids.shape[:2]
        as_units = (lambda t: t.view(B, H, -1, 1, t.shape[-1])) if tokens else (lambda t: t)  # noqa: E731
        table = self._key_table()
        if table is not None:  # one plan for both tables: the same chunks, one step
            values, fetched = fetch_tables([as_units(self.v_host), as_units(table)], ids, self.sel_idx,
                                           [self.sel_values, self.sel_keys], self.counters, device)
        else:
            values, fetched = fetch_chunks(as_units(self.v_host), ids, self.sel_idx, self.sel_values, self.counters,
                                           device), None
        self.sel_idx, self.sel_values, self.sel_keys = ids, values, fetched
        keys = rebuilt
        if p.fetch_keys:
            keys = fetched.reshape(rebuilt.shape)
        elif p.residual_bits:
            keys = add_residual(rebuilt, fetched.reshape(*rebuilt.shape[:3], -1), p.residual_bits,
                                p.residual_group_for(rebuilt.shape[-1]), backend=p.backend)
        return keys, values

    def _selected_rows(self, q0, k_sel, allow, scaling):
        """Top ``allow[b, h]`` (<= ``k_sel``) chunks per KV head -- or as many single tokens with
        ``select="tokens"`` -- : their keys rebuilt (``fetch_keys``: the exact ones fetched) and
        their values fetched. Returns keys and values (B, H, k_sel * cs, D), the chosen ids, the
        values as the caller returns them (the tail estimate reads them), the rows per unit and
        the units in use (B, H) int32: the first ``cnt * unit`` rows are in use."""
        p = self.policy
        B, H, _, D = self.landmarks.shape
        cs, dev = p.chunk_size, q0.device
        n_cand = min(k_sel * p.rerank, self.max_selectable)
        select = select_tokens if p.select == "tokens" else select_chunks
        ids, keys = select(q0, self.landmarks, self.selectable, self.factor, self.basis,
                           self._rope_inv_freq(dev), self.rope_start, allow, k=k_sel,
                           shortlist=max(n_cand, k_sel), chunk_size=cs, scale=scaling,
                           reduction=p.score_reduction, backend=p.backend)
        tokens = p.select == "tokens"
        keys, values = self._fetch_selected(ids, tokens, dev, keys)
        cnt = (ids >= 0).sum(-1).to(torch.int32)  # (B, H)
        rows_v = values.view(B, H, k_sel * cs, D)
        return keys, rows_v, ids, rows_v if tokens else values, 1 if tokens else cs, cnt

    def _attend_selected(self, q0, k_sel, allow, scaling):
        """`_selected_rows` attended through `sparse_decode`: ``(out, lse, ids, values)``."""
        keys, vals, ids, values, unit, cnt = self._selected_rows(q0, k_sel, allow, scaling)
        B, dev = q0.shape[0], q0.device
        slots = torch.arange(keys.shape[2] // unit, device=dev, dtype=torch.int32)
        index = SparseIndex(unit, torch.where(slots < cnt[..., None], slots, -1), cnt,
                            torch.full((B,), keys.shape[2], dtype=torch.int32, device=dev))
        out, lse = sparse_decode(q0, keys, vals, index, scale=scaling, backend=self._decode_backend,
                                 validate_index=False)
        return out, lse, ids, values
