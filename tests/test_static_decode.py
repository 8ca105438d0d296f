"""Static decode: every policy's one-token decode step compiles as one graph per capacity bucket.

``torch.compile(model.forward, fullgraph=True)`` with a counting backend (no code generation: the
check is that dynamo captures the step without a break and does not recompile as the cache fills)
runs 300 greedy one-token steps after a prompt, which crosses page boundaries, ring wraps,
quantizer flushes and selection refreshes at the policies' small example settings; the tokens must
equal the eager run's. Graphs allowed per capacity bucket: 2 (dynamo specialises the first call's
Python integers, then traces them as symbols once they change).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import kvpress
from kvpress.adapters import get_adapter
from kvpress.registry import list_policies, policy_class

from conftest import random_ids, sliding_model, tiny_model

STEPS = 300
PROMPT = 40

# Policies whose decode step is not yet static, each with what stands in the way. The goal is none.
NOT_YET_STATIC: dict[str, str] = {}


def _models():
    return {"llama": tiny_model("llama"), "qwen2": tiny_model("qwen2"),
            "gemma3": sliding_model("gemma3_text", layers=3, full_layers=2, window=16)}


@pytest.fixture(scope="module")
def models():
    return _models()


def _decode(model, policy, prompt, steps, compiled):
    torch._dynamo.reset()
    counter = CompileCounter()
    with torch.no_grad(), kvpress.apply(model, policy):
        cache = kvpress.make_cache(model, policy)
        cache.plan_capacity(prompt.shape[1] + steps)
        out = model(prompt, past_key_values=cache, use_cache=True)
        forward = torch.compile(model.forward, fullgraph=True, backend=counter) if compiled else model.forward
        tok = out.logits[:, -1:].argmax(-1)
        tokens = [int(tok)]
        for i in range(steps - 1):
            pos = torch.tensor([[prompt.shape[1] + i]])
            tok = forward(input_ids=tok, past_key_values=cache, use_cache=True, position_ids=pos).logits.argmax(-1)
            tokens.append(int(tok))
    return tokens, counter.frame_count


@pytest.mark.parametrize("model_name", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("name", list_policies())
def test_decode_step_compiles_as_one_graph(models, model_name, name):
    if name in NOT_YET_STATIC:
        pytest.skip(f"{name}: not yet static ({NOT_YET_STATIC[name]})")
    model = models[model_name]
    policy = policy_class(name).example(get_adapter(model))
    prompt = random_ids(PROMPT, seed=1)
    eager, _ = _decode(model, policy, prompt, STEPS, compiled=False)
    compiled, graphs = _decode(model, policy, prompt, STEPS, compiled=True)
    assert compiled == eager
    assert 1 <= graphs <= 2, f"{graphs} graphs for one capacity bucket"


def test_not_yet_static_names_registered_policies():
    assert set(NOT_YET_STATIC) <= set(list_policies())


@pytest.mark.parametrize("name", sorted(set(list_policies()) - set(NOT_YET_STATIC)))
def test_static_policies_report_compileable_caches(models, name):
    model = models["llama"]
    policy = policy_class(name).example(get_adapter(model))
    with kvpress.apply(model, policy):
        assert kvpress.make_cache(model, policy).is_compileable


@pytest.mark.parametrize("name", sorted(NOT_YET_STATIC))
def test_other_policies_do_not_claim_compileable_caches(models, name):
    model = models["llama"]
    policy = policy_class(name).example(get_adapter(model))
    with kvpress.apply(model, policy):
        assert not kvpress.make_cache(model, policy).is_compileable


def test_outgrowing_the_planned_capacity_grows_to_the_next_bucket(models):
    """A generation longer than planned: the buffer grows to the next bucket (one new shape, so a
    recompile), nothing is truncated, and the tokens still equal the eager run's."""
    from kvpress.plan import capacity_bucket

    model = models["llama"]
    policy = kvpress.get_policy("full")
    prompt = random_ids(PROMPT, seed=2)
    steps = 200
    torch._dynamo.reset()
    counter = CompileCounter()
    with torch.no_grad(), kvpress.apply(model, policy):
        cache = kvpress.make_cache(model, policy)
        planned = cache.plan_capacity(PROMPT + 8)
        out = model(prompt, past_key_values=cache, use_cache=True)
        forward = torch.compile(model.forward, fullgraph=True, backend=counter)
        tok = out.logits[:, -1:].argmax(-1)
        tokens = [int(tok)]
        for i in range(steps - 1):
            pos = torch.tensor([[PROMPT + i]])
            tok = forward(input_ids=tok, past_key_values=cache, use_cache=True, position_ids=pos).logits.argmax(-1)
            tokens.append(int(tok))
        capacity = cache.layers[0].buffer.capacity
        stored = cache.get_seq_length()
    eager, _ = _decode(model, policy, prompt, steps, compiled=False)
    assert tokens == eager
    assert stored == PROMPT + steps - 1 and capacity >= stored > planned
    buckets = len({capacity_bucket(n) for n in range(planned, capacity + 1)})
    assert counter.frame_count <= 2 * buckets, (counter.frame_count, buckets)


