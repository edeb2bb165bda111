"""Token streams on disk, and the fixed-length windows a run trains and evaluates on.

A :class:`TokenStream` is a sequence of binary shards (``uint16`` or ``uint32`` token ids, memory-mapped:
the pages a run touches are read, nothing else is held); :class:`Sequences` views a stream as ``(N, L)``
windows and hands out ``int64`` batches, so that no rank keeps a whole corpus as ``int64`` in memory.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import numpy as np
import torch

__all__ = ["TokenStream", "Sequences"]


class TokenStream:
    """The concatenation of token arrays (memory-mapped shards or in-memory arrays), read by position."""

    def __init__(self, parts: Sequence[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + len(p))

    def __len__(self) -> int:
        return self.starts[-1]

    @classmethod
    def concat(cls, *streams: TokenStream) -> TokenStream:
        return cls([p for s in streams for p in s.parts])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as one array (a view when they lie in one shard)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) outside a stream of {len(self)}")
        if start == stop:
            return np.zeros(0, dtype=self.parts[0].dtype if self.parts else np.int64)
        i = bisect.bisect_right(self.starts, start) - 1
        pieces = []
        while start < stop:
            lo = start - self.starts[i]
            hi = min(stop, self.starts[i + 1]) - self.starts[i]
            pieces.append(self.parts[i][lo:hi])
            start += hi - lo
            i += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class Sequences:
    """``count`` windows of ``seq_len`` tokens of a stream, from window ``first`` on; indexing gives int64."""

    def __init__(self, stream: TokenStream, seq_len: int, count: int, first: int = 0):
        if (first + count) * seq_len > len(stream):
            raise ValueError(f"{count} windows of {seq_len} from window {first} exceed a stream of {len(stream)}")
        self.stream, self.seq_len, self.count, self.first = stream, seq_len, count, first

    @property
    def shape(self) -> tuple[int, int]:
        return (self.count, self.seq_len)

    def __len__(self) -> int:
        return self.count

    def head(self, n: int) -> Sequences:
        """The first ``n`` windows (all of them when fewer)."""
        return Sequences(self.stream, self.seq_len, min(n, self.count), self.first)

    def _row(self, i: int) -> np.ndarray:
        if not -self.count <= i < self.count:
            raise IndexError(f"window {i} of {self.count}")
        i = (i % self.count) + self.first
        return self.stream.read(i * self.seq_len, (i + 1) * self.seq_len)

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, (int, np.integer)):
            return torch.from_numpy(self._row(int(key)).astype(np.int64))
        if isinstance(key, slice):
            start, stop, step = key.indices(self.count)
            if step == 1:
                a = self.stream.read((self.first + start) * self.seq_len, (self.first + max(start, stop)) * self.seq_len)
                return torch.from_numpy(a.astype(np.int64)).view(-1, self.seq_len)
            key = range(start, stop, step)
        if isinstance(key, torch.Tensor):
            key = key.tolist()
        rows = [self._row(int(i)) for i in key]
        if not rows:
            return torch.zeros(0, self.seq_len, dtype=torch.long)
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.count):
            yield self[i]

    def to_tensor(self) -> torch.Tensor:
        """All the windows as one ``(N, L)`` int64 tensor."""
        return self[:]
