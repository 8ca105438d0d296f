"""How far ShadowKV's low-rank keys move attention, per layer, on a task sample (CPU).

    python benchmarks/shadowkv_key_error.py --task niah_single --length 8192 --samples 48 --sample 46 --ranks 48,64

ShadowKV (arXiv 2410.21465) keeps each layer's pre-RoPE keys of all KV heads as a truncated SVD
(`kvpress.policies._shadowkv_store.low_rank`) and rebuilds the attended keys from it. This
measures what that costs the attention of the prompt's last ``--queries`` queries: for each
layer, the total variation distance between their softmax over all prompt keys with the exact
keys and with the rank-``r`` keys, averaged over query heads and queries (0 = the same
distribution, 1 = disjoint), and the share of the keys' energy the rank keeps.

Two factorisations are compared at each rank:

* ``plain``: the paper's SVD (``shadowkv``'s default), the best rank-``r`` keys in squared error,
  every channel alike;
* ``query``: ``shadowkv:svd=query``, the SVD in the metric of the prompt's queries: each channel
  weighted by the mean square of the queries of the KV head's group in it, averaged over each
  rotary pair (`kvpress.policies._shadowkv_store.query_pair_weights`), so the error it minimises
  is that of the scores ``q . k`` those queries would compute.

``--residual-bits 2,4`` adds, for each factorisation and rank, the rebuilt keys plus their
residual (the exact post-RoPE keys less the rebuilt ones) quantized per token in groups of
``--residual-group`` channels, as ``shadowkv:residual_bits=N`` fetches it beside the values
(columns ``plain+2b``, ...).

Keys and queries are read from the model's ``k_proj`` / ``q_proj`` outputs (pre-RoPE, Llama-style
rotary pairs) during one dense prefill; RoPE is applied as the model does.
"""

from __future__ import annotations

import argparse

import torch

from kvpress.evals.models import load_eval_model
from kvpress.kernels.quant import dequantize_per_token, quantize_per_token
from kvpress.evals.tasks import get_task
from kvpress.evals.tasks.base import build_input_ids
from kvpress.policies._shadowkv_store import low_rank, query_pair_weights

from _projections import prompt_projections, rotate


def low_rank_keys(k: torch.Tensor, rank: int, weights: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    """Rank-``rank`` keys (T, H_kv * D) of ``k`` as the policy factors them (`low_rank`, with the
    channel ``weights`` (H_kv * D,) of ``svd="query"`` or None), and the share of the (weighted)
    energy they keep."""
    H = 1  # the basis' head split does not matter here
    factor, basis = low_rank(k[None].float(), torch.zeros(1, dtype=torch.long), rank, H, torch.float32,
                             None if weights is None else weights[None])
    approx = (factor @ basis.reshape(1, rank, -1))[0]
    w = torch.ones(k.shape[1]) if weights is None else weights
    kept = 1 - float(((k - approx).square() * w).sum() / (k.float().square() * w).sum())
    return approx, kept


@torch.no_grad()
def key_error(model, input_ids: torch.Tensor, ranks: list[int], queries: int, residual_bits=(),
              residual_group: int = 32) -> list[dict]:
    """Per layer: ``{(method, rank): (tv, energy)}`` for methods ``plain`` and ``query``, and
    ``plain+Nb`` / ``query+Nb`` for each of ``residual_bits``."""
    cfg = model.config
    H_q, H = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H_q
    grabbed, cos, sin = prompt_projections(model, input_ids, ("q_proj", "k_proj"))
    T = input_ids.shape[1]
    rows = []
    for i in range(cfg.num_hidden_layers):
        q = grabbed[("q_proj", i)].float().view(T, H_q, D)
        k = grabbed[("k_proj", i)].float().view(T, H * D)
        qr = rotate(q[-queries:].transpose(0, 1), cos[-queries:], sin[-queries:]) * D ** -0.5  # (H_q, n, D)

        def rotated(keys):  # (H, T, D) post-RoPE
            return rotate(keys.view(T, H, D).transpose(0, 1), cos, sin)

        def attention(kr):
            kr = kr.repeat_interleave(H_q // H, 0)  # (H_q, T, D)
            return torch.softmax(qr @ kr.transpose(1, 2), dim=-1)  # (H_q, n, T)

        exact_rot = rotated(k)
        exact = attention(exact_rot)
        row = {}
        q_sq = q.square().view(T, H, H_q // H, D).mean(2).transpose(0, 1)[None]  # (1, H, T, D)
        weights = query_pair_weights(q_sq, torch.ones(1, T, dtype=torch.bool))[0]
        for method, w in (("plain", None), ("query", weights)):
            for r in ranks:
                approx, kept = low_rank_keys(k, r, w)
                approx_rot = rotated(approx)
                tv = 0.5 * (attention(approx_rot) - exact).abs().sum(-1).mean().item()
                row[(method, r)] = (tv, kept)
                for bits in residual_bits:
                    codes, scale, zero = quantize_per_token((exact_rot - approx_rot)[None], bits, residual_group)
                    fixed = approx_rot + dequantize_per_token(codes, scale, zero, bits, residual_group)[0]
                    tv = 0.5 * (attention(fixed) - exact).abs().sum(-1).mean().item()
                    row[(f"{method}+{bits}b", r)] = (tv, kept)
        rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=48, help="samples the task generates (as `kvpress eval --samples`)")
    ap.add_argument("--sample", type=int, default=46, help="which of them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", default="48,64")
    ap.add_argument("--queries", type=int, default=16, help="the prompt's last queries whose attention is compared")
    ap.add_argument("--residual-bits", default="", help="e.g. 2,4: also the rebuilt keys plus their quantized residual")
    ap.add_argument("--residual-group", type=int, default=32, help="channels per scale of the residual")
    args = ap.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    bits = [int(b) for b in args.residual_bits.split(",") if b]
    model, tokenizer = load_eval_model(args.model)
    sample = get_task(args.task).generate(tokenizer, args.length, args.samples, args.seed)[args.sample]
    ids = torch.tensor([build_input_ids(tokenizer, sample)])
    rows = key_error(model, ids, ranks, args.queries, bits, args.residual_group)
    methods = [f"{m}{s}" for m in ("plain", "query") for s in [""] + [f"+{b}b" for b in bits]]
    cols = [(m, r) for r in ranks for m in methods]
    print(f"{args.task} sample {args.sample} at {args.length} tokens ({ids.shape[1]} in the prompt), "
          f"attention of the last {args.queries} queries: TV distance (energy kept)")
    print("| layer | " + " | ".join(f"{m} r={r}" for m, r in cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for i, row in enumerate(rows):
        print(f"| {i} | " + " | ".join(f"{row[c][0]:.3f} ({row[c][1]:.3f})" for c in cols) + " |")
    print("| mean | " + " | ".join(f"{sum(r[c][0] for r in rows) / len(rows):.3f}" for c in cols) + " |")
    return rows


if __name__ == "__main__":
    main()
