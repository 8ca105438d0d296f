"""The lm-eval model type ``kvpress``: registration, argument checks, policy-cache loglikelihoods."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

import kvpress  # noqa: E402
from kvpress.evals.lm_eval_model import KVPressLM, build_policy, split_model_args  # noqa: E402
from kvpress.evals.models import byte_tokenizer  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama and the byte tokenizer saved as a local HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=256, eos_token_id=256, bos_token_id=256)
    path = tmp_path_factory.mktemp("tiny-lm")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def lms(tiny_dir):
    from lm_eval.models.huggingface import HFLM

    return {
        "full": KVPressLM(pretrained=tiny_dir, policy="full", chunk_size=64, device="cpu"),
        "window": KVPressLM(pretrained=tiny_dir, policy="window", budget=16, chunk_size=32, device="cpu"),
        "hf": HFLM(pretrained=tiny_dir, device="cpu", dtype="float32"),
    }


def test_model_type_is_registered():
    assert get_model("kvpress") is KVPressLM


def test_policy_and_fields_are_validated_before_loading(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("kvpress.load_model", boom)
    with pytest.raises(ValueError, match="unknown policy"):
        KVPressLM(pretrained="smollm2", policy="nope")
    with pytest.raises(ValueError, match="unknown model_args 'colour'"):
        KVPressLM(pretrained="smollm2", policy="window", colour=3)
    with pytest.raises(ValueError, match="out of range"):
        KVPressLM(pretrained="smollm2", policy="streaming", window_size=0)
    with pytest.raises(ValueError, match="not supported"):
        KVPressLM(pretrained="smollm2", policy="full", parallelize=True)
    with pytest.raises(ValueError, match="unknown model"):
        KVPressLM(pretrained="no-such-model", policy="full")
    with pytest.raises(ValueError, match="chunk_size"):
        KVPressLM(pretrained="smollm2", chunk_size=0)
    with pytest.raises(ValueError, match="prefill_chunk_size must be an int >= 1"):
        KVPressLM(pretrained="smollm2", prefill_chunk_size=0)


def test_model_args_split_and_budget():
    policy_kw, hf_kw, load_kw = split_model_args(
        {"policy": "streaming", "window_size": 60, "batch_size": 2, "max_length": 1024, "revision": "main"})
    assert policy_kw == {"window_size": 60} and hf_kw == {"batch_size": 2, "max_length": 1024}
    assert load_kw == {"revision": "main"}
    assert build_policy("streaming", budget=64).to_dict()["window_size"] + 4 == 64
    assert build_policy("full", budget=64).to_dict() == {"policy": "full"}
    assert build_policy("snapkv:window_size=16", budget=64) == kvpress.get_policy("snapkv", budget=64, window_size=16)


def test_loglikelihood_goes_through_the_policy_cache(lms):
    ctx_req = [Instance("loglikelihood", {}, ("Once upon a time, " * 8, " there was a fox."), 0)]
    roll_req = [Instance("loglikelihood_rolling", {}, (TEXT,), 0)]
    (full_ll, _), = lms["full"].loglikelihood(ctx_req)
    (window_ll, _), = lms["window"].loglikelihood(ctx_req)
    (hf_ll, _), = lms["hf"].loglikelihood(ctx_req)
    assert full_ll == pytest.approx(hf_ll, abs=1e-4), "full through the chunked policy cache == HF"
    assert abs(window_ll - full_ll) > 1e-3, "a 16-token window changes the continuation's loglikelihood"

    full_roll, window_roll, hf_roll = (lms[k].loglikelihood_rolling(roll_req)[0] for k in ("full", "window", "hf"))
    assert full_roll == pytest.approx(hf_roll, abs=1e-3)
    assert abs(window_roll - full_roll) > 1e-2


def test_generation_runs_under_the_policy(lms):
    req = [Instance("generate_until", {}, ("Hello there, how", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}), 0)]
    assert lms["full"].generate_until(req) == lms["hf"].generate_until(req)
    assert isinstance(lms["window"].generate_until(req)[0], str)
    info = lms["window"].get_model_info()
    assert info["kvpress_policy"] == {"policy": "window", "window_size": 16}


def test_generation_prompt_in_pieces(tiny_dir, lms, monkeypatch):
    """``prefill_chunk_size``: generate's prompt in forwards of that many tokens (inside the
    policy cache's prompt block), with the same text as one forward for ``full``."""
    from kvpress.cache import PolicyCache

    chunked = KVPressLM(pretrained=tiny_dir, policy="full", prefill_chunk_size=4, device="cpu")
    opened = []
    monkeypatch.setattr(PolicyCache, "begin_prompt",
                        lambda self, _orig=PolicyCache.begin_prompt: (opened.append(1), _orig(self))[1])
    req = [Instance("generate_until", {}, ("Hello there, how", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}), 0)]
    assert chunked.generate_until(req) == lms["full"].generate_until(req)
    assert opened  # the prompt went in pieces
    assert chunked.get_model_info()["kvpress_prefill_chunk_size"] == 4


