"""Per-layer mask-learning statistics (method.md §7), computed on bit-packed mask snapshots.

For one target layer ``k`` the three §7 quantities without the sum over layers:

    flip rate            r_t^k = ‖M_t^k − M_{t'}^k‖₀ / (R_k·C_k)     t' = the previous record
    initial flip rate    i_t^k = ‖M_t^k − M_0^k‖₀   / (R_k·C_k)
    sparse-weight ratio  S_t^k = ‖W_t^k ⊙ M_t^k‖₁ / ‖W_t^k‖₁

Snapshots are kept packed (1 bit per entry, :func:`~cast_llm.sparsity.mask.pack_mask`), and flips are
counted on the packed bytes directly (XOR + popcount), so no snapshot is ever unpacked: memory is 1/8 of
a bool copy, and the count touches 1/8 of the bytes. Pure functions: nothing is modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["packed_popcount", "packed_flips", "LayerCounts", "layer_counts"]


def packed_popcount(x: Tensor) -> int:
    """Number of set bits in a ``uint8`` tensor.

    SWAR popcount on the bytes themselves: three shift/mask steps, all in uint8, so there is no int64
    index tensor the size of the input (a 256-entry lookup table would need one).
    """
    if x.dtype != torch.uint8:
        raise TypeError(f"packed_popcount expects uint8, got {x.dtype}")
    x = x - (x >> 1).bitwise_and_(0x55)  # 2-bit counts
    x = x.bitwise_and(0x33) + (x >> 2).bitwise_and_(0x33)  # 4-bit counts
    x = (x + (x >> 4)).bitwise_and_(0x0F)  # 8-bit counts (≤ 8)
    return int(x.sum(dtype=torch.int64))


def packed_flips(a: Tensor, b: Tensor) -> int:
    """``‖A − B‖₀`` of two masks packed by :func:`~cast_llm.sparsity.mask.pack_mask` from the same shape.

    The padding bits of the last byte are zero in both, so they never count.
    """
    if a.shape != b.shape:
        raise ValueError(f"packed masks differ in size ({a.numel()} vs {b.numel()} bytes): not the same layer")
    return packed_popcount(torch.bitwise_xor(a, b.to(a.device)))


@dataclass(frozen=True)
class LayerCounts:
    """Raw counts of one layer at one record; rates are ratios of these (sums of them across layers give
    exactly the aggregate statistics of :mod:`cast_llm.sparsity.stats`)."""

    numel: int
    flips: int  # ‖M_t − M_{t'}‖₀
    initial_flips: int  # ‖M_t − M_0‖₀
    kept_l1: float  # ‖W ⊙ M‖₁
    total_l1: float  # ‖W‖₁

    @property
    def flip_rate(self) -> float:
        return self.flips / self.numel

    @property
    def initial_flip_rate(self) -> float:
        return self.initial_flips / self.numel

    @property
    def sparse_weight_ratio(self) -> float:
        return 1.0 if self.total_l1 == 0.0 else self.kept_l1 / self.total_l1  # as sparse_weight_ratio()


@torch.no_grad()
def layer_counts(weight: Tensor, cur_packed: Tensor, mask: Tensor, prev_packed: Tensor,
                 initial_packed: Tensor) -> LayerCounts:
    """Counts of one layer from its weight, its current mask (bool and packed) and two packed snapshots."""
    if mask.shape != weight.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != weight shape {tuple(weight.shape)}")
    # float32 sums: torch reduces them pairwise (relative error ~1e-7 even for 1e8 entries) at a fraction
    # of the cost of a float64 accumulation, which would convert every element first
    mag = weight.detach().abs().float()
    total = float(mag.sum())
    kept = float(mag.mul_(mask.to(mag.device)).sum())
    return LayerCounts(
        numel=weight.numel(),
        flips=packed_flips(cur_packed, prev_packed),
        initial_flips=packed_flips(cur_packed, initial_packed),
        kept_l1=kept,
        total_l1=total,
    )
