"""Find TidalDecode's token-selection and re-selection layers for a model by measuring attention recall.

``python -m kvpress.evals.tidal_layers --model smollm2`` (also ``kvpress calibrate tidal``).

Shipped: ``tidal-smollm2-135m-instruct.safetensors`` (``--model smollm2``) and
``tidal-gemma-3-270m.safetensors``, made in 15 s on the 2-core CPU by
``kvpress calibrate tidal --model gemma3-270m --min-selection-layer 5 --max-selection-layer 5``: Gemma 3
270M has three full-attention layers (5, 11, 17); a selection at 11 would leave no layer to reuse it, so
the search is held to 5, and it picks re-selection at 11 (score -0.258; no re-selection: -0.364).

On calibration text (the ``ppl`` document) the last ``--queries`` prompt positions stand in for
decode queries. For every layer ``l`` we record the queries and keys, and the top-``budget``
token selection that layer would make (exact scores, GQA group reduced as the policy does).
The *recall* of a selection ``S`` at layer ``l`` is the attention mass one query head of layer
``l`` puts on ``S`` plus the current token (1.0 = the sparse layer loses nothing).

For a candidate pair ``(s, r)`` the layers between the selection layer ``s`` and the re-selection
layer ``r`` reuse ``s``'s tokens, the layers after ``r`` reuse ``r``'s (``r = -1``: no
re-selection), and ``s`` and ``r`` are exact. The pair's score is the mean *log* recall over the
sparse layers' (query head, query) pairs: a geometric mean, so a head that loses most of its
mass (a retrieval head reading tokens the selection layer ignored) weighs far more than many
heads losing a little, which a plain mean hides. Both layers are searched (``s`` up to
``--max-selection-layer``: the layers before ``s`` stay dense, so a later ``s`` costs speed);
among pairs within ``--tolerance`` of the best score the earliest ``s`` wins. The command prints
the table and writes a ``tidal`` artifact (``layers = [s, r]``) that the policy reads by default.
On a model with sliding-window layers (Gemma 3, Qwen2 with ``use_sliding_window``) only the
full-attention layers are recorded, select and count as sparse: the others keep the model's window.

Measured on SmolLM2-135M: with ``s`` fixed at 2 and a plain mean, the best ``r`` was 3 (a
re-selection right after the selection: useless for the 26 later layers, and the needle tasks
failed even at budget 1024); searching ``s`` with the log score gives ``s = 3``, ``r = 15``.

``--text passkey`` measures on retrieval prompts instead (``duo``'s calibration data: 4 passkeys
of 3 words per prompt), the queries being the teacher-forced answer's tokens -- the steps where
a retrieval head must find the passkeys. On SmolLM2 (``--length 2048 --samples 4``)
it picks ``s = 3``, ``r = 14`` (score -0.213, geometric-mean recall 0.81 at budget 256): the same
layers as the ppl text, so which layers select is not what limits ``tidal`` on this model.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from dataclasses import dataclass

import torch

from kvpress.compat import output_cache
from kvpress.kernels import exact_scores
from kvpress.layers import DenseLayer
from kvpress.registry import Policy

TEXTS = ("ppl", "passkey")
LOG_FLOOR = 1e-4  # recall floor inside the log (a fully missed head scores log(1e-4), not -inf)


@dataclass(frozen=True)
class _RecordPolicy(Policy):
    """Dense attention that records each layer's last queries and keys (not registered)."""

    queries: int = 32
    name = "tidal-record"

    def make_layer(self, cache, layer_idx):
        return _RecordLayer(cache, layer_idx, self.queries)


class _RecordLayer(DenseLayer):
    def __init__(self, cache, layer_idx, queries):
        super().__init__(cache, layer_idx)
        self.queries = queries
        self.record = None

    def attend(self, q, k_new, v_new, scaling):
        out = super().attend(q, k_new, v_new, scaling)
        self.record = (q[:, :, -self.queries :].detach().float(), self.buffer.keys.detach().float(), scaling)
        return out


