"""apply()/make_cache(): integration paths, nesting, and bad input (the model stays untouched)."""

import pytest
import torch

import kvpress

from conftest import random_ids, tiny_model
from kvpress.compat import output_cache


def test_forward_with_use_cache_gets_policy_cache_and_equals_unpatched(llama):
    ids = random_ids(30)
    with torch.no_grad():
        ref = llama(ids).logits
        with kvpress.apply(llama, kvpress.get_policy("full")):
            out = llama(ids, use_cache=True)
            no_cache = llama(ids, use_cache=False)
    assert isinstance(out.past_key_values, kvpress.PolicyCache)
    assert (out.logits - ref).abs().max() <= 1e-5
    assert (no_cache.logits - ref).abs().max() <= 1e-5


def test_incremental_forwards_continue_the_cache(llama):
    ids = random_ids(40)
    with torch.no_grad():
        ref = llama(ids).logits
        for name in ("full", "streaming", "window"):
            policy = kvpress.get_policy(name).with_budget(64)
            with kvpress.apply(llama, policy):
                first = llama(ids[:, :25], use_cache=True)
                second = llama(ids[:, 25:], past_key_values=first.past_key_values, use_cache=True)
            torch.testing.assert_close(second.logits, ref[:, 25:], atol=1e-5, rtol=0)


def test_chunked_streaming_prefill_equals_one_shot(llama):
    ids = random_ids(60, seed=9)
    policy = kvpress.get_policy("streaming", sink_tokens=2, window_size=10)
    with torch.no_grad(), kvpress.apply(llama, policy):
        whole = llama(ids, use_cache=True).logits
        cache = kvpress.make_cache(llama, policy)
        parts = [llama(ids[:, i : i + 7], past_key_values=cache, use_cache=True).logits for i in range(0, 60, 7)]
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=0)


def test_make_cache_is_used_and_refused_outside_apply(llama):
    policy = kvpress.get_policy("window", window_size=16)
    cache = kvpress.make_cache(llama, policy)
    ids = random_ids(20)
    with torch.no_grad(), kvpress.apply(llama, policy):
        out = llama.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert out.past_key_values is cache
    assert cache.layers[0].stored_tokens() == 16
    with pytest.raises(RuntimeError, match="kvpress.apply"), torch.no_grad():
        llama(ids, past_key_values=kvpress.make_cache(llama, policy), use_cache=True)
    assert llama.config._attn_implementation == "sdpa"


def test_nested_apply_is_refused_and_outer_session_survives(llama):
    ids = random_ids(12)
    with kvpress.apply(llama, kvpress.get_policy("full")):
        with pytest.raises(RuntimeError, match="nested"):
            with kvpress.apply(llama, kvpress.get_policy("window")):
                pass
        with torch.no_grad():
            assert isinstance(llama(ids, use_cache=True).past_key_values, kvpress.PolicyCache)
    assert llama.config._attn_implementation == "sdpa"


def test_prefilled_foreign_cache_is_refused(llama):
    ids = random_ids(12)
    with torch.no_grad():
        dyn = llama(ids, use_cache=True).past_key_values
        with kvpress.apply(llama, kvpress.get_policy("full")), pytest.raises(ValueError, match="pre-filled"):
            llama(ids[:, :1], past_key_values=dyn, use_cache=True)


def test_continuous_batching_is_refused_inside_apply_and_works_after(llama):
    """``generate_batch`` keeps its own paged cache: inside ``apply`` it is refused (not run without
    the policy); after the block the model's own entry point is back (not run here: ~18 s on CPU)."""
    ids = random_ids(12)[0].tolist()
    with kvpress.apply(llama, kvpress.get_policy("streaming", sink_tokens=2, window_size=8)):
        with pytest.raises(NotImplementedError, match="continuous batching .* inside kvpress.apply use model.generate"):
            llama.generate_batch([ids], max_new_tokens=2, progress_bar=False, warmup=False)
    assert "init_continuous_batching" not in vars(llama) and llama.config._attn_implementation == "sdpa"
    assert llama.init_continuous_batching.__func__ is type(llama).init_continuous_batching


@pytest.mark.parametrize("implementation", ["static", "offloaded"])
def test_a_requested_cache_implementation_is_replaced_with_a_warning(llama, implementation):
    ids = random_ids(12)
    with torch.no_grad(), kvpress.apply(llama, kvpress.get_policy("window", window_size=8)):
        with pytest.warns(UserWarning, match=f"cache_implementation='{implementation}'.* policy's cache instead"):
            out = llama.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation=implementation,
                                 return_dict_in_generate=True)
    assert isinstance(output_cache(out), kvpress.PolicyCache)



