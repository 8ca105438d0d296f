"""The fixed rotation of the quantizers' ``rotate_values`` (`kvpress.policies._quant`)."""
from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=None)
def _value_basis_cpu(dim: int) -> torch.Tensor:
    if dim & (dim - 1) == 0:  # Sylvester's construction
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (h / math.sqrt(dim)).float()
    gen = torch.Generator().manual_seed(dim)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def value_basis(dim: int, device) -> torch.Tensor:
    """The orthonormal (dim, dim) fp32 rotation of ``rotate_values``: the normalised Hadamard
    matrix when ``dim`` is a power of two (every entry +-1/sqrt(dim), so each rotated channel
    is an equal-weight mix of all channels and one large channel spreads over all of them),
    otherwise a fixed random orthogonal matrix (seeded by ``dim``). A constant of the model
    shape, not state: nothing is stored per token or per row."""
    return _value_basis_cpu(dim).to(device)
