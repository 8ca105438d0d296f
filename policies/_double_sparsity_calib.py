"""Offline channel calibration for Double Sparsity and its versioned artifact.

Yang et al., "Post-Training Sparse Attention with Double Sparsity", arXiv 2408.07092: a few
"outlier" channels of each head carry most of q . k, and which channels they are is a static
property of the model. We rank the channels of each KV head on the offline calibration prose of
``kvpress.evals.tasks`` (the "ppl" document), using post-RoPE queries and keys, because those are
what the label cache stores and what the decode query is multiplied with.

The label scores only have to *rank* the candidate keys of one query, so a channel is worth
what it spreads q . k across keys: a channel whose key component is the same for every token
adds the same amount to every score and ranks nothing, however large. Importance of channel c
for KV head h (query heads g of its GQA group, per calibration chunk of T tokens, averaged over
chunks)::

    I[h, c] = mean_{g, t} q[g, t, c]^2  *  var_s k[s, c]

the expected variance of the channel's score term ``q_c k_c`` across keys (q and k taken as
independent). The magnitude statistic ``mean |q_c| |k_c|`` over causal pairs (the
paper's own script ranks by ``mean |q_c k_c|`` of each token with itself) keeps such constant
channels; measured on SmolLM2 at 4k (24 needle samples, budget 256, teacher-forced on full's
answers) the variance ranking follows full closer: token agreement 0.965 vs 0.947, mean log-prob
-0.340 vs -0.435 (all 64 channels, i.e. exact scores: 0.976 / -0.312); see the policy docstring.

Artifact (``kvpress.calibration`` format, policy ``double_sparsity``, version 1):
``importance`` fp32 [L, H_kv, D] and ``channel_rank`` int16 [L, H_kv, D] (channels of each
head, most important first; ties keep the lower channel first).

Shipped artifacts (``policies/artifacts/``, found by model: `kvpress.calibration.shipped_artifact_for`)::

    kvpress calibrate double_sparsity --model smollm2 --out policies/artifacts/double_sparsity-smollm2.safetensors
    kvpress calibrate double_sparsity --model gemma3-270m --out policies/artifacts/double_sparsity-gemma3-270m.safetensors

with the defaults (4096 tokens in forwards of 1024); the Gemma 3 270M one took 24 s on the 2-core CPU.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
import time
from typing import Callable

import torch

from kvpress.adapters import get_adapter
from kvpress.calibration import load_artifact, model_metadata, save_artifact, shipped_artifact, shipped_artifact_for
from kvpress.patching import observed_attention

POLICY = "double_sparsity"
VERSION = 1
SHIPPED = "double_sparsity-smollm2.safetensors"
# Every field below must match the model; model ids are compared by canonical name (see below).
_CHECKED = ("family", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_layout")
CALIBRATE_COMMAND = "kvpress calibrate double_sparsity --model MODEL --out FILE.safetensors"


def channel_importance(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Score variance a channel contributes across keys, per KV head, for one calibration chunk.

    Parameters
    ----------
    q : Tensor [H_q, T, D]
        Post-RoPE queries (query head ``h`` belongs to KV head ``h // G``).
    k : Tensor [H_kv, T, D]
        Post-RoPE keys, T >= 2.

    Returns
    -------
    Tensor fp32 [H_kv, D]
        ``mean_{g, t} q[g, t, c]^2 * var_s k[s, c]`` (unbiased variance over the chunk's keys).
    """
    h_q, t, d = q.shape
    h_kv = k.shape[0]
    if h_q % h_kv or k.shape[1:] != (t, d) or t < 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [H_q, T, D] and [H_kv, T, D], "
                         f"H_q % H_kv == 0, T >= 2")
    q_sq = q.float().pow(2).reshape(h_kv, h_q // h_kv, t, d).mean(dim=(1, 2))  # (H_kv, D)
    return q_sq * k.float().var(dim=1)  # (H_kv, D)


def rank_channels(importance: torch.Tensor) -> torch.Tensor:
    """Channel ids per head, most important first (stable: ties keep the lower id first), int16."""
    return torch.sort(importance, dim=-1, descending=True, stable=True).indices.to(torch.int16)


@torch.no_grad()
def calibrate(model, token_ids: torch.Tensor, *, seq_len: int = 1024,
              progress: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """Rank the channels of every KV head of ``model`` on ``token_ids``.

    The model runs without a cache over consecutive ``seq_len`` chunks, its attention function
    observed (:func:`kvpress.patching.observed_attention`): every layer's statistic is taken from
    the post-RoPE queries and keys the model itself attends with -- after its q/k norms (Qwen3,
    OLMo 2, Gemma 3) or fused projections (Phi-3) -- and the attention implementation is
    restored before returning.

    Parameters
    ----------
    model : PreTrainedModel of a supported family (``kvpress.adapters.SUPPORTED_FAMILIES``)
    token_ids : Tensor [N] (long)
        Calibration tokens; chunks shorter than 2 tokens are dropped.
    seq_len : int
        Tokens per forward (key variances are taken within a chunk).
    progress : callable, optional
        Receives one line per chunk.

    Returns
    -------
    dict with ``importance`` fp32 [L, H_kv, D] (:func:`channel_importance`, averaged over the
    chunks) and ``channel_rank`` int16 [L, H_kv, D].
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} is out of range; allowed: seq_len >= 2")
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    chunks = [ids[i:i + seq_len] for i in range(0, ids.numel(), seq_len) if ids.numel() - i >= 2]
    if not chunks:
        raise ValueError("calibration needs at least 2 tokens")
    adapter = get_adapter(model)
    total = torch.zeros(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, dtype=torch.float64)

    def observe(layer_idx, q, k):  # post-RoPE q (1, H, T, D), k (1, H_kv, T, D), as the model attends
        total[layer_idx] += channel_importance(q[0].float(), k[0].float()).double().cpu()

    with observed_attention(model, observe):
        start = time.perf_counter()
        for n, chunk in enumerate(chunks):
            model(input_ids=chunk[None].to(model.device), use_cache=False)
            t = chunk.numel()
            if progress is not None:
                progress(f"calibrate double_sparsity: chunk {n + 1}/{len(chunks)} ({t} tokens) "
                         f"{time.perf_counter() - start:.1f}s")
    importance = (total / len(chunks)).float()
    return {"importance": importance, "channel_rank": rank_channels(importance)}


def canonical_model_id(model_id: str) -> str:
    """Model name an artifact is matched on: the last path / hub component, lowercased.

    Version folders of kvpress' own model cache (``tf-<version>-<hash>``) are skipped, so the
    embedded models converted under another transformers version (their folders name the hub
    id, :func:`kvpress.calibration.portable_model_id`), or the same model loaded from the hub
    (``HuggingFaceTB/SmolLM2-135M-Instruct``), still match.
    """
    from kvpress.calibration import portable_model_id

    model_id = portable_model_id(str(model_id))
    parts = [p for p in model_id.replace("\\", "/").lower().split("/") if p and not p.startswith("tf-")]
    return parts[-1] if parts else ""


def save(path, tensors: dict[str, torch.Tensor], adapter, extra: dict | None = None) -> pathlib.Path:
    """Write a Double Sparsity artifact for ``adapter``'s model."""
    return save_artifact(path, tensors, policy=POLICY, version=VERSION, adapter=adapter, extra=extra)


def load(path, adapter) -> torch.Tensor:
    """Read an artifact, check it against ``adapter``'s model; returns ``channel_rank`` [L, H_kv, D]
    (:func:`_read`, which raises on a bad file)."""
    return _read(path, adapter)[0]


def _read(path, adapter) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read an artifact, check it against ``adapter``'s model; returns ``channel_rank`` [L, H_kv, D]
    and ``importance`` (None when the file has none of that shape).

    Raises
    ------
    FileNotFoundError
        No file (the message names the ``kvpress calibrate`` command).
    ValueError
        Another policy/format/version, a model field (layers, heads, KV heads, head_dim, RoPE
        layout, family, model name) that differs from the model, or malformed tensors.
    """
    tensors, meta = load_artifact(path, policy=POLICY, version=VERSION, adapter=adapter, check=_CHECKED)
    ours, theirs = canonical_model_id(adapter.model_id), canonical_model_id(meta.get("model_id", ""))
    if ours != theirs:
        raise ValueError(
            f"{path} was calibrated for model {meta.get('model_id')!r}, not {adapter.model_id!r}; "
            f"make one for this model with `{CALIBRATE_COMMAND}` and pass artifact=FILE"
        )
    rank = tensors.get("channel_rank")
    expected = (adapter.num_layers, adapter.num_kv_heads, adapter.head_dim)
    if rank is None or tuple(rank.shape) != expected:
        raise ValueError(f"{path}: channel_rank must have shape (layers, kv_heads, head_dim) = {expected}, "
                         f"got {None if rank is None else tuple(rank.shape)}")
    rank = rank.long()
    if not torch.equal(rank.sort(dim=-1).values, torch.arange(adapter.head_dim).expand_as(rank)):
        raise ValueError(f"{path}: channel_rank rows must be permutations of 0..{adapter.head_dim - 1}")
    importance = tensors.get("importance")
    return rank, importance.float() if importance is not None and importance.shape == rank.shape else None


_READS: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}  # _file_key -> (channel_rank, importance)
_COUNTS: dict[tuple, int] = {}  # (the file key, coverage) -> default_channels


def _file_key(path: pathlib.Path, adapter) -> tuple:
    """The file (path, mtime, size) and the model's fields: what a cached read depends on."""
    stat = path.stat() if path.is_file() else None
    return (str(path.resolve()), stat and stat.st_mtime_ns, stat and stat.st_size, adapter.model_id,
            adapter.family, adapter.num_layers, adapter.num_heads, adapter.num_kv_heads, adapter.head_dim)


def _cached_read(path: pathlib.Path, adapter) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_read`, cached by :func:`_file_key`: every layer of every generation reads the artifact once."""
    key = _file_key(path, adapter)
    if key not in _READS:
        _READS[key] = _read(path, adapter)
    return _READS[key]


def channel_rank(path: pathlib.Path, adapter) -> torch.Tensor:
    """:func:`load`, cached (:func:`_cached_read`)."""
    return _cached_read(path, adapter)[0]


# The label channels kept by default must carry this share of a head's calibrated importance, on
# average over the layers that select (full-attention layers). Set between the counts measured on
# the two shipped models: SmolLM2 (head_dim 64) lost needle digits with 8 channels (0.60 of the
# importance) and kept them with 16 (0.78); Gemma 3 270M (head_dim 256) lost every uuid needle with
# 32 (0.63) and kept them with 64 (0.79).
COVERAGE = 0.75

def default_channels(path: pathlib.Path, adapter, coverage: float = COVERAGE) -> int:
    """Label channels for ``label_channels=None``: the fewest, in steps of ``head_dim // 16`` from
    ``head_dim // 16`` to ``head_dim // 4``, whose top-ranked channels carry ``coverage`` of the
    artifact's importance (:func:`channel_importance`), averaged over the KV heads of the model's
    full-attention layers (all layers when every layer slides); ``head_dim // 4`` when none does.
    Artifacts without ``importance`` (made elsewhere) get ``min(16, head_dim // 4)``."""
    d = adapter.head_dim
    step, high = max(1, d // 16), max(1, d // 4)
    path = pathlib.Path(path)
    key = (_file_key(path, adapter), coverage)
    if key not in _COUNTS:
        importance = _cached_read(path, adapter)[1]  # (validates the file against the model)
        if importance is None:
            _COUNTS[key] = max(1, min(16, high))
        else:
            layers = [i for i in range(adapter.num_layers) if adapter.sliding_window(i) is None] or \
                list(range(adapter.num_layers))
            imp = importance[layers].double().clamp_min(0)
            share = imp.sort(dim=-1, descending=True).values.cumsum(-1) / imp.sum(-1, keepdim=True).clamp_min(1e-30)
            mean_share = share.mean(dim=(0, 1))  # (D,): share carried by the top c+1 channels
            _COUNTS[key] = next((c for c in range(step, high + 1, step) if mean_share[c - 1] >= coverage), high)
    return _COUNTS[key]


def artifact_for(artifact: str | None, adapter) -> pathlib.Path:
    """The artifact to read: ``artifact``, else the one shipped for the model (SmolLM2, Gemma 3 270M;
    ValueError naming the calibrate command for any other model)."""
    if artifact is not None:
        return pathlib.Path(artifact)
    shipped = shipped_artifact_for(POLICY, adapter) or shipped_artifact(SHIPPED)
    try:
        channel_rank(shipped, adapter)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(
            f"double_sparsity ships channel artifacts for SmolLM2 and Gemma 3 270M only; model "
            f"{adapter.model_id!r} needs its own: run `{CALIBRATE_COMMAND}` and pass artifact=FILE"
        ) from exc
    return shipped


def matches_model(path, adapter) -> bool:
    """Whether the artifact at ``path`` exists and was made for ``adapter``'s model."""
    try:
        load(path, adapter)
    except (FileNotFoundError, ValueError):
        return False
    return True


# ------------------------------------------------------------------------------ CLI
def synthetic_artifact(adapter, num_tokens: int = 96, seed: int = 0) -> pathlib.Path:
    """Calibrate ``adapter``'s model on random ids and write the artifact to a temp file (offline, fast).

    For tests and examples only: random ids say little about a real model's outlier channels.
    The file name is keyed by the model object and process, and written atomically.
    """
    key = hashlib.sha1(f"{os.getpid()}-{id(adapter.model)}-{adapter.family}-{adapter.num_layers}".encode()).hexdigest()[:16]
    path = pathlib.Path(tempfile.gettempdir()) / f"kvpress-double_sparsity-{key}.safetensors"
    if not matches_model(path, adapter):
        vocab = adapter.model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (num_tokens,), generator=torch.Generator().manual_seed(seed))
        tensors = calibrate(adapter.model, ids, seq_len=num_tokens)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save(tmp, tensors, adapter, extra={"synthetic": True})
        os.replace(tmp, path)
    return path


def configure_cli(parser) -> None:
    parser.add_argument("--model", default="smollm2", help="alias, local folder, hub id or random-* shape "
                        "(kvpress.evals.models; default: smollm2)")
    parser.add_argument("--out", required=True, help="artifact path (.safetensors)")
    parser.add_argument("--tokens", type=int, default=4096,
                        help="calibration tokens from the offline 'ppl' prose (default 4096; ~1 min on CPU for SmolLM2)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per forward (default 1024)")
    parser.add_argument("--device", default=None, help="e.g. cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: as loaded)")


def run_cli(args) -> int:
    from kvpress.evals.models import load_eval_model
    from kvpress.evals.tasks import get_task

    print(f"calibrate double_sparsity: loading {args.model}", flush=True)
    model, tokenizer = load_eval_model(args.model, device=args.device, dtype=args.dtype)
    ids = torch.tensor(get_task("ppl").token_ids(tokenizer, args.tokens))
    tensors = calibrate(model, ids, seq_len=args.seq_len, progress=lambda line: print(line, flush=True))
    adapter = get_adapter(model)
    path = save(args.out, tensors, adapter, extra={"tokens": int(ids.numel()), "seq_len": args.seq_len,
                                                   "source": "kvpress.evals.tasks ppl",
                                                   "statistic": "mean q^2 * var k"})
    meta = model_metadata(adapter)
    print(f"wrote {path} ({meta['num_layers']} layers x {meta['num_kv_heads']} KV heads x head_dim "
          f"{meta['head_dim']}, model {meta['model_id']})", flush=True)
    return 0
