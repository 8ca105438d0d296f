"""DuoAttention gate calibration (``kvpress calibrate duo``).

Method (Xiao et al., arXiv 2410.10819, Sec. 3.2): every (layer, KV head) gets a gate
``g = sigmoid(logit)``; the head's attention output becomes ``g * full + (1 - g) * streaming``
(streaming = attention to ``sink_tokens`` first tokens and a ``window_size`` recent window). The
model's weights are frozen; only the gates train, to keep the answer tokens of synthetic
multi-passkey retrieval prompts close to the unmodified model's, plus an L1 penalty
``reg * mean(g)`` that pushes gates toward streaming. Heads whose gate stays high are the
retrieval heads.

Data is generated offline: prose haystack (``kvpress.evals.tasks`` haystack, a public-domain
book) with ``num_passkeys`` passkeys of ``passkey_words`` random words each, spread through the
context at depths drawn from ``depths``; the question asks for all of them and the answer
(teacher-forced) lists them in order.

Deviations, to run on a shared CPU: short contexts (512-768 tokens instead of 1k-32k), 48 steps
instead of 2000, sink 16 / window 64 during calibration (the paper: 128 / 256), sigmoid gates
moved by max-normalised gradient steps (the paper: Adam on gates clamped to [0, 1]). And the
default loss (``loss="logits"``) is KL(full || gated) between the next-token distributions at
the answer positions; ``loss="hidden"`` is the paper's relative squared error of the final
hidden states. The saved ``gates`` are the sigmoids, so they read like the upstream patterns
(higher = retrieval).

The attention function is registered with transformers' ``AttentionInterface`` under its own
name and selected only for the calibration run; the model's previous implementation and its
parameters' ``requires_grad`` flags are restored afterwards.

Shipped artifact (``policies/artifacts/duo-smollm2.safetensors``)::

    kvpress calibrate duo --model smollm2 --out policies/artifacts/duo-smollm2.safetensors --threads 1

with the defaults of :class:`CalibrationSettings` (contexts 512/768 tokens, 48 steps, 4 passkeys
of 3 words at depths 0-1, sink 16 / window 64, logit KL loss, step 0.25, L1 weight 0.05, seed 0):
361 s on one thread of the shared 2-core CPU. Needs ``wonderwords`` (the ``eval`` extra).

Gemma 3 270M (``policies/artifacts/duo-gemma3-270m.safetensors``; its sliding layers keep the model's
512-token window, so contexts are longer than that)::

    kvpress calibrate duo --model gemma3-270m --out policies/artifacts/duo-gemma3-270m.safetensors \
        --lengths 2048,4096 --steps 48 --threads 1

25 minutes of CPU time on one thread (55 minutes of wall time while other jobs shared the machine).
Gates of its full-attention layers 5 / 11 / 17: 0.993 / 0.965 / 0.876.

Why these settings (SmolLM2, 50% retrieval heads, run-time sinks 16 / window 240, scored with
``kvpress eval --model smollm2 --policies duo:artifact=F --tasks niah_single,niah_multikey,niah_multivalue
--lengths 4096 --samples 8``): passkeys at depths 0-1 in training fixed the depth-0 needle that
gates trained on depths .05-.95 missed; the loss hardly mattered (the paper's hidden-state loss
scores as the logit loss at 4k), and a larger L1 weight, more steps or longer contexts did not
score better. Gates from different losses and step counts share 38-43 of the same 45 retrieval
heads. Closeness of hidden states is not what decides whether greedy decoding copies a needle:
gates that keep the final hidden states 3-15x closer than random splits barely separate from them
in answer-token accuracy, hence the logit loss.

Longer contexts: the streaming branch runs through
``kvpress.attention.sliding_causal_attention(..., sinks=...)`` (query chunks over the keys each
can see), 6.5x cheaper per layer at 4k than one SDPA call over a [T, T] mask
(``benchmarks/duo_calibration_attention.py``), so calibrating at 2k-4k is practical::

    kvpress calibrate duo --model smollm2 --out F --lengths 2048,4096 --steps 48 --window-size 240 --threads 2

(1965 s; 40 of the shipped 45 retrieval heads). At 8k those gates keep as many of ``full``'s
needles as the shipped ones (24 of 29 with 1024-token prefill chunks), not the same ones, so the
shipped artifact stays. ``--prefill dense`` fits the gates for ``duo:prefill=dense`` (the gated
mix applies only to the answer's queries, the prompt attends fully in every head); run that way
they do not beat the shipped gates.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kvpress.attention import sliding_causal_attention

# Version of the gate file this calibration writes (``duo`` loads it with this version)
ARTIFACT_VERSION = 1
# duo's prefill modes the gated forward can mimic (its "chunked" is not one: its chunks are longer than
# the calibration prompts, where it equals "dense")
CALIBRATION_PREFILLS = ("streaming", "dense")

ATTN_NAME = "kvpress_duo_calibration"
LOSSES = ("hidden", "logits")


@dataclass(frozen=True)
class CalibrationSettings:
    """Reduced-cost settings (see the module docstring for the paper's)."""

    lengths: tuple = (512, 768)
    steps: int = 48
    num_passkeys: int = 4
    passkey_words: int = 3
    sink_tokens: int = 16
    window_size: int = 64
    lr: float = 0.25
    reg: float = 0.05
    init_logit: float = 2.0  # sigmoid(2) ~ 0.88: start near the full model, as the paper starts at 1
    seed: int = 0
    # Scale each hidden dim by the teacher's RMS over the prompt before the squared error
    # (SmolLM2's final hidden states keep ~60% of their energy in 5 of 576 dims). Off for the
    # shipped artifact; on, it changed only 2 of the 45 retrieval heads (module docstring).
    normalize_dims: bool = False
    # What the answer tokens must keep: "hidden" = final hidden states (the paper's loss),
    # "logits" = the next-token distribution, KL(full || gated) (what greedy copying needs).
    loss: str = "logits"
    # Needle depths are drawn uniformly from this range (0 = right after the prompt header).
    depths: tuple = (0.0, 1.0)
    # Which run-time prefill the gates are fitted for: "streaming" (the paper: the gated mix at
    # every position) or "dense" (``duo:prefill=dense``: the prompt is plain attention in every
    # head and the mix applies only to the queries that produce the answer, i.e. decode).
    prefill: str = "streaming"

    def __post_init__(self):
        for name in ("steps", "num_passkeys", "passkey_words", "window_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is out of range; allowed: >= 1")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens={self.sink_tokens} is out of range; allowed: >= 0")
        if not self.lengths or min(self.lengths) < 256:
            raise ValueError(f"lengths={self.lengths} must be non-empty, each >= 256 tokens")
        if self.loss not in LOSSES:
            raise ValueError(f"loss={self.loss!r} is not supported; allowed: {', '.join(LOSSES)}")
        if len(self.depths) != 2 or not 0.0 <= self.depths[0] <= self.depths[1] <= 1.0:
            raise ValueError(f"depths={self.depths} must be (low, high) with 0 <= low <= high <= 1")
        if self.prefill not in CALIBRATION_PREFILLS:
            raise ValueError(f"prefill={self.prefill!r} is not supported; allowed: {', '.join(CALIBRATION_PREFILLS)}")


# ---------------------------------------------------------------------------- data
def passkey_sample(tokenizer, length: int, rng: random.Random, num_passkeys: int, passkey_words: int,
                   depths=CalibrationSettings.depths):
    """One multi-passkey prompt of about ``length`` tokens with its teacher-forced answer.

    Returns
    -------
    ids : LongTensor [1, T]
        Chat-formatted prompt followed by the answer tokens.
    answer_start : int
        Index of the first answer token in ``ids``.
    """
    from kvpress.evals.tasks.base import encode_input
    from kvpress.evals.tasks.haystack import get_haystack, word_list

    words = rng.sample(word_list(), num_passkeys * passkey_words)
    keys = [" ".join(words[i * passkey_words : (i + 1) * passkey_words]) for i in range(num_passkeys)]
    needles = [f"The pass key number {i + 1} is: {key}. Remember it." for i, key in enumerate(keys)]
    depths = sorted(rng.uniform(*depths) for _ in keys)
    base = get_haystack("prose")
    hay = base.rotated(rng.randrange(len(base.starts)), min_words=2 * length)
    question = f"\n\nWhat are the {num_passkeys} pass keys, in order?"
    answer = "The pass keys are: " + "; ".join(keys) + "."
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)

    def build(num_words: int) -> list[int]:
        inserts = [(hay.boundary(d, num_words), s) for d, s in zip(depths, needles)]
        context, _ = hay.render(num_words, inserts)
        return encode_input(tokenizer, context + question)

    num_words = int(length / 1.4)
    for _ in range(3):  # proportional refinement; a few % off the target is fine for calibration
        prompt = build(num_words)
        total = len(prompt) + len(answer_ids)
        num_words = max(16, int(num_words * length / total))
    ids = torch.tensor([prompt + answer_ids], dtype=torch.long)
    return ids, len(prompt)


