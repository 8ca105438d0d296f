"""Model adapters: the only code that knows a model family.

An adapter answers what policies need to know about a loaded model — its decoder layers and
attention modules, head counts, head_dim, and how its rotary position embedding (RoPE) rotates
a vector — so policies never walk ``model.model.layers`` themselves.

Supported families (``config.model_type``): Llama (SmolLM2, Llama 2/3), Mistral, Mixtral, Ministral,
Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, OLMo, OLMo 2, OLMo 3, Gemma, Gemma 3 (text-only checkpoints:
``gemma3_text``), Granite, Granite-MoE, Phi-3 (also Phi-4), Arcee, Seed-OSS and SmolLM3. kvpress
meets a model at two of transformers' own integration points -- the cache's ``update`` receives
post-RoPE keys and values, the registered attention function receives post-RoPE queries -- so
what a family does before RoPE (Qwen3's and OLMo 2's q/k norms, Granite's attention multiplier
as ``scaling``, Gemma's embedding scale, Phi-3's fused q/k/v projection, a MoE MLP) is invisible to the policies. What they do rely on, and what the families above share
(checked per family by tests/test_adapters.py): ``rotate_half`` RoPE over the whole head with
frequencies from ``base_model.rotary_emb`` (pre-RoPE keys are recovered by an exact inverse
rotation; Gemma 3's full-attention layers have their own base, which is the one returned, since
policies act on those layers) and no extra terms in the softmax (logit soft-capping, attention
sinks: refused). RoPE over part of the head (``partial_rotary_factor`` < 1) is refused too: the
pre-RoPE keys ShadowKV stores and the sinks StreamingLLM re-rotates would be wrong there. Layers
that apply no RoPE at all (SmolLM3's NoPE layers, ``ModelAdapter.nope_layers``) rotate by the
identity: ``rotate`` / ``invert_rope`` / ``inv_freq`` take the layer. Another family gets a clear error.

Sliding-window layers. Some configurations limit some layers to a window of the last ``W``
tokens (Qwen2 / Qwen3 with ``use_sliding_window`` from ``max_window_layers`` on, any family whose
``config.layer_types`` names ``"sliding_attention"``). Those layers already hold a bounded cache,
so kvpress leaves them as the model runs them: the cache gives each one a
:class:`~kvpress.window_layers.SlidingWindowLayer` (the last ``W`` tokens, exact) and the policy acts on
the full-attention layers only (``ModelAdapter.policy_layers``). A model whose layers all slide
(Mistral v0.1's ``sliding_window=4096``) leaves a policy nothing to act on and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_FAMILIES = ("llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmo",
                      "olmo2", "olmo3", "gemma", "gemma3_text", "granite", "granitemoe", "phi3", "arcee", "seed_oss",
                      "smollm3")
# families whose attention takes ``config.sliding_window`` in every layer (no per-layer types)
_EVERY_LAYER_WINDOW = ("mistral", "mixtral", "phi3")
# RoPE variants whose frequencies do not depend on the sequence length, so a rotation by an
# angle difference is exact. "dynamic" NTK scaling re-derives frequencies per length: refused.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelAdapter:
    """Facts about one loaded model, plus its RoPE rotation.

    Attributes
    ----------
    family : str
        ``config.model_type``, one of ``SUPPORTED_FAMILIES``.
    num_layers, num_heads, num_kv_heads, head_dim : int
        Decoder layers, query heads, key/value heads and the per-head dimension.
    """

    model: nn.Module
    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_id: str
    sliding_windows: tuple[int | None, ...] = ()  # per layer: the model's window, None = full attention
    nope_layers: tuple[int, ...] = ()  # layers whose attention applies no RoPE (SmolLM3's every fourth)

    def sliding_window(self, layer_idx: int) -> int | None:
        """The window (tokens, current one included) of a sliding-window layer; None for full attention."""
        return self.sliding_windows[layer_idx] if self.sliding_windows else None

    @property
    def policy_layers(self) -> tuple[int, ...]:
        """The full-attention layers: the ones a policy's cache layers run (the others keep the
        model's own sliding window, see the module docstring)."""
        return tuple(i for i in range(self.num_layers) if self.sliding_window(i) is None)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def base_model(self) -> nn.Module:
        """The decoder stack (``LlamaModel`` etc.) whose forward receives the cache.

        The argument is ``past_key_values`` before transformers 5.24 and ``cache`` from it on.
        """
        return self.model.base_model

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.base_model.layers)

    def attention_modules(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.decoder_layers()]

    # ------------------------------------------------------------------ RoPE
    def has_rope(self, layer_idx: int | None) -> bool:
        """Whether layer ``layer_idx`` rotates its queries and keys (None: the model's RoPE layers)."""
        return layer_idx is None or layer_idx not in self.nope_layers

    def inv_freq(self, device, layer_idx: int | None = None) -> torch.Tensor:
        """RoPE inverse frequencies of the full-attention layers, fp32 [head_dim // 2].

        Gemma 3 rotates its sliding-window layers with another base (``rope_local_base_freq``);
        policies act on the full-attention layers only, so theirs are the ones returned. For a
        layer without RoPE (``layer_idx`` in ``nope_layers``) they are zeros: every rotation by
        them is the identity, which is what that layer's keys had.
        """
        inv_freq = _full_attention_inv_freq(self.base_model.rotary_emb).detach().to(device=device, dtype=torch.float32)
        return inv_freq if self.has_rope(layer_idx) else torch.zeros_like(inv_freq)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, layer_idx: int | None = None) -> torch.Tensor:
        """Rotate ``x`` by RoPE angles ``positions * inv_freq`` (negative positions invert).

        RoPE at position p is a rotation by p * theta_i in each channel pair, so applying it with
        ``positions = -p`` undoes it exactly (up to fp32 rounding), and a rotation by ``p2 - p1``
        moves a vector rotated at p1 to p2. Any attention scaling factor of the RoPE variant is
        already inside the rotated vector and is left untouched.

        Parameters
        ----------
        x : Tensor [B, H, T, head_dim]
        positions : Tensor broadcastable to [B, 1 or H, T] (integer or float)
        layer_idx : int, optional
            The layer whose RoPE this is; a layer without RoPE returns a copy of ``x``.

        Returns
        -------
        Tensor of x's shape and dtype.
        """
        if not self.has_rope(layer_idx):
            return x.clone()
        theta = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq(x.device)  # (B, H|1, T, D/2)
        cos = torch.cat([theta.cos(), theta.cos()], dim=-1)
        sin = torch.cat([theta.sin(), theta.sin()], dim=-1)
        xf = x.to(torch.float32)
        half = xf.shape[-1] // 2
        rotated_half = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated_half * sin).to(x.dtype)

    def invert_rope(self, x: torch.Tensor, positions: torch.Tensor, layer_idx: int | None = None) -> torch.Tensor:
        """Pre-RoPE vectors from post-RoPE ``x`` at ``positions`` (exact inverse rotation)."""
        return self.rotate(x, -positions, layer_idx)


