"""The running batch's KV cache, kept in one preallocated buffer per layer between steps.

:class:`BatchKv` holds the keys and values of every sequence that decodes together, one row
each, ``[rows, kv_heads, capacity, head_dim]`` per layer. The rows are right-aligned at
column :attr:`BatchKv.width`: row ``i`` holds its ``lengths[i]`` tokens in columns
``width - lengths[i] .. width`` and zeros before them (left padding, which the decode
step's attention mask hides). A decode step writes every row's new keys and values into
column ``width`` in place (:func:`buffer_layer_class`), so a step copies no cache: the earlier
engine padded every sequence's own cache to the longest, concatenated them, let
``transformers`` concatenate the new token on, and cut each row back out -- three copies of
the whole cache and hundreds of small tensor ops per step.

The rows change only when sequences join or leave (:meth:`BatchKv.rebuild`: one copy of the
rows that stay, trimmed to the longest of them). The buffer grows by at most half its width
at a time (at least 16 columns) and never past the last column any row can still need (its
reserved prompt + ``max_tokens``), so it stays within ``rows x`` (the longest row + the
most tokens any row may still add).

Pure torch, synchronous: :mod:`flashpoint.models.generate` drives it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# The fewest columns a growing buffer adds (a short batch grows rarely, not every step).
MIN_GROWTH = 16


@dataclass(frozen=True)
class RowSource:
    """Where one row of a new batch comes from: row ``row`` of ``layers`` (per layer
    ``(keys, values)``, ``[rows, kv_heads, columns, head_dim]``), its ``length`` tokens
    starting at column ``start``; ``end`` is how many tokens it may hold in all (prompt +
    ``max_tokens``: what the buffer never needs to pass)."""

    layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
    row: int
    start: int
    length: int
    end: int


class BatchKv:
    """See the module docstring. Build with :meth:`rebuild`."""

    def __init__(self, buffers: list[tuple[torch.Tensor, torch.Tensor]], width: int,
                 lengths: list[int], ends: list[int]) -> None:
        self.buffers = buffers
        self.width = width
        self.lengths = lengths
        self.ends = ends

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        """Columns allocated per row."""
        return int(self.buffers[0][0].shape[2]) if self.buffers else 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes the buffers hold (padding and headroom included)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in self.buffers)

    def _limit(self) -> int:
        """The most columns any row can still need: its last token's column, right-aligned."""
        return max(self.width + end - n for n, end in zip(self.lengths, self.ends, strict=True))

    @classmethod
    def rebuild(cls, rows: Sequence[RowSource]) -> BatchKv | None:
        """A new batch of ``rows`` (None when there are none), right-aligned at their
        longest, with room to grow (module docstring). One copy of each row's tokens."""
        if not rows:
            return None
        width = max(r.length for r in rows)
        need = max(width + r.end - r.length for r in rows)
        capacity = min(need, width + max(MIN_GROWTH, width // 2))
        capacity = max(capacity, width + 1)  # room for the next decode step at least
        first = rows[0].layers
        buffers = []
        for layer in range(len(first)):
            k0, v0 = first[layer]
            keys = k0.new_zeros((len(rows), k0.shape[1], capacity, k0.shape[3]))
            values = v0.new_zeros((len(rows), v0.shape[1], capacity, v0.shape[3]))
            buffers.append((keys, values))
        # rows that come from one source with the same span move in one indexed copy (the
        # batch's own rows on a leave); the others one by one (a padded prefill's rows)
        groups: dict[tuple[int, int, int], tuple[Sequence[Any], list[int], list[int]]] = {}
        for dst, r in enumerate(rows):
            key = (id(r.layers), r.start, r.length)
            groups.setdefault(key, (r.layers, [], []))
            groups[key][1].append(r.row)
            groups[key][2].append(dst)
        device = first[0][0].device
        for (_, start, length), (layers, src_rows, dst_rows) in groups.items():
            src = torch.tensor(src_rows, device=device)
            dst = torch.tensor(dst_rows, device=device)
            for (keys, values), (k, v) in zip(buffers, layers, strict=True):
                keys[dst, :, width - length:width] = k[src, :, start:start + length]
                values[dst, :, width - length:width] = v[src, :, start:start + length]
        return cls(buffers, width, [r.length for r in rows], [r.end for r in rows])

    def sources(self, keep: Sequence[int]) -> list[RowSource]:
        """Rows ``keep`` of this batch, as sources for :meth:`rebuild`."""
        return [RowSource(self.buffers, i, self.width - self.lengths[i], self.lengths[i],
                          self.ends[i]) for i in keep]

    # -- one decode step ------------------------------------------------------------------
    def decode_inputs(self, tokens: int = 1) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The attention mask ``[rows, width + tokens]`` (zeros over each row's padding), the
        position ids ``[rows, tokens]`` (from each row's own length) and a ``transformers``
        cache that appends the pass's keys and values in place. Call :meth:`advanced` after
        the pass. ``tokens`` > 1: every row takes that many new tokens in one pass (a parked
        prefix extended with the tokens its source generated since, live migration)."""
        from transformers import DynamicCache

        if self.width + tokens > self.capacity:
            self._grow(tokens)
        device = self.buffers[0][0].device
        lengths = torch.tensor(self.lengths, device=device)
        columns = torch.arange(self.width + tokens, device=device)
        mask = (columns[None, :] >= (self.width - lengths)[:, None]).long()
        positions = lengths[:, None] + torch.arange(tokens, device=device)[None, :]
        layer = buffer_layer_class()
        cache = DynamicCache()
        cache.layers = [layer(k, v, self.width) for k, v in self.buffers]
        return mask, positions, cache

    def advanced(self, tokens: int = 1) -> None:
        """The pass wrote ``tokens`` tokens per row (from column ``width``)."""
        self.width += tokens
        self.lengths = [n + tokens for n in self.lengths]

    def _grow(self, tokens: int = 1) -> None:
        capacity = max(self.width + tokens,
                       min(self._limit(), self.width + max(MIN_GROWTH, self.width // 2)))
        grown = []
        for keys, values in self.buffers:
            k = keys.new_zeros((*keys.shape[:2], capacity, keys.shape[3]))
            v = values.new_zeros((*values.shape[:2], capacity, values.shape[3]))
            k[:, :, :self.width].copy_(keys[:, :, :self.width])
            v[:, :, :self.width].copy_(values[:, :, :self.width])
            grown.append((k, v))
        self.buffers = grown


@functools.cache
def buffer_layer_class() -> type:
    """The ``transformers`` cache layer over one layer's buffers, for one forward pass:
    ``update`` writes the new keys and values into the preallocated buffer after column
    ``width`` and returns views of the filled columns (no concatenation, no allocation).
    Defined on first use: it subclasses a ``transformers`` class, which this module does
    not import until a decode step needs it."""
    from transformers.cache_utils import DynamicLayer

    class BufferLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
            super().__init__()
            self._k_buf, self._v_buf, self._width = keys, values, width
            self.keys, self.values = keys[:, :, :width], values[:, :, :width]
            self.device = keys.device
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                   *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            end = self._width + key_states.shape[-2]
            self._k_buf[:, :, self._width:end].copy_(key_states)
            self._v_buf[:, :, self._width:end].copy_(value_states)
            self._width = end
            self.keys, self.values = self._k_buf[:, :, :end], self._v_buf[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._width

    return BufferLayer
