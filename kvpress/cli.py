"""The ``kvpress`` command line.

Subcommands: ``policies`` (the registry), ``check`` (is a model supported; from its config only),
``generate`` (one prompt under one policy), ``demo`` (the README's main job: the recommended
configurations side by side on a ~2k-token retrieval prompt), ``calibrate``. Other modules add their
subcommands in :data:`SUBCOMMANDS`.

Startup stays cheap: this module imports only the standard library, ``kvpress policies`` reads the
policy names and descriptions from the policy modules' source (:func:`policy_summaries`), and
torch, transformers and the policies are imported inside the commands that use them.

Errors a user can cause (a bad option value, a missing file, an unknown model or policy) print one
line, ``kvpress: error: ...``, on stderr and exit with code 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap

from kvpress import __version__

# Exceptions that a user's input causes (bad values, missing files, a missing optional package):
# one line on stderr, exit code 2.
USER_ERRORS = (ValueError, TypeError, OSError, ImportError)
_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line on stderr (exit code 2), not the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------------------- argument types
def int_at_least(low: int):
    """An argparse ``type``: an int ``>= low`` (the error names the allowed range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def dtype_name(text: str) -> str:
    """An argparse ``type``: float32 / float16 / bfloat16 (fp32, fp16, half, bf16 accepted)."""
    key = text.strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype kvpress runs in; allowed: float32, float16, "
                                         "bfloat16 (or fp32, fp16, bf16)")
    return DTYPES[key]


def device_name(text: str) -> str:
    """An argparse ``type``: cpu, cuda, cuda:N or mps (availability is checked by :func:`check_device`)."""
    if not _DEVICE.match(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; allowed: cpu, cuda, cuda:N, mps")
    return text.strip()


def check_device(device: str | None) -> None:
    """Raise ValueError when ``device`` (from :func:`device_name`) is not present on this machine."""
    if device is None or device == "cpu":
        return
    import torch

    if device == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError("--device mps: MPS is not available on this machine; allowed here: cpu")
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}); "
                         "allowed here: cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                         f"allowed: cuda:0 .. cuda:{torch.cuda.device_count() - 1}")


# --------------------------------------------------------------------------- models
from kvpress.model_config import check_lengths, check_model_name, model_config, one_line  # noqa: E402,F401


def read_text_file(path: str, option: str) -> str:
    """The UTF-8 text of ``path`` (ValueError naming ``option`` when it is missing, a folder or not text)."""
    if os.path.isdir(path):
        raise ValueError(f"{option} {path}: is a folder; expected a text file")
    if not os.path.isfile(path):
        raise ValueError(f"{option} {path}: no such file; expected a text file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{option} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


# --------------------------------------------------------------------------- policies
def policy_summaries() -> list[tuple[str, str, str]]:
    """``(name, description, paper)`` of every policy in ``kvpress.policies``, sorted by name.

    Read from the class attributes of each ``@register_policy`` class in the policy modules'
    source, without importing them (so ``kvpress policies`` imports no torch). When a module does
    not state the three as string literals, this falls back to the registry, which imports every
    policy. tests/test_cli.py checks that both give the same table.
    """
    rows = _summaries_from_source()
    if rows is None:
        import kvpress

        classes = [kvpress.policy_class(n) for n in kvpress.list_policies()]
        rows = [(cls.name, cls.description, cls.paper) for cls in classes]
    return sorted(rows)


def _summaries_from_source() -> list[tuple[str, str, str]] | None:
    import ast
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("kvpress.policies")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
    if any(p.is_dir() and (p / "__init__.py").is_file() and not p.name.startswith("_") for p in folder.iterdir()):
        return None  # a policy subpackage: kvpress.policies imports it; read the registry
    rows = []
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):  # kvpress.policies imports the modules without a leading '_'
            continue
        for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
            if isinstance(node, ast.ClassDef) and any(_names_register(d) for d in node.decorator_list):
                attrs = _string_attributes(node, ("name", "description", "paper"))
                if attrs is None:
                    return None
                rows.append((attrs["name"], attrs["description"], attrs["paper"]))
    return rows


