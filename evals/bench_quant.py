"""Benchmarks of the quantization policies (kivi / zipcache / gear) and their decode kernel.

Every mode checks correctness first, prints one fixed-width table and writes
``bench_quant_<mode>.json`` / ``.csv`` under ``--out``.

``kernel``: fused dequantize-attention decode (``kvpress.kernels.quant_decode``) vs dense SDPA
decode over the same context. GPU (triton backend, bf16 dense baseline, Llama-3-8B attention
H_q=32, H_kv=8, D=128)::

    python -m kvpress.evals.bench_quant kernel --device cuda --contexts 8k,32k,128k --bits 4,2 --out results/

A 4-bit cache moves ~3.5x fewer bytes than bf16, so a bandwidth-bound kernel could run up to ~3.5x faster at 32k.
On a GPU each side rotates over copies of its inputs when they would fit in L2 (column
``copies``; `bench_kernels.copies_beyond_l2`), so small working sets are not timed from cache.
CPU (torch backend, fp32 dense baseline, batch 1)::

    python -m kvpress.evals.bench_quant kernel --device cpu --contexts 8k,32k --threads 1

``bits``: ``cache_stats(...).bits_per_element`` of each policy on SmolLM2 after a real prefill
(fp16 weights, so the fp window costs 16 bits an element as on a GPU)::

    python -m kvpress.evals.bench_quant bits --length 8192

``sqnr``: per policy, effective bits (fp16 SmolLM2 cache after a ``--length`` prefill), SQNR of
the keys and values the packed store reproduces against the exact ones (all layers pooled,
packed tokens only: read back through the layer's own scoring / value paths with identity
queries and probabilities, so every correction a policy applies is included; nan for a layer
whose packed tokens are not in sequence order, i.e. zipcache) and long-text
perplexity (fp32, chunks of 512)::

    python -m kvpress.evals.bench_quant sqnr --length 4096 --policies kivi-2,kivi-2-g16,zipcache,gear-2

``attn``: a fast screen (~30 s a policy) that ranked configs as the 4k perplexity did: real
SmolLM2 queries / keys / values of every layer on the perplexity text (captured once through
``full``), each policy layer fed the first ``--length - 512`` tokens as a prompt, then the last
512 queries attend as one chunk; attention-output SQNR against exact attention, averaged over
layers (``mean_db``) and the worst layer (``min_db``)::

    python -m kvpress.evals.bench_quant attn --policies kivi-2,kivi-2-g16,gear-2,gear-2-no-sink

``quality``: SmolLM2 long-text perplexity (``kvpress.generation.chunked_nll``, chunks of 512,
so every chunk attends to the quantized earlier ones) and eval-suite task scores::

    python -m kvpress.evals.bench_quant quality --length 4096 --tasks niah_single,vt --samples 3
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpress.compat import cache_kwargs, output_cache
from kvpress.evals.bench_kernels import copies_beyond_l2, graph_timeit, rotating, timeit
from kvpress.kernels.packed_decode import quant_decode, reference_quant_decode
from kvpress.kernels.quant import quantize_per_channel, quantize_per_token

H_Q, H_KV, HEAD_DIM = 32, 8, 128  # Llama-3-8B attention
POLICIES = {  # label -> (registry name, overrides)
    "full": ("full", {}),
    "kivi-4": ("kivi", {"bits": 4}),
    "kivi-2": ("kivi", {"bits": 2}),
    "kivi-2-g16": ("kivi", {"bits": 2, "group_size": 16}),
    "kivi-2-g64": ("kivi", {"bits": 2, "group_size": 64}),
    "zipcache": ("zipcache", {}),
    "zipcache-r1/16": ("zipcache", {"salient_ratio": 0.0625}),  # below kivi-2's bits
    "gear-2": ("gear", {"bits": 2}),
    "gear-2-no-sink": ("gear", {"bits": 2, "sink_tokens": 0}),  # ablations of the default
    "gear-2-sink-only": ("gear", {"bits": 2, "outliers_per_group": 0, "rank": 0}),
    "gear-2-rank0": ("gear", {"bits": 2, "rank": 0}),
    "gear-2-g16-sink-only": ("gear", {"bits": 2, "group_size": 16, "outliers_per_group": 0, "rank": 0}),  # kivi-2-g16 + sinks
}


def _k(text: str) -> list[int]:
    return [int(float(t[:-1]) * 1024) if t.endswith("k") else int(t) for t in text.split(",") if t]


def _write(rows: list[dict], out: str | None, mode: str) -> None:
    if not out or not rows:
        return
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"bench_quant_{mode}.json").write_text(json.dumps(rows, indent=1))
    with open(path / f"bench_quant_{mode}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _table(rows: list[dict]) -> str:
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    width = {c: max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.rjust(width[c]) for c in cols)]
    lines += ["  ".join(fmt(r[c]).rjust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- kernel
def _packed(B, T, bits, group, device, gen):
    k = torch.randn(B, H_KV, T, HEAD_DIM, generator=gen).to(device)
    v = torch.randn(B, H_KV, T, HEAD_DIM, generator=gen).to(device)
    return k, v, quantize_per_channel(k, bits, group), quantize_per_token(v, bits, group)


def kernel_mode(args) -> list[dict]:
    device = torch.device(args.device)
    backend = "triton" if device.type == "cuda" else "torch"
    dense_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q_dtype = torch.float16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    # correctness first: the backend against the dequantizing reference
    for bits in args.bits:
        _, _, kq, vq = _packed(1, 1024, bits, args.group_size, device, gen)
        q = torch.randn(1, H_Q, HEAD_DIM, generator=gen).to(device)
        ref, _ = reference_quant_decode(q, *kq, *vq, bits=bits, group_size=args.group_size)
        out, _ = quant_decode(q.to(q_dtype), *kq, *vq, bits=bits, group_size=args.group_size, backend=backend)
        err = (out.float() - ref).abs().max().item()
        if err > 1e-2:
            raise SystemExit(f"quant_decode ({backend}, {bits}-bit) differs from the reference by {err}")
    rows = []
    for B in args.batches:
        for T in args.contexts:
            k, v, _, _ = _packed(B, T, 2, args.group_size, device, gen)
            kd, vd = k.to(dense_dtype), v.to(dense_dtype)
            q = torch.randn(B, H_Q, HEAD_DIM, generator=gen).to(device)
            qd = q.to(dense_dtype)[:, :, None]
            dense_bytes = kd.numel() * kd.element_size() * 2
            # on a GPU, a working set that fits in L2 would be timed from cache: rotate over copies
            n_dense = copies_beyond_l2(dense_bytes) if device.type == "cuda" else 1
            dense_sets = [(qd, kd, vd)] + [(qd, kd.clone(), vd.clone()) for _ in range(n_dense - 1)]
            dense = rotating([lambda s=s: F.scaled_dot_product_attention(*s, enable_gqa=True) for s in dense_sets])
            for bits in args.bits:
                _, _, kq, vq = _packed(B, T, bits, args.group_size, device, gen)
                qq = q.to(q_dtype)
                packed_bytes = sum(t.numel() * t.element_size() for t in (*kq, *vq))
                n_quant = copies_beyond_l2(packed_bytes) if device.type == "cuda" else 1
                sets = [(kq, vq)] + [(tuple(t.clone() for t in kq), tuple(t.clone() for t in vq))
                                     for _ in range(n_quant - 1)]
                quant = rotating([lambda s=s: quant_decode(qq, *s[0], *s[1], bits=bits, group_size=args.group_size,
                                                           backend=backend) for s in sets])
                fns = [quant, dense]
                t_q, t_d = timeit(fns, device, args.warmup, args.iters, args.clock)
                eager = t_q
                if device.type == "cuda":  # device time (graph replays); eager_ms keeps the launch cost
                    reps = -(-20 // math.lcm(n_quant, n_dense)) * math.lcm(n_quant, n_dense)  # whole rotations
                    t_q, t_d = graph_timeit(fns, device, reps=reps)
                rows.append({"device": device.type, "B": B, "context": T, "bits": bits, "group": args.group_size,
                             "quant_ms": t_q, "dense_ms": t_d, "eager_ms": eager, "speedup": t_d / t_q,
                             "packed_MB": packed_bytes / 1e6, "dense_MB": dense_bytes / 1e6,
                             "quant_GB/s": packed_bytes / t_q / 1e6, "dense_GB/s": dense_bytes / t_d / 1e6,
                             "copies": n_quant, "dense_dtype": str(dense_dtype).replace("torch.", "")})
                del sets
            del dense_sets
    return rows


# ----------------------------------------------------------------------------- model modes
def _policy(label):
    """A label of `POLICIES`, or any policy spec as the CLI takes it (``kivi:bits=4:rotate_values=True``)."""
    import kvpress

    if label not in POLICIES:
        return kvpress.get_policy(label)
    name, overrides = POLICIES[label]
    return kvpress.get_policy(name, **overrides)


def bits_mode(args) -> list[dict]:
    import kvpress
    from kvpress.evals.tasks import get_task

    model, tok = kvpress.load_model("smollm2", dtype=args.dtype)
    ids = torch.tensor([get_task("ppl").token_ids(tok, args.length)])
    rows = []
    for label in args.policies:
        with torch.no_grad(), kvpress.apply(model, _policy(label)):
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache = output_cache(out)
            nxt = out.logits[:, -1:].argmax(-1)
            for _ in range(args.decode):  # a few steps, so the window is in its steady state
                nxt = model(nxt, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
        s = kvpress.cache_stats(cache)
        rows.append({"policy": label, "tokens": s.tokens, "dtype": args.dtype, "bits_per_element": s.bits_per_element,
                     "resident_MB": s.resident_bytes / 1e6, "dense_MB": s.dense_bytes / 1e6})
    return rows


def _reproduced_kv(layer, chunk: int = 512):
    """Keys and values (B, H, N, D) fp32 a quantized layer reproduces for its N packed tokens:
    scores of identity queries are the keys, outputs of one-hot probabilities the values (rotated
    back to the model's basis where the layer stores them rotated, ``rotate_values``)."""
    B, H, _, D = layer.k_win.shape
    N = layer.n_quant
    eye = torch.eye(D).expand(B, H, D, D)
    k = layer._quant_scores(eye, 1.0).transpose(-1, -2)  # (B, H, N, D)
    v = torch.cat([layer._quant_output(torch.eye(N)[i : i + chunk].expand(B, H, -1, N).contiguous())
                   for i in range(0, N, chunk)], 2)
    return k, layer.from_stored_values(v)


def sqnr_mode(args) -> list[dict]:
    import kvpress
    from kvpress.evals.tasks import get_task
    from kvpress.generation import chunked_nll

    def sqnr(ref, err):
        return 10 * math.log10(ref / err)

    rows = []
    model16, tok = kvpress.load_model("smollm2", dtype="float16")
    model, _ = kvpress.load_model("smollm2", dtype="float32")
    ids = torch.tensor([get_task("ppl").token_ids(tok, args.length)])
    with torch.no_grad(), kvpress.apply(model, kvpress.get_policy("full")):
        exact = output_cache(model(ids, use_cache=True))
        exact = [(layer.keys.float(), layer.values.float()) for layer in exact.layers]
    for label in args.policies:
        policy = _policy(label)
        with torch.no_grad(), kvpress.apply(model16, policy):
            bits = kvpress.cache_stats(model16(ids, use_cache=True, logits_to_keep=1)).bits_per_element
        row = {"policy": label, "bits_per_element": bits}
        if label != "full" and all(getattr(layer, "packed_in_sequence_order", False) for layer in
                                   kvpress.make_cache(model, policy).layers):
            with torch.no_grad(), kvpress.apply(model, policy):
                cache = output_cache(model(ids, use_cache=True, logits_to_keep=1))
                acc = [0.0, 0.0, 0.0, 0.0]
                for layer, (k, v) in zip(cache.layers, exact):
                    kh, vh = _reproduced_kv(layer)
                    n = kh.shape[2]
                    acc[0] += k[:, :, :n].pow(2).sum().item()
                    acc[1] += (k[:, :, :n] - kh).pow(2).sum().item()
                    acc[2] += v[:, :, :n].pow(2).sum().item()
                    acc[3] += (v[:, :, :n] - vh).pow(2).sum().item()
            row.update(k_sqnr_db=sqnr(acc[0], acc[1]), v_sqnr_db=sqnr(acc[2], acc[3]))
        else:  # full: exact; a store in another order (zipcache's precision stores) cannot be paired back
            exact_row = label == "full"
            row.update(k_sqnr_db=float("inf") if exact_row else float("nan"),
                       v_sqnr_db=float("inf") if exact_row else float("nan"))
        if not args.no_ppl:
            row["ppl"] = math.exp(chunked_nll(model, ids, policy, chunk_size=512).mean().item())
        rows.append(row)
        print(row, flush=True)
    return rows


def _capture_qkv(model, ids) -> dict[int, tuple]:
    """Post-RoPE (q, k, v, scaling) of every layer for ``ids``, read off a ``full`` cache's
    ``attend`` calls (the layer class is wrapped only for this one forward)."""
    import kvpress

    policy = kvpress.get_policy("full")
    cls = type(kvpress.make_cache(model, policy).layers[0])
    seen, orig = {}, cls.attend

    def attend(self, q, k, v, scaling):
        seen[self.layer_idx] = (q, k, v, scaling)
        return orig(self, q, k, v, scaling)

    cls.attend = attend
    try:
        with torch.no_grad(), kvpress.apply(model, policy):
            model(ids, use_cache=True, logits_to_keep=1)
    finally:
        cls.attend = orig
    return seen


def attn_mode(args) -> list[dict]:
    import kvpress
    from kvpress.attention import dense_causal_attention
    from kvpress.evals.tasks import get_task

    model, tok = kvpress.load_model("smollm2", dtype="float32")
    ids = torch.tensor([get_task("ppl").token_ids(tok, args.length)])
    qkv = _capture_qkv(model, ids)
    q0 = args.length - 512  # the last chunk's queries, as in the chunked perplexity
    refs = {i: dense_causal_attention(q[:, :, q0:], k, v, sc, q_start=q0) for i, (q, k, v, sc) in qkv.items()}
    energy = {i: ref.pow(2).sum().item() for i, ref in refs.items()}  # per layer, shared by every policy
    rows = []
    for label in args.policies:
        policy = _policy(label)
        cache = kvpress.make_cache(model, policy)
        dbs = []
        with torch.no_grad():
            for i, (q, k, v, sc) in qkv.items():
                layer = cache.layers[i]
                layer.update(k[:, :, :q0], v[:, :, :q0])
                if policy.prefills_densely():
                    layer.ingest_prefill(*layer.take_pending())
                else:  # a policy that needs the prompt's queries (zipcache's probes)
                    layer.attend(q[:, :, :q0], *layer.take_pending(), sc)
                layer.update(k[:, :, q0:], v[:, :, q0:])
                out = layer.attend(q[:, :, q0:], *layer.take_pending(), sc)
                err = (out.float() - refs[i]).pow(2).sum().item()
                dbs.append(10 * math.log10(energy[i] / max(err, 1e-30)))
        worst = min(range(len(dbs)), key=dbs.__getitem__)
        rows.append({"policy": label, "mean_db": sum(dbs) / len(dbs), "min_db": dbs[worst], "worst_layer": worst})
        print(rows[-1], flush=True)
    return rows


def quality_mode(args) -> list[dict]:
    import kvpress
    from kvpress.evals.tasks import build_input_ids, get_task
    from kvpress.generation import chunked_nll, timed_generate

    model, tok = kvpress.load_model("smollm2", dtype=args.dtype)
    ppl_ids = torch.tensor([get_task("ppl").token_ids(tok, args.length)])
    tasks = [get_task(t) for t in args.tasks]
    samples = {t.spec: t.generate(tok, args.length, args.samples, seed=0) for t in tasks}
    rows = []
    for label in args.policies:
        policy = _policy(label)
        t0 = time.perf_counter()
        nll = chunked_nll(model, ppl_ids, policy, chunk_size=512)
        row = {"policy": label, "length": args.length, "ppl": math.exp(nll.mean().item())}
        for task in tasks:
            scores = []
            for sample in samples[task.spec]:
                ids = torch.tensor([build_input_ids(tok, sample)])
                out = timed_generate(model, ids, policy, max_new_tokens=sample.max_new_tokens,
                                     eos_token_id=tok.eos_token_id)
                scores.append(task.score(tok.decode(out.tokens, skip_special_tokens=True), sample))
            row[task.name] = sum(scores) / len(scores)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["kernel", "bits", "sqnr", "attn", "quality"])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", type=_k, default=None, help="kernel: comma list, k = 1024 (default cuda 8k,32k,128k; cpu 8k,32k)")
    p.add_argument("--batches", type=_k, default=[1])
    p.add_argument("--bits", type=_k, default=[4, 2])
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"labels from {list(POLICIES)} or policy specs (kivi:bits=4:rotate_values=True)")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--dtype", default=None, help="SmolLM2 weights dtype (default: float16 for bits, float32 for quality)")
    p.add_argument("--tasks", default="niah_single,vt")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--no-ppl", action="store_true", help="sqnr: skip the perplexity column")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.policies = args.policies.split(",")
    args.tasks = [t for t in args.tasks.split(",") if t]
    if args.dtype is None:
        args.dtype = "float16" if args.mode == "bits" else "float32"  # sqnr: fp16 for bits, fp32 for the rest
    if args.contexts is None:
        args.contexts = _k("8k,32k,128k") if args.device == "cuda" else _k("8k,32k")
    modes = {"kernel": kernel_mode, "bits": bits_mode, "sqnr": sqnr_mode, "attn": attn_mode, "quality": quality_mode}
    rows = modes[args.mode](args)
    print(_table(rows))
    _write(rows, args.out, args.mode)
    return rows


if __name__ == "__main__":
    main()