def layer_recalls(records, budget: int, min_source: int = 0) -> dict[int, dict[int, torch.Tensor]]:
    """``recall[s][l]``: attention mass of layer ``l``'s heads on layer ``s``'s selection (l > s).

    Parameters
    ----------
    records : list or dict of (q [1, H_q, M, D], k [1, H_kv, T, D], scaling)
        Per layer, the last M queries (positions T - M .. T - 1) and all keys: a list over all
        layers, or a dict by layer index holding only the layers that can select and be
        sparse (a model's full-attention layers; the sliding-window ones keep their own window).
    budget : int
        Tokens selected per KV head, the current token included (it is always attended, as
        with ``recent_tokens=1``).
    min_source : int
        First layer considered as a selection source.

    Returns
    -------
    dict
        ``recall[s][l]`` float ``(H_q, M)`` in [0, 1].
    """
    records = dict(enumerate(records)) if isinstance(records, (list, tuple)) else dict(records)
    layers = sorted(records)
    q0, k0, _ = records[layers[0]]
    _, H_q, M, _ = q0.shape
    H_kv, T = k0.shape[1], k0.shape[2]
    G = H_q // H_kv
    pos = torch.arange(T)
    q_pos = torch.arange(T - M, T)  # (M,)
    causal = pos[None, :] <= q_pos[:, None]  # (M, T)
    candidates = pos[None, :] < q_pos[:, None]  # the current token is always attended
    current = (pos[None, :] == q_pos[:, None]).float()  # (M, T)
    k_top = max(0, min(budget - 1, T))
    probs, chosen = {}, {}
    for layer in layers:
        q, k, scaling = records[layer]
        logits = (q[0] @ k[0].repeat_interleave(G, 0).transpose(-1, -2)) * scaling  # (H_q, M, T)
        probs[layer] = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        scores = exact_scores(q[0].transpose(0, 1), k.expand(M, -1, -1, -1), scale=scaling,
                              mask=candidates)  # (M, H_kv, T)
        top = torch.topk(scores, k_top, dim=-1).indices  # (M, H_kv, k_top)
        sel = torch.zeros(M, H_kv, T).scatter_(-1, top, 1.0) * candidates[:, None, :]  # masked ties stay out
        sel = torch.maximum(sel, current[:, None, :])
        chosen[layer] = sel.repeat_interleave(G, 1).transpose(0, 1)  # (H_q, M, T)
    return {s: {l: (probs[l] * chosen[s]).sum(-1) for l in layers if l > s}
            for s in layers if s >= min_source}


def pair_score(recall, selection: int, reselection: int) -> float:
    """Mean log recall over the sparse layers' (head, query) pairs for ``(selection, reselection)``
    (the sparse layers: the recorded layers after ``selection``)."""
    vals = []
    for l in sorted(recall[selection]):
        if l == reselection:
            continue  # exact
        source = reselection if 0 <= reselection < l else selection
        vals.append(recall[source][l].clamp(min=LOG_FLOOR).log().flatten())
    return float(torch.cat(vals).mean()) if vals else 0.0


def pick_layers(recall, selection_layers, tolerance: float = 0.01):
    """Best ``(selection, reselection)`` (reselection -1: none) and every pair's score.

    Among pairs scoring within ``tolerance`` of the best, the earliest selection layer wins
    (fewer dense layers), then the best score.
    """
    # a selection layer must be recorded (not a sliding-window layer) and have sparse layers after it
    candidates = [s for s in selection_layers if recall.get(s)]
    if not candidates:
        raise ValueError(f"none of the selection layers {list(selection_layers)} is a recorded layer with a later one "
                         f"(recorded: {sorted(recall)})")
    scores = {}
    for s in candidates:
        for r in [-1, *sorted(recall[s])]:
            scores[(s, r)] = pair_score(recall, s, r)
    top = max(scores.values())
    near = [pair for pair, v in scores.items() if v >= top - tolerance]
    best = min(near, key=lambda pair: (pair[0], -scores[pair]))
    return best, scores


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="alias, local folder, hub id or random-* shape "
                        "(kvpress.evals.models; default: smollm2)")
    parser.add_argument("--length", type=int, default=2048, help="calibration tokens (default 2048)")
    parser.add_argument("--queries", type=int, default=32, help="last prompt positions used as queries")
    parser.add_argument("--budget", type=int, default=256, help="tokens selected per KV head")
    parser.add_argument("--min-selection-layer", type=int, default=1)
    parser.add_argument("--max-selection-layer", type=int, default=None,
                        help="latest selection layer searched (default: num_layers // 5)")
    parser.add_argument("--tolerance", type=float, default=0.01,
                        help="score margin within which an earlier selection layer is preferred")
    parser.add_argument("--out", default=None, help="artifact path (default: the shipped one for the model)")
    parser.add_argument("--text", choices=TEXTS, default="ppl",
                        help="ppl: the last --queries positions of the ppl document (the shipped artifact); "
                             "passkey: multi-passkey retrieval prompts (duo's calibration data), the queries "
                             "being the teacher-forced answer's tokens")
    parser.add_argument("--samples", type=int, default=4, help="passkey prompts (--text passkey)")
    parser.add_argument("--threads", type=int, default=None)
    parser.set_defaults(func=run)


