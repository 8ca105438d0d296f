"""The lm-eval model type ``kvpress``: any kvpress policy inside lm-evaluation-harness.

Importing this module registers the type (``kvpress lm-eval`` does it for you)::

    kvpress lm-eval --model kvpress \\
        --model_args pretrained=smollm2,policy=streaming,budget=256 --tasks niah_single_1 ...

``model_args``: ``pretrained`` (``smollm2``, a local folder or a hub id, loaded with
:func:`kvpress.load_model`), ``policy`` (a registered name, default ``full``), any field of that
policy (``window_size=252``, ``bits=2`` ...), ``budget`` (through ``policy.with_budget`` when the
policy has no ``budget`` field), ``chunk_size`` (prefill chunk of loglikelihood requests, default
512), ``prefill_chunk_size`` (generation's prompt in forwards of this many tokens,
``generate(prefill_chunk_size=...)``; default: one forward), and lm-eval's own HF arguments (``batch_size``, ``max_length``, ``dtype``, ``device``, ``add_bos_token`` ...). The
policy and its fields are validated before the model loads.

* ``generate_until`` tasks run ``model.generate`` inside ``kvpress.apply``: the policy cache
  holds the prompt and the generated tokens. A kvpress task's prompt must have the length its
  task sized it to (``ValueError`` otherwise, naming the fix): chat-format tasks need
  ``--apply_chat_template``, plain-format ones (base models, or ``prompt_format=plain``) run
  without it, and the task's tokenizer must be the model's.
* ``loglikelihood`` and ``loglikelihood_rolling`` tasks run a chunked prefill through the policy
  cache (:func:`kvpress.evals.decode.chunked_logits`): each ``chunk_size``-token chunk attends
  to what the policy kept of the earlier ones, so compression changes the scored logits. (HF's
  own path is one dense forward that never reads back the cache, so every policy would score
  like ``full``.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import kvpress

from .decode import DEFAULT_CHUNK_SIZE, chunked_logits
from .models import check_model_name

logger = logging.getLogger(__name__)

MODEL_TYPE = "kvpress"
# HFLM arguments that only make sense when HFLM loads the weights itself.
_UNSUPPORTED = ("parallelize", "peft", "delta", "autogptq", "gptqmodel", "tp_plan", "max_memory_per_gpu",
                "max_cpu_memory", "offload_folder", "backend", "subfolder")
# HFLM arguments passed on to kvpress.load_model instead.
_LOAD_KWARGS = ("revision", "trust_remote_code", "gguf_file")
_OWN = ("pretrained", "policy", "budget", "chunk_size", "prefill_chunk_size", "tokenizer")


# HFLM's warnings about a model object passed as `pretrained`: this model type always loads the
# weights itself and hands HFLM the object (multi-process runs set their accelerator after), so
# they say nothing a user can change.
_PRELOADED_NOTICES = ("model kwarg is not of type `str`", "Passed an already-initialized model through `pretrained`")


class _DropMessages(logging.Filter):
    def __init__(self, fragments):
        super().__init__()
        self.fragments = tuple(fragments)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


@contextlib.contextmanager
def _without_lm_eval_notices(logger_name: str, fragments):
    """Drop the log records of ``logger_name`` containing one of ``fragments`` inside the block."""
    target, dropper = logging.getLogger(logger_name), _DropMessages(fragments)
    target.addFilter(dropper)
    try:
        yield
    finally:
        target.removeFilter(dropper)


def _hflm_params() -> set[str]:
    params = inspect.signature(HFLM.__init__).parameters
    return {name for name, p in params.items() if name != "self" and p.kind is not p.VAR_KEYWORD}


def build_policy(policy: str = "full", budget=None, **fields):
    """The policy ``policy`` (a name, a preset or a ``name:field=value`` spec) with ``fields`` and,
    when given, ``budget``.

    ``budget`` sets the field of that name when the policy has one, else goes through
    ``with_budget`` (ValueError for policies without a budget).
    """
    from kvpress.presets import is_preset, preset_spec

    spec = preset_spec(policy) if is_preset(policy) else policy
    cls = kvpress.policy_class(kvpress.parse_policy_spec(spec)[0])
    names = {f.name for f in dataclasses.fields(cls)}
    if budget is not None and "budget" in names:
        fields["budget"] = budget
        budget = None
    built = kvpress.get_policy(policy, **fields)
    return built.with_budget(int(budget)) if budget is not None else built


def split_model_args(kwargs: dict) -> tuple[dict, dict, dict]:
    """Split lm-eval ``model_args`` into (policy fields, HFLM kwargs, load_model kwargs).

    Raises
    ------
    ValueError
        For an argument that is neither a field of the policy, nor ours, nor lm-eval's; or for
        HFLM loading options the kvpress model type does not support.
    """
    policy_name = kwargs.get("policy", "full")
    cls = kvpress.policy_class(policy_name)
    fields = {f.name for f in dataclasses.fields(cls)}
    hflm = _hflm_params()
    policy_kwargs, hf_kwargs, load_kwargs = {}, {}, {}
    for key, value in kwargs.items():
        if key in _OWN:
            continue
        if key in fields:
            policy_kwargs[key] = value
        elif key in _UNSUPPORTED:
            raise ValueError(f"model_args {key}= is not supported by the kvpress model type (it loads the model itself)")
        elif key in _LOAD_KWARGS:
            if value is not None:
                load_kwargs[key] = value
        elif key in hflm:
            hf_kwargs[key] = value
        else:
            raise ValueError(
                f"unknown model_args {key!r} for --model kvpress with policy {policy_name!r}; allowed: "
                f"{', '.join(_OWN)}, the policy's fields {sorted(fields) or '(none)'}, or lm-eval HF arguments "
                f"({', '.join(sorted(hflm - set(_UNSUPPORTED) - {'pretrained', 'tokenizer'}))})"
            )
    return policy_kwargs, hf_kwargs, load_kwargs


def _resolve_device(device) -> str:
    if device is None or str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("kvpress: device %s requested but CUDA is not available; using cpu", device)
        return "cpu"
    return device


@register_model(MODEL_TYPE)
class KVPressLM(HFLM):
    """lm-eval's HF model with a kvpress policy cache (see the module docstring).

    Parameters
    ----------
    pretrained : str
        ``smollm2``, a local folder or a hub id (or a ``random-*`` shape).
    policy : str
        Registered policy name.
    budget : int, optional
        Tokens attended per KV head per decode step.
    chunk_size : int
        Prefill chunk for loglikelihood requests.
    prefill_chunk_size : int, optional
        ``generate_until`` requests feed their prompt in forwards of this many tokens (bounds the
        prefill's activations; see `kvpress.PolicyCache.prompt`); None: one forward.
    **kwargs
        Policy fields and lm-eval HF arguments.
    """

    def __init__(self, pretrained: str = "smollm2", policy: str = "full", budget: int | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, prefill_chunk_size: int | None = None, **kwargs):
        if not isinstance(pretrained, str):
            raise TypeError("the kvpress model type loads the model itself: pass pretrained=<name or path>")
        policy_kwargs, hf_kwargs, load_kwargs = split_model_args({"policy": policy, **kwargs})
        self.policy = build_policy(policy, budget, **policy_kwargs)  # before any weights load
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if prefill_chunk_size is not None and (not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1):
            raise ValueError(f"prefill_chunk_size must be an int >= 1 (or unset: one forward), got {prefill_chunk_size!r}")
        check_model_name(pretrained)
        self.chunk_size = chunk_size
        self.prefill_chunk_size = prefill_chunk_size

        accelerator = None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # accelerate launch: one process per device
            from accelerate import Accelerator

            accelerator = Accelerator()
            device = str(accelerator.device)
        else:
            device = _resolve_device(hf_kwargs.get("device"))
        dtype = hf_kwargs.pop("dtype", None)
        dtype = None if dtype in (None, "auto") else dtype
        hf_kwargs.pop("device", None)

        from .models import load_eval_model

        if pretrained.lower().startswith("random-"):
            model, tokenizer = load_eval_model(pretrained, dtype=dtype, device=device)
        else:
            model, tokenizer = kvpress.load_model(pretrained, dtype=dtype, device=device, **load_kwargs)
        with _without_lm_eval_notices("lm_eval.models.huggingface", _PRELOADED_NOTICES):
            super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", **hf_kwargs)
        self.pretrained = pretrained
        if accelerator is not None and accelerator.num_processes > 1:
            self.accelerator = accelerator
            self._device = accelerator.device
            self._rank = accelerator.process_index
            self._world_size = accelerator.num_processes
        logger.info("kvpress: %s with %r", pretrained, self.policy)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits of ``inps`` [B, T] from a chunked prefill through the policy cache."""
        if attn_mask is not None or labels is not None:
            raise ValueError("the kvpress model type supports decoder-only models only")
        with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                            enabled=self.mixed_precision_dtype is not None):
            return chunked_logits(self.model, self.policy, inps, chunk_size=self.chunk_size)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """HFLM's ``generate_until``, once every kvpress task prompt is checked against the length its
        task sized it to (:func:`check_prompt_lengths`)."""
        check_prompt_lengths(self, requests)
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """lm-eval's batched ``generate`` with the policy cache."""
        if self.prefill_chunk_size is not None:
            generation_kwargs.setdefault("prefill_chunk_size", self.prefill_chunk_size)
        with kvpress.apply(self.model, self.policy):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def get_model_info(self) -> dict:
        """Parameters, dtype and the policy config (no hub lookup: the model may be local)."""
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "model_name": self.pretrained,
            "kvpress_policy": self.policy.to_dict(),
            "kvpress_chunk_size": self.chunk_size,
            "kvpress_prefill_chunk_size": self.prefill_chunk_size,
        }