def test_deepcopy_inside_apply_is_a_plain_model_inside_and_after_the_block():
    import copy

    model = tiny_model("llama", seed=3)
    ids = random_ids(24)
    with torch.no_grad():
        ref = model(ids).logits
        ref_gen = model.generate(ids, max_new_tokens=4, do_sample=False)
        with kvpress.apply(model, kvpress.get_policy("window", window_size=8)):
            clone = copy.deepcopy(model)
            inside = clone(ids, use_cache=True)
            evicted = model(ids, use_cache=True).logits  # the original still runs the policy
        assert clone.config._attn_implementation == model.config._attn_implementation != "kvpress"
        assert not isinstance(inside.past_key_values, kvpress.PolicyCache)
        torch.testing.assert_close(inside.logits, ref, atol=1e-5, rtol=0)
        assert not torch.allclose(evicted, ref, atol=1e-3)
        torch.testing.assert_close(clone(ids).logits, ref, atol=1e-5, rtol=0)
        assert torch.equal(clone.generate(ids, max_new_tokens=4, do_sample=False), ref_gen)
        assert not {"generate", "_prefill", "__deepcopy__"} & (set(vars(clone)) | set(vars(model)))
        with kvpress.apply(clone, kvpress.get_policy("window", window_size=8)):  # the copy takes a policy of its own
            torch.testing.assert_close(clone(ids, use_cache=True).logits, evicted, atol=1e-5, rtol=0)


def test_right_padding_is_refused(llama):
    ids = random_ids(10, batch=2)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, -3:] = 0
    with torch.no_grad(), kvpress.apply(llama, kvpress.get_policy("full")), pytest.raises(ValueError, match="left padding"):
        llama(ids, attention_mask=mask, use_cache=True)


def test_non_hf_model_is_refused():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        with kvpress.apply(torch.nn.Linear(2, 2), kvpress.get_policy("full")):
            pass


def test_unsupported_family_names_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32)).eval()
    before = model.config.to_dict()
    with pytest.raises(ValueError, match="supported families: llama, mistral, mixtral, .*phi3"):
        with kvpress.apply(model, kvpress.get_policy("full")):
            pass
    assert model.config.to_dict() == before


def test_non_policy_argument_is_refused(llama):
    with pytest.raises(TypeError, match="get_policy"):
        with kvpress.apply(llama, "streaming"):
            pass
    assert llama.config._attn_implementation == "sdpa"


def test_unknown_policy_and_field_and_bad_values():
    with pytest.raises(ValueError, match="known policies: .*full"):
        kvpress.get_policy("nope")
    with pytest.raises(ValueError, match="fields are"):
        kvpress.get_policy("streaming", budget_tokens=3)
    with pytest.raises(ValueError, match="window_size"):
        kvpress.get_policy("window", window_size=0)
    with pytest.raises(TypeError, match="window_size"):
        kvpress.get_policy("window", window_size=2.5)
    with pytest.raises(ValueError, match="exceed sink_tokens"):
        kvpress.get_policy("streaming", sink_tokens=8).with_budget(8)
    assert kvpress.get_policy("streaming", window_size="30", rerotate="true").window_size == 30


def test_attention_name_outside_apply_raises(llama):
    ids = random_ids(8)
    with kvpress.apply(llama, kvpress.get_policy("full")):
        pass
    llama.set_attn_implementation("kvpress")
    try:
        with pytest.raises(RuntimeError, match="outside"), torch.no_grad():
            llama(ids)
    finally:
        llama.set_attn_implementation("sdpa")


def test_model_split_layers_keep_device_of_keys():
    model = tiny_model("llama", layers=3)
    with torch.no_grad(), kvpress.apply(model, kvpress.get_policy("full")):
        cache = model(random_ids(9), use_cache=True).past_key_values
    assert all(layer.device == torch.device("cpu") for layer in cache.layers)


def test_get_policy_takes_the_command_lines_spec_form():
    """``get_policy("kivi:bits=4:residual_length=64")`` is the keyword form; conflicts and
    malformed parts are clear errors."""
    assert kvpress.get_policy("kivi:bits=4:residual_length=64") == kvpress.get_policy("kivi", bits=4, residual_length=64)
    assert kvpress.get_policy("snapkv:budget=64", window_size=16) == kvpress.get_policy("snapkv", budget=64, window_size=16)
    assert kvpress.parse_policy_spec("duo: sparsity = 0.25") == ("duo", {"sparsity": "0.25"})
    with pytest.raises(ValueError, match=r"both set \['bits'\]"):
        kvpress.get_policy("kivi:bits=4", bits=2)
    with pytest.raises(ValueError, match="expected name:field=value"):
        kvpress.get_policy("kivi:bits")
    with pytest.raises(ValueError, match="sets 'bits' twice"):
        kvpress.get_policy("kivi:bits=4:bits=2")
    with pytest.raises(ValueError, match="has no field"):
        kvpress.get_policy("kivi:nbits=4")
    with pytest.raises(ValueError, match="unknown policy 'kivy'"):
        kvpress.get_policy("kivy:bits=4")
