"""Ahead-of-time compilation of a recorded Triton launch for an NVIDIA target, on any machine.

Used by the compile tests (``tests/kernels/test_triton_compile.py``) and the offline SASS reader
(``benchmarks/gpu/sass_quant.py``). ``triton.compile`` of an ``ASTSource`` is given what a CUDA
launch would specialize on: ``tt.divisibility=16`` on every pointer (CUDA allocations are
256-byte aligned) and on every integer divisible by 16, integers equal to 1 as constants. Without
these hints the compiled code differs from a real launch's (its loads are not pipelined). Every
constexpr is passed explicitly: left-out ones do not reliably take their defaults in Triton 3.9's ``ASTSource``.
"""
from __future__ import annotations

import torch

_PTR = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
        torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.bool: "i1"}


def compile_launch(fn, args, kwargs, arch: int = 90):
    """The ``triton.compile`` result of ``fn[grid](*args, **kwargs)`` for ``sm_{arch}`` (``.asm``
    holds ``ttgir``, ``ptx``, ``cubin``); ``kwargs`` may carry ``num_warps`` / ``num_stages``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    options["enable_fp_fusion"] = True  # what a launch compiles with (explicit: Triton 3.9 warns on the default)
    bound = {**dict(zip(fn.arg_names, args)), **kwargs}
    if set(bound) != set(fn.arg_names):
        raise TypeError(f"{fn.__name__}: launched without {set(fn.arg_names) - set(bound)}")
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _PTR[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int) and value == 1:
            signature[param.name], constexprs[param.name] = "constexpr", 1
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}.{param.name}: unexpected argument {value!r}")
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                          options=options)
