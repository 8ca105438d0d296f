"""gear's CUDA decode (torch reads of the packed store) with the GPU's pass sizes and the CPU's,
in one run (CUDA only).

    python benchmarks/gpu/gear_passes.py [--length 32768] [--new-tokens 6]

``kvpress bench`` on the random Llama-3-8B shape, ``full`` and ``gear`` with the GPU's pass sizes
(``CUDA_CHUNK_BYTES``, ``CUDA_OUTLIER_CHUNK``), then ``gear`` again with the CPU's (4 MiB
chunks, 1024-token outlier passes), which are several times slower there.
"""
import argparse

from kvpress.evals.bench import run_bench
from kvpress.evals.models import load_eval_model
from kvpress.kernels import quant as kq
from kvpress.policies import gear

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--length", type=int, default=32768)
ap.add_argument("--new-tokens", type=int, default=6)
args = ap.parse_args()
loaded = load_eval_model("random-llama3-8b-32l", device="cuda")
run_bench("random-llama3-8b-32l", ("full", "gear"), lengths=(args.length,), new_tokens=args.new_tokens, loaded=loaded)
kq.CUDA_CHUNK_BYTES, gear.CUDA_OUTLIER_CHUNK = kq.CHUNK_BYTES, gear.OUTLIER_CHUNK
print("# gear with the CPU's pass sizes:")
run_bench("random-llama3-8b-32l", ("gear",), lengths=(args.length,), new_tokens=args.new_tokens, loaded=loaded)
