"""Every int field of every registered policy has a bounded range checked at construction."""
from __future__ import annotations

import dataclasses
import re
import typing

import pytest

import kvpress
from kvpress.registry import MAX_TOKENS, _field_types

# documented sentinels that are not out of range
_SENTINELS = {("tidal", "reselection_layer", -1)}


def _int_fields():
    for name in kvpress.list_policies():
        for field, tp in _field_types(kvpress.policy_class(name)).items():
            args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, type(int | None)) else (tp,)
            if int in args:
                yield name, field


INT_FIELDS = sorted(_int_fields())


def test_the_walk_finds_the_fields():
    assert ("window", "window_size") in INT_FIELDS and ("zipcache", "seed") in INT_FIELDS
    assert ("shadowkv", "outlier_chunks") in INT_FIELDS and len(INT_FIELDS) > 50


@pytest.mark.parametrize("value", [10**30, -1, 2**31, -(10**30)])
@pytest.mark.parametrize("name,field", INT_FIELDS)
def test_int_field_out_of_range_is_a_value_error_naming_it(name, field, value):
    if (name, field, value) in _SENTINELS:
        kvpress.get_policy(name, **{field: value})
        return
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        kvpress.get_policy(name, **{field: value})


@pytest.mark.parametrize("name,field", [(n, f) for n, f in INT_FIELDS if f in
                                        ("window_size", "sink_tokens", "tail_chunk", "residual_length")])
def test_token_fields_stop_at_max_tokens(name, field):
    with pytest.raises(ValueError, match=rf"{field} <= \d+") as err:
        kvpress.get_policy(name, **{field: MAX_TOKENS + 1})
    assert int(re.search(rf"{field} <= (\d+)", str(err.value)).group(1)) <= MAX_TOKENS


def test_defaults_still_build():
    for name in kvpress.list_policies():
        policy = kvpress.get_policy(name)
        assert dataclasses.is_dataclass(policy)
