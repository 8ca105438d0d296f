"""``benchmarks/shadowkv_key_error.py``: attention distance of ShadowKV's low-rank keys, plain and
query-weighted SVD, per layer."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import shadowkv_key_error as ke  # noqa: E402


def test_full_rank_keys_attend_as_the_exact_ones_and_low_rank_ones_do_not():
    rows = ke.main(["--model", "random-tiny", "--task", "niah_single", "--length", "512", "--samples", "1",
                    "--sample", "0", "--ranks", "1,128", "--queries", "8"])
    assert rows and all(set(r) == {(m, k) for m in ("plain", "query") for k in (1, 128)} for r in rows)
    for row in rows:
        for m in ("plain", "query"):
            tv, kept = row[(m, 128)]  # 128 = num_kv_heads * head_dim of random-tiny: exact keys
            assert tv < 1e-4 and abs(kept - 1) < 1e-5
            assert row[(m, 1)][0] > 100 * max(tv, 1e-6) and 0 < row[(m, 1)][1] < 1


def test_a_quantized_residual_brings_low_rank_keys_back_near_the_exact_ones():
    rows = ke.main(["--model", "random-tiny", "--task", "niah_single", "--length", "512", "--samples", "1",
                    "--sample", "0", "--ranks", "1", "--queries", "8", "--residual-bits", "2,8"])
    for row in rows:
        for m in ("plain", "query"):
            rank1, two, eight = (row[(k, 1)][0] for k in (m, f"{m}+2b", f"{m}+8b"))
            assert eight < two < rank1 and eight < rank1 / 50