# Columns of a kvpress generation task's documents (kvpress.evals.lm_eval_tasks.harness.make_dataset).
_SIZED_DOC_KEYS = ("num_tokens", "answer_prefix", "prompt_format")


def check_prompt_lengths(lm: HFLM, requests) -> None:
    """Check that every kvpress task prompt in ``requests`` encodes to the tokens its task sized.

    The documents of the kvpress tasks record ``num_tokens``, the length of the input built in
    their ``prompt_format`` with the task's tokenizer. lm-eval renders the prompt itself: with the
    chat template under ``--apply_chat_template``, as plain text without it. The context is encoded
    here as ``generate_until`` encodes it; requests of other tasks are not looked at.

    Raises
    ------
    ValueError
        When a prompt's length differs from its document's ``num_tokens``, with the way to fix it.
    """
    for request in requests:
        doc = getattr(request, "doc", None)
        if not isinstance(doc, dict) or not all(key in doc for key in _SIZED_DOC_KEYS):
            continue
        ids, _mask = lm.tok_batch_encode([request.args[0]])
        num_tokens = int(ids.shape[-1])
        if num_tokens == int(doc["num_tokens"]):
            continue
        if doc["prompt_format"] == "chat":
            fix = ("run lm-eval with --apply_chat_template, or build plain prompts with "
                   "--metadata '{\"prompt_format\": \"plain\", ...}'")
        else:
            fix = ("run lm-eval without --apply_chat_template, or build chat prompts with "
                   "--metadata '{\"prompt_format\": \"chat\", ...}'")
        raise ValueError(
            f"{request.task_name}: lm-eval's prompt has {num_tokens} tokens but the task sized it to "
            f"{doc['num_tokens']} in the {doc['prompt_format']} format: {fix}; the task's tokenizer must be the "
            "model's, and --system_instruction, --num_fewshot or add_bos_token change the prompt"
        )


def lm_eval_main(argv: list[str]) -> int:
    """Run lm-eval's CLI on ``argv`` with the ``kvpress`` model type registered.

    Adds ``--include_path`` for the kvpress tasks when the command line has none.
    """
    import sys

    from lm_eval.__main__ import cli_evaluate

    from .lm_eval_tasks import INCLUDE_PATH

    argv = list(argv)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        if argv and argv[0] not in ("ls", "validate", "-h", "--help"):
            argv += ["--include_path", str(INCLUDE_PATH)]
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    finally:
        sys.argv = saved
    return 0