@pytest.mark.parametrize("name", sorted(set(list_policies()) - set(NOT_YET_STATIC)))
def test_generate_takes_transformers_compiled_decode(models, name):
    """``model.generate`` under ``apply`` with a compile config (forced on CPU) runs transformers' own
    compiled decode on a left-padded batch: the tokens equal eager generation's, in one graph,
    which takes no integer input (the host counts are advanced outside the graph), which is what a
    CUDA graph needs to be replayed rather than re-recorded every step."""
    from transformers import CompileConfig

    model = models["llama"]
    policy = policy_class(name).example(get_adapter(model))
    long, short = random_ids(30, seed=1), random_ids(18, seed=2)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 12, dtype=torch.long), short], 1)])
    mask = (ids != 0).long()
    mask[0] = 1
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.name for n in gm.graph.nodes
                       if n.op == "placeholder" and not isinstance(n.meta.get("example_value"), torch.Tensor)])
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    with torch.no_grad(), kvpress.apply(model, policy):
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, disable_compile=True)
        compiled = model.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, compile_config=config)
    assert torch.equal(compiled, eager)
    # one graph: the host integers a step advances are symbols from the first trace (`step_ints`)
    assert len(graphs) == 1 and not any(graphs), graphs


@pytest.mark.parametrize("name", sorted(n for n in set(list_policies()) - set(NOT_YET_STATIC)
                                        if policy_class(n)().prefills_densely()))
def test_compiled_generate_from_a_shared_dense_prefill(models, name):
    """``generate`` handed a cache built from a shared dense prefill (``cache_from_dense``): its first
    step runs eagerly (transformers compiles only the steps after it), the rest compiled. A layer
    whose fixed-shape state an eager step gave back builds it again before the compiled call
    (``before_static_step``), not while dynamo traces: tokens equal eager generation's."""
    from transformers import CompileConfig

    from kvpress.compat import cache_kwargs
    from kvpress.prefill import cache_from_dense, dense_prefill

    model = models["llama"]
    policy = policy_class(name).example(get_adapter(model))
    ids = random_ids(40, seed=3)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    with torch.no_grad():
        logits, dense = dense_prefill(model, ids)
        ids = torch.cat([ids, logits.argmax(-1)[:, None]], 1)
        runs = []
        for kw in ({"disable_compile": True}, {"compile_config": config}):
            with kvpress.apply(model, policy):
                cache = cache_from_dense(model, policy, dense, capacity=ids.shape[1] + 30)
                runs.append(model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                                           max_new_tokens=30, do_sample=False, **kw))
    assert torch.equal(runs[0], runs[1])
    assert len(graphs) == 1  # (the eager first step leaves no state the compiled steps' guards see change)