def test_generation_checks_the_length_a_kvpress_task_sized_its_prompt_to(tiny_dir, lms):
    from lm_eval.tasks import TaskManager

    from kvpress.evals.lm_eval_tasks import INCLUDE_PATH

    manager = TaskManager(include_path=str(INCLUDE_PATH), include_defaults=False,
                          metadata={"tokenizer": tiny_dir, "max_seq_lengths": [512], "num_samples": 1})
    task = manager.load(["kvpress_niah_single"])["tasks"]["kvpress_niah_single"]
    task.build_all_requests()  # no --apply_chat_template; the byte tokenizer has no template: plain
    (built,) = task.instances
    assert built.doc["prompt_format"] == "plain"
    context, gen_kwargs = built.args[0], {**built.args[1], "max_gen_toks": 2}
    plain = Instance("generate_until", built.doc, (context, gen_kwargs), 0, metadata=("kvpress_niah_single", 0, 1))
    assert isinstance(lms["window"].generate_until([plain])[0], str)

    sized_for_chat = {**built.doc, "prompt_format": "chat", "num_tokens": built.doc["num_tokens"] + 30}
    chat = Instance("generate_until", sized_for_chat, (context, gen_kwargs), 0, metadata=("kvpress_niah_single", 0, 1))
    with pytest.raises(ValueError, match=r"kvpress_niah_single: lm-eval's prompt has \d+ tokens but the task sized "
                                         r"it to \d+ in the chat format: run lm-eval with --apply_chat_template"):
        lms["window"].generate_until([chat])
    shorter = Instance("generate_until", {**built.doc, "num_tokens": 7}, (context, gen_kwargs), 0,
                       metadata=("kvpress_niah_single", 0, 1))
    with pytest.raises(ValueError, match="run lm-eval without --apply_chat_template"):
        lms["full"].generate_until([shorter])


def test_lm_eval_passthrough_adds_our_include_path(monkeypatch):
    import sys

    from kvpress.cli import main
    from kvpress.evals.lm_eval_tasks import INCLUDE_PATH

    seen = []
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", lambda: seen.append(list(sys.argv)))
    assert main(["lm-eval", "--model", "kvpress", "--model_args", "pretrained=smollm2", "--tasks", "x"]) == 0
    assert seen[-1][1:] == ["--model", "kvpress", "--model_args", "pretrained=smollm2", "--tasks", "x",
                            "--include_path", str(INCLUDE_PATH)]
    assert main(["lm-eval", "--tasks", "x", "--include_path", "/mine"]) == 0
    assert seen[-1][1:] == ["--tasks", "x", "--include_path", "/mine"]
    assert main(["lm-eval", "ls", "tasks"]) == 0 and seen[-1][1:] == ["ls", "tasks"]


@pytest.mark.slow  # lm-eval indexes its thousands of task YAMLs first (~1-2 min on 2 busy cores)
def test_kvpress_lm_eval_cli_runs_our_task(tiny_dir, tmp_path, monkeypatch):
    from kvpress.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    metadata = json.dumps({"tokenizer": tiny_dir, "max_seq_lengths": [512], "num_samples": 1})
    code = main([
        "lm-eval", "--model", "kvpress", "--model_args", f"pretrained={tiny_dir},policy=window,budget=32",
        "--tasks", "kvpress_niah_single", "--metadata", metadata, "--device", "cpu",
        "--gen_kwargs", "max_gen_toks=4", "--output_path", str(tmp_path),
    ])
    assert code == 0
    (result_file,) = tmp_path.rglob("results_*.json")
    results = json.loads(result_file.read_text())
    assert "kvpress_niah_single" in results["results"]
    assert results["config"]["model_args"]["policy"] == "window"


@pytest.mark.slow  # two processes each load lm-eval and the model (~2 min on 2 cores)
def test_two_process_data_parallel(tiny_dir, tmp_path):
    # torchrun starts two ranks; ACCELERATE_USE_CPU=1 makes Accelerator() join them over gloo,
    # so lm-eval must give each rank half of the requests and gather every sample's score.
    import os
    import shutil
    import subprocess

    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    env = dict(os.environ, ACCELERATE_USE_CPU="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    metadata = json.dumps({"tokenizer": tiny_dir, "max_seq_lengths": [512], "num_samples": 4})
    done = subprocess.run([
        "torchrun", "--nproc_per_node", "2", "-m", "kvpress.cli", "lm-eval", "--model", "kvpress",
        "--model_args", f"pretrained={tiny_dir},policy=window,budget=32", "--tasks", "kvpress_niah_single",
        "--metadata", metadata, "--gen_kwargs", "max_gen_toks=4", "--limit", "4", "--output_path", str(tmp_path),
        "--log_samples",
    ], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "on rank 0" in log and "on rank 1" in log
    (samples_file,) = tmp_path.rglob("samples_kvpress_niah_single_*.jsonl")
    docs = [json.loads(line)["doc_id"] for line in samples_file.read_text().splitlines()]
    assert sorted(docs) == [0, 1, 2, 3]  # gathered from both ranks, each once


def test_no_warning_about_the_model_object_it_hands_to_hflm(tiny_dir, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        KVPressLM(pretrained=tiny_dir, policy="window", budget=16, device="cpu")
    messages = [r.getMessage() for r in caplog.records]
    assert not any("not of type `str`" in m or "already-initialized model" in m for m in messages), messages
    assert not logging.getLogger("lm_eval.models.huggingface").filters  # the filter ends with the constructor
