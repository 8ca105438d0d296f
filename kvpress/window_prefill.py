"""The dense prefill of a :class:`~kvpress.window_layers.SinkWindowLayer` in chunks (DuoAttention's
chunked pre-filling; one chunk per forward without ``prefill_chunk``), and the chunk an open prompt's
forward ends in, held for the next piece (`PolicyCache.prompt`). See ``SinkWindowLayer``'s doc."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .attention import dense_causal_attention, streaming_attention


class ChunkedPrefill:
    """Runs a forward of several tokens for a dense-prefill ``layer`` (its slots, tail sums and
    ``seen`` are the layer's) and holds what an open prompt's last chunk needs.

    ``held``: phase -> the first sequence index of the chunk an open prompt's forward ended in, per
    group of rows whose chunks start at indices = phase (mod ``chunk``); ``held_k`` / ``held_v``:
    every row's tokens from ``held_from``, the earliest such start.
    """

    def __init__(self, layer, chunk: int | None):
        self.layer = layer
        self.chunk = chunk
        self.held: dict[int, int] = {}
        self.held_from = 0
        self.held_k = self.held_v = None

    def state_tensors(self) -> dict:
        return {} if self.held_k is None else {"_held_k": self.held_k, "_held_v": self.held_v}

    def groups(self, row_start) -> list[tuple[int, torch.Tensor | None]]:
        """``(phase, rows)``: rows whose chunks start at sequence indices ``phase`` (mod the chunk);
        ``rows`` None for one group of every row. Read on the host once per row-start tensor (a
        later prompt piece may extend a row's padding, `PolicyCache._extend_padding`)."""
        layer = self.layer
        size = self.chunk
        if size is None or row_start is None:
            return [(0, None)]
        key = ("sink_window_chunk_groups", size, row_start.device)
        cached = layer.cache.shared.get(key)
        if cached is not None and cached[0] is row_start:  # (the reference keeps its id unique)
            return cached[1]
        phases = (row_start % size).tolist()
        distinct = sorted(set(phases))
        if len(distinct) == 1:
            groups = [(distinct[0], None)]
        else:
            groups = [(ph, torch.tensor([r for r, x in enumerate(phases) if x == ph], device=row_start.device))
                      for ph in distinct]
        layer.cache.shared[key] = (row_start, groups)
        return groups

    @contextmanager
    def only_rows(self, rows: torch.Tensor | None, row_start: torch.Tensor):
        """Run a group of rows as if the batch held only them: slots, tail sums and row starts are
        taken out for the block and written back after it (``rows`` None: every row, no copy)."""
        layer = self.layer
        if rows is None:
            yield row_start
            return
        full = (layer.k, layer.v, layer.pos)
        layer.k, layer.v, layer.pos = (t.index_select(0, rows) for t in full)
        tail = None if layer.tail is None else layer.tail.state_tensors()
        if tail is not None and tail["tail_k_sum"] is not None:
            for name, t in tail.items():
                setattr(layer.tail, name, t.index_select(0, rows))
        layer._rows_row_start = row_start.index_select(0, rows)
        try:
            yield layer._rows_row_start
        finally:
            for t, sub in zip(full, (layer.k, layer.v, layer.pos)):
                t.index_copy_(0, rows, sub)
            layer.k, layer.v, layer.pos = full
            layer._rows_row_start = None
            if tail is not None:
                layer.tail.merge_rows(rows, tail, layer.k.shape[0])

    def attend(self, q, k_new, v_new, scaling, row_start):
        """Several tokens with ``dense_prefill``: each chunk (see the class doc) sees the kept
        slots and its own earlier tokens; groups of rows whose chunks start elsewhere run one after
        the other. In an open prompt (`PolicyCache.prompt`) a chunk the forward ends in is held, not
        stored, so the next forward continues the same chunk."""
        layer = self.layer
        groups = self.groups(layer.row_start)
        phases = {phase for phase, _ in groups}
        self.held = {ph: st for ph, st in self.held.items() if ph in phases}  # rows whose padding grew moved
        seen = layer.seen
        if len(groups) == 1:
            out = self.loop(q, k_new, v_new, scaling, row_start, groups[0][0], None)
        else:
            out = q.new_empty(q.shape)
            for phase, rows in groups:
                layer.seen = seen
                with self.only_rows(rows, row_start) as sub_start:
                    part = self.loop(q.index_select(0, rows), k_new.index_select(0, rows),
                                     v_new.index_select(0, rows), scaling, sub_start, phase, rows)
                out.index_copy_(0, rows, part)
        # keep every row's tokens from the earliest chunk still open (none: nothing held)
        if self.held:
            first = min(self.held.values())
            k_h, v_h = (k_new, v_new) if self.held_k is None else (torch.cat([self.held_k, k_new], dim=2),
                                                                    torch.cat([self.held_v, v_new], dim=2))
            from_ = seen if self.held_k is None else self.held_from
            self.held_k, self.held_v, self.held_from = k_h[:, :, first - from_:], v_h[:, :, first - from_:], first
        else:
            self.held_k = self.held_v = None
        return out

    def held_rows(self, start: int, rows: torch.Tensor | None):
        """Held keys / values from sequence index ``start`` of these rows (all: None)."""
        k, v = self.held_k[:, :, start - self.held_from:], self.held_v[:, :, start - self.held_from:]
        return (k, v) if rows is None else (k.index_select(0, rows), v.index_select(0, rows))

    def loop(self, q, k_new, v_new, scaling, row_start, phase: int, rows):
        """The chunks of one group of rows (chunks start at indices ``phase`` mod the chunk size)."""
        layer = self.layer
        n_new = k_new.shape[2]
        size = self.chunk
        outs, a = [], 0
        while a < n_new:
            b = n_new if size is None else min(n_new, a + size - ((layer.seen - phase) % size))
            q_c, k_c, v_c = q[:, :, a:b], k_new[:, :, a:b], v_new[:, :, a:b]
            start = self.held.pop(phase, None)
            k_h = v_h = None
            if start is None:
                start = layer.seen
            elif start < layer.seen:  # the chunk's tokens from the prompt's earlier forwards
                k_h, v_h = self.held_rows(start, rows)
            k_all = k_c if k_h is None else torch.cat([k_h, k_c], dim=2)  # the chunk so far
            v_all = v_c if v_h is None else torch.cat([v_h, v_c], dim=2)
            if start == 0:
                outs.append(dense_causal_attention(q_c, k_all, v_all, scaling, q_start=layer.seen,
                                                   row_start=layer.row_start))
            else:
                k_s, v_s, pos_s = layer.k, layer.v, layer._visible_pos(row_start)
                if k_h is not None:
                    held = torch.arange(start, layer.seen, device=k_c.device).expand(k_c.shape[0], -1)
                    held = torch.where(held >= row_start[:, None], held, -1)
                    k_s, v_s = torch.cat([k_s, k_h], dim=2), torch.cat([v_s, v_h], dim=2)
                    pos_s = torch.cat([pos_s, held], dim=1)
                # a window covering the slots and the whole chunk: every kept slot and every
                # earlier token of the chunk is visible (causally)
                outs.append(streaming_attention(
                    q_c, k_s, v_s, pos_s, k_c, v_c, scaling,
                    q_start=layer.seen, row_start=row_start, sinks=layer.sinks, window=layer.seen + (b - a),
                    tail=layer.tail.means() if layer.tail is not None and layer.tail.chunks else None,
                ))
            layer.seen += b - a
            if layer.cache.prompt_open and not (size is not None and (layer.seen - phase) % size == 0):
                self.held[phase] = start
            else:
                self.write_at(start, k_all, v_all, row_start)
            a = b
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def write_at(self, start: int, k, v, row_start) -> None:
        """``_write`` of tokens at sequence indices ``start ..`` (``seen`` already past them)."""
        layer = self.layer
        seen, layer.seen = layer.seen, start
        layer._write(k, v, row_start)
        layer.seen = seen

    def end_prompt(self) -> None:
        layer = self.layer
        if not self.held:
            return
        row_start = layer._row_start(layer.k.shape[0], layer.k.device)
        for phase, rows in self.groups(layer.row_start):
            start = self.held.pop(phase, None)
            if start is None:
                continue
            k, v = self.held_rows(start, rows)  # the prompt's last chunk of these rows
            with self.only_rows(rows, row_start) as sub_start:
                self.write_at(start, k, v, sub_start)
        self.held = {}
        self.held_k = self.held_v = None
