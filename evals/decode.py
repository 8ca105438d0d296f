"""Decoding and scoring through a policy cache: the loops the eval runner and lm-eval model share.

* :func:`generate_sample` — greedy decoding of one prompt under a policy, either with the
  policy's own prefill (``kvpress.generation.timed_generate``) or from a dense prefill shared by
  every ``full_prefill`` policy (:func:`shared_prefill` + :func:`decode_from_cache`).
* :func:`chunked_logits` — a prompt fed in chunks with the policy cache passed in,
  so compression done after each chunk changes the logits of the later tokens (a plain
  ``model(ids)`` forward never reads the cache it writes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import kvpress
from kvpress.compat import cache_kwargs
from kvpress.generation import timed_generate
from kvpress.prefill import cache_from_dense, dense_prefill

DEFAULT_CHUNK_SIZE = 512


@dataclass
class DecodeResult:
    """One greedy generation.

    Attributes
    ----------
    tokens : list of int
        Generated ids (eos included when produced).
    prefill_s : float
        Prompt processing time: the policy's own prefill, or the shared dense prefill plus the
        copy into this policy's cache.
    decode_ms_per_token : float
        Mean time of one decode step (NaN when only one token was generated).
    stats : kvpress.CacheStats
        Memory of the policy cache after generation.
    shared_prefill : bool
        Whether the prompt came from a shared dense prefill.
    """

    tokens: list
    prefill_s: float
    decode_ms_per_token: float
    stats: object
    shared_prefill: bool = False


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class SharedPrefill:
    """A dense prefill of one prompt, reusable by every ``full_prefill`` policy."""

    first_logits: torch.Tensor  # (1, V)
    cache: object  # PolicyCache of ``full``
    seconds: float
    length: int


@torch.no_grad()
def shared_prefill(model, input_ids: torch.Tensor) -> SharedPrefill:
    """Prefill ``input_ids`` [1, T] once under ``full`` (timed)."""
    input_ids = input_ids.to(model.device)
    _sync(model.device)
    start = time.perf_counter()
    logits, cache = dense_prefill(model, input_ids)
    _sync(model.device)
    return SharedPrefill(logits, cache, time.perf_counter() - start, input_ids.shape[1])


@torch.no_grad()
def decode_from_cache(model, policy, cache, first_logits: torch.Tensor, prompt_length: int, *,
                      max_new_tokens: int, eos_token_id=None):
    """Greedy decoding of batch 1 from a filled policy cache and the prompt's last logits.

    Parameters
    ----------
    cache : PolicyCache
        Holds the prompt (e.g. from :func:`kvpress.prefill.cache_from_dense`); modified.
    first_logits : Tensor [1, V]
        Logits of the last prompt token.
    prompt_length : int
        Tokens in the prompt (positions of the new tokens start there).

    Returns
    -------
    tokens : list of int
    decode_ms_per_token : float
        NaN when a single token was generated.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    device = model.device
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    next_token = first_logits.argmax(-1)  # (1,)
    tokens = [int(next_token)]
    mask = torch.ones(1, prompt_length + 1, dtype=torch.long, device=device)
    times = []
    with kvpress.apply(model, policy):
        for step in range(1, max_new_tokens):
            if tokens[-1] in eos:
                break
            position = torch.tensor([[prompt_length + step - 1]], device=device)
            start = time.perf_counter()
            out = model(input_ids=next_token[:, None], attention_mask=mask, position_ids=position,
                        **cache_kwargs(model, cache), use_cache=True)
            next_token = out.logits[:, -1].argmax(-1)
            _sync(device)
            times.append(time.perf_counter() - start)
            tokens.append(int(next_token))
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
    ms = 1000.0 * sum(times) / len(times) if times else float("nan")
    return tokens, ms