# ---------------------------------------------------------------------------- gated attention
def streaming_mask(length: int, sinks: int, window: int, device) -> torch.Tensor:
    """bool [T, T]: query i sees key j <= i when j < sinks or i - j < window."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    return (j <= i) & ((j < sinks) | (i - j < window))


class GatedAttention:
    """The calibration attention: per KV head, ``g * full + (1 - g) * streaming`` (all heads).

    ``mix_from`` (set per sample): queries before it attend fully in every head and only the
    later ones get the gated mix -- the dense-prefill mode, where the prompt's K/V are exact and
    only decode steps see the streaming heads' sinks + window. None mixes at every position.
    """

    def __init__(self, logits: torch.Tensor, group: int, sinks: int, window: int,
                 model_windows: tuple[int | None, ...] = ()):
        self.logits = logits  # (L, H_kv), requires grad
        self.group = group
        self.sinks, self.window = sinks, window
        self.model_windows = model_windows  # per layer: the model's own sliding window, or None
        self.mix_from: int | None = None
        self._mask: torch.Tensor | None = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query (1, H_q, T, D); key/value (1, H_kv, T, D); no cache during calibration.
        t = query.shape[2]
        model_window = self.model_windows[module.layer_idx] if self.model_windows else None
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if model_window is not None:  # a layer the model slides: its own attention, never a duo layer
            out = sliding_causal_attention(query, key, value, scale, window=model_window)
            return out.transpose(1, 2).contiguous(), None
        full = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        start = self.mix_from or 0
        if start == 0:  # every query: chunks over the keys each can see, O(T * (sinks + window))
            stream = sliding_causal_attention(query, key, value, scale, window=self.window, sinks=self.sinks)
        else:  # only the answer's queries (dense prefill): one masked call over them
            if self._mask is None or self._mask.shape[0] != t:
                self._mask = streaming_mask(t, self.sinks, self.window, query.device)
            stream = F.scaled_dot_product_attention(query[:, :, start:], key, value, attn_mask=self._mask[start:],
                                                    scale=scaling, enable_gqa=True)  # (1, H_q, T - start, D)
        gate = torch.sigmoid(self.logits[module.layer_idx]).repeat_interleave(self.group)  # (H_q,)
        gate = gate.to(query.dtype).view(1, -1, 1, 1)
        mixed = stream + gate * (full[:, :, start:] - stream)
        out = mixed if start == 0 else torch.cat([full[:, :, :start], mixed], dim=2)  # (1, H_q, T, D)
        return out.transpose(1, 2).contiguous(), None


def _final_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    return model.base_model(input_ids=ids, use_cache=False).last_hidden_state  # (1, T, hidden)


def distill_loss(student: torch.Tensor, teacher_all: torch.Tensor, span: slice, normalize_dims: bool) -> torch.Tensor:
    """Relative squared error of the answer tokens' final hidden states (a scalar).

    ``student`` (N, hidden) are the gated model's states at ``span``; ``teacher_all`` (T, hidden)
    the full model's over the whole prompt. With ``normalize_dims`` each hidden dim is divided by
    the teacher's RMS over the prompt first, so every dim counts alike whatever its scale.
    """
    teacher = teacher_all[span]  # (N, hidden)
    if normalize_dims:
        scale = teacher_all.pow(2).mean(0).clamp_min(1e-6).rsqrt()  # (hidden,)
        student, teacher = student * scale, teacher * scale
    return (student - teacher).pow(2).sum(-1).mean() / teacher.pow(2).sum(-1).mean()


def _answer_log_probs(model, hidden: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities fp32 (N, vocab) from final hidden states (N, hidden)."""
    head = model.get_output_embeddings()
    return torch.log_softmax(head(hidden.to(head.weight.dtype)).float(), dim=-1)