def get_adapter(model) -> ModelAdapter:
    """Return the adapter for a loaded HF causal LM, or raise a clear error.

    Raises
    ------
    TypeError
        ``model`` is not a transformers ``PreTrainedModel``.
    ValueError
        The family is not supported (the message lists the supported ones), the model has no KV
        cache support, its RoPE variant cannot be rotated exactly, or every one of its layers uses
        sliding-window attention (nothing left for a policy).
    """
    try:
        from transformers import PreTrainedModel
    except ImportError as exc:  # pragma: no cover - transformers is a hard dependency
        raise ImportError("kvpress needs transformers>=5.0") from exc
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"kvpress expects a Hugging Face transformers PreTrainedModel, got {type(model).__name__}"
        )
    config = model.config
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model family {family!r} is not supported; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    base = model.base_model
    if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise ValueError(f"{type(model).__name__} has no decoder layers / rotary embedding kvpress can use")
    if getattr(config, "use_cache", True) is False and not hasattr(model, "generate"):
        raise ValueError(f"{type(model).__name__} does not use a KV cache")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping}) is "
                         "not supported: kvpress' attention has no soft-capping term")
    rope_type = _rope_type(config)
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    inv_freq = _full_attention_inv_freq(base.rotary_emb)
    if inv_freq is None or 2 * inv_freq.shape[-1] != head_dim:
        rotated = "unknown" if inv_freq is None else 2 * inv_freq.shape[-1]
        raise ValueError(f"partial RoPE (partial_rotary_factor={_partial_rotary_factor(config)}: {rotated} of head_dim "
                         f"{head_dim} channels rotated) is not supported; supported: RoPE over the whole head")
    # SmolLM3 marks its NoPE layers on the module (use_rope = config.no_rope_layers[i], 0 or 1)
    nope = tuple(i for i, layer in enumerate(base.layers) if not getattr(layer.self_attn, "use_rope", True))
    if len(nope) == len(base.layers):
        raise ValueError("no layer of this model applies RoPE; supported: models whose full-attention layers "
                         "use RoPE, with or without some NoPE layers (SmolLM3)")
    windows = _sliding_windows(model)
    if all(w is not None for w in windows):
        raise ValueError(
            f"{type(model).__name__} uses sliding-window attention in every layer (sliding_window="
            f"{getattr(config, 'sliding_window', None)}): its cache is already bounded and no full-attention "
            "layer is left for a kvpress policy to act on. Supported: models with at least one full-attention "
            "layer (e.g. Mistral v0.2+, Qwen2/Qwen3 with use_sliding_window=False or max_window_layers > 0)")
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return ModelAdapter(
        model=model,
        family=family,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        model_id=str(getattr(config, "_name_or_path", "") or getattr(model, "name_or_path", "")),
        sliding_windows=windows if any(w is not None for w in windows) else (),
        nope_layers=nope,
    )


