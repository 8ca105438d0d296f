"""The PTX that unpacks packed codes to fp16 on CUDA (``triton_quant_kernel._codes_ptx``), checked
on CPU by executing its few instructions in Python over every byte value: the interpreter cannot
run inline PTX, and a wrong bit trick would otherwise surface only on a GPU."""
import struct

import numpy as np
import pytest

pytest.importorskip("triton")

from kvpress.kernels.triton_quant_kernel import _codes_ptx  # noqa: E402


def _f16x2(x: int) -> np.ndarray:
    return np.frombuffer(struct.pack("<I", x), dtype=np.float16)


def _execute(ptx: str, regs: dict) -> dict:
    """Run the straight-line PTX subset ``_codes_ptx`` emits (mov, prmt, shr, lop3 0xEA, sub.f16x2)."""
    env = dict(regs)

    def val(tok):
        return env[tok] if tok in env else int(tok, 0)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        a = [x.strip() for x in rest.split(",")]
        if op == "mov.b32":
            env[a[0]] = val(a[1])
        elif op == "prmt.b32":  # result byte i = byte (selector nibble i) of {second, first}
            src = val(a[1]).to_bytes(4, "little") + val(a[2]).to_bytes(4, "little")
            env[a[0]] = int.from_bytes(bytes(src[(val(a[3]) >> (4 * i)) & 7] for i in range(4)), "little")
        elif op == "shr.u32":
            env[a[0]] = val(a[1]) >> val(a[2])
        elif op == "lop3.b32":
            assert a[4] == "0xEA", "only (a & b) | c is emulated"
            env[a[0]] = (val(a[1]) & val(a[2])) | val(a[3])
        elif op == "sub.f16x2":
            r = (_f16x2(val(a[1])) - _f16x2(val(a[2]))).astype(np.float16)
            env[a[0]] = struct.unpack("<I", r.tobytes())[0]
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return env


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_ptx_unpacks_every_byte(bits):
    """Byte i of the input register is element i of the pack; output 2j holds plane j of elements
    0, 1 and output 2j + 1 of elements 2, 3, each the exact fp16 value of the code."""
    planes, mask = 8 // bits, (1 << bits) - 1
    ptx = _codes_ptx(bits)
    values = np.arange(256, dtype=np.uint8)
    for rot in range(4):  # every byte value in every position of the register
        word = np.stack([np.roll(values, 64 * i + rot) for i in range(4)], axis=1)  # (256, 4)
        for by in word:
            env = _execute(ptx, {f"${2 * planes}": int.from_bytes(by.tobytes(), "little")})
            for j in range(planes):
                got = np.concatenate([_f16x2(env[f"${2 * j}"]), _f16x2(env[f"${2 * j + 1}"])])
                np.testing.assert_array_equal(got.astype(np.float32), ((by >> (j * bits)) & mask).astype(np.float32))