def logit_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """Mean over answer positions of KL(full || gated) between next-token distributions (nats).

    Unlike the hidden-state error, which is dominated by a few high-energy dims, this weighs
    exactly what decoding reads: how much probability the gated model moves off the full
    model's answer tokens (a needle's first sub-word above all).
    """
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1).mean()


# ---------------------------------------------------------------------------- training loop
@contextlib.contextmanager
def gated_attention(model, logits: torch.Tensor, sink_tokens: int, window_size: int):
    """Run ``model`` with :class:`GatedAttention` over ``logits`` [L, H_kv] inside the block.

    The model's weights are frozen for the block; its attention implementation, the weights'
    ``requires_grad`` flags and train/eval mode are restored on exit (also after an exception).
    """
    from kvpress.adapters import get_adapter
    from kvpress.patching import selected_attention

    adapter = get_adapter(model)
    expected = (adapter.num_layers, adapter.num_kv_heads)
    if tuple(logits.shape) != expected:
        raise ValueError(f"gate logits have shape {tuple(logits.shape)}; this model needs {expected} [layers, KV heads]")
    attention = GatedAttention(logits, adapter.group_size, sink_tokens, window_size, adapter.sliding_windows)
    grad_before = {name: p.requires_grad for name, p in model.named_parameters()}
    was_training = model.training
    try:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        with selected_attention(model, ATTN_NAME, attention):
            yield attention
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(grad_before[name])
        model.train(was_training)


