"""Quest's page metadata: `PageStats`, the element-wise key min / max of every page, updated
incrementally as tokens arrive and kept in step with the K/V buffer by `SelectiveLayer` (its
metadata protocol). Pages are counted from each row's first real token, so a left-padded row
pages exactly like the same prompt run alone."""

from __future__ import annotations

import torch


class PageStats:
    """Element-wise key min / max per page, ``(B, H_kv, P_cap, D)`` each, grown in chunks.

    Page ``j`` of row ``b`` holds relative positions ``[j * page_size, (j + 1) * page_size)``,
    i.e. sequence indices from ``row_start[b] + j * page_size``. A page with no token yet holds
    ``+inf`` (min) / ``-inf`` (max); :meth:`bounds` reports those as zeros, like
    :func:`kvpress.kernels.page_min_max`.
    """

    def __init__(self, page_size: int, grow_pages: int = 8):
        self.page_size = page_size
        self.grow_pages = grow_pages
        self.page_min: torch.Tensor | None = None
        self.page_max: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v, start: int, row_start: torch.Tensor | None) -> None:
        """Fold keys ``k`` [B, H_kv, n, D] at sequence indices ``start ..`` into their pages (``v``:
        unused, the metadata protocol of `SelectiveLayer`).

        Only the pages the new tokens fall in are touched (a scatter min / max), so a decode
        step costs O(D) per head, not O(cached tokens).
        """
        B, H, n, D = k.shape
        if n == 1 and row_start is None:  # a decode step without padding: one page, in place
            page = start // self.page_size
            self._ensure(B, H, D, page + 1, k)
            kf = k[:, :, 0].to(self.page_min.dtype)
            mn, mx = self.page_min[:, :, page], self.page_max[:, :, page]  # (B, H, D) views
            torch.minimum(mn, kf, out=mn)
            torch.maximum(mx, kf, out=mx)
            return
        rel = torch.arange(start, start + n, device=k.device).expand(B, n)  # (B, n)
        if row_start is not None:
            rel = rel - row_start[:, None]
        real = rel >= 0
        pages = torch.where(real, rel, torch.zeros_like(rel)) // self.page_size  # (B, n)
        need = int(pages.max()) + 1 if n else 0
        self._ensure(B, H, D, need, k)
        kf = k.to(self.page_min.dtype)
        index = pages[:, None, :, None].expand(B, H, n, D)
        mask = real[:, None, :, None]
        self.page_min.scatter_reduce_(2, index, kf.masked_fill(~mask, float("inf")), "amin")
        self.page_max.scatter_reduce_(2, index, kf.masked_fill(~mask, float("-inf")), "amax")

    def static_append(self, k: torch.Tensor, v, pos: torch.Tensor, row_start: torch.Tensor | None,
                      capacity: int) -> None:
        """Fold one decode key per row k [B, H_kv, 1, D] at the device position ``pos`` ([1] long)
        into its page in place (a static decode step); the bounds hold every page of a
        ``capacity``-token store."""
        B, H, _, D = k.shape
        self._ensure(B, H, D, -(-capacity // self.page_size), k)
        rel = (pos if row_start is None else pos - row_start).expand(B)  # (B,) a decode token is real
        at = (rel // self.page_size).view(B, 1, 1, 1).expand(B, H, 1, D)
        kf = k.to(self.page_min.dtype)
        self.page_min.scatter_reduce_(2, at, kf, "amin")
        self.page_max.scatter_reduce_(2, at, kf, "amax")

    def reserve(self, capacity: int, like: torch.Tensor) -> None:
        """Hold the bounds of every page of a ``capacity``-token store ``like`` [B, H_kv, capacity, D]
        (a static decode step's bounds then keep their shape)."""
        B, H, _, D = like.shape
        self._ensure(B, H, D, -(-capacity // self.page_size), like)

    def truncate(self, buffer, row_start: torch.Tensor | None, cache) -> None:
        """Forget the tokens after the ``buffer``'s (a crop truncated it): pages that held a removed
        token are folded again from the kept keys."""
        if self.page_min is None:
            return
        keys = buffer.keys
        length, ps = keys.shape[2], self.page_size
        first = max(0, length - cache.max_row_start) // ps  # first page (of any row) that held a removed token
        self.page_min[:, :, first:] = float("inf")
        self.page_max[:, :, first:] = float("-inf")
        start = min(length, cache.min_row_start + first * ps)  # no row's page `first` starts earlier
        if start < length:  # folding a key twice into a min / max changes nothing
            self.append(keys[:, :, start:], None, start, row_start)

    def count_stored(self, length: int) -> None:
        """(The bounds need no host count.)"""

    def state_tensors(self) -> dict:
        return {"page_min": self.page_min, "page_max": self.page_max}

    def batch_select(self, indices: torch.Tensor) -> None:
        if self.page_min is not None:
            self.page_min = self.page_min.index_select(0, indices.to(self.page_min.device))
            self.page_max = self.page_max.index_select(0, indices.to(self.page_max.device))

    def _ensure(self, B: int, H: int, D: int, pages: int, like: torch.Tensor) -> None:
        if self.page_min is not None and self.page_min.shape[2] >= pages:
            return
        cap = max(self.grow_pages, -(-pages // self.grow_pages) * self.grow_pages)
        new_min = like.new_full((B, H, cap, D), float("inf"))
        new_max = like.new_full((B, H, cap, D), float("-inf"))
        if self.page_min is not None:
            old = self.page_min.shape[2]
            new_min[:, :, :old] = self.page_min
            new_max[:, :, :old] = self.page_max
        self.page_min, self.page_max = new_min, new_max

    def bounds(self, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page_min, page_max)`` of the first ``num_pages`` pages, empty pages as zeros."""
        mn, mx = self.page_min[:, :, :num_pages], self.page_max[:, :, :num_pages]
        empty = torch.isinf(mn)
        return mn.masked_fill(empty, 0.0), mx.masked_fill(empty, 0.0)
