"""``benchmarks/answer_kl.py``: teacher-forced KL of a policy's next-token distributions to the
unpatched model's, along the unpatched model's own answers."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import answer_kl  # noqa: E402


def test_full_is_the_unpatched_model_and_a_quantized_cache_is_not():
    """`full` under `apply` reproduces the unpatched distributions (KL at float rounding, no top-1
    change); 2-bit `kivi` over a prompt longer than its window moves them; every answer step is
    counted for every policy."""
    totals = answer_kl.main(["--model", "random-tiny", "--task", "niah_single", "--length", "1024",
                             "--samples", "0", "--policies", "full,kivi:residual_length=16"])
    full, kivi = totals["full"], totals["kivi:residual_length=16"]
    assert full["steps"] == kivi["steps"] > 0
    assert full["top1_diff"] == 0 and full["kl"] / full["steps"] < 1e-6
    assert kivi["kl"] / kivi["steps"] > 100 * max(full["kl"] / full["steps"], 1e-12)
