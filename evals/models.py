"""Model names the eval runner and benchmark accept, checked before anything loads.

Besides :func:`kvpress.load_model`'s names (``smollm2``, ``gemma3-270m``, a local folder, a hub id), the
benchmarks accept randomly initialised models of real shapes, for speed measurements at lengths
a small real model cannot reach:

``random-llama3-8b``
    Llama-3-8B's attention and MLP shapes (hidden 4096, 32 query / 8 KV heads, head_dim 128,
    MLP 14336, RoPE theta 500000, 128k context) with **4 layers** and a 32000-token vocabulary
    (random weights; scores are meaningless, speed and memory per layer are real).
``random-llama3-8b-Nl``
    The same with ``N`` layers (e.g. ``random-llama3-8b-32l`` for the full depth).
``random-smollm2``
    SmolLM2-135M's shape (30 layers, 9/3 heads, head_dim 64) with random weights, no download.
``random-tiny``
    4 layers, hidden 256, 4 query / 2 KV heads, head_dim 64, 64k positions: smoke runs of the
    benchmark scripts on a CPU in seconds.
``random-gemma3-270m``
    Gemma-3-270M's shape (18 layers, hidden 640, 4 query / 1 KV head of 256 dims, MLP 2048,
    a 262144-token vocabulary, 32k positions): five of every six layers slide over 512 tokens
    (local RoPE base 10000, global 1e6), so a policy runs only layers 5, 11 and 17 -- what kvpress
    saves on a hybrid model at real head sizes.

Random models come with a byte-level tokenizer (no chat template), enough for the tasks.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_RANDOM_LLAMA3 = re.compile(r"^random-llama3-8b(?:-(\d+)l)?$")
EOS_ID = 256  # the byte tokenizer's <|eos|>
RANDOM_MODELS = ("random-llama3-8b", "random-llama3-8b-<N>l", "random-smollm2", "random-tiny", "random-gemma3-270m")


def check_model_name(name: str) -> None:
    """Raise ValueError unless ``name`` is something the runner can load.

    Accepted: the kvpress aliases, ``random-*`` shapes (:data:`RANDOM_MODELS`), an existing
    local path, or a hub id ``org/name`` (which must be in the local cache when offline).
    """
    from kvpress.models import MODEL_ALIASES, resolve_alias

    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model must be a non-empty string, got {name!r}")
    lowered = name.strip().lower()
    if resolve_alias(lowered) is not None or _random_layers(lowered) is not None:
        return
    if lowered in RANDOM_MODELS or Path(name).expanduser().exists() or _HUB_ID.match(name):
        return
    raise ValueError(
        f"unknown model {name!r}; allowed: {', '.join(sorted(MODEL_ALIASES))}, {', '.join(RANDOM_MODELS)}, "
        "an existing local folder, or a hub id 'org/name'"
    )


def _random_layers(name: str) -> int | None:
    match = _RANDOM_LLAMA3.match(name)
    if match is None:
        return None
    return int(match.group(1) or 4)


def byte_tokenizer():
    """A byte-level tokenizer: ids 0-255 are bytes, 256 is ``<|eos|>`` (also the pad token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"eos_token": "<|eos|>", "pad_token": "<|eos|>"})
    tokenizer.padding_side = "left"
    return tokenizer


def random_config(name: str):
    """The transformers config of ``random-llama3-8b[-Nl]``, ``random-smollm2``, ``random-tiny`` or
    ``random-gemma3-270m`` (see the module docstring)."""
    from transformers import LlamaConfig

    lowered = name.lower()
    layers = _random_layers(lowered)
    if lowered == "random-gemma3-270m":
        from transformers import Gemma3TextConfig

        config = Gemma3TextConfig(
            vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
            max_position_embeddings=32768, query_pre_attn_scalar=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        )
    elif layers is not None:
        config = LlamaConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
            rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        )
    elif lowered == "random-smollm2":
        config = LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
            rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        )
    elif lowered == "random-tiny":
        config = LlamaConfig(
            vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=65536,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        )
    else:
        raise ValueError(f"unknown random model {name!r}; allowed: {', '.join(RANDOM_MODELS)}")
    config.pad_token_id, config.bos_token_id, config.eos_token_id = EOS_ID, None, EOS_ID
    return config


def random_model(name: str, *, dtype=None, device=None, seed: int = 0):
    """Build a random model of :func:`random_config`'s shapes, with the byte tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    lowered = name.lower()
    config = random_config(lowered)
    torch.manual_seed(seed)
    dtype = dtype or (torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.config._name_or_path = lowered  # the model id artifacts (calibrations) are checked against
    model.generation_config.pad_token_id = EOS_ID
    model.generation_config.eos_token_id = EOS_ID
    return model, byte_tokenizer()


def load_eval_model(name: str, *, dtype=None, device=None):
    """``(model, tokenizer)`` for any name :func:`check_model_name` accepts."""
    import kvpress

    check_model_name(name)
    if name.lower().startswith("random-"):
        return random_model(name, dtype=dtype, device=device)
    return kvpress.load_model(name, dtype=dtype, device=device)


def default_device() -> str:
    """``cuda`` when available (and not disabled with ``KVPRESS_DEVICE``), else ``cpu``."""
    import torch

    env = os.environ.get("KVPRESS_DEVICE")
    if env:
        return env
    return "cuda" if torch.cuda.is_available() else "cpu"
