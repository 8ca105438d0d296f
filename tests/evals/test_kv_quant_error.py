"""``benchmarks/kv_quant_error.py``: attention distance and output error of 4-bit KV schemes."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kv_quant_error as qe  # noqa: E402


def test_exact_schemes_are_exact_and_finer_codes_are_closer():
    rows = qe.main(["--model", "random-tiny", "--task", "niah_single", "--length", "512", "--n-samples", "1",
                    "--samples", "0", "--queries", "8", "--window", "64",
                    "--schemes", "kexact+vexact,base,k8+v8,vexact,kexact,kpre+ksink+kout+vnorm+vrot"])
    tv, out = rows["kexact+vexact"]
    assert tv < 1e-6 and out < 1e-6
    assert rows["k8+v8"][1] * 4 < rows["base"][1]  # 16x finer steps
    assert rows["vexact"][0] == pytest.approx(rows["base"][0])  # values do not move the attention
    assert rows["kexact"][0] < 1e-6 and 0 < rows["kexact"][1] <= rows["base"][1] * 1.01
    assert 0 < rows["vexact"][1] < rows["base"][1]
    assert all(0 < v[1] < 1 for k, v in rows.items() if k != "kexact+vexact")


def test_unknown_scheme_part_is_refused():
    with pytest.raises(SystemExit, match="allowed: base"):
        qe.main(["--model", "random-tiny", "--schemes", "base,k3"])