def _recorded(model, ids: torch.Tensor, queries: int) -> list:
    import kvpress

    with torch.no_grad(), kvpress.apply(model, _RecordPolicy(queries=queries)):
        cache = output_cache(model(ids, use_cache=True))
    # the layers the policy ran (a model's sliding-window layers keep their own window, unrecorded)
    return {i: layer.record for i, layer in enumerate(cache.layers) if isinstance(layer, _RecordLayer)}


def calibration_recalls(model, tokenizer, text: str, length: int, queries: int, budget: int, min_source: int,
                        samples: int = 4, seed: int = 0) -> dict:
    """``layer_recalls`` on the calibration text; for ``passkey`` the recalls of ``samples``
    prompts are joined along the query axis (each query counts once in the pair scores)."""
    from kvpress.evals.tasks import get_task

    if text == "ppl":
        ids = torch.tensor([get_task("ppl").token_ids(tokenizer, length)])
        return layer_recalls(_recorded(model, ids, queries), budget, min_source)
    import random

    from kvpress.policies._duo_calibrate import passkey_sample

    rng = random.Random(seed)
    merged: dict = {}
    for _ in range(samples):
        ids, answer_start = passkey_sample(tokenizer, length, rng, num_passkeys=4, passkey_words=3)
        recall = layer_recalls(_recorded(model, ids, ids.shape[1] - answer_start), budget, min_source)
        for src, by_layer in recall.items():
            for layer, values in by_layer.items():
                merged.setdefault(src, {}).setdefault(layer, []).append(values)
            merged.setdefault(src, {})  # the last layer selects for no later layer
    return {src: {layer: torch.cat(v, dim=1) for layer, v in by_layer.items()} for src, by_layer in merged.items()}


def run(args) -> int:
    import kvpress
    from kvpress.calibration import save_artifact, shipped_artifact
    from kvpress.evals.models import load_eval_model
    from kvpress.policies._tidal_artifact import ARTIFACT_VERSION, artifact_name

    if args.samples < 1:
        raise SystemExit(f"--samples must be >= 1, got {args.samples}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_eval_model(args.model)
    adapter = kvpress.get_adapter(model)
    n = adapter.num_layers
    hi = args.max_selection_layer if args.max_selection_layer is not None else max(1, n // 5)
    if not 0 <= args.min_selection_layer <= hi < n - 1:
        raise SystemExit(f"need 0 <= --min-selection-layer <= --max-selection-layer <= {n - 2}")
    full = adapter.policy_layers  # sliding-window layers keep the model's window: they neither select nor reuse
    if not any(args.min_selection_layer <= s <= hi and s < full[-1] for s in full):
        raise SystemExit(f"no full-attention layer with a later one in --min-selection-layer..--max-selection-layer "
                         f"= {args.min_selection_layer}..{hi}; full-attention layers: {list(full)}")
    recall = calibration_recalls(model, tokenizer, args.text, args.length, args.queries, args.budget,
                                 args.min_selection_layer, samples=args.samples)
    (sel, resel), scores = pick_layers(recall, range(args.min_selection_layer, hi + 1), args.tolerance)
    queries = args.queries if args.text == "ppl" else f"the answers of {args.samples} passkey prompts"
    print(f"model {adapter.model_id}  text {args.text}  length {args.length}  queries {queries}  budget {args.budget}")
    print("mean log recall of the sparse layers (rows: selection layer; best re-selection layer)")
    for s in sorted({s2 for s2, _ in scores}):
        row = {r: v for (s2, r), v in scores.items() if s2 == s}
        r_best = max(row, key=row.get)
        mark = "  <- chosen" if s == sel else ""
        print(f"  selection {s:>2}: best reselection {r_best:>3} score {row[r_best]:8.4f} "
              f"(none {row[-1]:8.4f}){mark}")
    print(f"chosen: selection layer {sel}, re-selection layer {resel} (score {scores[(sel, resel)]:.4f})")
    out = pathlib.Path(args.out) if args.out else shipped_artifact(artifact_name(adapter.model_id))
    table = torch.full((n, n + 1), math.nan)  # [s, r + 1]; column 0 = no re-selection
    for (s, r), v in scores.items():
        table[s, r + 1] = v
    save_artifact(out, {"layers": torch.tensor([sel, resel]), "score": table},
                  policy="tidal", version=ARTIFACT_VERSION, adapter=adapter,
                  extra={"length": args.length, "queries": args.queries, "budget": args.budget,
                         "text": args.text, "samples": args.samples if args.text == "passkey" else 1,
                         "score": "mean log recall", "tolerance": args.tolerance})
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
