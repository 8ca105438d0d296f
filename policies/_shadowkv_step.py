"""``shadowkv``'s eager decode step (for `ShadowKVLayer`): the generated token stored (a fold first
when one is due), the chunks chosen, their values fetched from the host tier (reusing the previous
step's), exact + chosen + generated tokens attended under one softmax."""

from __future__ import annotations

import torch

from kvpress.kernels import SparseIndex, merge_states, native, sparse_decode
from kvpress.kernels.backend import shadowkv_step_backend
from kvpress.kernels.rows import attend_rows, triton_rows_supported

from ._shadowkv_select import select_chunks, select_tokens, tail_estimate, tail_estimate_tokens
from ._shadowkv_static import StaticStore
from ._shadowkv_store import attended_keys, fetch_tables


def store_step(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store one token per row ``k``/``v`` (B, H_kv, 1, D) as a decode step does: first, when the
    generated tokens reach ``local_window + fold_size``, the oldest fold into the store (the device
    fold of a `StaticStore` built for it, given back; see `ShadowKVPolicy.fold_size`)."""
    p = layer.policy
    if p.fold_tokens and layer.gen_len >= p.local_window + p.fold_tokens:
        store = StaticStore(layer, tokens=layer.seen + 1)
        store.fold()
        store.to_layer(layer)  # (the previous step's fetch stays: chunk ids are stable)
    layer.gen.append(k, v)
    layer.seen += 1


def key_table(layer):
    """The host table fetched beside the values: exact keys (``fetch_keys``), the rebuilt keys'
    quantized residual (``residual_bits``) or None."""
    return layer.k_host if layer.policy.fetch_keys else layer.kr_host


def decode(layer, q, k_new, v_new, scaling):
    """One eager decode step of ``layer``: store, select, fetch, attend (B, H_q, 1, D). On fp32 CPU
    (`kvpress.kernels.backend.shadowkv_step_backend`) selection and attention are two compiled calls."""
    p = layer.policy
    store_step(layer, k_new, v_new)
    q0 = q[:, :, 0].contiguous()  # (B, H_q, D)
    # chunks each (row, KV head) may add: what its own exact tokens and the generated ones leave
    allow = ((p.budget - layer._exact_cnt_cpu - layer.gen_len) // p.chunk_size).clamp(min=0)
    allow = torch.minimum(allow, layer._sel_cnt_cpu)  # (B, H) on the host
    k_sel = int(allow.max()) if allow.numel() else 0
    compiled = shadowkv_step_backend(q0, layer.gen_k, p.backend, layer.landmarks, layer.factor,
                                     layer.basis) == "native"
    out, lse, ids, values = attend_step(layer, q0, k_sel, allow, scaling, compiled)
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


def decode_backend(policy) -> str:
    # "triton" for the rebuild still lets sparse_decode fall back to torch for unsupported head_dims
    return "torch" if policy.backend == "torch" else "auto"


def attend_step(layer, q0, k_sel, allow, scaling, compiled: bool = False):
    """Generated tokens, exact tokens and the top ``allow[b, h]`` (<= ``k_sel``) chunks under one
    softmax: `native.attend_rows` (``compiled``), one Triton `attend_rows` launch on CUDA, else
    each set through `sparse_decode`, merged (the reference path). Returns ``(out, lse, ids, values)``:
    the chosen ids and values as the tail estimate reads them."""
    H, dev = layer.gen_k.shape[1], q0.device
    sets = [(layer.gen_k, layer.gen_v, None, layer.gen_len)]
    if layer.exact_max:
        sets.append((layer.exact_k, layer.exact_v, layer.exact_cnt, layer.exact_max))
    triton = not compiled and decode_backend(layer.policy) == "auto" and triton_rows_supported(
        q0, H, len(sets) + bool(k_sel))
    if not compiled and not triton:
        B = q0.shape[0]
        full = lambda n: torch.full((B,), n, dtype=torch.int32, device=dev)  # noqa: E731
        gen_index = SparseIndex.dense(full(layer.gen_len), H, block_size=64, capacity=layer.gen_k.shape[2])
        out, lse = sparse_decode(q0, layer.gen_k, layer.gen_v, gen_index, scale=scaling,
                                 backend=decode_backend(layer.policy), validate_index=False)
        if layer.exact_max:
            index = SparseIndex(1, layer.exact_idx, layer.exact_cnt, full(layer.exact_max))
            o, l = sparse_decode(q0, layer.exact_k, layer.exact_v, index, scale=scaling,
                                 backend=decode_backend(layer.policy), validate_index=False)
            out, lse = merge_states(out, lse, o, l)
        ids = values = None
        if k_sel:
            o, l, ids, values = attend_selected(layer, q0, k_sel, allow.to(dev, non_blocking=True), scaling)
            out, lse = merge_states(out, lse, o, l)
        return out, lse, ids, values
    ids = values = None
    if k_sel:
        keys, vals, ids, values, unit, cnt = selected_rows(layer, q0, k_sel, allow.to(dev, non_blocking=True),
                                                           scaling, compiled)
        sets.append((keys, vals, cnt * unit, keys.shape[2]))
    if compiled:
        out, lse = native.attend_rows(q0, sets, scale=scaling)
        return out, lse, ids, values
    out, lse = attend_rows(q0, sets, scale=scaling, backend="triton")
    return out.to(q0.dtype), lse, ids, values


def selected_rows(layer, q0, k_sel, allow, scaling, compiled: bool = False):
    """Top ``allow[b, h]`` (<= ``k_sel``) chunks per KV head -- or as many single tokens with
    ``select="tokens"`` -- chosen (`select_chunks` / `select_tokens`, or with ``compiled``
    `native.shadowkv_select`), their values fetched from the host tier reusing the previous step's,
    and the keys to attend them with: rebuilt, plus the fetched residual with ``residual_bits``,
    the fetched exact keys with ``fetch_keys``. Returns keys and values (B, H, k_sel * cs, D), the
    ids, the values as the tail estimate reads them, the rows per unit and the units in use (B, H)
    int32: the first ``cnt * unit`` rows are in use."""
    p = layer.policy
    B, H, _, D = layer.landmarks.shape
    cs, dev, tokens = p.chunk_size, q0.device, p.select == "tokens"
    shortlist = max(min(k_sel * p.rerank, layer.max_selectable), k_sel)
    args = (q0, layer.landmarks, layer.selectable, layer.factor, layer.basis, layer._rope_inv_freq(dev),
            layer.rope_start, allow)
    kwargs = dict(k=k_sel, shortlist=shortlist, chunk_size=cs, scale=scaling, reduction=p.score_reduction)
    if compiled:
        ids, keys = native.shadowkv_select(*args, **kwargs, tokens=tokens)
    else:
        ids, keys = (select_tokens if tokens else select_chunks)(*args, **kwargs, backend=p.backend)
    as_units = (lambda t: t.view(B, H, -1, 1, t.shape[-1])) if tokens else (lambda t: t)  # noqa: E731
    hosts = [as_units(t) for t in (layer.v_host, key_table(layer)) if t is not None]  # one plan, one step
    values, *fetched = fetch_tables(hosts, ids, layer.sel_idx, [layer.sel_values, layer.sel_keys][: len(hosts)],
                                    layer.counters, dev)
    fetched = fetched[0] if fetched else None
    layer.sel_idx, layer.sel_values, layer.sel_keys = ids, values, fetched
    keys = attended_keys(layer, ids, fetched, keys)
    cnt = (ids >= 0).sum(-1).to(torch.int32)  # (B, H)
    rows_v = values.reshape(B, H, k_sel * cs, D)
    return keys, rows_v, ids, rows_v if tokens else values, 1 if tokens else cs, cnt


def attend_selected(layer, q0, k_sel, allow, scaling):
    """`selected_rows` attended through `sparse_decode`: ``(out, lse, ids, values)``."""
    keys, vals, ids, values, unit, cnt = selected_rows(layer, q0, k_sel, allow, scaling)
    B, dev = q0.shape[0], q0.device
    slots = torch.arange(keys.shape[2] // unit, device=dev, dtype=torch.int32)
    index = SparseIndex(unit, torch.where(slots < cnt[..., None], slots, -1), cnt,
                        torch.full((B,), keys.shape[2], dtype=torch.int32, device=dev))
    out, lse = sparse_decode(q0, keys, vals, index, scale=scaling, backend=decode_backend(layer.policy),
                             validate_index=False)
    return out, lse, ids, values
