"""Shared fixtures: tiny randomly initialised models of every supported family."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Under pytest-xdist every worker gets one core; oversubscribed BLAS threads slow everything down.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

# every family kvpress.adapters supports; the contract tests run each policy on each
FAMILIES = ("llama", "qwen2", "qwen2_moe", "mistral", "mixtral", "ministral", "qwen3", "qwen3_moe", "olmo", "olmo2",
            "olmo3", "gemma", "gemma3_text", "granite", "granitemoe", "phi3", "arcee", "seed_oss", "smollm3")
# families whose config.layer_types default to a sliding pattern (set per test instead)
LAYER_TYPE_FAMILIES = ("gemma3_text", "olmo3", "ministral")


@pytest.fixture
def torch_threads():
    """``torch.set_num_threads`` for one test (the native kernels follow it); restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def tiny_model(family: str = "llama", *, layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
               head_dim: int = 16, **config):
    """A randomly initialised causal LM of ``family`` with ``head_dim``-dim heads (fp32, eval mode);
    ``config`` overrides fields of its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(
        vocab_size=256, hidden_size=head_dim * heads, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=255,
    )
    if family in ("mistral", "mixtral", "phi3"):
        kwargs["sliding_window"] = None  # a window in every layer is refused (full attention only)
    if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        kwargs["use_sliding_window"] = False
    if family in ("qwen2_moe", "qwen3_moe"):
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = 32
    if family in ("mixtral", "granitemoe"):
        kwargs.update(num_local_experts=4, num_experts_per_tok=2)
    if family == "smollm3":  # its NoPE layers (every fourth by default): layer 1 of 2 here
        kwargs["no_rope_layers"] = [1] * (layers - 1) + [0]
    if family in LAYER_TYPE_FAMILIES:  # their default patterns slide most layers (Gemma 3: 5 of 6): all of 2
        kwargs["layer_types"] = ["full_attention"] * layers
    kwargs.update(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kwargs)).eval()
    model.generation_config.pad_token_id = 0
    return model


# the contract tests also run on a GQA group above the compiled kernels' 8 (Qwen3-235B has 16):
# the torch paths take any group, "auto" falls back to them; and on models whose last layer
# slides (an 8-token window, shorter than the test prompts): the policy runs layers 0-1 only
CONTRACT_MODELS = FAMILIES + ("llama-g16", "qwen2-sliding", "gemma3_text-sliding", "olmo3-sliding")


def contract_model(name: str, seed: int = 0):
    """The tiny model of a ``CONTRACT_MODELS`` entry."""
    if name == "llama-g16":
        return tiny_model("llama", heads=16, kv_heads=1, seed=seed)
    if name.endswith("-sliding"):
        return sliding_model(name.removesuffix("-sliding"), seed=seed)
    return tiny_model(name, seed=seed)


def sliding_model(family: str = "qwen2", *, layers: int = 3, full_layers: int = 2, window: int = 8, seed: int = 0):
    """A tiny model whose layers from ``full_layers`` on attend a sliding window of ``window`` tokens."""
    types = ["full_attention"] * full_layers + ["sliding_attention"] * (layers - full_layers)
    if family in LAYER_TYPE_FAMILIES:  # per-layer types (and Gemma 3's local RoPE base for the sliding ones)
        return tiny_model(family, layers=layers, seed=seed, sliding_window=window, layer_types=types)
    if family == "qwen2_moe":  # its own max_window_layers rule slides every other layer below it: types given
        return tiny_model(family, layers=layers, seed=seed, use_sliding_window=True, sliding_window=window,
                          layer_types=types)
    return tiny_model(family, layers=layers, seed=seed, use_sliding_window=True, sliding_window=window,
                      max_window_layers=full_layers)


@pytest.fixture(scope="session", params=CONTRACT_MODELS)
def family_model(request):
    return contract_model(request.param)


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


def random_ids(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (batch, length), generator=gen)



def greedy_steps(model, policy, ids, steps: int, *, compiled: bool, capacity: int | None = None,
                 eager_first: int = 0, then=None):
    """Greedy decoding of ``steps`` one-token steps after the prompt ``ids`` under ``policy``, the
    steps from ``eager_first`` on through ``torch.compile(fullgraph=True)`` with a counting backend
    when ``compiled`` (the cache planned for ``capacity`` tokens when given); ``then(cache)`` runs
    inside the policy's block afterwards. Returns (tokens, graphs compiled, cache, what ``then`` returned)."""
    import kvpress
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    with torch.no_grad(), kvpress.apply(model, policy):
        cache = kvpress.make_cache(model, policy)
        if capacity is not None:
            cache.plan_capacity(capacity)
        tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        compiled_step = torch.compile(model.forward, fullgraph=True, backend=counter)
        tokens = []
        for i in range(steps):
            tokens.append(int(tok))
            step = compiled_step if compiled and i >= eager_first else model.forward
            pos = torch.tensor([[ids.shape[1] + i]])
            tok = step(input_ids=tok, past_key_values=cache, use_cache=True, position_ids=pos).logits.argmax(-1)
        extra = then(cache) if then is not None else None
    return tokens, counter.frame_count, cache, extra


def unplanned_decode(model, policy, *, compiled: bool, prompt: int = 10, steps: int = 150):
    """:func:`greedy_steps` on a cache never planned after a random ``prompt``-token prompt:
    (tokens, graphs compiled, the cache)."""
    tokens, graphs, cache, _ = greedy_steps(model, policy, random_ids(prompt, seed=6), steps, compiled=compiled)
    return tokens, graphs, cache


def planned_after_prompt(model, policy, capacity: int = 300, prompt: int = 30):
    """A cache of ``policy`` planned for ``capacity`` tokens that holds a random ``prompt``-token
    prompt; asserts ``cache_stats`` counts at least the bytes of every state tensor, and returns it."""
    import kvpress

    with torch.no_grad(), kvpress.apply(model, policy):
        cache = kvpress.make_cache(model, policy)
        cache.plan_capacity(capacity)
        model(random_ids(prompt, seed=5), past_key_values=cache, use_cache=True)
    resident = kvpress.cache_stats(cache).resident_bytes
    assert resident >= sum(t.numel() * t.element_size() for layer in cache.layers
                           for t in layer.state_tensors().values() if t is not None)
    return cache
