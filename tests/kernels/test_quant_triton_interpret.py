"""Triton quantization kernels under TRITON_INTERPRET=1 (fp32, small shapes) against the torch
references. All cases run in ONE child process (this file executed as a script), so the
interpreter flag never leaks into the rest of the test session."""
import json
import os
import subprocess
import sys

import pytest
from interpret_probe import interpreter_unusable  # noqa: E402

pytest.importorskip("triton")

# (B, H_kv, G, T, D, bits, group, starts, splits): odd token counts, GQA 1/3/4/8, head_dim 64/128
DECODE = [
    (1, 1, 1, 8, 64, 4, 8, None, None),
    (2, 2, 3, 104, 64, 2, 8, [0, 13], 2),
    (1, 1, 4, 96, 128, 4, 32, None, 3),
    (2, 1, 8, 256, 64, 2, 32, [0, 70], None),
    (1, 2, 1, 64, 64, 8, 16, None, None),
    (1, 1, 2, 1024, 64, 4, 64, [1000], 4),  # everything before 1000 masked: a split sees nothing
    (1, 2, 4, 256, 128, 8, 128, [0], 2),  # a tile of one 128-token key group, one value group per token
    (1, 2, 4, 192, 128, 4, (64, 16), [5], 2),  # key groups of 64 tokens, value groups of 16 channels
    (2, 1, 3, 96, 64, 2, (16, 64), None, None),  # and the other way round
    (1, 2, 16, 128, 64, 4, 32, [0], 2),  # GQA group 16 (one 16-row tile), 12 (padded to 16)
    (2, 1, 12, 96, 128, 2, 32, [0, 30], None),
]
# (B, H_kv, G, T, D, bits, group, starts, splits, refined channels): the refined keys' second codes
REFINED = [(1, 2, 3, 96, 64, 4, 16, None, 2, 8), (2, 1, 4, 128, 128, 2, 32, [0, 40], None, 16),
           (1, 1, 2, 64, 64, 4, 64, None, None, 64)]
PACK = [(1, 2, 64, 64, b, g, pc) for b in (2, 4, 8) for g, pc in ((32, True), (16, False))] + \
       [(2, 1, 37, 128, 4, 32, False), (1, 1, 128, 128, 2, 128, True)]


