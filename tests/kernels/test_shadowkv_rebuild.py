"""ShadowKV key rebuild: torch reference vs a literal formulation, input errors, Triton under the interpreter.

Interpreter cases run in ONE child process (this file run as a script with TRITON_INTERPRET=1),
so the interpreter flag never leaks into the rest of the test session.
"""
import json
import os
import sys

import pytest
import torch

from kvpress.kernels import shadowkv_rebuild, torch_shadowkv_rebuild
from interpret_probe import run_interpreter_worker  # noqa: E402


def make_case(B=1, H=2, D=64, R=24, C=5, K=3, cs=8, dtype=torch.float32, seed=0, empty_slot=True):
    gen = torch.Generator().manual_seed(seed)
    factor = torch.randn(B, C * cs, R, generator=gen).to(dtype)
    basis = torch.randn(B, R, H, D, generator=gen).div(R ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(C, generator=gen)[:K] for _ in range(B * H)]).view(B, H, K).to(torch.int32)
    if empty_slot and K:
        ids[0, 0, -1] = -1
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    rope_start = torch.randint(0, cs, (B,), generator=gen)
    return factor, basis, ids, inv_freq, rope_start, cs


def literal(factor, basis, ids, inv_freq, rope_start, cs):
    """Rebuild every token, rotate the whole sequence (HF rotate_half RoPE), then gather chunks."""
    B, T, R = factor.shape
    H, D = basis.shape[2], basis.shape[3]
    k_pre = torch.einsum("btr,brhd->bhtd", factor.double(), basis.double())  # (B, H, T, D)
    pos = (torch.arange(T)[None] - rope_start[:, None]).double()  # (B, T)
    theta = pos[:, None, :, None] * inv_freq.double()  # (B, 1, T, D/2)
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    rot = torch.cat([-k_pre[..., D // 2:], k_pre[..., : D // 2]], -1)
    k = k_pre * cos + rot * sin
    out = torch.zeros(B, H, ids.shape[2] * cs, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for s, c in enumerate(ids[b, h].tolist()):
                if c >= 0:
                    out[b, h, s * cs:(s + 1) * cs] = k[b, h, c * cs:(c + 1) * cs]
    return out


@pytest.mark.parametrize("shape", [dict(), dict(B=2, H=3, D=16, R=5, C=4, K=4, cs=16),
                                   dict(H=1, D=128, R=40, C=3, K=1, cs=64), dict(K=0)])
def test_torch_reference_matches_literal_rebuild(shape):
    args = make_case(**shape)
    out = torch_shadowkv_rebuild(*args[:5], chunk_size=args[5])
    ref = literal(*args)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_fp16_error_close_to_fp16_roundoff():
    args = make_case(D=64, R=32)
    out = torch_shadowkv_rebuild(args[0].half(), args[1].half(), *args[2:5], chunk_size=8)
    ref = literal(*args)
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (out.double() - ref).pow(2).sum())
    assert out.dtype == torch.float16 and sqnr > 50


@pytest.mark.parametrize("bad, match", [
    (dict(chunk_size=12), "chunk_size must be one of"),
    (dict(ids_dtype=torch.int64), "chunk_idx must be int32"),
    (dict(basis_dtype=torch.float16), "share one float dtype"),
    (dict(inv_freq_len=3), "inv_freq must have head_dim / 2"),
])
def test_bad_input_raises_clear_error(bad, match):
    factor, basis, ids, inv_freq, rope_start, cs = make_case()
    if "ids_dtype" in bad:
        ids = ids.to(bad["ids_dtype"])
    if "basis_dtype" in bad:
        basis = basis.to(bad["basis_dtype"])
    if "inv_freq_len" in bad:
        inv_freq = inv_freq[: bad["inv_freq_len"]]
    with pytest.raises(ValueError, match=match):
        shadowkv_rebuild(factor, basis, ids, inv_freq, rope_start, chunk_size=bad.get("chunk_size", cs),
                         backend="torch")
    with pytest.raises(ValueError, match="backend must be one of"):
        shadowkv_rebuild(factor, basis, ids, inv_freq, rope_start, chunk_size=cs, backend="cuda")


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("interpreter enabled in this process")
    factor, basis, ids, inv_freq, rope_start, cs = make_case()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        shadowkv_rebuild(factor, basis, ids, inv_freq, rope_start, chunk_size=cs, backend="triton")


# Interpreter cases: odd ranks (not multiples of BLOCK_R), every chunk size, head_dim 32/64/128, batch 2.
INTERPRET_CASES = [dict(R=24), dict(B=2, H=3, D=32, R=7, C=6, K=4, cs=16, seed=1),
                   dict(H=1, D=128, R=33, C=3, K=2, cs=64, seed=2), dict(H=2, D=64, R=16, C=9, K=5, cs=32, seed=3),
                   dict(K=0)]


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreter_worker(__file__, INTERPRET_CASES)


@pytest.mark.parametrize("i", range(len(INTERPRET_CASES)))
def test_triton_interpreter_matches_reference(interpreted, i):
    r = interpreted[i]
    assert r["shape_ok"] and r["dtype_ok"]
    assert r["err_vs_torch"] <= 2e-4 * max(1.0, r["scale"]), r
    assert r["empty_zero"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_gpu_error_within_twice_torch_error(dtype):
    factor, basis, ids, inv_freq, rope_start, cs = make_case(B=2, H=8, D=128, R=160, C=512, K=64, seed=4)
    ref = literal(factor, basis, ids, inv_freq, rope_start, cs).cuda()
    dev = [t.cuda() for t in (factor.to(dtype), basis.to(dtype), ids, inv_freq, rope_start)]
    tri = shadowkv_rebuild(*dev, chunk_size=cs, backend="triton")
    tor = shadowkv_rebuild(*dev, chunk_size=cs, backend="torch")
    err_tri = (tri.double() - ref).abs().max().item()
    err_tor = (tor.double() - ref).abs().max().item()
    assert err_tri <= 2 * err_tor + 1e-3


def _worker():  # pragma: no cover - runs in the child process
    from kvpress.kernels.triton_shadowkv import triton_shadowkv_rebuild

    results = []
    for c in json.load(sys.stdin):
        factor, basis, ids, inv_freq, rope_start, cs = make_case(**c)
        out = triton_shadowkv_rebuild(factor, basis, ids, inv_freq, rope_start, chunk_size=cs)
        ref = torch_shadowkv_rebuild(factor, basis, ids, inv_freq, rope_start, chunk_size=cs)
        empty = (ids < 0).repeat_interleave(cs, dim=2)
        results.append({
            "shape_ok": out.shape == ref.shape, "dtype_ok": out.dtype == ref.dtype,
            "err_vs_torch": (out - ref).abs().max().item() if out.numel() else 0.0,
            "scale": ref.abs().max().item() if ref.numel() else 0.0,
            "empty_zero": bool((out[empty] == 0).all()) if out.numel() else True,
        })
    print(json.dumps(results))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    _worker()