def passkey_samples(tokenizer, settings: "CalibrationSettings"):
    """Endless (ids [1, T], answer_start) samples cycling over ``settings.lengths``."""
    rng = random.Random(settings.seed)
    step = 0
    while True:
        length = settings.lengths[step % len(settings.lengths)]
        yield passkey_sample(tokenizer, length, rng, settings.num_passkeys, settings.passkey_words, settings.depths)
        step += 1


def calibrate(model, tokenizer=None, settings: CalibrationSettings = CalibrationSettings(), *, samples=None, log=print):
    """Train the gates; returns (gates fp32 [L, H_kv] in (0, 1), info dict with losses and time).

    Parameters
    ----------
    model : PreTrainedModel
        Causal LM of a supported family (kept frozen; restored afterwards).
    tokenizer
        Its tokenizer, for the passkey prompts (chat template used when present).
    samples : iterable of (LongTensor [1, T], int), optional
        ``(ids, answer_start)`` pairs to use instead of generated passkey prompts.
    """
    from kvpress.adapters import get_adapter

    adapter = get_adapter(model)
    if samples is None:
        if tokenizer is None:
            raise ValueError("calibrate needs a tokenizer (or explicit samples)")
        samples = passkey_samples(tokenizer, settings)
    samples = iter(samples)
    torch.manual_seed(settings.seed)
    logits = torch.full((adapter.num_layers, adapter.num_kv_heads), settings.init_logit, requires_grad=True)
    history = []
    start = time.perf_counter()
    for step in range(settings.steps):
        ids, answer_start = next(samples)
        if not 1 <= answer_start < ids.shape[1]:
            raise ValueError(f"answer_start={answer_start} must lie in [1, {ids.shape[1] - 1}]")
        # Hidden states that predict the answer tokens: positions answer_start - 1 .. T - 2.
        span = slice(answer_start - 1, ids.shape[1] - 1)
        ids = ids.to(model.device)
        with torch.no_grad():
            teacher_all = _final_hidden(model, ids)[0].float()  # (T, hidden)
            if settings.loss == "logits":
                teacher_logp = _answer_log_probs(model, teacher_all[span])  # (N, vocab)
        with gated_attention(model, logits, settings.sink_tokens, settings.window_size) as attention:
            if settings.prefill == "dense":
                # the prompt (its last token predicts the first answer token) is the prefill:
                # exact; the answer tokens are the decode steps that see the mix
                attention.mix_from = answer_start
            student = _final_hidden(model, ids)[0, span].float()
            if settings.loss == "logits":
                distill = logit_kl(teacher_logp, _answer_log_probs(model, student))
            else:
                distill = distill_loss(student, teacher_all, span, settings.normalize_dims)
            gates = torch.sigmoid(logits)
            # layers the model slides keep its window (GatedAttention): their gates are unused
            loss = distill + settings.reg * gates[list(adapter.policy_layers)].mean()
            (grad,) = torch.autograd.grad(loss, logits)
        with torch.no_grad():
            # Max-normalised gradient step: every sample moves the gates by at most lr, and the
            # heads keep their *relative* gradient sizes (Adam's per-gate normalisation would
            # reduce a few dozen steps to gradient signs and leave many ties).
            logits -= settings.lr * grad / grad.abs().max().clamp_min(1e-12)
        history.append({"step": step + 1, "tokens": ids.shape[1], "distill": float(distill.detach()), "loss": float(loss.detach())})
        log(
            f"[duo calibrate] step {step + 1}/{settings.steps}  tokens {ids.shape[1]}  distill {float(distill.detach()):.5f}  "
            f"loss {float(loss.detach()):.5f}  mean gate {float(gates.detach().mean()):.3f}  ({time.perf_counter() - start:.0f} s)"
        )
    gates = torch.sigmoid(logits.detach()).float()
    info = {"settings": asdict(settings), "history": history, "wall_s": round(time.perf_counter() - start, 1)}
    return gates, info