def _mutation_checker(found: list):
    """A compile backend (AOT, no code generation) recording, per graph, the placeholder names of
    inputs the graph mutates without their being static inputs: inductor skips a CUDA graph of such
    a graph ("mutated inputs"), so the compiled step would run launch by launch."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    names: list = []

    def fw(gm, example_inputs):
        meta = torch._guards.TracingContext.try_get().fw_metadata
        static = set(meta.static_input_indices or [])
        found.append([names[i] for i in meta.mutated_inp_runtime_indices if i not in static])
        return make_boxed_func(gm.forward)

    inner = aot_autograd(fw_compiler=fw)

    def backend(gm, example_inputs):
        names[:] = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        return inner(gm, example_inputs)

    return backend


@pytest.mark.parametrize("name", sorted(set(list_policies()) - set(NOT_YET_STATIC)))
def test_compiled_decode_mutates_only_static_inputs(models, name):
    """Every tensor ``generate``'s compiled decode step updates in place is a static input (tagged
    by ``before_static_step``), which a CUDA graph of the step needs: seen on an H200, Quest's page
    bounds were not, and its graph was skipped (3x slower than ``full`` at 32k, batch 8). ShadowKV
    writes its host tier (pinned host memory) in the step, which no CUDA graph holds."""
    from transformers import CompileConfig

    model = models["llama"]
    policy = policy_class(name).example(get_adapter(model))
    found: list = []
    config = CompileConfig(fullgraph=True, backend=_mutation_checker(found), mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    with torch.no_grad(), kvpress.apply(model, policy):
        model.generate(random_ids(40, seed=4), max_new_tokens=12, do_sample=False, compile_config=config)
    assert found, "no graph compiled"
    bad = sorted({n for graph in found for n in graph})
    if name == "shadowkv":
        assert bad and all("host" in n for n in bad), bad
    else:
        assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(set(list_policies()) - set(NOT_YET_STATIC)))
def test_compiled_decode_is_captured_in_a_cuda_graph(name):
    """On CUDA, ``generate``'s compiled decode of every policy (transformers' default compile: inductor,
    CUDA graphs) is one graph recorded as a CUDA graph (inductor skips none: no mutated input that is
    not static, no CPU tensor) and gives eager decoding's tokens (fp32). ShadowKV's step writes its
    host tier (pinned host memory), which a CUDA graph does not hold: a skip is expected there."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = tiny_model("llama").cuda()
    policy = policy_class(name).example(get_adapter(model))
    ids = random_ids(40, seed=5).cuda()
    config = CompileConfig(fullgraph=True)  # inductor, mode reduce-overhead
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), kvpress.apply(model, policy):
        eager = model.generate(ids, max_new_tokens=24, do_sample=False, disable_compile=True)
        compiled = model.generate(ids, max_new_tokens=24, do_sample=False, compile_config=config)
    assert torch.equal(compiled, eager)
    assert counters["stats"]["unique_graphs"] == 1
    skips = counters["inductor"]["cudagraph_skips"]
    assert skips >= 1 if name == "shadowkv" else skips == 0, skips


@pytest.mark.parametrize("name", ["exact_topk", "quest", "tidal", "double_sparsity"])
def test_tail_estimate_keeps_one_graph_as_chunks_start(models, name):
    """The tail estimate's chunk count grows every ``tail_chunk`` tokens; the compiled step must not
    guard on it (16-token chunks start at other steps than the first one, from a 40-token prompt)."""
    model = models["llama"]
    policy = replace(policy_class(name).example(get_adapter(model)), tail_chunk=16)
    prompt = random_ids(PROMPT, seed=1)
    eager, _ = _decode(model, policy, prompt, 100, compiled=False)
    compiled, graphs = _decode(model, policy, prompt, 100, compiled=True)
    assert compiled == eager
    assert 1 <= graphs <= 2, f"{graphs} graphs for one capacity bucket"