def _names_register(decorator) -> bool:
    import ast

    return (isinstance(decorator, ast.Name) and decorator.id == "register_policy") or (
        isinstance(decorator, ast.Attribute) and decorator.attr == "register_policy")


def _string_attributes(node, names) -> dict | None:
    """The string literals a class body assigns to ``names``; None when one is not a literal or missing."""
    import ast

    attrs = {}
    for stmt in node.body:
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets = [stmt.target]
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id in names:
                if not (isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)):
                    return None
                attrs[target.id] = stmt.value.value
    direct = [b.id for b in node.bases if isinstance(b, ast.Name)] == ["Policy"] and len(node.bases) == 1
    if "paper" not in attrs and direct:
        attrs["paper"] = ""  # Policy's default
    return attrs if set(attrs) == set(names) else None


def _policy_overrides(args) -> dict:
    overrides = {}
    for item in args.option or []:
        if "=" not in item:
            raise ValueError(f"--option expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.strip()] = value.strip()
    return overrides


def build_policy(name: str, budget: int | None = None, overrides: dict | None = None):
    """``get_policy(name, **overrides)``, then ``with_budget(budget)`` when a budget is given."""
    import kvpress

    policy = kvpress.get_policy(name, **(overrides or {}))
    return policy.with_budget(budget) if budget is not None else policy


# --------------------------------------------------------------------------- commands
def cmd_policies(args) -> int:
    rows = policy_summaries()
    width = max(len(name) for name, _, _ in rows)
    print(f"{'name':<{width}}  {'description':<52}  paper")
    for name, description, paper in rows:
        print(f"{name:<{width}}  {description:<52}  {paper or '-'}")
        if args.verbose:
            import kvpress

            print(textwrap.indent(repr(kvpress.get_policy(name)), " " * (width + 2)))
    from kvpress.presets import describe

    print("\n" + "\n".join(describe()))
    return 0


def cmd_generate(args) -> int:
    import kvpress
    from kvpress.generation import timed_generate

    # bad input fails before anything loads
    policy = build_policy(args.policy, args.budget, _policy_overrides(args))
    prompt = read_text_file(args.prompt_file, "--prompt-file")
    check_model_name(args.model, "generate")
    model, tokenizer = kvpress.load_model(args.model)
    if args.chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
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

    if args.policies is not None:
        names = [n.strip() for n in args.policies.split(",")]
        if not all(names):
            raise ValueError(f"--policies {args.policies!r} has an empty entry; give comma-separated policy specs "
                             "(see `kvpress policies`), or leave it out for the recommended ones")
        for name in names:
            build_policy(name)  # an unknown name fails here, listing the known ones
    check_model_name(args.model, "demo")
    check_lengths(args.model, [args.length], "--length")
    return run_demo(model=args.model, length=args.length, budget=args.budget or None, policies=args.policies,
                    all_policies=args.all, prefill_chunk_size=args.prefill_chunk_size)


def cmd_check(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    import kvpress

    config = model_config(args.model)
    try:
        with torch.device("meta"):  # shapes only: no weights are read or allocated
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:  # no causal-LM class for this config
        print(f"{args.model}: not supported: {one_line(exc)}")
        return 1
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


# --------------------------------------------------------------------------- parser
def _add_prefill_chunk_arg(p):
    p.add_argument("--prefill-chunk-size", type=int_at_least(1), default=None, metavar="N",
                   help="feed the prompt in forwards of N tokens (bounds the prefill's activations)")


def _add_policy_args(p):
    p.add_argument("--policy", required=True,
                   help="registered policy name, or name:field=value[:...] (see `kvpress policies`)")
    p.add_argument("--budget", type=int_at_least(1), default=None, help="tokens attended per KV head per decode step")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help="policy field override (repeatable)")


def _add_debug_arg(p):
    # SUPPRESS: a subcommand's absent --debug leaves the top-level one as parsed
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the traceback of an error instead of one line")


def make_parser(calibrators: bool = True) -> argparse.ArgumentParser:
    """The ``kvpress`` parser; ``calibrators=False`` leaves ``calibrate``'s subcommands out, which
    saves importing every policy (they register their calibrators on import)."""
    parser = ArgumentParser(prog="kvpress", description="KV-cache compression for Hugging Face models")
    parser.add_argument("--version", action="version", version=f"kvpress-toolkit {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("policies", help="list registered policies")
    p.add_argument("-v", "--verbose", action="store_true", help="also print each policy's default config")
    p.set_defaults(func=cmd_policies)

    p = sub.add_parser("check", help="is a model supported, and which policies run on it as configured "
                                     "(reads its config only: no weights are loaded)")
    p.add_argument("model", help="a local model folder, a config .json or .gguf file, a hub id, or 'smollm2'")
    p.add_argument("--length", type=int_at_least(1), default=None,
                   help="tokens for the KV-cache size line (default: the config's max_position_embeddings)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("generate", help="generate from a prompt file under a policy")
    p.add_argument("--model", default="smollm2", help="'smollm2', a local HF directory or a hub id")
    _add_policy_args(p)
    p.add_argument("--prompt-file", required=True)
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    _add_prefill_chunk_arg(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="recommended policy configurations side by side on a retrieval prompt")
    p.add_argument("--model", default="smollm2", help="'smollm2', a local HF directory or a hub id")
    p.add_argument("--length", type=int_at_least(1), default=2048, help="prompt length in tokens")
    p.add_argument("--budget", type=int_at_least(0), default=256,
                   help="token budget of the policies that take one (0: their own)")
    p.add_argument("--policies", default=None,
                   help="comma-separated policy specs (name:field=value; default: kvpress.demo.DEFAULT_POLICIES)")
    p.add_argument("--all", action="store_true", help="every registered policy, at its defaults but for --budget")
    _add_prefill_chunk_arg(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("calibrate", help="calibrate a policy's artifact for a model")
    cal = p.add_subparsers(dest="policy_name", required=True)
    if calibrators:
        import kvpress
        from kvpress.calibration import CALIBRATORS

        kvpress.list_policies()  # policy modules register their calibrators on import
        for name, (help_text, configure, run) in sorted(CALIBRATORS.items()):
            cp = cal.add_parser(name, help=help_text)
            configure(cp)
            _add_debug_arg(cp)
            cp.set_defaults(func=run)

    for name, (help_text, configure) in SUBCOMMANDS.items():
        configure(sub.add_parser(name, help=help_text, add_help=name != "lm-eval"))
    for name, p in sub.choices.items():
        if name != "lm-eval":  # lm-eval's own options pass through untouched
            _add_debug_arg(p)
    return parser


# name -> (help, configure(subparser) that sets `func`); filled by other modules' register calls.
SUBCOMMANDS: dict = {}


def _load_extensions() -> None:
    import importlib

    for module in ("kvpress.evals.cli",):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def _command(argv) -> str | None:
    """The subcommand ``argv`` names (the top-level options take no values)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _load_extensions()
    parser = make_parser(calibrators=_command(argv) == "calibrate")
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "accepts_extra", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version (0) or a usage error (2, one line already printed)
        return exc.code if isinstance(exc.code, int) else 2
    args.extra = extra
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader went away (`kvpress policies | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except USER_ERRORS as exc:
        if args.debug:
            raise
        print(f"kvpress: error: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m kvpress.cli` (what `accelerate launch -m` runs) executes this file as __main__,
    # a second copy of the module: subcommands register on the importable `kvpress.cli`, so
    # run that one's main.
    from kvpress.cli import main as _main

    sys.exit(_main())