# ---------------------------------------------------------------------------- CLI
def configure_parser(parser: argparse.ArgumentParser) -> None:
    d = CalibrationSettings()
    parser.add_argument("--model", default="smollm2", help="'smollm2', a local HF directory or a hub id")
    parser.add_argument("--out", required=True, help="output .safetensors artifact")
    parser.add_argument("--lengths", default=",".join(map(str, d.lengths)), help="context lengths in tokens, cycled over steps")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--num-passkeys", type=int, default=d.num_passkeys)
    parser.add_argument("--passkey-words", type=int, default=d.passkey_words)
    parser.add_argument("--sink-tokens", type=int, default=d.sink_tokens)
    parser.add_argument("--window-size", type=int, default=d.window_size)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--reg", type=float, default=d.reg, help="L1 weight pushing gates toward streaming")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--normalize-dims", action="store_true",
        help="scale each hidden dim by the teacher's RMS before the squared error (default: plain error)",
    )
    parser.add_argument(
        "--loss", choices=LOSSES, default=d.loss,
        help="hidden: final hidden states of the answer tokens (the paper); logits: KL of their next-token distributions",
    )
    parser.add_argument(
        "--depths", default=",".join(map(str, d.depths)),
        help="needle depth range LOW,HIGH in [0, 1] (0 = right after the prompt header)",
    )
    parser.add_argument(
        "--prefill", choices=CALIBRATION_PREFILLS, default=d.prefill,
        help="fit the gates for the run-time prefill: streaming (the paper's calibration; the shipped gates, "
             "also used with duo's default chunked prefill) or dense "
             "(duo:prefill=dense: only the answer's queries see the streaming heads' sinks + window)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def run_from_args(args) -> int:
    import kvpress
    from kvpress.calibration import save_artifact

    try:
        lengths = tuple(int(x) for x in str(args.lengths).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--lengths expects comma-separated integers, got {args.lengths!r}") from None
    try:
        depths = tuple(float(x) for x in str(args.depths).split(","))
    except ValueError:
        raise ValueError(f"--depths expects LOW,HIGH, got {args.depths!r}") from None
    settings = CalibrationSettings(
        lengths=lengths, steps=args.steps, num_passkeys=args.num_passkeys, passkey_words=args.passkey_words,
        sink_tokens=args.sink_tokens, window_size=args.window_size, lr=args.lr, reg=args.reg, seed=args.seed,
        normalize_dims=args.normalize_dims, loss=args.loss, depths=depths, prefill=args.prefill,
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = kvpress.load_model(args.model)
    adapter = kvpress.get_adapter(model)
    gates, info = calibrate(model, tokenizer, settings)
    info["model"] = args.model
    info["threads"] = torch.get_num_threads()
    path = save_artifact(args.out, {"gates": gates}, policy="duo", version=ARTIFACT_VERSION, adapter=adapter, extra=info)
    print(f"[duo calibrate] wrote {path} in {info['wall_s']} s; gates per layer (rows) x KV head:")
    for layer, row in enumerate(gates.tolist()):
        print(f"  {layer:3d}  " + "  ".join(f"{g:.3f}" for g in row))
    return 0
