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

__all__ = ["packed_popcount", "packed_flips", "LayerCounts", "layer_counts", "count_tensor", "gather_counts"]


def _popcount(x: Tensor) -> Tensor:
    """Number of set bits in a ``uint8`` tensor, as an int64 tensor on its device (no host sync).

    SWAR popcount on the bytes themselves: three shift/mask steps, all in uint8, so there is no int64
    index tensor the size of the input (a 256-entry lookup table would need one).
    """
    if x.dtype != torch.uint8:
        raise TypeError(f"packed_popcount expects uint8, got {x.dtype}")
    x = x - (x >> 1).bitwise_and_(0x55)  # 2-bit counts
    x = x.bitwise_and(0x33) + (x >> 2).bitwise_and_(0x33)  # 4-bit counts
    x = (x + (x >> 4)).bitwise_and_(0x0F)  # 8-bit counts (≤ 8)
    return x.sum(dtype=torch.int64)


def packed_popcount(x: Tensor) -> int:
    """Number of set bits in a ``uint8`` tensor."""
    return int(_popcount(x))


def _flips(a: Tensor, b: Tensor) -> Tensor:
    if a.shape != b.shape:
        raise ValueError(f"packed masks differ in size ({a.numel()} vs {b.numel()} bytes): not the same layer")
    return _popcount(torch.bitwise_xor(a, b.to(a.device)))


def packed_flips(a: Tensor, b: Tensor) -> int:
    """``‖A − B‖₀`` of two masks packed by :func:`~cast_llm.sparsity.mask.pack_mask` from the same shape.

    The padding bits of the last byte are zero in both, so they never count.
    """
    return int(_flips(a, b))


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
def count_tensor(weight: Tensor, cur_packed: Tensor, mask: Tensor, prev_packed: Tensor, initial_packed: Tensor,
                 *, l1_dtype: torch.dtype = torch.float32) -> Tensor:
    """``(flips, initial_flips, kept_l1, total_l1)`` of one layer as a float64 tensor on the weight's device,
    without a host sync (:func:`gather_counts` reads many of them with one). The L1 sums accumulate in
    ``l1_dtype``: float32 by default — torch reduces them pairwise (relative error ~1e-7 even for 1e8
    entries) at a fraction of the cost of a float64 accumulation, which would convert every element first."""
    if mask.shape != weight.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != weight shape {tuple(weight.shape)}")
    mag = weight.detach().abs()
    if l1_dtype == torch.float32:
        mag = mag.float()
        total = mag.sum()
        kept = mag.mul_(mask.to(mag.device)).sum()
    else:
        total = mag.sum(dtype=l1_dtype)
        kept = mag.masked_fill(~mask.to(mag.device), 0).sum(dtype=l1_dtype)
    parts = (_flips(cur_packed, prev_packed), _flips(cur_packed, initial_packed), kept, total)
    return torch.stack([x.to(device=weight.device, dtype=torch.float64) for x in parts])


def gather_counts(numels: list[int], counts: list[Tensor]) -> list[LayerCounts]:
    """:class:`LayerCounts` from :func:`count_tensor` results, read to the host with ONE sync per device
    (one per layer and quantity would stall a GPU a thousand times on a 200-layer model's log step)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, c in enumerate(counts):
        by_device.setdefault(c.device, []).append(i)
    values: list[list[float]] = [[] for _ in counts]
    for idx in by_device.values():
        for i, row in zip(idx, torch.stack([counts[i] for i in idx]).tolist()):
            values[i] = row
    return [LayerCounts(numel=n, flips=int(v[0]), initial_flips=int(v[1]), kept_l1=v[2], total_l1=v[3])
            for n, v in zip(numels, values)]


def layer_counts(weight: Tensor, cur_packed: Tensor, mask: Tensor, prev_packed: Tensor,
                 initial_packed: Tensor) -> LayerCounts:
    """Counts of one layer from its weight, its current mask (bool and packed) and two packed snapshots."""
    counts = count_tensor(weight, cur_packed, mask, prev_packed, initial_packed)
    return gather_counts([weight.numel()], [counts])[0]
