"""Shared by the attention-error benchmarks: a prompt's per-layer projections and the model's RoPE."""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with rotate-half pairs: ``x`` (H, T, D), ``cos``/``sin`` (T, D)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@torch.no_grad()
def prompt_projections(model, input_ids: torch.Tensor, names: tuple[str, ...]):
    """One dense forward of ``input_ids`` (1, T): ``({(name, layer): output (T, features)}, cos,
    sin)`` for the attention projections ``names`` (``"q_proj"``, ``"k_proj"``, ``"v_proj"``, read
    pre-RoPE from Llama-style modules) and the model's RoPE tables (T, D) fp32."""
    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    grabbed: dict = {}
    hooks = [getattr(layer.self_attn, name).register_forward_hook(
        lambda m, a, out, key=(name, i): grabbed.__setitem__(key, out[0].detach()))
        for i, layer in enumerate(model.model.layers) for name in names]
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    T = input_ids.shape[1]
    cos, sin = model.model.rotary_emb(torch.zeros(1, T, D), torch.arange(T)[None])
    return grabbed, cos[0].float(), sin[0].float()
