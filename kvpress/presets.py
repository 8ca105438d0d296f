"""Named presets: the configurations the README recommends, by short name.

A preset is a policy spec (``name:field=value...``, the form every command line takes) with a
one-line description and the BENCHMARKS.md table that measured it. ``kvpress.get_policy`` takes a
preset name wherever it takes a policy name, and keyword overrides still apply on top::

    kvpress.get_policy("zipcache-4bit")
    kvpress.get_policy("double-sparsity-256", budget=512)

Preset names contain a hyphen, so they never collide with a registered policy name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """One named configuration.

    Attributes
    ----------
    name : str
        The short name ``get_policy`` accepts.
    spec : str
        The policy spec it stands for (``kivi:bits=4``).
    description : str
        What it is for, in one line.
    measured : str
        The BENCHMARKS.md table (its results file under ``benchmarks/results/``) that measured it.
    """

    name: str
    spec: str
    description: str
    measured: str


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "zipcache-4bit",
            "zipcache:bits_low=4:bits_high=8:salient_ratio=0.0625:refine_key_channels=8",
            "4-bit KV, salient tokens and 8 key channels per head at 8 bits: no measured loss",
            "zipcache_4bit_quality",
        ),
        Preset(
            "kivi-4bit",
            "kivi:bits=4",
            "4-bit KIVI: the smallest 4-bit cache and the fastest quantized CPU decode",
            "quant_quality",
        ),
        Preset(
            "double-sparsity-256",
            "double_sparsity:budget=256:rerank=8:tail_chunk=64",
            "256 tokens per step, re-ranked on exact keys: the fastest decode that keeps needles",
            "double_sparsity_quality",
        ),
        Preset(
            "duo-50",
            "duo:sparsity=0.5:prefill_chunk_size=2048",
            "DuoAttention, half the heads streaming, 2048-token prefill chunks: half the cache",
            "duo_quality",
        ),
        Preset(
            "shadowkv-offload",
            "shadowkv:budget=256:rerank=32:tail_chunk=64:select=tokens:residual_bits=2",
            "values on the host, low-rank keys + 2-bit residual: under 25% of the cache on device",
            "shadowkv_quality",
        ),
        Preset(
            "snapkv-256",
            "snapkv:budget=256:kernel_size=21",
            "256 prompt tokens picked by the question: the smallest cache that finds most needles",
            "selection_budgets_4k",
        ),
        Preset(
            "streaming-long",
            "streaming:sink_tokens=4:window_size=1020:rerotate=true",
            "4 sinks + 1020-token window, re-rotated: bounded perplexity past the trained context",
            "streaming_ppl",
        ),
    )
}


def is_preset(name: object) -> bool:
    """Whether ``name`` is a preset name."""
    return isinstance(name, str) and name in PRESETS


def preset_spec(name: str) -> str:
    """The policy spec of preset ``name`` (ValueError listing the presets otherwise)."""
    if not is_preset(name):
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name].spec


def list_presets() -> list[str]:
    """Preset names in the order the README's table gives them."""
    return list(PRESETS)


def describe() -> list[str]:
    """Lines for ``kvpress policies``: each preset's name, description and spec."""
    width = max(len(n) for n in PRESETS)
    lines = ["presets (use as a policy name):"]
    for preset in PRESETS.values():
        lines.append(f"  {preset.name:<{width}}  {preset.description}")
        lines.append(f"  {'':<{width}}  = {preset.spec}")
    return lines
