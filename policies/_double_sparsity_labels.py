"""Double Sparsity's label cache (`LabelCache`) and its optional 4-bit codes (``label_bits=4``): per-token
quantization of the label cache, two codes per byte."""
from __future__ import annotations

import torch


def quantize_labels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token asymmetric 4-bit codes of labels x [B, H, T, r].

    Returns packed uint8 codes [B, H, T, ceil(r / 2)] (two per byte, low nibble first) and fp16
    ``scale`` / ``zero`` [B, H, T, 1] with ``x ~= codes * scale + zero``.
    """
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.float16)
    zero = lo.to(torch.float16)
    codes = ((xf - zero.float()) / scale.float()).round_().clamp_(0, 15).to(torch.uint8)  # (B, H, T, r)
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale, zero


def dequantize_labels(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, r: int) -> torch.Tensor:
    """Inverse of :func:`quantize_labels`: fp32 labels [B, H, T, r]."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)[..., :r]  # (B, H, T, r)
    return codes.float() * scale.float() + zero.float()


class LabelCache:
    """The label cache: channels ``channels`` (H_kv, r) of every stored post-RoPE key, in the
    K/V buffer's token order, grown with its capacity (zeroed: a static step scores every slot of the
    capacity, the unused ones masked). Kept in step with the buffer by `SelectiveLayer` (its
    metadata protocol).

    16-bit labels are stored token-last, ``labels`` [B, H_kv, r, T_cap] in the model dtype, so
    scoring streams contiguous rows of tokens (~1/3 faster on CPU); 4-bit ones as packed codes
    ``label_codes`` [B, H_kv, T_cap, ceil(r / 2)] (uint8) with ``label_scale`` / ``label_zero``
    [B, H_kv, T_cap, 1] (fp16). :meth:`view` gives [B, H_kv, T, r] either way.
    """

    def __init__(self, channels: torch.Tensor, bits: int):
        self.channels_cpu = channels  # (H_kv, r) long
        self.channels: torch.Tensor | None = None  # on the keys' device, set on first use
        self.bits = bits
        self.labels = self.label_codes = self.label_scale = self.label_zero = None
        self.length = 0  # tokens labelled
        self.capacity = 0  # the K/V buffer's

    def _parts(self, k: torch.Tensor) -> dict:
        """The labels of keys k [B, H_kv, n, D]: store name -> (tensor, token dim)."""
        new = k.gather(-1, self.channels[None, :, None, :].expand(k.shape[0], k.shape[1], k.shape[2], -1))
        if self.bits == 16:
            return {"labels": (new.transpose(-1, -2), 3)}
        names = ("label_codes", "label_scale", "label_zero")
        return {name: (t, 2) for name, t in zip(names, quantize_labels(new))}

    def _stores(self, parts: dict) -> dict:
        """The stores for ``parts``, grown to the capacity: name -> (store, token dim)."""
        stores = {}
        for name, (part, t_dim) in parts.items():
            store = getattr(self, name)
            if store is None or store.shape[t_dim] < self.capacity:
                shape = list(part.shape)
                shape[t_dim] = self.capacity
                grown = part.new_zeros(shape)
                if store is not None:
                    grown.narrow(t_dim, 0, self.length).copy_(store.narrow(t_dim, 0, self.length))
                setattr(self, name, grown)
            stores[name] = (getattr(self, name), t_dim)
        return stores

    def reserve(self, capacity: int, like: torch.Tensor) -> None:
        self.capacity = max(self.capacity, capacity)

    def append(self, k: torch.Tensor, v, start: int, row_start) -> None:
        """Label the new keys k [B, H_kv, n, D] (stored at the buffer's end)."""
        if self.channels is None:
            self.channels = self.channels_cpu.to(k.device)
        n, store = k.shape[2], self.labels
        if (self.bits == 16 and store is not None and store.shape[3] >= self.capacity
                and store.dtype == k.dtype and store.shape[:2] == k.shape[:2]):
            # decode: gather straight into the label cache (no temporary, no copy)
            idx = self.channels[None, :, None, :].expand(k.shape[0], k.shape[1], n, -1)
            torch.gather(k, -1, idx, out=store.narrow(3, self.length, n).transpose(-1, -2))
        else:
            parts = self._parts(k)
            for name, (store, t_dim) in self._stores(parts).items():
                store.narrow(t_dim, self.length, n).copy_(parts[name][0])
        self.length += n

    def static_append(self, k: torch.Tensor, v, pos: torch.Tensor, row_start, capacity: int) -> None:
        """Label one decode key per row k [B, H_kv, 1, D] at the device position ``pos`` ([1] long)."""
        self.capacity = max(self.capacity, capacity)
        parts = self._parts(k)
        for name, (store, t_dim) in self._stores(parts).items():
            store.index_copy_(t_dim, pos, parts[name][0].to(store.dtype))

    def count_stored(self, length: int) -> None:
        self.length = length

    def truncate(self, buffer, row_start, cache) -> None:
        self.length = buffer.length  # labels are per token, in the buffer's order

    def view(self, capacity: int | None = None) -> torch.Tensor:
        """Labels [B, H_kv, T, r] of the stored tokens, or of every slot of ``capacity`` (a transposed
        view when 16-bit; de-quantized when 4-bit)."""
        n = self.length if capacity is None else capacity
        if self.bits == 16:
            return self.labels[:, :, :, :n].transpose(-1, -2)
        return dequantize_labels(self.label_codes[:, :, :n], self.label_scale[:, :, :n], self.label_zero[:, :, :n],
                                 self.channels.shape[1])

    def state_tensors(self) -> dict:
        return {"channels": self.channels, "labels": self.labels, "label_codes": self.label_codes,
                "label_scale": self.label_scale, "label_zero": self.label_zero}

    def batch_select(self, indices: torch.Tensor) -> None:
        for name in ("labels", "label_codes", "label_scale", "label_zero"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, indices.to(t.device)))
