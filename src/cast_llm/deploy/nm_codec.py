"""Compact storage of one N:M sparse weight: the kept values and where they sit (method.md §1).

A weight ``W`` of shape ``(R, C)`` (PyTorch ``nn.Linear`` layout, N:M groups of ``m`` consecutive columns
along the input dimension) keeps exactly ``n`` entries per group. :class:`NMSparseWeight` stores

* ``values``: ``(R, C·n/m)`` in the weight's dtype — the kept entries of every group, in column order;
* ``positions``: where they were, bit-packed (:mod:`cast_llm.deploy.bitpack`), in one of two encodings:

  - ``"index"``: the in-group column of each kept value, ``ceil(log2 m)`` bits each — for 2:4 that is
    2 bits per kept value, 1 bit per weight: fp16 values + indices = 0.5 + 0.0625 = 0.5625 × dense;
  - ``"bitmask"``: 1 bit per weight (the mask itself).

  ``"auto"`` takes the smaller per group (``n·ceil(log2 m)`` vs ``m`` bits), preferring ``"index"`` on a
  tie: 2:4 and 1:4 → index, 4:8 → bitmask (12 vs 8 bits).

Which entries are "kept" comes from the mask when one is given, else from the weight itself
(:func:`cast_llm.sparsity.mask.nm_mask`: the ``n`` largest ``|w|`` of each group, ties by position — for
an N:M-sparse weight that is every non-zero, padded with the first zeros of groups that hold fewer than
``n``). A weight with more than ``n`` non-zeros in a group is refused. Decompression writes exact ``+0.0``
at pruned positions, so a round trip is bit-identical except that a pruned ``-0.0`` comes back as ``+0.0``.

The same code stores integer tensors (quantization codes, :mod:`cast_llm.quant.pack`) when given a mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cast_llm.deploy.bitpack import pack_bits, packed_nbytes, unpack_bits
from cast_llm.errors import CastError
from cast_llm.sparsity.mask import nm_mask, pack_mask, unpack_mask

ENCODINGS = ("auto", "index", "bitmask")


def index_bits(m: int) -> int:
    """Bits needed to name one of ``m`` columns (2 for m = 4)."""
    return max(1, math.ceil(math.log2(m)))


def choose_encoding(n: int, m: int, encoding: str = "auto") -> str:
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    if encoding != "auto":
        return encoding
    return "index" if n * index_bits(m) <= m else "bitmask"


def _kept_positions(groups_mask: torch.Tensor, n: int) -> torch.Tensor:
    """(R, G, m) bool with exactly n True per group -> (R, G, n) int64 in-group columns, ascending."""
    # c[j] = kept entries among columns 0..j; the (k+1)-th kept column is the count of columns with c <= k
    # (no sort, no scatter: n comparisons and sums over m = 4 entries)
    c = groups_mask.to(torch.uint8).cumsum(-1, dtype=torch.uint8)  # (R, G, m)
    return torch.stack([(c <= k).sum(-1) for k in range(n)], dim=-1)


@dataclass
class NMSparseWeight:
    """One N:M sparse 2-D weight in compact form; see the module docstring for the layout."""

    values: torch.Tensor  # (R, C*n/m), the weight's dtype
    positions: torch.Tensor  # 1-D uint8, bit-packed indices or bitmask
    shape: tuple[int, int]  # (R, C) of the dense weight
    n: int
    m: int
    encoding: str  # "index" | "bitmask"

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor,
        n: int = 2,
        m: int = 4,
        *,
        mask: torch.Tensor | None = None,
        encoding: str = "auto",
        name: str = "weight",
    ) -> NMSparseWeight:
        """Compress ``weight`` (R, C). ``mask`` (bool, True = kept, exactly ``n`` per group) overrides the
        magnitude rule; entries outside the mask must be zero either way. ``name`` appears in errors."""
        if weight.dim() != 2:
            raise CastError(f"{name}: expected a 2-D weight, got shape {tuple(weight.shape)}")
        rows, cols = weight.shape
        if cols % m:
            raise CastError(f"{name}: {cols} input columns is not a multiple of m={m}; it cannot be {n}:{m}")
        encoding = choose_encoding(n, m, encoding)
        if mask is None:
            mask = nm_mask(weight, n, m)
        if mask.shape != weight.shape or mask.dtype != torch.bool:
            raise ValueError(f"{name}: mask must be bool of shape {tuple(weight.shape)}")
        groups_mask = mask.view(rows, cols // m, m)  # (R, C) -> (R, G, m)
        if not bool((groups_mask.sum(-1) == n).all()):
            raise ValueError(f"{name}: mask must keep exactly {n} of every {m} columns")
        outside = weight.masked_select(~mask)
        if bool((outside != 0).any()):
            bad = int((weight.view(rows, cols // m, m) != 0).sum(-1).gt(n).sum())
            raise CastError(f"{name} {tuple(weight.shape)} is not {n}:{m} sparse: {bad} group(s) of {m} hold "
                            f"more than {n} non-zeros; prune it first (cast-llm prune) or export --format hf")
        pos = _kept_positions(groups_mask, n)  # (R, G, n)
        values = weight.view(rows, cols // m, m).gather(-1, pos).reshape(rows, cols // m * n)
        if encoding == "index":
            packed = pack_bits(pos.to(torch.uint8), index_bits(m))
        else:
            packed = pack_mask(mask)
        return cls(values.contiguous(), packed, (rows, cols), n, m, encoding)

    def positions_tensor(self) -> torch.Tensor:
        """(R, G, n) int64 in-group columns of the kept values."""
        rows, cols = self.shape
        groups = cols // self.m
        if self.encoding == "index":
            pos = unpack_bits(self.positions, index_bits(self.m), rows * groups * self.n)
            return pos.view(rows, groups, self.n).long()
        mask = unpack_mask(self.positions, (rows, groups, self.m))
        return _kept_positions(mask, self.n)

    def mask(self) -> torch.Tensor:
        """(R, C) bool, True where a value is stored."""
        rows, cols = self.shape
        out = torch.zeros(rows, cols // self.m, self.m, dtype=torch.bool, device=self.values.device)
        out.scatter_(-1, self.positions_tensor().to(out.device), True)
        return out.view(rows, cols)

    def to_dense(self, fill: torch.Tensor | float = 0) -> torch.Tensor:
        """The dense (R, C) weight. Pruned entries get ``fill`` (0; quantization codes use the zero-point)."""
        rows, cols = self.shape
        groups = cols // self.m
        pos = self.positions_tensor().to(self.values.device)
        out = torch.zeros(rows, groups, self.m, dtype=self.values.dtype, device=self.values.device)
        out.scatter_(-1, pos, self.values.view(rows, groups, self.n))
        out = out.view(rows, cols)
        if isinstance(fill, torch.Tensor) or fill != 0:
            out = torch.where(self.mask(), out, torch.as_tensor(fill, dtype=out.dtype, device=out.device))
        return out

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.positions.numel()

    @staticmethod
    def expected_nbytes(shape: tuple[int, int], n: int, m: int, element_size: int, encoding: str = "auto") -> int:
        """Theoretical size: values + packed positions (for fp16 2:4: 0.5625 × the dense bytes)."""
        rows, cols = shape
        kept = rows * cols // m * n
        encoding = choose_encoding(n, m, encoding)
        pos = packed_nbytes(kept, index_bits(m)) if encoding == "index" else packed_nbytes(rows * cols, 1)
        return kept * element_size + pos