def _sliding_windows(model) -> tuple[int | None, ...]:
    """Per decoder layer: the window of a sliding-window layer (tokens), None for full attention.

    Raises ValueError for a layer type kvpress does not know (e.g. chunked attention), or a
    sliding layer without a positive window.
    """
    config = model.config
    types = list(getattr(config, "layer_types", None) or [])
    known = ("full_attention", "sliding_attention")
    unknown = sorted({t for t in types if t not in known})
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported; supported: {', '.join(known)}")
    # Mistral, Mixtral and Phi-3 pass config.sliding_window to every layer; Qwen2/Qwen3 set it per layer on the module
    every = getattr(config, "sliding_window", None) if config.model_type in _EVERY_LAYER_WINDOW else None
    out = []
    for i, layer in enumerate(model.base_model.layers):
        window = every if every is not None else getattr(layer.self_attn, "sliding_window", None)
        if window is None and i < len(types) and types[i] == "sliding_attention":
            window = getattr(config, "sliding_window", None)
            if window is None:
                raise ValueError(f"layer {i} is a sliding_attention layer but config.sliding_window is None")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"layer {i} has sliding_window={window!r}; expected a positive token count")
        out.append(window)
    return tuple(out)


def _full_attention_inv_freq(rotary) -> torch.Tensor | None:
    """The RoPE inverse frequencies of the full-attention layers (Gemma 3 keeps a second set for its
    sliding layers), or None for a rotary module kvpress does not know."""
    inv_freq = getattr(rotary, "full_attention_inv_freq", None)
    return getattr(rotary, "inv_freq", None) if inv_freq is None else inv_freq


def _partial_rotary_factor(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return params["partial_rotary_factor"]
    return getattr(config, "partial_rotary_factor", 1.0)


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (Gemma 3): the full-attention layers' RoPE
    if isinstance(params, dict):
        return params.get("rope_type", params.get("type", "default")) or "default"
    return "default"
