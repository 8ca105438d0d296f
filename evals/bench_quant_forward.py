"""A multi-token forward on a quantized cache: reading the packed codes against one dequantized copy.

    python -m kvpress.evals.bench_quant_forward --context 8192 --tokens 2,4,8,16,32,64 --threads 1

One cache layer of SmolLM2's attention shape (9 query heads, 3 KV heads, head_dim 64) per policy
is filled with ``--context`` random tokens (all but the window packed), then a forward of ``T``
new tokens is timed through each path of `kvpress.policies._quant.QuantWindowLayer.attend`:
``codes`` (the packed readers, queries in blocks; the native CPU kernels where they take the
rows) and ``copy`` (the store dequantized once into fp32, SDPA over [copy | window]). The layer's
flush is switched off and the window rolled back after every forward, so each repeat times the
same attention; the table gives the median ms per forward of ``--repeats`` and checks first
that the two paths' outputs agree. `_quant.DEQUANT_MIN_QUERIES` is the ``T`` from which
``attend`` takes the copy.

``--ppl-tokens N`` adds a model-level comparison: the perplexity of N tokens of the long-text
task fed through each policy's cache in 512-token chunks (`kvpress.generation.chunked_nll`, the
eval suite's ``ppl`` path) with each path, and its wall time::

    python -m kvpress.evals.bench_quant_forward --ppl-tokens 4096 --tokens 16 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def one_layer_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    return AutoModelForCausalLM.from_config(config).eval()


def filled_layer(model, policy, context: int, seed: int = 0):
    import kvpress

    gen = torch.Generator().manual_seed(seed)
    layer = kvpress.make_cache(model, policy).layers[0]
    k, v = torch.randn(1, 3, context, 64, generator=gen), torch.randn(1, 3, context, 64, generator=gen)
    q = torch.randn(1, 9, context, 64, generator=gen)
    layer.update(k, v)
    layer.attend(q, *layer.take_pending(), 0.125)
    layer._maybe_flush = lambda: None  # every timed forward sees the same store and window
    return layer


def forward(layer, q, k, v, threshold: int):
    """One ``T``-token forward with ``DEQUANT_MIN_QUERIES = threshold``; the window rolled back after."""
    from kvpress.policies import _quant

    saved, _quant.DEQUANT_MIN_QUERIES = _quant.DEQUANT_MIN_QUERIES, threshold
    probes = layer.probe_state() if hasattr(layer, "probe_state") else None
    try:
        start = time.perf_counter()
        layer.update(k, v)
        out = layer.attend(q, *layer.take_pending(), 0.125)
        seconds = time.perf_counter() - start
    finally:
        _quant.DEQUANT_MIN_QUERIES = saved
        T = k.shape[2]
        layer.win_len -= T
        layer.seen -= T
        if probes is not None:  # zipcache: its probes as they were
            layer.set_probe_state(probes)
    return out, seconds


def perplexities(model_name: str, policies: list[str], tokens: int) -> list[dict]:
    """Perplexity and seconds of `chunked_nll` (512-token chunks) per policy with each path."""
    import math

    import kvpress
    from kvpress.evals.models import load_eval_model
    from kvpress.evals.tasks import get_task
    from kvpress.generation import chunked_nll

    model, tokenizer = load_eval_model(model_name)
    ids = torch.tensor([get_task("ppl").token_ids(tokenizer, tokens)])
    rows = []
    print(f"# {model_name}: perplexity of {ids.shape[1]} tokens in 512-token chunks; seconds")
    print(f"{'policy':<22}{'codes ppl':>12}{'s':>8}{'copy ppl':>12}{'s':>8}")
    for spec in policies:
        row = {"policy": spec, "ppl_tokens": ids.shape[1]}
        for mode, threshold in (("codes", 10**9), ("copy", 1)):
            from kvpress.policies import _quant

            saved, _quant.DEQUANT_MIN_QUERIES = _quant.DEQUANT_MIN_QUERIES, threshold
            try:
                start = time.perf_counter()
                nll = chunked_nll(model, ids, kvpress.get_policy(spec), chunk_size=512)
                row[f"{mode}_s"] = time.perf_counter() - start
            finally:
                _quant.DEQUANT_MIN_QUERIES = saved
            row[f"{mode}_ppl"] = math.exp(nll.mean().item())
        rows.append(row)
        print(f"{spec:<22}{row['codes_ppl']:>12.4f}{row['codes_s']:>8.1f}{row['copy_ppl']:>12.4f}{row['copy_s']:>8.1f}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    import kvpress
    from kvpress.evals.results import write_jsonl

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="kivi:bits=4,zipcache,gear")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--tokens", default="2,4,8,16,32,64", help="forward lengths T, comma list")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ppl-tokens", type=int, default=0, help="also compare perplexity over this many tokens (0: no)")
    p.add_argument("--model", default="smollm2", help="the model of --ppl-tokens")
    p.add_argument("--out", default=None, help="write the rows as JSON lines here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    policies = args.policies.split(",")
    model = one_layer_model()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    print(f"# context={args.context} threads={args.threads} repeats={args.repeats}; ms per forward of one layer (median)")
    print(f"{'policy':<22}" + "".join(f"{'T=' + str(t) + ' codes':>13}{'copy':>8}" for t in tokens))
    for spec in policies:
        layer = filled_layer(model, kvpress.get_policy(spec), args.context)
        line = f"{spec:<22}"
        for T in tokens:
            gen = torch.Generator().manual_seed(T)
            q, k, v = (torch.randn(1, h, T, 64, generator=gen) for h in (9, 3, 3))
            ref, _ = forward(layer, q, k, v, 10**9)
            got, _ = forward(layer, q, k, v, 1)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)  # the paths agree before they are timed
            ms = {}
            for mode, threshold in (("codes", 10**9), ("copy", 1)):
                ms[mode] = statistics.median(forward(layer, q, k, v, threshold)[1] for _ in range(args.repeats)) * 1e3
            rows.append({"policy": spec, "context": args.context, "tokens": T, "codes_ms": ms["codes"], "copy_ms": ms["copy"]})
            line += f"{ms['codes']:>13.2f}{ms['copy']:>8.2f}"
        print(line, flush=True)
    if args.ppl_tokens:
        rows += perplexities(args.model, policies, args.ppl_tokens)
    if args.out:
        write_jsonl(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