def _run_cases():
    import torch

    from kvpress.kernels import packed_decode as kd
    from kvpress.kernels import quant as kq
    from kvpress.kernels.triton_quant import triton_quant_decode, triton_quantize_pack

    results = {"decode": [], "pack": [], "refined": []}
    for B, H, G, T, D, bits, group, starts, splits, R in REFINED:
        gen = torch.Generator().manual_seed(T + R)
        k, v, q = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen), \
            torch.randn(B, H * G, D, generator=gen)
        k[..., ::5] *= 6
        ch = torch.stack([torch.randperm(D, generator=gen)[:R] for _ in range(B * H)]).view(B, H, R)
        kc, ks, kz, rc, rs = kq.quantize_refined_keys(k, bits, group, ch)
        vc = kq.quantize_per_token(v, bits, group if D % group == 0 else 32)
        st = None if starts is None else torch.tensor(starts)
        kw = dict(bits=bits, group_size=group, seq_starts=st, value_group_size=group if D % group == 0 else 32,
                  refine=(rc, rs, ch))
        ref, ref_lse = kd.reference_quant_decode(q, kc, ks, kz, *vc, **kw)
        plain, _ = kd.reference_quant_decode(q, kc, ks, kz, *vc, **{**kw, "refine": None})
        out, lse = triton_quant_decode(q, kc, ks, kz, *vc, num_splits=splits, **kw)
        tout, _ = kd.torch_quant_decode(q, kc, ks, kz, *vc, **kw)
        results["refined"].append({"out_err": (out - ref).abs().max().item(), "lse_err": (lse - ref_lse).abs().max().item(),
                                   "torch_err": (tout - ref).abs().max().item(),
                                   "refine_moves": (plain - ref).abs().max().item()})
    for B, H, G, T, D, bits, group, starts, splits in DECODE:
        group, vgroup = group if isinstance(group, tuple) else (group, None)
        gen = torch.Generator().manual_seed(T + G)
        k, v, q = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen), \
            torch.randn(B, H * G, D, generator=gen)
        kc = kq.quantize_per_channel(k, bits, group)
        vc = kq.quantize_per_token(v, bits, vgroup or group)
        st = None if starts is None else torch.tensor(starts)
        ref, ref_lse = kd.reference_quant_decode(q, *kc, *vc, bits=bits, group_size=group, seq_starts=st,
                                                 value_group_size=vgroup)
        out, lse = triton_quant_decode(q, *kc, *vc, bits=bits, group_size=group, seq_starts=st, num_splits=splits,
                                       value_group_size=vgroup)
        tout, _ = kd.torch_quant_decode(q, *kc, *vc, bits=bits, group_size=group, seq_starts=st,
                                        value_group_size=vgroup)
        assert (tout - ref).abs().max().item() < 1e-4, "torch_quant_decode disagrees with the reference"
        results["decode"].append({"out_err": (out - ref).abs().max().item(),
                                  "lse_err": (lse - ref_lse).abs().max().item()})
    for B, H, T, D, bits, group, pc in PACK:
        x = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(T))
        ref = (kq.quantize_per_channel if pc else kq.quantize_per_token)(x, bits, group)
        got = triton_quantize_pack(x, bits, group, per_channel=pc)
        diff = (kq.unpack_codes(ref[0], bits).int() - kq.unpack_codes(got[0], bits).int()).abs()
        results["pack"].append({"shapes": all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(ref, got)),
                                "scale_equal": torch.equal(ref[1], got[1]) and torch.equal(ref[2], got[2]),
                                "max_code_diff": diff.max().item(), "frac_diff": diff.float().mean().item()})
    results["forms"] = _forms_case()
    results["layer"] = _kivi_layer_case()
    results["layer_sinks"] = _kivi_layer_case(sink_tokens=4, prompt=10)
    results["layer_g16"] = _kivi_layer_case(heads=16, kv_heads=1)
    results["zipcache"] = _zipcache_layer_case()
    results["zipcache_padded"] = _zipcache_layer_case(row_start=(0, 70))
    results["zipcache_8bit"] = _zipcache_layer_case(bits_high=8, bits_low=4)
    results["zipcache_refine"] = _zipcache_layer_case(bits_high=8, bits_low=4, refine=16)
    results["zipcache_refine_padded"] = _zipcache_layer_case(row_start=(0, 70), refine=8)
    return results


def _forms_case():
    """The kernel's other forms (late value loads; scales held in the tile dtype) against the
    reference: they stay selectable for the GPU sweep (``tune_quant.py --forms``)."""
    import torch

    from kvpress.kernels import packed_decode as kd
    from kvpress.kernels import quant as kq
    from kvpress.kernels import triton_quant as tq

    errs = []
    for early, fp32 in ((False, False), (True, False), (False, True)):
        tq.EARLY_LOADS, tq.FP32_SCALES = early, fp32
        for B, H, G, T, D, bits, (group, vgroup), starts in ((2, 2, 4, 192, 128, 4, (64, 16), [5, 0]),
                                                             (1, 1, 3, 96, 64, 2, (32, 32), None)):
            gen = torch.Generator().manual_seed(T + bits)
            k, v = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
            q = torch.randn(B, H * G, D, generator=gen)
            kc, vc = kq.quantize_per_channel(k, bits, group), kq.quantize_per_token(v, bits, vgroup)
            st = None if starts is None else torch.tensor(starts)
            ref, ref_lse = kd.reference_quant_decode(q, *kc, *vc, bits=bits, group_size=group, seq_starts=st,
                                                     value_group_size=vgroup)
            out, lse = tq.triton_quant_decode(q, *kc, *vc, bits=bits, group_size=group, seq_starts=st,
                                              num_splits=2, value_group_size=vgroup)
            errs.append(max((out - ref).abs().max().item(), (lse - ref_lse).abs().max().item()))
    tq.EARLY_LOADS = tq.FP32_SCALES = True
    return errs


