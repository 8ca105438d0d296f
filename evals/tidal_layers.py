"""Find TidalDecode's re-selection layer for a model by measuring attention recall.

``python -m kvpress.evals.tidal_layers --model smollm2`` (also ``kvpress calibrate tidal``).

On calibration text (the ``ppl`` document) the last ``--queries`` prompt positions stand in for
decode queries. For every layer ``l`` we record the queries and keys, and the top-``budget``
token selection that layer would make (exact scores, GQA group reduced as the policy does).
The *recall* of a selection ``S`` at layer ``l`` is the attention mass layer ``l``'s query heads
put on ``S`` plus the current token (1.0 = the sparse layer loses nothing). For a candidate
re-selection layer ``r`` the layers between the selection layer and ``r`` reuse the selection
layer's tokens, the layers after ``r`` reuse ``r``'s, and ``r`` itself is exact; the command
picks the ``r`` with the highest mean recall over the sparse layers, prints the table, and
writes a ``tidal`` artifact (``layers = [selection_layer, r]``) that the policy reads by default.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from dataclasses import dataclass

import torch

from kvpress.kernels import exact_scores
from kvpress.layers import DenseLayer
from kvpress.registry import Policy


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


def layer_recalls(records, budget: int, selection_layer: int) -> dict[int, dict[int, float]]:
    """``recall[s][l]``: mean attention mass of layer ``l`` on layer ``s``'s selection (l > s).

    Parameters
    ----------
    records : list of (q [1, H_q, M, D], k [1, H_kv, T, D], scaling)
        Per layer, the last M queries (positions T - M .. T - 1) and all keys.
    budget : int
        Tokens selected per KV head (the current token is attended on top, as recent_tokens=1).
    """
    num_layers = len(records)
    q0, k0, _ = records[0]
    _, H_q, M, _ = q0.shape
    H_kv, T = k0.shape[1], k0.shape[2]
    G = H_q // H_kv
    pos = torch.arange(T)
    q_pos = torch.arange(T - M, T)  # (M,)
    causal = pos[None, :] <= q_pos[:, None]  # (M, T)
    candidates = pos[None, :] < q_pos[:, None]  # the current token is always attended
    probs, selections = [], []
    for q, k, scaling in records:
        logits = (q[0] @ k[0].repeat_interleave(G, 0).transpose(-1, -2)) * scaling  # (H_q, M, T)
        probs.append(torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1))
        scores = exact_scores(q[0].transpose(0, 1), k.expand(M, -1, -1, -1), scale=scaling,
                              mask=candidates)  # (M, H_kv, T)
        selections.append(torch.topk(scores, min(budget, T), dim=-1).indices)  # (M, H_kv, K)
    current = (pos[None, :] == q_pos[:, None]).float()  # (M, T)
    recall: dict[int, dict[int, float]] = {}
    for s in range(selection_layer, num_layers):
        chosen = torch.zeros(M, H_kv, T).scatter_(-1, selections[s], 1.0)  # (M, H_kv, T)
        chosen = torch.maximum(chosen, current[:, None, :]).repeat_interleave(G, 1).transpose(0, 1)  # (H_q, M, T)
        recall[s] = {l: float((probs[l] * chosen).sum(-1).mean()) for l in range(s + 1, num_layers)}
    return recall


def pick_reselection(recall, num_layers: int, selection_layer: int) -> tuple[int | None, dict[int, float]]:
    """Mean recall over the sparse layers for each candidate re-selection layer; the best one."""
    sparse = range(selection_layer + 1, num_layers)
    means = {}
    for r in range(selection_layer + 1, num_layers):
        vals = [1.0 if l == r else recall[selection_layer if l < r else r][l] for l in sparse]
        means[r] = sum(vals) / len(vals)
    none = [recall[selection_layer][l] for l in sparse]
    means[-1] = sum(none) / max(1, len(none))
    best = max((r for r in means if r != -1), key=lambda r: means[r], default=None)
    return best, means


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="alias, local folder or hub id (default: smollm2)")
    parser.add_argument("--length", type=int, default=2048, help="calibration tokens (default 2048)")
    parser.add_argument("--queries", type=int, default=32, help="last prompt positions used as queries")
    parser.add_argument("--budget", type=int, default=256, help="tokens selected per KV head")
    parser.add_argument("--selection-layer", type=int, default=2)
    parser.add_argument("--out", default=None, help="artifact path (default: the shipped one for the model)")
    parser.add_argument("--threads", type=int, default=None)
    parser.set_defaults(func=run)


def run(args) -> int:
    import kvpress
    from kvpress.calibration import save_artifact, shipped_artifact
    from kvpress.evals.tasks import get_task
    from kvpress.policies.tidal import ARTIFACT_VERSION, artifact_name

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = kvpress.load_model(args.model)
    adapter = kvpress.get_adapter(model)
    if not 0 <= args.selection_layer < adapter.num_layers - 1:
        raise SystemExit(f"--selection-layer must lie in [0, {adapter.num_layers - 2}]")
    ids = torch.tensor([get_task("ppl").token_ids(tokenizer, args.length)])
    policy = _RecordPolicy(queries=args.queries)
    with torch.no_grad(), kvpress.apply(model, policy):
        cache = model(ids, use_cache=True).past_key_values
    records = [layer.record for layer in cache.layers]
    recall = layer_recalls(records, args.budget, args.selection_layer)
    best, means = pick_reselection(recall, adapter.num_layers, args.selection_layer)
    print(f"model {adapter.model_id}  length {args.length}  queries {args.queries}  budget {args.budget}  "
          f"selection layer {args.selection_layer}")
    print(f"{'reselect':>8} {'mean recall':>12}")
    for r in sorted(means):
        mark = "  <- best" if r == best else ""
        print(f"{'none' if r == -1 else r:>8} {means[r]:>12.4f}{mark}")
    out = pathlib.Path(args.out) if args.out else shipped_artifact(artifact_name(adapter.model_id))
    table = torch.tensor([means.get(r, math.nan) for r in range(adapter.num_layers)])
    save_artifact(out, {"layers": torch.tensor([args.selection_layer, best]), "mean_recall": table},
                  policy="tidal", version=ARTIFACT_VERSION, adapter=adapter,
                  extra={"length": args.length, "queries": args.queries, "budget": args.budget,
                         "text": "ppl"})
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
