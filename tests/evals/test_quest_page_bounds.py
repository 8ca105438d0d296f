"""``benchmarks/quest_page_bounds.py``: the page bound and selection it reports are the policy's."""
import sys
from pathlib import Path

import torch

from conftest import tiny_model
from kvpress import get_policy
from kvpress.prefill import cache_from_dense, dense_prefill

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import quest_page_bounds as qpb  # noqa: E402


def test_the_scripts_selection_is_quest_layer_select():
    torch.manual_seed(0)
    model = tiny_model("llama", layers=3)  # 4 query heads, 2 KV heads
    ids = torch.randint(0, model.config.vocab_size, (1, 203))
    for size in (8, 16):
        quest = get_policy("quest", budget=64, page_size=size, dense_layers=1)
        record: dict = {}
        with qpb.recording_queries(record):
            _, dense = dense_prefill(model, ids)
        cache = cache_from_dense(model, quest, dense)
        for layer_idx in (1, 2):
            q, scaling = record[layer_idx][0]
            keys = dense.layers[layer_idx].buffer.keys
            bound, lo, hi = qpb.quest_selection(q, keys, scaling, quest)
            ours = (bound.topk(quest.selected_pages, dim=-1).indices + lo).sort(dim=-1).values
            index = cache.layers[layer_idx].select(q, scaling)
            theirs = index.block_idx[0].long().sort(dim=-1).values
            assert index.block_size == size and index.dense_tail == quest.dense_tail
            assert torch.equal(ours, theirs)
            # the report agrees with itself: a needle page is selected exactly when its bound rank is in budget
            topk = get_policy("exact_topk", budget=64)
            rows = qpb.page_report(q, keys, scaling, quest, topk, (40, 43))
            for row in rows:
                assert 0 < row["quest_mass"] <= 1 + 1e-5 and 0 < row["topk_mass"] <= 1 + 1e-5
                for page in row["needle"]:
                    assert page["selected"] == (page["bound_rank"] <= quest.selected_pages)


def test_main_reports_every_quest_layer_on_a_task_sample():
    rows = qpb.main(["--model", "random-tiny", "--task", "niah_single", "--length", "512", "--samples", "1",
                     "--sample-ids", "0", "--budget", "128", "--page-sizes", "8"])
    assert rows and {r["query"] for r in rows} == {"prompt", "answer"}
    assert all(r["needle"] and r["top_mass"] <= 1 + 1e-5 for r in rows)
