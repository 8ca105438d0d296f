"""Every Triton kernel compiles for Hopper (sm_90) with the installed Triton, no GPU needed.

The interpreter tests check what the kernels compute; they never run Triton's compiler, which is
where a kernel breaks when the Triton version changes (the GPU image has Triton 3.6, this
machine 3.9). Here the launchers run on CPU tensors of the real dtypes with the kernels replaced
by recorders, and each recorded launch (argument types, constexprs, num_warps) is compiled ahead
of time to a cubin with ``triton.compile`` for a ``GPUTarget("cuda", 90, 32)``, specialized as a
CUDA launch would be (`kvpress.kernels.triton_aot`).
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kvpress.kernels import triton_decode, triton_decode_kernel, triton_quant, triton_quant_kernel  # noqa: E402
from kvpress.kernels import triton_rows, triton_rows_kernel, triton_shadowkv, triton_shadowkv_kernel  # noqa: E402
from kvpress.kernels import triton_merge, triton_merge_kernel  # noqa: E402
from kvpress.kernels.triton_aot import compile_launch  # noqa: E402
from kvpress_kernel_cases import build, case  # noqa: E402

KERNELS = {
    triton_decode_kernel: ("_sparse_decode_split_kernel", "_merge_splits_kernel"),
    triton_quant_kernel: ("_quant_decode_split_kernel", "_quantize_pack_kernel"),
    triton_shadowkv_kernel: ("_shadowkv_rebuild_kernel",),
    triton_rows_kernel: ("_attend_rows_kernel",),
    triton_merge_kernel: ("_merge_two_kernel",),
}


class _Recorder:
    def __init__(self, fn, launches):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.fn, args, kwargs))
        return launch


@pytest.fixture
def launches(monkeypatch):
    """Launchers run on CPU tensors; their kernel launches are recorded instead of run."""
    if triton_decode.interpreting():
        pytest.skip("TRITON_INTERPRET=1 replaces the kernels with interpreted functions")
    recorded = []
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, _Recorder(getattr(module, name), recorded))
    for module in (triton_decode, triton_quant, triton_shadowkv, triton_rows, triton_merge):
        monkeypatch.setattr(module, "require_cuda_or_interpreter", lambda t, what: None)
    return recorded


def _compile(fn, args, kwargs, arch: int = 90):
    return compile_launch(fn, args, kwargs, arch).asm


def _check_compiles(launches, expected_kernels):
    assert [fn.__name__ for fn, _, _ in launches] == expected_kernels
    for fn, args, kwargs in launches:
        asm = _compile(fn, args, kwargs)
        assert len(asm["cubin"]) > 0 and ".target sm_90" in asm["ptx"], fn.__name__


@pytest.mark.parametrize("dtype,D,G,block_size,starts", [("fp16", 128, 4, 16, None), ("bf16", 64, 3, 64, [5, 0]),
                                                          ("fp32", 128, 1, 8, None), ("bf16", 128, 16, 16, None)])
def test_sparse_decode_compiles_for_sm90(launches, dtype, D, G, block_size, starts):
    q, k, v, index = build(case(B=2, G=G, D=D, T_cap=256, block_size=block_size, mode="topk", budget=4,
                                sinks=4, tail=8, dtype=dtype, starts=starts))
    triton_decode.triton_sparse_decode(q, k, v, index, num_splits=2)
    _check_compiles(launches, ["_sparse_decode_split_kernel", "_merge_splits_kernel"])


@pytest.mark.parametrize("bits,dtype,G,groups", [(4, torch.float16, 4, (32, 32)), (2, torch.bfloat16, 4, (32, 16)),
                                                  (4, torch.bfloat16, 16, (64, 16)), (8, torch.float16, 3, (128, 128)),
                                                  (4, torch.float32, 4, (32, 32)), (2, torch.float16, 8, (8, 8))])
def test_quant_kernels_compile_for_sm90(launches, bits, dtype, G, groups):
    """Every unpacking width, key tiles of one or several token groups, value groups of 8-128
    channels, fp16 tiles and fp32 queries (fp32 tiles)."""
    from kvpress.kernels.quant import quantize_per_channel, quantize_per_token

    (group, vgroup), B, H_kv, T, D = groups, 1, 2, 256, 128
    x = torch.randn(B, H_kv, T, D, dtype=dtype)
    triton_quant.triton_quantize_pack(x, bits, group, per_channel=True)
    triton_quant.triton_quantize_pack(x, bits, vgroup, per_channel=False)
    kq = quantize_per_channel(x.float(), bits, group)
    vq = quantize_per_token(x.float(), bits, vgroup)
    q = torch.randn(B, H_kv * G, D, dtype=dtype)
    triton_quant.triton_quant_decode(q, *kq, *vq, bits=bits, group_size=group, value_group_size=vgroup, num_splits=2)
    _check_compiles(launches, ["_quantize_pack_kernel", "_quantize_pack_kernel", "_quant_decode_split_kernel",
                               "_merge_splits_kernel"])


@pytest.mark.parametrize("bits,dtype,R", [(4, torch.float16, 16), (2, torch.bfloat16, 8), (4, torch.bfloat16, 64)])
def test_quant_decode_with_refined_keys_compiles_for_sm90(launches, bits, dtype, R):
    """The fused kernel's refined-key-channel reads (zipcache's ``refine_key_channels``), PTX codes on."""
    from kvpress.kernels.quant import quantize_per_token, quantize_refined_keys

    B, H_kv, T, D, group = 1, 2, 256, 128, 32
    x = torch.randn(B, H_kv, T, D)
    ch = torch.stack([torch.randperm(D)[:R] for _ in range(B * H_kv)]).view(B, H_kv, R)
    kc, ks, kz, rc, rs = quantize_refined_keys(x, bits, group, ch)
    q = torch.randn(B, H_kv * 4, D, dtype=dtype)
    triton_quant.triton_quant_decode(q, kc, ks, kz, *quantize_per_token(x, bits, group), bits=bits, group_size=group,
                                     num_splits=2, refine=(rc, rs, ch))
    _check_compiles(launches, ["_quant_decode_split_kernel", "_merge_splits_kernel"])


@pytest.mark.parametrize("dtype,D,chunk", [(torch.bfloat16, 128, 8), (torch.float16, 64, 16)])
def test_shadowkv_rebuild_compiles_for_sm90(launches, dtype, D, chunk):
    B, H_kv, T, R, K = 1, 2, 256, 48, 5
    factor = torch.randn(B, T, R, dtype=dtype)
    basis = torch.randn(B, R, H_kv, D, dtype=dtype)
    chunk_idx = torch.randint(0, T // chunk, (B, H_kv, K), dtype=torch.int32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    triton_shadowkv.triton_shadowkv_rebuild(factor, basis, chunk_idx, inv_freq, torch.zeros(B, dtype=torch.int64),
                                            chunk_size=chunk)
    _check_compiles(launches, ["_shadowkv_rebuild_kernel"])


@pytest.mark.parametrize("dtype,D,G,n_sets", [(torch.bfloat16, 128, 4, 3), (torch.float16, 64, 16, 1),
                                              (torch.bfloat16, 64, 3, 4)])
def test_attend_rows_compiles_for_sm90(launches, dtype, D, G, n_sets):
    B, H = 2, 2
    q = torch.randn(B, H * G, D, dtype=dtype)
    sets = []
    for i in range(n_sets):
        k = torch.randn(B, H, 96 + 32 * i, D, dtype=dtype)
        cnt = None if i == 0 else torch.randint(0, 96, (B, H), dtype=torch.int32)
        sets.append((k, torch.randn_like(k), cnt, 90 + i))
    triton_rows.triton_attend_rows(q, sets, scale=D ** -0.5)
    _check_compiles(launches, ["_attend_rows_kernel"])


@pytest.mark.parametrize("dtypes,D", [((torch.bfloat16, torch.bfloat16), 128), ((torch.float32, torch.bfloat16), 64),
                                      ((torch.float16, torch.float32), 80)])
def test_merge_states_compiles_for_sm90(launches, dtypes, D):
    out_a, out_b = torch.randn(2, 12, D, dtype=dtypes[0]), torch.randn(2, 12, D, dtype=dtypes[1])
    triton_merge.triton_merge_states(out_a, torch.randn(2, 12), out_b, torch.randn(2, 12))
    _check_compiles(launches, ["_merge_two_kernel"])
