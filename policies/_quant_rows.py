"""A left-padded batch under the quantization policies: one quantized layer per row.

A quantized layer's state depends on where each of its row's tokens falls: which tokens form a
key group (``group_size`` tokens of one channel), which ones a flush packs together (GEAR's
low-rank chunk, ZipCache's saliency split and probes) and when the full-precision window flushes
(once it holds ``residual_length + flush_unit`` tokens). In a batch padded to a common length
those points, counted from the batch's first column, fall elsewhere in each row than in the same
row run alone, so a padded row would be quantized differently from its batch-1 run and generate
other tokens. `RowSplit` gives each row its own layer (batch 1, no padding), fed only that row's
real tokens: every row is quantized, flushed and read exactly as alone. A padding query attends
only to itself (its output is its own value), as in `kvpress.attention.dense_causal_attention`.

The cost: a step of a padded batch runs one layer call per row (a batch without padding keeps
the batched layer); each row's store holds its real tokens only.
"""
from __future__ import annotations

import copy

import torch

from ._quant_static import static_attend


class RowCache:
    """What a row's layer sees of its batch's cache: no padding (it gets the row's real tokens
    only); every other attribute (``prompt_open``, ``shared``, the adapter) is the batch's."""

    min_row_start = max_row_start = 0

    def __init__(self, cache):
        self._cache = cache

    def row_start_on(self, device) -> None:
        return None

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_cache":
            raise AttributeError(name)
        return getattr(self._cache, name)


class RowSplit:
    """The rows of a left-padded batch, each in its own quantized layer.

    ``owner``: the batch's layer (a `kvpress.policies._quant.QuantWindowLayer`), whose
    ``_row_layer(cache)`` builds a layer of the same policy; it keeps counting ``seen`` (padding
    included) and hands its calls here. ``layers[b]`` is row ``b``'s layer, None while the row has
    had only padding (a prompt in pieces whose padding outlasts the first piece).
    """

    def __init__(self, owner, batch: int):
        self.owner = owner
        self.cache = RowCache(owner.cache)
        self.layers: list = [None] * batch
        self._starts: tuple[torch.Tensor | None, list[int]] = (None, [])

    def row_starts(self) -> list[int]:
        """Each row's first real token (host ints; read from the device once per new padding)."""
        rs = self.owner.cache.row_start_on("cpu")
        if rs is not self._starts[0]:
            self._starts = (rs, [0] * len(self.layers) if rs is None else rs.tolist())
        return self._starts[1]

    def _layer(self, b: int, k: torch.Tensor, v: torch.Tensor):
        """Row ``b``'s layer, built on its first real token; it follows the owner's past recording."""
        layer = self.layers[b]
        if layer is None:
            layer = self.layers[b] = self.owner._row_layer(self.cache)
            layer.lazy_initialization(k, v)
        layer.record_past = self.owner.record_past
        return layer

    def attend(self, q, k_new, v_new, scaling) -> torch.Tensor:
        """`CacheLayer.attend` of the batch: each row's real queries through its own layer."""
        T, group = q.shape[2], q.shape[1] // k_new.shape[1]
        outs = []
        for b, start in enumerate(self.row_starts()):
            a = min(T, max(0, start - self.owner.seen))  # this forward's padding columns of row b
            parts = [v_new[b : b + 1, :, :a].repeat_interleave(group, dim=1)] if a else []  # (1, H_q, a, D)
            if a < T:
                k, v = k_new[b : b + 1, :, a:], v_new[b : b + 1, :, a:]
                layer = self._layer(b, k, v)
                if layer.record_past:
                    layer.record_forward(k, v)
                parts.append(layer.attend(q[b : b + 1, :, a:], k, v, scaling).to(q.dtype))
            outs.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
        self.owner.seen += T
        return torch.cat(outs, dim=0)

    def static_attend(self, q, k_new, v_new, scaling, start: torch.Tensor) -> torch.Tensor:
        """A static decode step of the batch (``start``: its sequence index, [1] long): every row has
        a layer by now, and each takes its token at its own index, counted from its first real
        token, flushing when its own window fills (a device mask: one graph whichever rows flush).
        The rows' host counts advance with the owner's (`QuantWindowLayer.count_tokens`)."""
        outs = [static_attend(layer, q[b : b + 1], k_new[b : b + 1], v_new[b : b + 1], scaling, start - row_start)
                for b, (layer, row_start) in enumerate(zip(self.layers, self.row_starts()))]
        self.owner.count_static_step()
        return torch.cat(outs, dim=0).to(q.dtype)

    def ingest_prefill(self, k, v) -> None:
        """`CacheLayer.ingest_prefill` of the batch: each row's real tokens into its own layer."""
        T = k.shape[2]
        for b, start in enumerate(self.row_starts()):
            if start < T:
                kb, vb = k[b : b + 1, :, start:], v[b : b + 1, :, start:]
                self._layer(b, kb, vb).ingest_prefill(kb, vb)
        self.owner.seen += T

    def removable(self) -> int:
        counts = [layer.removable() for layer in self.layers if layer is not None]
        return min(counts) if counts else 0

    def remove_latest(self, n: int) -> None:
        """Each row's layer takes back the latest ``n`` tokens (the owner's ``seen`` is cut by the core)."""
        for layer in self.layers:
            if layer is not None:
                layer.remove_latest(n)

    def end_prompt(self) -> None:
        for layer in self.layers:
            if layer is not None:
                layer.end_prompt()

    def batch_select(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices``; a row taken twice (beam search) gets a copy of its own."""
        taken, layers = set(), []
        for i in indices.tolist():
            layer = self.layers[i]
            if layer is not None and i in taken:
                layer = copy.deepcopy(layer, {id(self.cache): self.cache})  # the cache view stays shared
            taken.add(i)
            layers.append(layer)
        self.layers = layers
        self.owner.batch_size = len(layers)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"row{b}.{name}": t for b, layer in enumerate(self.layers) if layer is not None
                for name, t in layer.state_tensors().items()}

    def cached_elements(self) -> int:
        """K+V elements of the rows' real tokens (padding is not stored)."""
        return sum(layer.cached_elements() for layer in self.layers if layer is not None)