def generate_sample(model, policy, input_ids: torch.Tensor, *, max_new_tokens: int, eos_token_id=None,
                    prefill: SharedPrefill | None = None, prefill_chunk_size: int | None = None) -> DecodeResult:
    """Greedy generation for one prompt [1, T]; from ``prefill`` when given (``full_prefill`` policies),
    else its own prefill, in forwards of ``prefill_chunk_size`` tokens when given."""
    if prefill is not None and prefill_chunk_size is not None:
        raise ValueError("a shared dense prefill is one forward: pass prefill or prefill_chunk_size, not both")
    if prefill is None:
        res = timed_generate(model, input_ids, policy, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                             prefill_chunk_size=prefill_chunk_size)
        return DecodeResult(res.tokens[0].tolist(), res.prefill_s, res.decode_ms_per_token, res.stats)
    _sync(model.device)
    start = time.perf_counter()
    cache = cache_from_dense(model, policy, prefill.cache)
    _sync(model.device)
    copy_s = time.perf_counter() - start
    tokens, ms = decode_from_cache(model, policy, cache, prefill.first_logits, prefill.length,
                                   max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
    return DecodeResult(tokens, prefill.seconds + copy_s, ms, kvpress.cache_stats(cache), shared_prefill=True)


@torch.no_grad()
def chunked_logits(model, policy, input_ids: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE,
                   keep_from: int = 0, return_cache: bool = False):
    """Logits of ``input_ids`` [B, T] computed chunk by chunk through ``policy``'s cache.

    Each chunk attends to what the cache kept of the earlier chunks, so an evicting or
    quantizing policy changes the logits of later tokens (as it would during generation).
    Rows are processed together; right padding is harmless (causal: pads only follow a
    row's real tokens).

    Parameters
    ----------
    input_ids : Tensor [B, T] (long)
    chunk_size : int
        Tokens per forward pass (>= 1).
    keep_from : int
        Return logits of positions ``keep_from .. T - 1`` only (saves memory on long inputs).

    return_cache : bool
        Also return the policy cache (for ``kvpress.cache_stats``).

    Returns
    -------
    Tensor [B, T - keep_from, V], float32 (and the cache when ``return_cache``).
    """
    pieces = []
    cache = None
    for start, out, cache in _chunk_forwards(model, policy, input_ids, chunk_size):
        if start + out.logits.shape[1] > keep_from:
            pieces.append(out.logits[:, max(keep_from - start, 0):].float())
    logits = torch.cat(pieces, dim=1)
    return (logits, cache) if return_cache else logits


@torch.no_grad()
def chunked_nll(model, policy, input_ids: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Per-token negative log-likelihood of ``input_ids`` [1, T] fed chunk by chunk through
    ``policy``'s cache (as :func:`chunked_logits`), reduced chunk by chunk: memory holds one chunk's
    logits (``chunk_size * vocab`` floats), never the whole sequence's (17 GB for 16k tokens of
    Gemma 3's 262k-entry vocabulary). Returns (NLL of tokens 1..T-1 [T - 1] fp32, the cache)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"chunked_nll expects input_ids of shape [1, T]; got {tuple(input_ids.shape)}")
    ids = input_ids.to(model.device)
    nll, cache = [], None
    for start, out, cache in _chunk_forwards(model, policy, ids, chunk_size):
        targets = ids[0, start + 1 : start + 1 + out.logits.shape[1]]
        logits = out.logits[0, : targets.shape[0]].float()
        nll.append(torch.nn.functional.cross_entropy(logits, targets, reduction="none"))
    return torch.cat(nll), cache


def _chunk_forwards(model, policy, input_ids: torch.Tensor, chunk_size: int):
    """Run ``input_ids`` [B, T] in ``chunk_size``-token forwards through one fresh cache of
    ``policy``; yields (the chunk's first position, the forward's output, the cache)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    device = model.device
    input_ids = input_ids.to(device)
    batch, length = input_ids.shape
    cache = kvpress.make_cache(model, policy)
    with kvpress.apply(model, policy):
        for start in range(0, length, chunk_size):
            end = min(start + chunk_size, length)
            positions = torch.arange(start, end, device=device).expand(batch, -1)
            mask = torch.ones(batch, end, dtype=torch.long, device=device)
            out = model(input_ids=input_ids[:, start:end], attention_mask=mask, position_ids=positions,
                        **cache_kwargs(model, cache), use_cache=True)
            yield start, out, cache
