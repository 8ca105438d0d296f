"""The ``kvpress`` command line.

Subcommands: ``policies`` (the registry), ``check`` (is a model supported; from its config only),
``generate`` (one prompt under one policy), ``demo``
(the README's main job: every policy side by side on a ~4k-token retrieval prompt). Other
modules add their subcommands in :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap


def _policy_overrides(args) -> dict:
    overrides = {}
    for item in args.option or []:
        if "=" not in item:
            raise SystemExit(f"--option expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.strip()] = value.strip()
    return overrides


def build_policy(name: str, budget: int | None = None, overrides: dict | None = None):
    """``get_policy(name, **overrides)``, then ``with_budget(budget)`` when a budget is given."""
    import kvpress

    policy = kvpress.get_policy(name, **(overrides or {}))
    return policy.with_budget(budget) if budget is not None else policy


def cmd_policies(args) -> int:
    import kvpress

    rows = [(n, kvpress.policy_class(n)) for n in kvpress.list_policies()]
    width = max(len(n) for n, _ in rows)
    print(f"{'name':<{width}}  {'description':<52}  paper")
    for name, cls in rows:
        print(f"{name:<{width}}  {cls.description:<52}  {cls.paper or '-'}")
        if args.verbose:
            print(textwrap.indent(kvpress.get_policy(name).__repr__(), " " * (width + 2)))
    return 0


def cmd_generate(args) -> int:
    import kvpress
    from kvpress.generation import timed_generate

    policy = build_policy(args.policy, args.budget, _policy_overrides(args))  # bad input fails before loading
    with open(args.prompt_file, encoding="utf-8") as f:
        prompt = f.read()
    model, tokenizer = kvpress.load_model(args.model)
    if args.chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    result = timed_generate(model, ids, policy, max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                            prefill_chunk_size=args.prefill_chunk_size)
    print(tokenizer.decode(result.tokens[0], skip_special_tokens=True))
    print(
        f"\n[{policy.name}] prompt {ids.shape[1]} tokens, prefill {result.prefill_s:.2f} s, "
        f"decode {result.decode_ms_per_token:.1f} ms/token; {result.stats}",
        file=sys.stderr,
    )
    return 0


def cmd_demo(args) -> int:
    from kvpress.demo import run_demo

    return run_demo(model=args.model, length=args.length, budget=args.budget, policies=args.policies,
                    prefill_chunk_size=args.prefill_chunk_size)


def _config_model(name: str):
    """A model of ``name``'s config with no weights (meta device): a local folder, a config.json, a
    hub id in the local cache, or a kvpress alias."""
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvpress.models import alias_config

    config = alias_config(name)  # an embedded model's config, from its converted cache
    if config is None:
        config = AutoConfig.from_pretrained(os.path.dirname(name) if name.endswith(".json") else name)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def cmd_check(args) -> int:
    import torch

    import kvpress

    try:
        model = _config_model(args.model)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        print(f"{args.model}: cannot read its config: {exc}", file=sys.stderr)
        return 2
    try:
        adapter = kvpress.get_adapter(model)
    except ValueError as exc:
        print(f"{args.model}: not supported: {exc}")
        return 1
    policy_layers = adapter.policy_layers
    print(f"{args.model}: supported ({adapter.family}); {adapter.num_layers} layers, {adapter.num_heads} query / "
          f"{adapter.num_kv_heads} KV heads, head_dim {adapter.head_dim}")
    slides = [i for i in range(adapter.num_layers) if adapter.sliding_window(i) is not None]
    print(f"  policy layers: {len(policy_layers)} of {adapter.num_layers}"
          + (f" (layers {slides} keep the model's own window)" if slides else ""))
    if adapter.nope_layers:
        print(f"  layers without RoPE: {list(adapter.nope_layers)}")
    length = args.length or getattr(model.config, "max_position_embeddings", None)
    if length:
        dtype = getattr(model.config, "dtype", None) or model.dtype
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        per_layer = [length if adapter.sliding_window(i) is None else min(length, adapter.sliding_window(i))
                     for i in range(adapter.num_layers)]
        dense = 2 * sum(per_layer) * adapter.num_kv_heads * adapter.head_dim * torch.finfo(dtype).bits // 8
        print(f"  the model's own KV cache at {length} tokens in {str(dtype).removeprefix('torch.')}: "
              f"{dense / 2**20:.1f} MiB per sequence")
    for name in kvpress.list_policies():
        try:
            kvpress.get_policy(name).check_model(adapter)
            verdict = "ready"
        except (ValueError, FileNotFoundError) as exc:
            verdict = str(exc).splitlines()[0]
        print(f"  {name:<16} {verdict}")
    return 0


def _add_prefill_chunk_arg(p):
    p.add_argument("--prefill-chunk-size", type=int, default=None, metavar="N",
                   help="feed the prompt in forwards of N tokens (bounds the prefill's activations)")


def _add_policy_args(p):
    p.add_argument("--policy", required=True, help="registered policy name, or name:field=value[:...] (see `kvpress policies`)")
    p.add_argument("--budget", type=int, default=None, help="tokens attended per KV head per decode step")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help="policy field override (repeatable)")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpress", description="KV-cache compression for Hugging Face models")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("policies", help="list registered policies")
    p.add_argument("-v", "--verbose", action="store_true", help="also print each policy's default config")
    p.set_defaults(func=cmd_policies)

    p = sub.add_parser("check", help="is a model supported, and which policies run on it as configured "
                                     "(reads its config only: no weights are loaded)")
    p.add_argument("model", help="a local model folder or config.json, a cached hub id, or 'smollm2'")
    p.add_argument("--length", type=int, default=None,
                   help="tokens for the KV-cache size line (default: the config's max_position_embeddings)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("generate", help="generate from a prompt file under a policy")
    p.add_argument("--model", default="smollm2", help="'smollm2', a local HF directory or a hub id")
    _add_policy_args(p)
    p.add_argument("--prompt-file", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    _add_prefill_chunk_arg(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="every policy side by side on a long-context retrieval prompt")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=4096, help="prompt length in tokens")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--policies", default=None, help="comma-separated names (default: all registered)")
    _add_prefill_chunk_arg(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("calibrate", help="calibrate a policy's artifact for a model")
    cal = p.add_subparsers(dest="policy_name", required=True)
    from kvpress.calibration import CALIBRATORS

    for name, (help_text, configure, run) in sorted(CALIBRATORS.items()):
        cp = cal.add_parser(name, help=help_text)
        configure(cp)
        cp.set_defaults(func=run)

    for name, (help_text, configure) in SUBCOMMANDS.items():
        configure(sub.add_parser(name, help=help_text, add_help=name != "lm-eval"))
    return parser


# name -> (help, configure(subparser) that sets `func`); filled by other modules' register calls.
SUBCOMMANDS: dict = {}


def _load_extensions() -> None:
    import importlib

    import kvpress

    kvpress.list_policies()  # policy modules register their calibrators on import

    for module in ("kvpress.evals.cli",):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def main(argv=None) -> int:
    _load_extensions()
    parser = make_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as exc:
        print(f"kvpress: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m kvpress.cli` (what `accelerate launch -m` runs) executes this file as __main__,
    # a second copy of the module: subcommands register on the importable `kvpress.cli`, so
    # run that one's main.
    from kvpress.cli import main as _main

    sys.exit(_main())
