"""Torch ops one decode step issues per layer, by the source line that issues them (no GPU needed).

    TRITON_INTERPRET=1 python benchmarks/count_step_ops.py SPEC [--length 2048] [--batch 1] [--cuda-path]
        [--dtype bfloat16]

On a host-bound GPU machine a decode step's time is its launches (BENCHMARKS.md "End-to-end decode on an H200 at 32k"), and
the count of ops is the same on any machine: this counts them on the CPU, for a one-layer
random-weight Llama-3-8B-shaped model (``--model``), in one decode step after two warm ones, with a
TorchDispatchMode (a Triton launch under TRITON_INTERPRET=1 counts once, as ``launch``, not as the
interpreter's own ops). ``--cuda-path`` takes the routes a CUDA run takes where they are CPU-only
here (ShadowKV's one-launch `attend_rows`); with ``backend=triton`` in SPEC and
TRITON_INTERPRET=1 the Triton kernels run interpreted (their launchers' ops counted, the
interpreter's own not). ``--cuda-path`` also runs the quantized layers' fused decode
(``decode_backend="triton"``), the one-launch Triton ``merge_states``, `sparse_decode`'s Triton
kernel and the torch reads' CUDA pass sizes (``gear``'s CUDA path is its torch reads:
``gear:backend=torch`` takes it here); it patches those module globals for the rest of the
process. Printed: the total and the ops that are not views (a view launches no kernel), the
commonest ops, the non-view ops per file, the lines issuing ops that wait for the device when
their input lives there (``item``, ``nonzero``, ...: on the CPU every tensor is a host tensor,
so read each line to tell), the lines issuing the most, and the total per file.
"""
from __future__ import annotations

import argparse
import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvpress
from kvpress.compat import cache_kwargs, output_cache
from kvpress.evals.models import load_eval_model


# ops that only make a new view of a tensor's storage: no kernel on a GPU
VIEW_OPS = frozenset({"view", "_unsafe_view", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "expand",
                      "alias", "as_strided", "permute", "narrow", "detach", "split", "unbind", "_reshape_alias"})


# ops that make the host wait for a CUDA device when their input lives there (a value read back,
# an output whose size depends on the data)
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "is_nonzero", "equal",
                      "repeat_interleave", "index[bool]", "index_put[bool]", "index_put_[bool]"})


class CountOps(TorchDispatchMode):
    """Counts every op dispatched, and the innermost kvpress source line that issued it.

    Under TRITON_INTERPRET=1 a Triton launch runs on the CPU through torch ops of the interpreter's
    own (copies of its arguments): those are not counted; each launch counts once, as ``launch``
    (one kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops, self.sites, self.site_ops = collections.Counter(), collections.Counter(), collections.Counter()
        self.in_launch = 0
        self._run = None

    def __enter__(self):
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:  # no Triton: nothing interpreted
            return super().__enter__()
        counter, run = self, InterpretedFunction.run
        self._run = (InterpretedFunction, run)

        def counted_run(fn, *args, **kwargs):
            if kwargs.get("warmup"):
                return run(fn, *args, **kwargs)
            counter._count("launch")
            counter.in_launch += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                counter.in_launch -= 1

        InterpretedFunction.run = counted_run
        return super().__enter__()

    def __exit__(self, *exc):
        if self._run is not None:
            cls, run = self._run
            cls.run = run
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_launch:
            name = func.overloadpacket.__name__
            if name in ("index", "index_put", "index_put_") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
                    if i is not None):
                name += "[bool]"  # a boolean mask: the op finds its True entries first (a nonzero)
            self._count(name)
        return func(*args, **(kwargs or {}))

    def _count(self, name: str) -> None:
        self.ops[name] += 1
        ours = [f for f in traceback.extract_stack() if "/kvpress/" in f.filename or "/policies/" in f.filename
                or "/kernels/" in f.filename]
        site = "(model)" if not ours else f"{ours[-1].filename.split('/')[-1]}:{ours[-1].lineno} {ours[-1].line[:60]}"
        self.sites[site] += 1
        self.site_ops[site, name] += 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="policy spec, e.g. shadowkv:budget=1120:rank=48:backend=triton")
    parser.add_argument("--model", default="random-llama3-8b-1l", help="a kvpress.evals.models name")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1, help="rows (a step whose ops grow with it loops over rows)")
    parser.add_argument("--cuda-path", action="store_true", help="take CUDA-only routes (needs TRITON_INTERPRET=1)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the model's dtype (a GPU run's bf16 adds the fp32 copies a step makes)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    if args.cuda_path:
        import kvpress.kernels.backend as kernel_backend
        # every kernel's "auto" takes the Triton kernel a CUDA run takes (the native CPU kernels off)
        kernel_backend.AUTO_TRITON_ON_CPU = True
        kernel_backend.native_available = lambda: False
        import kvpress.kernels.quant as quant
        import kvpress.policies.gear as gear
        quant.CHUNK_BYTES, gear.OUTLIER_CHUNK = quant.CUDA_CHUNK_BYTES, gear.CUDA_OUTLIER_CHUNK  # CUDA's pass sizes
    model, _ = load_eval_model(args.model, device="cpu", dtype=getattr(torch, args.dtype))
    ids = torch.randint(3, model.config.vocab_size - 1, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
    name, overrides = kvpress.parse_policy_spec(args.spec)
    T = args.length
    with torch.no_grad(), kvpress.apply(model, kvpress.get_policy(name, **overrides)):
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, nxt = output_cache(out), out.logits[:, -1:].argmax(-1)

        def step(i):
            return model(nxt, **cache_kwargs(model, cache), use_cache=True,
                         position_ids=torch.full((args.batch, 1), T + i)).logits[:, -1:].argmax(-1)

        if args.cuda_path:  # the quantized layers' fused decode (`_fused_decode`), as on CUDA
            for layer in cache.layers:
                if hasattr(layer, "decode_backend"):
                    layer.decode_backend = "triton"
        for i in range(2):
            nxt = step(i)
        counter = CountOps()
        with counter:
            nxt = step(2)
    layers = model.config.num_hidden_layers
    launches = counter.ops.get("launch", 0)
    views = sum(n for op, n in counter.ops.items() if op in VIEW_OPS)
    print(f"{args.spec}: {sum(counter.ops.values())} ops in one decode step of {layers} layer(s), "
          f"{sum(counter.ops.values()) - views} of them not views"
          + (f" ({launches} Triton launches)" if launches else ""))
    print("commonest:", ", ".join(f"{k} {v}" for k, v in counter.ops.most_common(20)))
    kernels = collections.Counter()
    for (site, op), n in counter.site_ops.items():
        if op not in VIEW_OPS:
            kernels[site.split(":")[0]] += n
    print("not views, by file:", ", ".join(f"{k} {v}" for k, v in kernels.most_common()))
    syncs = collections.Counter({site: n for (site, op), n in counter.site_ops.items() if op in SYNC_OPS})
    listed = ", ".join(f"{n}x {site}" for site, n in syncs.most_common())
    print("may wait for the device (if its input is there):", listed or "none")
    for site, n in counter.sites.most_common(args.top):
        print(f"{n:5d}  {site}")
    by_file = collections.Counter()
    for site, n in counter.sites.items():
        by_file[site.split(":")[0]] += n
    print("by file:", ", ".join(f"{k} {v}" for k, v in by_file.most_common()))
    return sum(counter.ops.values())


if __name__ == "__main__":
    main()
