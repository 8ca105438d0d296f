"""`kvpress.kernels.backend`: the one place that picks torch / native / triton for every kernel."""
import pytest
import torch

from kvpress.kernels import backend
from kvpress.kernels.checks import interpreting

NATIVE = backend.native_available()
needs_native = pytest.mark.skipif(not NATIVE, reason="native CPU kernels not built here (no C compiler?)")


def qkv(dtype=torch.float32, G=2, D=64):
    return (torch.randn(1, 2 * G, D, dtype=dtype), torch.randn(1, 2, 16, D, dtype=dtype),
            torch.randn(1, 2, 16, D, dtype=dtype))


def test_choose_takes_the_first_that_can_run_and_refuses_what_cannot():
    why = {"triton": lambda: "no GPU", "native": lambda: None}
    assert backend.choose("op", "auto", backend.ORDER, why) == "native"
    assert backend.choose("op", "auto", ("triton", "torch"), why) == "torch"
    assert backend.choose("op", "torch", backend.ORDER, why) == "torch"
    with pytest.raises(ValueError, match=r"op: backend='triton' cannot run these inputs: no GPU; use backend='auto'"):
        backend.choose("op", "triton", backend.ORDER, why)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'torch'\), got 'native'"):
        backend.choose("op", "native", ("triton", "torch"), why)


@needs_native
def test_sparse_decode_runs_native_on_fp32_cpu_and_torch_on_half():
    q, k, v = qkv()
    ids = torch.zeros(1, 2, 3, dtype=torch.int32)
    assert backend.sparse_decode_backend(q, k, v, ids, "auto") == "native"
    assert backend.sparse_decode_backend(*qkv(G=16), ids, "auto") == "native"  # the native decode takes any group
    assert backend.sparse_decode_backend(*qkv(torch.float16), ids, "auto") == "torch"
    with pytest.raises(ValueError, match="it needs fp32 CPU tensors"):
        backend.sparse_decode_backend(*qkv(torch.float16), ids, "native")
    with pytest.raises(ValueError, match="int32 block ids"):
        backend.sparse_decode_backend(q, k, v, ids.long(), "native")


@pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1 lets the Triton kernels take CPU tensors")
def test_triton_on_cpu_names_why_in_the_order_the_launchers_check():
    q, k, v = qkv()
    ids = torch.zeros(1, 2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        backend.sparse_decode_backend(q, k, v, ids, "triton")
    with pytest.raises(ValueError, match=r"head_dim in \(64, 128\), got 32"):
        backend.sparse_decode_backend(*qkv(D=32), ids, "triton")
    with pytest.raises(ValueError, match="GQA groups of 1..16"):
        backend.sparse_decode_backend(*qkv(G=17), ids, "triton")


def test_merge_keeps_torch_on_cpu_unless_native_is_asked_for():
    out = torch.randn(2, 3, 8)
    assert backend.merge_backend(out, "auto") == "torch"
    if NATIVE:
        assert backend.merge_backend(out, "native") == "native"
    with pytest.raises(ValueError, match="backend must be one of"):
        backend.merge_backend(out, "cuda")


@needs_native
def test_attend_rows_counts_sets_and_layouts():
    q, k, v = qkv()
    assert backend.rows_backend(q, [(k, v, None, 16)], "auto") == "native"
    assert backend.rows_backend(q, [(k, v, None, 16)] * 9, "auto") == "torch"  # more sets than one native call takes
    kt = k.transpose(2, 3).contiguous().transpose(2, 3)  # (T, D) not dense
    with pytest.raises(ValueError, match="row set 0 must be fp32 CPU k / v of one layout"):
        backend.rows_backend(q, [(kt, kt, None, 16)], "native")


@needs_native
def test_quant_step_picks_native_for_a_cpu_decode_step_over_packed_tokens():
    from kvpress.kernels import quantize_per_channel, quantize_per_token

    x = torch.randn(1, 2, 32, 64)
    store = (quantize_per_channel(x, 4, 32), quantize_per_token(x, 4, 32))
    q = torch.randn(1, 4, 1, 64)
    assert backend.quant_step_backend(q, 2, [store], n_quant=32, backend="auto") == "native"
    assert backend.quant_step_backend(q, 2, [store], n_quant=0, backend="auto") == "torch"  # nothing packed yet
    assert backend.quant_step_backend(q.expand(1, 4, 3, 64), 2, [store], n_quant=32, backend="auto") == "torch"
    assert backend.quant_step_backend(q, 2, [store], n_quant=32, backend="torch") == "torch"
    strided = (store[0], tuple(t.transpose(2, 3) for t in store[1]))  # value rows not dense
    with pytest.raises(ValueError, match="backend='native' cannot read this packed store"):
        backend.quant_step_backend(q, 2, [strided], n_quant=32, backend="native")
    assert backend.quant_step_backend(q, 2, [strided], n_quant=32, backend="auto") == "torch"
    if not interpreting():
        with pytest.raises(ValueError, match="decode_backend='triton'"):
            backend.quant_step_backend(q, 2, [store], n_quant=32, backend="auto", decode_backend="triton")


def test_policy_level_choices_without_the_library(monkeypatch):
    monkeypatch.setattr(backend, "native_available", lambda: False)
    q, k, v = qkv()
    assert backend.sparse_decode_backend(q, k, v, torch.zeros(1, 2, 1, dtype=torch.int32), "auto") == "torch"
    with pytest.raises(ValueError, match="native library is not available"):
        backend.label_select_backend(q, 2, torch.randn(1, 2, 4, 16), k, "native")
    assert backend.label_select_backend(q, 2, torch.randn(1, 2, 4, 16), k, "auto") == "torch"
    assert backend.label_select_backend(q, 2, torch.randn(1, 2, 4, 16), k, "triton") == "torch"
    assert backend.shadowkv_step_backend(q, k, "auto") == "torch"
    assert backend.residual_backend(k, torch.zeros(1, 2, 16, 40, dtype=torch.uint8), "auto") == "torch"


def test_fused_quant_decode_runs_only_where_the_kernel_can_and_a_forced_one_raises():
    q = torch.randn(1, 4, 1, 64)
    step = dict(n_quant=32)
    assert backend.fused_quant_backend(q, 2, **step) == ("triton" if backend.AUTO_TRITON_ON_CPU and interpreting()
                                                        and backend.triton_available() else "torch")
    assert backend.fused_quant_backend(q, 2, **step, decode_backend="torch") == "torch"
    # not a decode step over packed tokens: the other paths, even when the kernel is forced
    assert backend.fused_quant_backend(q.expand(1, 4, 3, 64), 2, **step, decode_backend="triton") == "torch"
    assert backend.fused_quant_backend(q, 2, n_quant=0, decode_backend="triton") == "torch"
    with pytest.raises(ValueError, match=r"decode_backend='triton' cannot run these inputs: it takes head_dim in "
                                         r"\(64, 128\), got 32; use decode_backend='auto' or 'torch'"):
        backend.fused_quant_backend(torch.randn(1, 4, 1, 32), 2, **step, decode_backend="triton")
    with pytest.raises(ValueError, match=r"GQA groups of 1\.\.16"):
        backend.fused_quant_backend(torch.randn(1, 34, 1, 64), 2, **step, decode_backend="triton")
    with pytest.raises(ValueError, match=r"decode_backend must be one of \('auto', 'triton', 'torch'\), got 'cuda'"):
        backend.fused_quant_backend(q, 2, **step, decode_backend="cuda")
    if not interpreting():
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            backend.fused_quant_backend(q, 2, **step, decode_backend="triton")
