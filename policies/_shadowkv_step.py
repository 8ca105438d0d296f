"""``shadowkv``'s eager decode step (for `ShadowKVLayer`): the generated tokens stored, the chunks
chosen, their values fetched from the host tier (reusing the previous step's), exact + chosen +
generated tokens attended, on the torch path or as two compiled calls on fp32 CPU."""

from __future__ import annotations

import torch

from kvpress.kernels import SparseIndex, merge_states, native, sparse_decode
from kvpress.kernels.backend import shadowkv_step_backend
from kvpress.kernels.rows import attend_rows, triton_rows_supported

from ._shadowkv_select import select_chunks, select_tokens, tail_estimate, tail_estimate_tokens
from ._shadowkv_static import StaticStore
from ._shadowkv_store import add_residual, fetch_chunks, fetch_tables


def append_generated(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Append ``k``/``v`` (B, H_kv, n, D) to ``layer``'s generated tokens."""
    B, H, n, D = k.shape
    if layer.gen_k is None or layer.gen_len + n > layer.gen_k.shape[2]:
        cap = -(-(layer.gen_len + n) // 64) * 64  # grow in 64-token steps: one copy every 64 tokens
        # zeros, not empty: a backend reading the unused slots under a -inf mask must not meet NaN (0 * NaN)
        new_k, new_v = k.new_zeros(B, H, cap, D), v.new_zeros(B, H, cap, D)
        if layer.gen_len:
            new_k[:, :, : layer.gen_len] = layer.gen_k[:, :, : layer.gen_len]
            new_v[:, :, : layer.gen_len] = layer.gen_v[:, :, : layer.gen_len]
        layer.gen_k, layer.gen_v = new_k, new_v
    layer.gen_k[:, :, layer.gen_len : layer.gen_len + n] = k
    layer.gen_v[:, :, layer.gen_len : layer.gen_len + n] = v
    layer.gen_len += n


def key_table(layer):
    """The host table fetched beside the values: exact keys (``fetch_keys``), the rebuilt keys'
    quantized residual (``residual_bits``) or None."""
    return layer.k_host if layer.policy.fetch_keys else layer.kr_host


def decode(layer, q, k_new, v_new, scaling):
    """One eager decode step of ``layer``: fold, store, select, fetch, attend (B, H_q, 1, D)."""
    p = layer.policy
    fold = p.fold_tokens
    if fold and layer.gen_len >= p.local_window + fold:
        if layer.record_past:  # a verification's step: `crop` may take it back
            layer._fold_undo.append((layer.seen, {name: getattr(layer, name) for name in layer._FOLDED}))
        fold_generated(layer, (layer.gen_len - p.local_window) // fold * fold)
    append_generated(layer, k_new, v_new)
    layer.seen += 1
    q0 = q[:, :, 0].contiguous()  # (B, H_q, D)
    # chunks each (row, KV head) may add: what its own exact tokens and the generated ones leave
    allow = ((p.budget - layer._exact_cnt_cpu - layer.gen_len) // p.chunk_size).clamp(min=0)
    allow = torch.minimum(allow, layer._sel_cnt_cpu)  # (B, H) on the host
    k_sel = int(allow.max()) if allow.numel() else 0
    compiled = native_step_ok(layer, q0)
    if compiled:
        out, lse, ids, values = native_step(layer, q0, k_sel, allow, scaling)
    else:
        out, lse, ids, values = torch_step(layer, q0, k_sel, allow, scaling)
    if p.tail_chunk and layer.max_selectable:
        estimate = tail_estimate_tokens if p.select == "tokens" else tail_estimate
        if compiled and p.select == "tokens":  # the same math in one call (torch: the reference)
            estimate = native.shadowkv_tail
        o, l = estimate(q0, layer.landmarks, layer.selectable, layer.tail_v_sum, ids, values,
                        chunk_size=p.chunk_size, tail_chunk=p.tail_chunk, scale=scaling)
        if compiled and out.dtype == torch.float32:
            out, lse = native.merge_states(out, lse, o, l)  # (torch: `merge_states`, the reference)
        else:
            out, lse = merge_states(out, lse, o.to(out.dtype), l)
    attended = int((layer._exact_cnt_cpu + allow * p.chunk_size).max()) if allow.numel() else 0
    layer.max_attended = max(layer.max_attended, attended + layer.gen_len)
    return out[:, :, None]


def fold_generated(layer, f: int) -> None:
    """Move the oldest ``f`` generated tokens (whole chunks) into ``layer``'s store (see
    `ShadowKVPolicy.fold_size`): the device fold of a `StaticStore` built for it, given back.

    Each is placed on the chunk grid after the prompt, so positions, chunk ids and tail groups
    continue the prompt's. Rows whose tokens up to the fold's end still fit the budget add them
    to their exact tokens; every row gets the chunk entries (the exact rows' not selectable) so
    the grid stays one for the batch.
    """
    store = StaticStore(layer, tokens=layer.seen + 1)
    store.fold()
    store.to_layer(layer, keep_fetched=True)


def decode_backend(policy) -> str:
    # "triton" for the rebuild still lets sparse_decode fall back to torch for unsupported head_dims
    return "torch" if policy.backend == "torch" else "auto"


def torch_step(layer, q0, k_sel, allow, scaling):
    """Generated tokens, exact tokens and selected chunks: on CUDA one `attend_rows` launch over
    the three stores; else each through `sparse_decode`, merged (the reference path)."""
    B, _, D = q0.shape
    H, dev = layer.gen_k.shape[1], q0.device
    allow = allow.to(dev, non_blocking=True) if k_sel else allow
    ids = values = None
    if decode_backend(layer.policy) == "auto" and triton_rows_supported(q0, H, 1 + bool(layer.exact_max) + bool(k_sel)):
        sets = [(layer.gen_k, layer.gen_v, None, layer.gen_len)]
        if layer.exact_max:
            sets.append((layer.exact_k, layer.exact_v, layer.exact_cnt, layer.exact_max))
        if k_sel:
            keys, vals, ids, values, unit, cnt = selected_rows(layer, q0, k_sel, allow, scaling)
            sets.append((keys, vals, cnt * unit, keys.shape[2]))
        out, lse = attend_rows(q0, sets, scale=scaling, backend="triton")
        return out.to(q0.dtype), lse, ids, values
    full = lambda n: torch.full((B,), n, dtype=torch.int32, device=dev)  # noqa: E731
    gen_index = SparseIndex.dense(full(layer.gen_len), H, block_size=64, capacity=layer.gen_k.shape[2])  # no sync
    backend = decode_backend(layer.policy)
    out, lse = sparse_decode(q0, layer.gen_k, layer.gen_v, gen_index, scale=scaling, backend=backend,
                             validate_index=False)
    if layer.exact_max:
        index = SparseIndex(1, layer.exact_idx, layer.exact_cnt, full(layer.exact_max))
        o, l = sparse_decode(q0, layer.exact_k, layer.exact_v, index, scale=scaling, backend=backend,
                             validate_index=False)
        out, lse = merge_states(out, lse, o, l)
    if k_sel:
        o, l, ids, values = attend_selected(layer, q0, k_sel, allow, scaling)
        out, lse = merge_states(out, lse, o, l)
    return out, lse, ids, values


def native_step_ok(layer, q0: torch.Tensor) -> bool:
    """Whether this step runs as two compiled calls (`kvpress.kernels.backend.shadowkv_step_backend`
    decides from the policy's backend: ``"auto"``, fp32 CPU, the library built)."""
    return shadowkv_step_backend(q0, layer.gen_k, layer.policy.backend, layer.landmarks, layer.factor,
                                 layer.basis) == "native"

def native_step(layer, q0, k_sel, allow, scaling):
    """`native.shadowkv_select` (selection and the chosen chunks' keys), the values fetched, then
    `native.attend_rows` over generated tokens, exact tokens and chosen chunks (or single
    tokens, ``select="tokens"``) under one softmax."""
    p = layer.policy
    B, _, D = q0.shape
    H, cs = layer.gen_k.shape[1], p.chunk_size
    sets = [(layer.gen_k, layer.gen_v, None, layer.gen_len)]
    if layer.exact_max:
        sets.append((layer.exact_k, layer.exact_v, layer.exact_cnt, layer.exact_max))
    ids = values = None
    if k_sel:
        n_cand = min(k_sel * p.rerank, layer.max_selectable)
        tokens = p.select == "tokens"
        ids, keys = native.shadowkv_select(q0, layer.landmarks, layer.selectable, layer.factor, layer.basis,
                                           layer._rope_inv_freq(q0.device), layer.rope_start, allow, k=k_sel,
                                           shortlist=max(n_cand, k_sel), chunk_size=cs, scale=scaling,
                                           reduction=p.score_reduction, tokens=tokens)
        keys, values = fetch_selected(layer, ids, tokens, q0.device, keys)
        rows = (ids >= 0).sum(-1).to(torch.int32) * (1 if tokens else cs)
        sets.append((keys, values.reshape(B, H, k_sel * cs, D).contiguous(), rows, k_sel * cs))
        if tokens:
            values = values.view(B, H, k_sel * cs, D)
    out, lse = native.attend_rows(q0, sets, scale=scaling)
    return out, lse, ids, values

def fetch_selected(layer, ids, tokens: bool, device, rebuilt):
    """The chosen chunks' (``tokens``: single tokens') values from the host tier, reusing the
    previous step's, and the keys to attend them with (B, H, rows, D): ``rebuilt`` (their
    low-rank keys), with ``residual_bits`` plus their residual fetched beside the values, with
    ``fetch_keys`` their exact keys fetched instead. Returns ``(keys, values)``."""
    p = layer.policy
    B, H = ids.shape[:2]
    as_units = (lambda t: t.view(B, H, -1, 1, t.shape[-1])) if tokens else (lambda t: t)  # noqa: E731
    table = key_table(layer)
    if table is not None:  # one plan for both tables: the same chunks, one step
        values, fetched = fetch_tables([as_units(layer.v_host), as_units(table)], ids, layer.sel_idx,
                                       [layer.sel_values, layer.sel_keys], layer.counters, device)
    else:
        values, fetched = fetch_chunks(as_units(layer.v_host), ids, layer.sel_idx, layer.sel_values, layer.counters,
                                       device), None
    layer.sel_idx, layer.sel_values, layer.sel_keys = ids, values, fetched
    keys = rebuilt
    if p.fetch_keys:
        keys = fetched.reshape(rebuilt.shape)
    elif p.residual_bits:
        keys = add_residual(rebuilt, fetched.reshape(*rebuilt.shape[:3], -1), p.residual_bits,
                            p.residual_group_for(rebuilt.shape[-1]), backend=p.backend)
    return keys, values

def selected_rows(layer, q0, k_sel, allow, scaling):
    """Top ``allow[b, h]`` (<= ``k_sel``) chunks per KV head -- or as many single tokens with
    ``select="tokens"`` -- : their keys rebuilt (``fetch_keys``: the exact ones fetched) and
    their values fetched. Returns keys and values (B, H, k_sel * cs, D), the chosen ids, the
    values as the caller returns them (the tail estimate reads them), the rows per unit and
    the units in use (B, H) int32: the first ``cnt * unit`` rows are in use."""
    p = layer.policy
    B, H, _, D = layer.landmarks.shape
    cs, dev = p.chunk_size, q0.device
    n_cand = min(k_sel * p.rerank, layer.max_selectable)
    select = select_tokens if p.select == "tokens" else select_chunks
    ids, keys = select(q0, layer.landmarks, layer.selectable, layer.factor, layer.basis,
                       layer._rope_inv_freq(dev), layer.rope_start, allow, k=k_sel,
                       shortlist=max(n_cand, k_sel), chunk_size=cs, scale=scaling,
                       reduction=p.score_reduction, backend=p.backend)
    tokens = p.select == "tokens"
    keys, values = fetch_selected(layer, ids, tokens, dev, keys)
    cnt = (ids >= 0).sum(-1).to(torch.int32)  # (B, H)
    rows_v = values.view(B, H, k_sel * cs, D)
    return keys, rows_v, ids, rows_v if tokens else values, 1 if tokens else cs, cnt

def attend_selected(layer, q0, k_sel, allow, scaling):
    """`_selected_rows` attended through `sparse_decode`: ``(out, lse, ids, values)``."""
    keys, vals, ids, values, unit, cnt = selected_rows(layer, q0, k_sel, allow, scaling)
    B, dev = q0.shape[0], q0.device
    slots = torch.arange(keys.shape[2] // unit, device=dev, dtype=torch.int32)
    index = SparseIndex(unit, torch.where(slots < cnt[..., None], slots, -1), cnt,
                        torch.full((B,), keys.shape[2], dtype=torch.int32, device=dev))
    out, lse = sparse_decode(q0, keys, vals, index, scale=scaling, backend=decode_backend(layer.policy),
                             validate_index=False)
    return out, lse, ids, values
