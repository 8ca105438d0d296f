"""Which part of a 4-bit KV cache moves attention: keys or values, and what each remedy buys (CPU).

    python benchmarks/kv_quant_error.py --task niah_multivalue --length 4096 --samples 64,65 \
        --schemes base,ksink,ksink+vexact,vrot,ksink+vrot

On each task sample the model prefills the prompt once (dense); every layer's queries, keys and
values are read from ``q_proj`` / ``k_proj`` / ``v_proj``, RoPE applied as the model does. Each
scheme quantizes the keys and values of all but the last ``--window`` prompt tokens (the
quantizers' full-precision window) and dequantizes them again -- the numbers a packed store gives
back -- and the attention of the prompt's last ``--queries`` queries is compared with the exact
one, per layer, then averaged over layers and samples:

* ``tv``: total variation distance between the exact and the quantized softmax (what key error does);
* ``out``: relative error ``|o - o*| / |o*|`` of the attention output per query head (both errors).

Schemes are ``+``-joined parts; without a part, keys are 4-bit per channel in groups of 32 tokens
(KIVI's keys) and values 4-bit per token in groups of ``--value-group`` channels:

``ksink``  the first 4 tokens' keys exact, their group's range taken without them (``kivi:sink_tokens=4``)
``k8`` / ``v8``  8-bit keys / values
``kexact`` / ``vexact``  keys / values not quantized (to split the error between them)
``kpre``  keys quantized before RoPE (KVQuant, arXiv 2401.18079), rotated after
``kout``  dense-and-sparse keys: the 20 entries of each 32-token group that lie furthest from their
          channel's median kept exact (about 1% of the entries, KVQuant's share)
``kch8``  the 8 key channels of each KV head with the largest expected score error (mean squared query
          channel over the prompt's queries times the channel's mean squared group range) at 8 bits
``kds8``  the 8 key channels the shipped Double Sparsity artifact ranks first at 8 bits
``krot``  keys and queries rotated by the Hadamard matrix (post-RoPE; scores unchanged) before the
          keys are quantized per channel
``vnorm``  ``zipcache``'s value normaliser: each channel divided by the square root of its largest magnitude
``vrot``  values rotated by the Hadamard matrix before quantization, rotated back after
          (``rotate_values=True``, `kvpress.policies._rotation.value_basis`)
"""

from __future__ import annotations

import argparse

import torch

from kvpress.evals.models import load_eval_model
from kvpress.evals.tasks import get_task
from kvpress.evals.tasks.base import build_input_ids
from kvpress.kernels.quant import (dequantize_per_channel, dequantize_per_token, quantize_per_channel,
                                   quantize_per_token)
from kvpress.policies import _double_sparsity_calib as calib
from kvpress.policies._rotation import value_basis

from _projections import prompt_projections, rotate

PARTS = ("ksink", "k8", "v8", "kexact", "vexact", "kpre", "kout", "kch8", "kds8", "krot", "vnorm", "vrot")
WIDE_CHANNELS = 8
KEY_GROUP = 32
SINKS = 4
OUTLIERS = 20


