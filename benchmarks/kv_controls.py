"""Needle scores with the prompt's KV perturbed in a controlled way (CPU, SmolLM2).

    python benchmarks/kv_controls.py TASK LENGTH SAMPLES OUT.jsonl 'VARIANT;VARIANT;...'

A VARIANT is a policy spec as ``kvpress eval`` takes it (``name:key=value,...``), optionally
prefixed by a perturbation of the dense prompt KV applied before the policy's cache is built
from it (``kvpress.prefill.cache_from_dense``):

``bf16|`` / ``fp16|``   keys and values rounded to that dtype and back
``kq4|`` / ``vq4|`` / ``kvq4|`` (any bit width in place of 4; ``g16`` etc. after it sets the group)
                        keys (per channel, groups of 32 tokens) / values (per token, groups of
                        32 channels) / both quantized and dequantized as ``kivi`` stores them,
                        except the last 128 tokens and the tail that does not fill a group

Greedy decode from the shared dense prefill; one JSON line per (variant, sample) with the score;
resumable (rows already in OUT are skipped). It splits a quantizer's loss (e.g. ``kivi:bits=4`` on
niah_multivalue) between keys and values.
"""
import json
import os
import re
import sys
import types

import torch

import kvpress
from kvpress.evals.decode import decode_from_cache
from kvpress.evals.runner import _eos, parse_policy_spec
from kvpress.evals.tasks import build_input_ids, get_task
from kvpress.kernels import dequantize_per_channel, dequantize_per_token, quantize_per_channel, quantize_per_token
from kvpress.prefill import cache_from_dense, dense_prefill

WINDOW, GROUP = 128, 32  # kivi's defaults: full-precision recent tokens, quantization group


def fake_quant(x: torch.Tensor, bits: int, per_channel: bool, group: int = GROUP) -> torch.Tensor:
    """x [B, H, T, D] with the tokens before its last >= WINDOW quantized and dequantized (the
    cut at a multiple of GROUP, kivi's flush unit; ``group`` is the quantization group)."""
    nq = max(0, (x.shape[2] - WINDOW) // max(GROUP, group) * max(GROUP, group))
    if per_channel:
        deq = dequantize_per_channel(*quantize_per_channel(x[:, :, :nq], bits, group), bits, group)
    else:
        deq = dequantize_per_token(*quantize_per_token(x[:, :, :nq], bits, group), bits, group)
    return torch.cat([deq.to(x.dtype), x[:, :, nq:]], 2)


def perturbed(dense, how: str):
    """The dense prefill's layers with keys / values perturbed as ``how`` says ("" = untouched)."""
    if not how:
        return dense
    kv = [(layer.buffer.keys, layer.buffer.values) for layer in dense.layers]
    if how in ("bf16", "fp16"):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[how]
        pairs = [(k.to(dt).to(k.dtype), v.to(dt).to(v.dtype)) for k, v in kv]
    elif re.fullmatch(r"(k|v|kv)q\d+(g\d+)?", how):
        which, bits, group = re.fullmatch(r"(k|v|kv)q(\d+)(?:g(\d+))?", how).groups()
        bits, group = int(bits), int(group or GROUP)
        pairs = [(fake_quant(k, bits, True, group) if "k" in which else k,
                  fake_quant(v, bits, False, group) if "v" in which else v) for k, v in kv]
    else:
        raise SystemExit(f"unknown perturbation {how!r}; allowed: bf16, fp16, kqN, vqN, kvqN (each optionally gM)")
    return types.SimpleNamespace(layers=[types.SimpleNamespace(buffer=types.SimpleNamespace(keys=k, values=v))
                                         for k, v in pairs])


def main() -> None:
    task_name, length, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    variants = sys.argv[5].split(";")
    torch.set_num_threads(1)
    model, tok = kvpress.load_model("smollm2")
    task = get_task(task_name)
    eos = _eos(tok, model)
    done = set()
    if os.path.exists(out):
        for line in open(out):
            r = json.loads(line)
            done.add((r["variant"], r["sample"]))
    for i, sample in enumerate(task.generate(tok, length, num_samples=n, seed=0)):
        todo = [v for v in variants if (v, i) not in done]
        if not todo:
            continue
        ids = torch.tensor([build_input_ids(tok, sample)])
        with torch.no_grad():
            logits, dense = dense_prefill(model, ids)
        for variant in todo:
            how, _, spec = variant.rpartition("|")
            name, kw = parse_policy_spec(spec)
            policy = kvpress.get_policy(name, **kw)
            cache = cache_from_dense(model, policy, perturbed(dense, how))
            toks, _ = decode_from_cache(model, policy, cache, logits, ids.shape[1],
                                        max_new_tokens=sample.max_new_tokens, eos_token_id=eos)
            text = tok.decode(toks, skip_special_tokens=True)
            rec = {"variant": variant, "sample": i, "score": task.score(text, sample), "pred": text.strip()[:80],
                   "answers": sample.answers}
            with open(out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(i, variant, rec["score"], repr(rec["pred"][:40]), flush=True)


if __name__ == "__main__":
    main()