def _zipcache_layer_case(row_start=None, bits_high=4, bits_low=2, refine=0):
    """The zipcache layer's fused decode path (the kernel on each store + the window + merge) vs
    its torch path; with ``row_start`` a left-padded batch of two rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvpress

    cfg = LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = LlamaForCausalLM(cfg).eval()
    policy = kvpress.get_policy("zipcache", bits_high=bits_high, bits_low=bits_low, group_size=16, value_group_size=32,
                                residual_length=16, flush_size=16, salient_ratio=0.25, probe_recent=4,
                                probe_random=4, backend="torch", refine_key_channels=refine)
    B = 1 if row_start is None else len(row_start)
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(B, 4, 120, 64, generator=gen), torch.randn(B, 2, 120, 64, generator=gen), \
        torch.randn(B, 2, 120, 64, generator=gen)
    # flushes between the 40 steps (saliency from the probes the steps keep)
    outs, layers, fused_steps = _fused_and_torch_paths(model, policy, q, k, v, 80, row_start)
    hi_same = torch.equal(layers[0].hi.t["kc"][:, :, : layers[0].hi.n], layers[1].hi.t["kc"][:, :, : layers[1].hi.n])
    return {"err": (outs[0] - outs[1]).abs().max().item(), "hi": layers[0].hi.n, "lo": layers[0].lo.n,
            "fused_steps": fused_steps, "same_salient_store": hi_same, "refined": layers[0].lo.refined,
            "pads": [layers[0].hi.pad[:, 0].tolist(), layers[0].lo.pad[:, 0].tolist()]}


def _fused_and_torch_paths(model, policy, q, k, v, prompt, row_start):
    """One layer of ``policy`` prefilled with the first ``prompt`` tokens of q / k / v, then decoding
    the rest one token at a time, once on the fused path (``decode_backend="triton"``) and once on
    the torch path: (the two paths' decode outputs, their layers, fused steps run)."""
    import torch

    import kvpress

    outs, layers, fused_calls = [], [], []
    for backend in ("triton", "torch"):
        layer = kvpress.make_cache(model, policy).layers[0]
        if row_start is not None:
            layer.cache._set_row_start(torch.tensor(row_start))
        layer.decode_backend = backend
        layer.update(k[:, :, :prompt], v[:, :, :prompt])
        layer.attend(q[:, :, :prompt], *layer.take_pending(), 0.125)
        # a left-padded batch runs one layer per row (`RowSplit`): the paths are those layers'
        rows = [layer] if layer.by_row is None else layer.by_row.layers
        for row in rows:
            row.decode_backend = backend
            if backend == "triton":  # count the steps the fused kernel runs (a fallback would compare torch to torch)
                fused = row._fused_decode
                row._fused_decode = lambda *a, _f=fused: fused_calls.append(1) or _f(*a)
        steps = []
        for t in range(prompt, k.shape[2]):
            layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
            steps.append(layer.attend(q[:, :, t : t + 1], *layer.take_pending(), 0.125))
        outs.append(torch.cat(steps, 2))
        layers.append(rows[-1])  # the last row's layer: the padded one when the batch is padded
    return outs, layers, len(fused_calls)  # fused steps of all rows together


def _kivi_layer_case(sink_tokens=0, row_start=None, heads=4, kv_heads=2, prompt=80):
    """The kivi layer's fused decode path (triton kernel + window + exact sinks + merge) vs its
    torch path; with ``row_start`` a left-padded batch of two rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvpress

    cfg = LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64)
    model = LlamaForCausalLM(cfg).eval()
    policy = kvpress.get_policy("kivi", bits=4, group_size=16, residual_length=16, sink_tokens=sink_tokens)
    B = 1 if row_start is None else len(row_start)
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, heads, 100, 64, generator=gen), torch.randn(B, kv_heads, 100, 64, generator=gen), \
        torch.randn(B, kv_heads, 100, 64, generator=gen)
    k[:, :, :4] *= 10  # large first keys: sinks the fused path must read exactly
    outs, layers, fused_steps = _fused_and_torch_paths(model, policy, q, k, v, prompt, row_start)
    layer = layers[1]
    return {"err": (outs[0] - outs[1]).abs().max().item(), "n_quant": layer.n_quant, "fused_steps": fused_steps,
            "sinks": None if layer.sk is None else list(layer.sk.shape), "rows": layer.sk is not None and
            layer.sk.shape[0]}


@pytest.fixture(scope="module")
def results():
    reason = interpreter_unusable()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        pytest.fail(f"interpreter worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(DECODE)), ids=[f"decode{c}" for c in DECODE])
def test_fused_decode_matches_reference(results, i):
    r = results["decode"][i]
    assert r["out_err"] <= 2e-5 and r["lse_err"] <= 2e-5, r


@pytest.mark.parametrize("i", range(len(PACK)), ids=[f"pack{c}" for c in PACK])
def test_quantize_pack_matches_torch(results, i):
    r = results["pack"][i]
    assert r["shapes"] and r["scale_equal"], r
    # torch rounds exact ties to even, the kernel rounds them up: at most a one-code difference, rarely
    assert r["max_code_diff"] <= 1 and r["frac_diff"] < 1e-3, r


def test_fused_decode_forms_match_reference(results):
    assert len(results["forms"]) == 6 and max(results["forms"]) <= 2e-5, results["forms"]


def test_kivi_layer_fused_path_matches_torch_path(results):
    r = results["layer"]
    assert r["n_quant"] >= 64 and r["fused_steps"] == 20 and r["err"] <= 2e-5, r


def test_kivi_layer_fused_path_takes_gqa_group_16(results):
    """16 query heads per KV head (Llama-3.1-405B's group) stay on the fused path: one 16-row tile."""
    r = results["layer_g16"]
    assert r["n_quant"] >= 64 and r["fused_steps"] == 20 and r["err"] <= 2e-5, r


def test_kivi_fused_decode_with_sinks_matches_torch_path(results):
    """The sinks are still in the fp window when decode starts (a 10-token prompt) and are flushed
    during it: the fused path must switch from window to exact sinks without a seam. (A left-padded
    row runs in a layer of its own, `RowSplit`, so its sinks are its first tokens, as here.)"""
    r = results["layer_sinks"]
    assert r["n_quant"] > 0 and r["sinks"] == [1, 2, 4, 64] and 0 < r["fused_steps"] < 90 and r["err"] <= 2e-5, r


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    print(json.dumps(_run_cases()))


@pytest.mark.parametrize("i", range(len(REFINED)), ids=[f"refined{c}" for c in REFINED])
def test_fused_decode_reads_refined_key_channels(results, i):
    """`quantize_refined_keys`' second codes in the fused kernel and the torch path, against the
    reference that adds them to the dequantized keys (and they do move the output)."""
    r = results["refined"][i]
    assert r["out_err"] <= 2e-5 and r["lse_err"] <= 2e-5 and r["torch_err"] <= 1e-4, r
    assert r["refine_moves"] > 1e-3, r


@pytest.mark.parametrize("case", ["zipcache", "zipcache_padded", "zipcache_8bit", "zipcache_refine",
                                  "zipcache_refine_padded"])
def test_zipcache_layer_fused_path_matches_torch_path(results, case):
    """Both stores on the fused kernel, each with its own padding start, merged with the window; the
    probes it keeps pick the same salient tokens at the flushes between the steps."""
    r = results[case]
    # padded: row 0 fuses all 40 steps, row 1 (in a layer of its own) from its first flush on
    assert (40 < r["fused_steps"] < 80 if case.endswith("_padded") else r["fused_steps"] == 40), r
    assert r["hi"] > 0 and r["lo"] > 0 and r["same_salient_store"], r
    assert r["err"] <= 2e-5, r
    assert r["refined"] == case.startswith("zipcache_refine"), r
    if case.endswith("_padded"):  # row 1 runs in a layer of its own (`RowSplit`): no padding in its stores
        assert r["pads"] == [[0], [0]], r
