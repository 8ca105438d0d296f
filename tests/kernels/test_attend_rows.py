"""`attend_rows` (one softmax over several row sets): the torch path against `sparse_decode` of each
set merged with `merge_states` and against the compiled CPU twin, input errors, the Triton kernel
under the interpreter (one child process: this file run as a script with TRITON_INTERPRET=1) and
on CUDA.
"""
import json
import math
import os
import sys

import pytest
import torch

from kvpress.kernels import SparseIndex, merge_states, native, reference_sparse_decode, sparse_decode
from kvpress.kernels.rows import attend_rows, check_row_sets, torch_attend_rows
from interpret_probe import run_interpreter_worker  # noqa: E402


def make_case(B=2, H=2, G=3, D=64, sets=((70, 80, False), (33, 40, True), (130, 150, True)), seed=0,
              empty_row=True, dtype=torch.float32, device="cpu"):
    """q and row sets ``(n, n_cap, with_cnt)``; rows past those in use hold NaN (never to count).
    With ``empty_row`` the last (row, KV head) has no row in use in any set with ``cnt``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, D, generator=gen)
    out = []
    for n, cap, with_cnt in sets:
        k, v = torch.randn(B, H, cap, D, generator=gen), torch.randn(B, H, cap, D, generator=gen)
        cnt = torch.randint(0, n + 1, (B, H), generator=gen, dtype=torch.int32) if with_cnt else None
        if cnt is not None and empty_row:
            cnt[-1, -1] = 0
        limit = cnt if cnt is not None else torch.full((B, H), n)
        unused = torch.arange(cap) >= limit[..., None]  # (B, H, cap)
        k[unused], v[unused] = float("nan"), float("nan")
        cnt = None if cnt is None else cnt.to(device)
        out.append((k.to(device, dtype), v.to(device, dtype), cnt, n))
    return q.to(device, dtype), out


def composed(q, sets, scale, backend=None):
    """Each set attended alone, merged with `merge_states`: by `reference_sparse_decode` (dense, fp32,
    on the CPU) or, with ``backend``, by `sparse_decode` on q's device in q's dtype."""
    B, H = q.shape[0], sets[0][0].shape[1]
    out = lse = None
    for k, v, cnt, n in sets:
        c = cnt if cnt is not None else torch.full((B, H), n, dtype=torch.int32, device=q.device)
        c = c.clamp(max=n).to(torch.int32)
        slots = torch.arange(max(n, 1), dtype=torch.int32, device=q.device)
        index = SparseIndex(1, torch.where(slots < c[..., None], slots, -1), c,
                            torch.full((B,), n, dtype=torch.int32, device=q.device))
        if backend is None:
            o, l = reference_sparse_decode(q.cpu().float(), k.cpu().float().nan_to_num(), v.cpu().float().nan_to_num(),
                                           index.to("cpu"), scale=scale)
        else:
            o, l = sparse_decode(q, k.nan_to_num(), v.nan_to_num(), index, scale=scale, backend=backend)
        out, lse = (o, l) if out is None else merge_states(out, lse, o, l)
    return out, lse


SHAPES = [dict(), dict(G=1, D=16), dict(G=8, D=128, sets=((5, 5, False),)), dict(H=3, G=2, D=32, seed=3),
          dict(sets=((0, 4, False), (17, 20, True)), seed=1), dict(sets=((3, 9, True),) * 4, seed=2),
          dict(sets=((64, 64, True), (0, 0, False)), seed=4)]


@pytest.mark.parametrize("shape", SHAPES)
def test_torch_path_matches_sparse_decode_merged(shape):
    q, sets = make_case(**shape)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = torch_attend_rows(q, sets, scale=scale)
    ref_out, ref_lse = composed(q, sets, scale)
    assert out.dtype == lse.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_no_row_in_use_gives_zeros_and_minus_inf():
    q, sets = make_case(sets=((8, 8, True), (0, 3, False)))
    sets[0][2].zero_()
    out, lse = attend_rows(q, sets, scale=0.1)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_bf16_inputs_are_attended_in_fp32():
    q, sets = make_case(dtype=torch.bfloat16)
    out, lse = attend_rows(q, sets, scale=0.125)
    ref_out, _ = composed(q.float(), [(k.float(), v.float(), c, n) for k, v, c, n in sets], 0.125)
    assert out.dtype == torch.float32
    assert (out - ref_out).abs().max() < 1e-5


@pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")
def test_torch_path_matches_the_compiled_cpu_twin():
    q, sets = make_case(G=4, D=64, seed=5)
    sets = [(k.nan_to_num().contiguous(), v.nan_to_num().contiguous(), c, n) for k, v, c, n in sets]
    out, lse = torch_attend_rows(q, sets, scale=0.125)
    n_out, n_lse = native.attend_rows(q, sets, scale=0.125)
    torch.testing.assert_close(out, n_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, n_lse, atol=1e-5, rtol=1e-5)


def test_auto_on_fp32_cpu_takes_the_compiled_twin_where_it_applies(monkeypatch):
    q, sets = make_case(G=4, D=64, seed=7)
    calls = []
    real = native.attend_rows
    monkeypatch.setattr(native, "attend_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    out, lse = attend_rows(q, sets, scale=0.125)
    ref_out, ref_lse = torch_attend_rows(q, sets, scale=0.125)
    assert calls == ([1] if native.available() else [])
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    attend_rows(q.bfloat16(), [(k.bfloat16(), v.bfloat16(), c, n) for k, v, c, n in sets], scale=0.125)
    assert len(calls) == (1 if native.available() else 0)  # bf16: the torch path


def test_bench_rows_cpu_smoke(tmp_path):
    from kvpress.evals.bench_rows import main

    out = tmp_path / "rows.json"
    assert main(["--device", "cpu", "--batches", "1,2", "--selected", "64", "--iters", "2", "--warmup", "1",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["rel_err"] < 1e-4 and r["attend_rows_us"] > 0 for r in rows)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, s: (q, []), "at least one row set"),
    (lambda q, s: (q, [s[0][:3]]), r"must be \(k, v, cnt, n\)"),
    (lambda q, s: (q, [(s[0][0], s[0][1][:, :, :5], None, 5)]), "k and v must both be"),
    (lambda q, s: (q, [s[0], (s[1][0][:, :1], s[1][1][:, :1], None, 3)]), "same"),
    (lambda q, s: (q, [(s[0][0], s[0][1], None, 999)]), "n must be an int in 0..n_cap"),
    (lambda q, s: (q, [(s[1][0], s[1][1], s[1][2].float(), s[1][3])]), "cnt must be None or an integer"),
    (lambda q, s: (q[:, :5], s), "multiple of the sets' KV heads"),
    (lambda q, s: (q.long(), s), "q must be a"),
])
def test_bad_inputs_are_clear_errors(mutate, match):
    q, sets = make_case()
    q, sets = mutate(q, sets)
    with pytest.raises(ValueError, match=match):
        check_row_sets(q, sets)


def test_attend_rows_checks_its_inputs_before_choosing_a_backend():
    q, sets = make_case()
    with pytest.raises(ValueError, match=r"must be \(k, v, cnt, n\)"):
        attend_rows(q, [sets[0][:3]], scale=0.1)
    with pytest.raises(ValueError, match="at least one row set"):
        attend_rows(q, [], scale=0.1)


def test_unknown_backend_and_triton_on_cpu_are_clear_errors():
    q, sets = make_case()
    with pytest.raises(ValueError, match="backend must be one of"):
        attend_rows(q, sets, scale=0.1, backend="cuda")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.importorskip("triton")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            attend_rows(q, sets, scale=0.1, backend="triton")
    with pytest.raises(ValueError, match="head_dim in"):
        attend_rows(*make_case(D=32), scale=0.1, backend="triton")


# Interpreter cases: every head_dim and group the kernel takes, 1-4 sets, empty sets and rows.
INTERPRET_CASES = [dict(), dict(G=1, D=128, seed=1), dict(G=16, H=1, D=64, seed=2, sets=((40, 64, True), (65, 70, False))),
                   dict(sets=((0, 4, False), (17, 20, True)), seed=3), dict(sets=((3, 9, True),) * 4, seed=4),
                   dict(B=1, H=3, G=5, D=64, sets=((129, 130, True),), seed=5)]


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreter_worker(__file__, INTERPRET_CASES)


@pytest.mark.parametrize("i", range(len(INTERPRET_CASES)))
def test_triton_interpreter_matches_torch_path(interpreted, i):
    r = interpreted[i]
    assert r["finite"] and r["empty_ok"], r
    assert r["out_err"] <= 1e-5 and r["lse_err"] <= 1e-5, r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G,D", [(4, 128), (16, 64)])
def test_triton_gpu_error_within_twice_that_of_sparse_decode_merged(dtype, G, D):
    """One launch over three sets is as accurate as `sparse_decode` (triton) of each, merged."""
    q, sets = make_case(B=3, H=2, G=G, D=D, sets=((700, 1024, False), (96, 96, True), (1120, 1120, True)),
                        dtype=dtype, device="cuda", seed=6)
    scale = 1 / math.sqrt(D)
    ref_out, ref_lse = composed(q, sets, scale)
    rel = lambda o: ((o.cpu().float() - ref_out).norm() / ref_out.norm()).item()  # noqa: E731
    out, lse = attend_rows(q, sets, scale=scale, backend="triton")
    old_out, _ = composed(q, sets, scale, backend="triton")
    assert not out.isnan().any() and rel(out) <= 2 * rel(old_out) + 1e-4 and rel(out) < 1e-2
    finite = ~torch.isneginf(ref_lse)
    assert (lse.cpu()[finite] - ref_lse[finite]).abs().max().item() <= 1e-2
    assert torch.isneginf(lse.cpu()[~finite]).all()


def _worker():  # pragma: no cover - runs in the child process
    from kvpress.kernels.triton_rows import triton_attend_rows

    results = []
    for c in json.load(sys.stdin):
        q, sets = make_case(**c)
        scale = 1 / math.sqrt(q.shape[-1])
        out, lse = triton_attend_rows(q, sets, scale=scale)
        ref_out, ref_lse = torch_attend_rows(q, sets, scale=scale)
        empty = torch.isneginf(ref_lse)
        results.append({
            "finite": bool(out.isfinite().all()),
            "empty_ok": bool(torch.isneginf(lse[empty]).all() and (out[empty] == 0).all()),
            "out_err": (out - ref_out).abs().max().item(),
            "lse_err": (lse[~empty] - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0,
        })
    print(json.dumps(results))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    _worker()
