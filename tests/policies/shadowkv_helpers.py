"""What the ShadowKV test modules share: the tiny Llama as their ``model`` fixture, the prompt
length and a small configuration (chunks of 8, rank 8, a budget of a few chunks)."""
import pytest

import kvpress

PROMPT = 160  # 20 chunks of 8, no shift
SMALL = dict(budget=48, chunk_size=8, rank=8, outlier_chunks=2, local_window=16)


@pytest.fixture(scope="module")
def model(llama):
    """The session's tiny Llama (conftest's ``llama``) under the name these modules' tests use."""
    return llama


def small_policy(**overrides):
    """``shadowkv`` in the small configuration, ``overrides`` on top."""
    return kvpress.get_policy("shadowkv", **{**SMALL, **overrides})