def per_channel(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` (H, T, D) through KIVI's key quantizer and back."""
    codes, scale, zero = quantize_per_channel(x[None], bits, KEY_GROUP)
    return dequantize_per_channel(codes, scale, zero, bits, KEY_GROUP)[0]


def per_token(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """``x`` (H, T, D) through the value quantizer and back."""
    codes, scale, zero = quantize_per_token(x[None], bits, group)
    return dequantize_per_token(codes, scale, zero, bits, group)[0]


def wide_channels(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per KV head, the ``WIDE_CHANNELS`` key channels whose 4-bit error moves scores most: mean
    squared query channel (post-RoPE queries ``q`` (H_q, T, D)) times mean squared range of the
    channel over its quantization groups (post-RoPE keys ``k`` (H, T', D)); (H, WIDE_CHANNELS)."""
    H, T, D = k.shape
    g = k[:, : T // KEY_GROUP * KEY_GROUP].reshape(H, -1, KEY_GROUP, D)
    spread = (g.amax(2) - g.amin(2)).pow(2).mean(1)  # (H, D)
    q_sq = q.pow(2).reshape(H, -1, q.shape[1], D).mean((1, 2))
    return (q_sq * spread).topk(WIDE_CHANNELS, -1).indices


def quant_keys(k_pre: torch.Tensor, k: torch.Tensor, parts: set, cos, sin, wide=None) -> torch.Tensor:
    """Post-RoPE keys (H, T, D) as the scheme gives them back; ``k_pre`` the same keys before RoPE;
    ``wide`` (H, n) channels kept at 8 bits."""
    if "kexact" in parts:
        return k
    if "krot" in parts:  # q.k = (qH).(kH): quantize kH, hand back (kH)~ H^T
        basis = value_basis(k.shape[-1], k.device)
        return quant_keys(k_pre, k @ basis, parts - {"krot", "kpre"}, cos, sin, wide) @ basis.T
    x = (k_pre if "kpre" in parts else k).clone()
    H, T, D = x.shape
    groups = x.reshape(H, T // KEY_GROUP, KEY_GROUP, D)
    median = groups.median(2, keepdim=True).values.expand_as(groups).reshape(H, T, D)
    exact = x.clone()
    keep = torch.zeros_like(x, dtype=torch.bool)
    if "kout" in parts:
        dev = (x - median).abs().reshape(H, T // KEY_GROUP, KEY_GROUP * D)
        cut = dev.topk(OUTLIERS, -1).values[..., -1:]
        keep |= (dev >= cut).view(H, T, D)
    if "ksink" in parts:
        keep[:, :SINKS] = True
    x = torch.where(keep, median, x)  # kept entries do not stretch their group's range
    coded = per_channel(x, 8 if "k8" in parts else 4)
    if wide is not None:
        idx = wide[:, None, :].expand(H, T, wide.shape[1])
        coded.scatter_(2, idx, per_channel(x, 8).gather(2, idx))
    x = torch.where(keep, exact, coded)
    return rotate(x, cos, sin) if "kpre" in parts else x


def quant_values(v: torch.Tensor, parts: set, group: int) -> torch.Tensor:
    """Values (H, T, D) as the scheme gives them back."""
    if "vexact" in parts:
        return v
    scale = v.abs().amax(1, keepdim=True).sqrt().clamp_min(1e-6) if "vnorm" in parts else None
    basis = value_basis(v.shape[-1], v.device) if "vrot" in parts else None
    x = v if scale is None else v / scale
    x = x if basis is None else x @ basis
    x = per_token(x, 8 if "v8" in parts else 4, group)
    x = x if basis is None else x @ basis.T
    return x if scale is None else x * scale


def quant_error(model, input_ids: torch.Tensor, schemes: list[str], queries: int, window: int,
                value_group: int, ds_rank=None) -> dict[str, tuple[float, float]]:
    """``{scheme: (tv, out)}`` averaged over the layers for one prompt."""
    cfg = model.config
    H_q, H = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H_q
    grabbed, cos, sin = prompt_projections(model, input_ids, ("q_proj", "k_proj", "v_proj"))
    T = input_ids.shape[1]
    n = (T - window) // KEY_GROUP * KEY_GROUP  # quantized tokens
    totals = {s: [0.0, 0.0] for s in schemes}
    layers = cfg.num_hidden_layers
    for i in range(layers):
        q = grabbed[("q_proj", i)].float().view(T, H_q, D).transpose(0, 1)
        k_pre = grabbed[("k_proj", i)].float().view(T, H, D).transpose(0, 1)
        v = grabbed[("v_proj", i)].float().view(T, H, D).transpose(0, 1)
        k = rotate(k_pre, cos, sin)
        qr = rotate(q[:, -queries:], cos[-queries:], sin[-queries:]) * D ** -0.5

        def attention(keys, values):
            keys, values = keys.repeat_interleave(H_q // H, 0), values.repeat_interleave(H_q // H, 0)
            p = torch.softmax(qr @ keys.transpose(1, 2), dim=-1)
            return p, p @ values

        p0, o0 = attention(k, v)
        for scheme in schemes:
            parts = set(scheme.split("+")) - {"base"}
            wide = None
            if "kch8" in parts:
                wide = wide_channels(rotate(q, cos, sin), k[:, :n])
            elif "kds8" in parts:
                wide = ds_rank[i, :, :WIDE_CHANNELS]
            kq, vq = k.clone(), v.clone()
            kq[:, :n] = quant_keys(k_pre[:, :n], k[:, :n], parts, cos[:n], sin[:n], wide)
            vq[:, :n] = quant_values(v[:, :n], parts, value_group)
            p, o = attention(kq, vq)
            totals[scheme][0] += 0.5 * (p - p0).abs().sum(-1).mean().item() / layers
            totals[scheme][1] += ((o - o0).norm(dim=-1) / o0.norm(dim=-1)).mean().item() / layers
    return {s: (tv, out) for s, (tv, out) in totals.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default="niah_multivalue")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--n-samples", type=int, default=256, help="samples the task generates (as `kvpress eval --samples`)")
    ap.add_argument("--samples", default="64,65", help="which of them, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schemes", default="base,ksink,ksink+vexact,vrot,ksink+vrot")
    ap.add_argument("--queries", type=int, default=16, help="the prompt's last queries whose attention is compared")
    ap.add_argument("--window", type=int, default=128, help="latest prompt tokens left unquantized")
    ap.add_argument("--value-group", type=int, default=32, help="channels per value quantization group")
    args = ap.parse_args(argv)
    schemes = args.schemes.split(",")
    for scheme in schemes:
        bad = set(scheme.split("+")) - set(PARTS) - {"base"}
        if bad:
            raise SystemExit(f"unknown scheme part(s) {sorted(bad)}; allowed: base, {', '.join(PARTS)}")
    ids_list = [int(s) for s in args.samples.split(",")]
    model, tokenizer = load_eval_model(args.model)
    ds_rank = None
    if any("kds8" in s.split("+") for s in schemes):
        from kvpress.adapters import get_adapter
        from kvpress.registry import get_policy
        adapter = get_adapter(model)
        policy = get_policy("double_sparsity")
        ds_rank = calib.load(policy.artifact_path(adapter), adapter)
    samples = get_task(args.task).generate(tokenizer, args.length, args.n_samples, args.seed)
    mean = {s: [0.0, 0.0] for s in schemes}
    for sid in ids_list:
        ids = torch.tensor([build_input_ids(tokenizer, samples[sid])])
        for s, (tv, out) in quant_error(model, ids, schemes, args.queries, args.window, args.value_group, ds_rank).items():
            mean[s][0] += tv / len(ids_list)
            mean[s][1] += out / len(ids_list)
    print(f"{args.task} at {args.length} tokens, samples {args.samples}; attention of the last {args.queries} "
          f"queries, mean over layers (4-bit unless stated; value groups of {args.value_group} channels)")
    print("| scheme | attention TV | output relative error |")
    print("|---|---:|---:|")
    for s in schemes:
        print(f"| {s} | {mean[s][0]:.4f} | {mean[s][1]:.4f} |")
    return mean


if __name__ == "__main__":
    main()
