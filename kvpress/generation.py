"""Greedy generation with separate prefill / decode timing, for the CLI, demo and benchmarks."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from .compat import cache_kwargs, output_cache
from .patching import apply
from .registry import Policy
from .stats import CacheStats, cache_stats


@dataclass
class GenerationResult:
    """Output of :func:`timed_generate`.

    Attributes
    ----------
    tokens : Tensor [B, N] (long)
        Generated tokens (prompt excluded); rows that stopped early are padded with eos.
    prefill_s : float
        Wall time of the prompt forward pass.
    decode_ms_per_token : float
        Mean wall time of one decode step (model forward + greedy pick), over ``N - 1`` steps.
    stats : CacheStats
        ``cache_stats`` of the policy cache after generation.
    """

    tokens: torch.Tensor
    prefill_s: float
    decode_ms_per_token: float
    stats: CacheStats | None
    cache: object = None


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def timed_generate(
    model,
    input_ids: torch.Tensor,
    policy: Policy | None,
    *,
    max_new_tokens: int = 32,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | list[int] | None = None,
    keep_cache: bool = False,
    on_prefill=None,
    prefill_chunk_size: int | None = None,
) -> GenerationResult:
    """Greedy decoding under ``policy`` with prefill and per-token decode timed separately.

    Parameters
    ----------
    model : PreTrainedModel
    input_ids : Tensor [B, T] (long), left padded when B > 1 (pass ``attention_mask``).
    policy : Policy or None
        None runs the unpatched model (transformers' DynamicCache) for comparison.
    max_new_tokens : int
    eos_token_id : int or list of int, optional
        Decoding stops when every row has produced one (default: the model's generation config).
    keep_cache : bool
        Return the cache object in the result (it can be large).
    on_prefill : callable, optional
        Called with the cache once the prompt is in it, before the first timed decode step
        (benchmarks use it to time the cache layers' ``attend`` during decode only).
    prefill_chunk_size : int, optional
        Feed the prompt in forwards of this many tokens (inside `PolicyCache.prompt`, as
        ``generate(prefill_chunk_size=...)`` does): the prompt's activations are bounded by the
        chunk; ``prefill_s`` times them all. The prefill computes the last position's logits only.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if prefill_chunk_size is not None and prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size={prefill_chunk_size} must be >= 1 (or None: one forward)")
    device = model.device
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device)
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    eos = torch.tensor([] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    with (apply(model, policy) if policy is not None else contextlib.nullcontext()):
        _sync(device)
        start = time.perf_counter()
        out = _prefill(model, input_ids, attention_mask, position_ids, policy, prefill_chunk_size)
        next_token = out.logits[:, -1].argmax(-1)
        _sync(device)
        prefill_s = time.perf_counter() - start
        cache = output_cache(out)
        if on_prefill is not None:
            on_prefill(cache)
        tokens = [next_token]
        done = torch.isin(next_token, eos)
        last_pos = position_ids[:, -1:]
        decode_times = []
        for step in range(1, max_new_tokens):
            if bool(done.all()):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
            last_pos = last_pos + 1
            start = time.perf_counter()
            out = model(
                input_ids=next_token[:, None], attention_mask=attention_mask, position_ids=last_pos,
                **cache_kwargs(model, cache), use_cache=True,
            )
            next_token = out.logits[:, -1].argmax(-1)
            _sync(device)
            decode_times.append(time.perf_counter() - start)
            if eos.numel():
                next_token = torch.where(done, eos[0].to(next_token.dtype), next_token)
            tokens.append(next_token)
            done = done | torch.isin(next_token, eos)
    decode_ms = 1000.0 * sum(decode_times) / len(decode_times) if decode_times else float("nan")
    return GenerationResult(
        tokens=torch.stack(tokens, dim=1),
        prefill_s=prefill_s,
        decode_ms_per_token=decode_ms,
        stats=cache_stats(cache) if policy is not None else None,
        cache=cache if keep_cache else None,
    )


def _prefill(model, input_ids, attention_mask, position_ids, policy, chunk: int | None):
    """The prompt's forward(s) of :func:`timed_generate`: one, or ``chunk``-token pieces of one prompt."""
    if chunk is None or input_ids.shape[1] <= chunk:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                     logits_to_keep=1)
    if policy is not None:
        from .patching import make_cache

        cache = make_cache(model, policy)
        block = cache.prompt()
    else:
        from transformers import DynamicCache

        cache, block = DynamicCache(config=model.config), contextlib.nullcontext()
    with block:
        for start in range(0, input_ids.shape[1], chunk):
            end = start + chunk
            out = model(input_ids=input_ids[:, start:end], attention_mask=attention_mask[:, :end],
                        position_ids=position_ids[:, start:end], **cache_kwargs(model, cache), use_cache=True,
                        logits_to_keep=1)
    return out


@torch.no_grad()
def chunked_nll(model, input_ids: torch.Tensor, policy: Policy | None, *, chunk_size: int = 512) -> torch.Tensor:
    """Per-token negative log-likelihood of a long sequence fed through the policy cache in chunks.

    Every chunk attends to whatever the policy kept of the earlier chunks, so compression (or
    eviction) really affects the result — unlike a single full-attention forward.

    Parameters
    ----------
    input_ids : Tensor [1, T] (long)
    policy : Policy or None (None: the unpatched model with its DynamicCache)
    chunk_size : int
        Tokens per forward; memory of the logits is ``chunk_size * vocab`` floats.

    Returns
    -------
    Tensor [T - 1] (fp32): NLL of tokens 1..T-1 given their prefix.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"chunked_nll expects input_ids of shape [1, T]; got {tuple(input_ids.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    ids = input_ids.to(model.device)
    nll = []
    with (apply(model, policy) if policy is not None else contextlib.nullcontext()):
        cache = None
        for start in range(0, ids.shape[1], chunk_size):
            piece = ids[:, start : start + chunk_size]
            out = model(input_ids=piece, **cache_kwargs(model, cache), use_cache=True)
            cache = output_cache(out)
            logits = out.logits[0].float()  # (chunk, V)
            targets = ids[0, start + 1 : start + 1 + piece.shape[1]]
            logits = logits[: targets.shape[0]]
            nll.append(torch.nn.functional.cross_entropy(logits, targets, reduction="none"))
    return torch.cat(nll)


def perplexity(nll: torch.Tensor) -> float:
    """exp(mean NLL)."""
    return math.exp(float(nll.mean()))
