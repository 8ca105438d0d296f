"""Calls the registered Triton ops (``kvpress::triton_*``) under TRITON_INTERPRET=1 on tiny fp32
inputs and prints, as one JSON object, each op's largest error against its torch reference.

Run in a child process (see test_triton_ops.py): the interpreter flag must be set before triton
is imported and must not leak into the rest of the test session.
"""
import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

import torch  # noqa: E402

from kvpress.kernels import quantize_per_channel, quantize_per_token, reference_sparse_decode  # noqa: E402
from kvpress.kernels.merge import torch_merge_states  # noqa: E402
from kvpress.kernels.packed_decode import reference_quant_decode  # noqa: E402
from kvpress.kernels.rows import torch_attend_rows  # noqa: E402
from kvpress_kernel_cases import build, case  # noqa: E402

OPS = torch.ops.kvpress


def err(got, want) -> float:
    finite = torch.isfinite(want)
    if not bool((torch.isfinite(got) == finite).all()):
        return float("inf")
    return (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0


def main() -> dict:
    gen = torch.Generator().manual_seed(0)
    res = {}
    q, k, v, i = build(case(B=2, H_kv=2, G=3, D=64, T_cap=40, lens=[40, 29], starts=[0, 3], block_size=8,
                            mode="random", budget=2, sinks=2, tail=3))
    out, lse = OPS.triton_sparse_decode(q, k, v, i.block_idx, i.block_cnt, i.seq_lens, i.seq_starts, i.block_size,
                                        i.sinks, i.dense_tail, i.max_blocks, 0.125, 2)
    ref_out, ref_lse = reference_sparse_decode(q, k, v, i, scale=0.125)
    res["triton_sparse_decode"] = max(err(out, ref_out), err(lse, ref_lse))

    oa, ob = torch.randn(2, 3, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    la, lb = torch.randn(2, 3, generator=gen), torch.randn(2, 3, generator=gen)
    la[0, 1] = lb[1, 2] = float("-inf")
    out, lse = OPS.triton_merge_states(oa, la, ob, lb)
    ref_out, ref_lse = torch_merge_states(oa, la, ob, lb)
    res["triton_merge_states"] = max(err(out, ref_out), err(lse, ref_lse))

    k2, v2 = torch.randn(2, 2, 7, 64, generator=gen), torch.randn(2, 2, 7, 64, generator=gen)
    cnt = torch.tensor([[7, 2], [0, 5]], dtype=torch.int32)
    out, lse = OPS.triton_attend_rows(q, [k, k2], [v, v2], [None, cnt], [20, 7], 0.125)
    ref_out, ref_lse = torch_attend_rows(q, [(k, v, None, 20), (k2, v2, cnt, 7)], scale=0.125)
    res["triton_attend_rows"] = max(err(out, ref_out), err(lse, ref_lse))

    x = torch.randn(1, 2, 64, 64, generator=gen)
    kc, ks, kz = OPS.triton_quantize_pack(x, 4, 32, True)
    vc, vs, vz = OPS.triton_quantize_pack(x.flip(2), 4, 16, False)
    ref = quantize_per_channel(x, 4, 32) + quantize_per_token(x.flip(2), 4, 16)
    # ties round up here and to even in torch: a code may differ by one, the scales not at all
    codes_off = max(((a.view(-1, 1) >> torch.tensor([0, 4], dtype=torch.uint8) & 15).int()
                     - (b.view(-1, 1) >> torch.tensor([0, 4], dtype=torch.uint8) & 15).int()).abs().max().item()
                    for a, b in ((kc, ref[0]), (vc, ref[3])))
    res["triton_quantize_pack"] = max(codes_off - 1, 0) + max(err(a.float(), b.float()) for a, b in
                                                               ((ks, ref[1]), (kz, ref[2]), (vs, ref[4]), (vz, ref[5])))
    qq = torch.randn(1, 6, 64, generator=gen)
    starts = torch.tensor([5], dtype=torch.int32)
    out, lse = OPS.triton_quant_decode(qq, kc, ks, kz, vc, vs, vz, starts, None, None, None, 4, 32, 16, 0.125, 2)
    ref_out, ref_lse = reference_quant_decode(qq, kc, ks, kz, vc, vs, vz, bits=4, group_size=32, seq_starts=starts,
                                              scale=0.125, value_group_size=16)
    res["triton_quant_decode"] = max(err(out, ref_out), err(lse, ref_lse))
    return res


if __name__ == "__main__":
    print(json.dumps(main()))
