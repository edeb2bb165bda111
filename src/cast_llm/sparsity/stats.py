"""Mask-learning statistics of method.md §7, aggregated over many layers.

    flip rate            r_t = Σ_k ‖M_t^k − M_{t−1}^k‖₀ / Σ_k R_k·C_k
    initial flip rate    i_t = Σ_k ‖M_t^k − M_0^k‖₀   / Σ_k R_k·C_k
    changed groups       g_t = share of all N:M groups whose kept set differs from M_0's    (ours)
    sparse-weight ratio  S_t = Σ_k ‖W_t^k ⊙ M_t^k‖₁ / Σ_k ‖W_t^k‖₁      (→ 1 when pruned weights vanish)

Every function takes one tensor or a sequence of tensors (one per layer, any shapes) and returns a
Python float. The sums run over all layers before dividing, so a large layer weighs more than a small one,
as in the paper. ``‖M_t − M_{t−1}‖₀`` counts changed entries: under N:M a swap inside a group (one entry
pruned, another kept) counts as 2. Masks are bool tensors (True = kept) in the weight's own layout; a
bit-packed mask from :func:`~cast_llm.sparsity.mask.pack_mask` must be unpacked first (its padding makes
its size ambiguous). Pure functions: nothing is modified.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["mask_flips", "flip_rate", "initial_flip_rate", "changed_groups", "changed_group_counts",
           "changed_group_rate", "l1_mass",
           "sparse_weight_ratio"]

TensorOrSeq = Tensor | Sequence[Tensor]


def _as_list(x: TensorOrSeq, what: str) -> list[Tensor]:
    items = [x] if isinstance(x, Tensor) else list(x)
    for t in items:
        if not isinstance(t, Tensor):
            raise TypeError(f"{what}: expected tensors, got {type(t).__name__}")
    return items


def _pairs(a: TensorOrSeq, b: TensorOrSeq, names: tuple[str, str], bool_sides: tuple[bool, bool]):
    la, lb = _as_list(a, names[0]), _as_list(b, names[1])
    if len(la) != len(lb):
        raise ValueError(f"{names[0]} has {len(la)} tensors but {names[1]} has {len(lb)}; pass one per layer")
    for i, (x, y) in enumerate(zip(la, lb)):
        if x.shape != y.shape:
            raise ValueError(f"layer {i}: {names[0]} shape {tuple(x.shape)} != {names[1]} shape {tuple(y.shape)}")
        for t, name, must_be_bool in ((x, names[0], bool_sides[0]), (y, names[1], bool_sides[1])):
            if must_be_bool and t.dtype != torch.bool:
                raise TypeError(f"layer {i}: {name} must be a bool mask, got {t.dtype} (unpack_mask() a packed one)")
    return list(zip(la, lb))


def mask_flips(prev: TensorOrSeq, cur: TensorOrSeq) -> int:
    """Σ_k ‖M_cur^k − M_prev^k‖₀: how many entries changed between two sets of masks."""
    total = 0
    for p, c in _pairs(prev, cur, ("prev", "cur"), (True, True)):
        total += int(torch.ne(p.to(c.device), c).sum())
    return total


def _rate(a: TensorOrSeq, b: TensorOrSeq, names: tuple[str, str]) -> float:
    pairs = _pairs(a, b, names, (True, True))
    size = sum(c.numel() for _, c in pairs)
    if size == 0:
        raise ValueError("no mask entries: pass at least one non-empty mask")
    return mask_flips([p for p, _ in pairs], [c for _, c in pairs]) / size


def flip_rate(prev: TensorOrSeq, cur: TensorOrSeq) -> float:
    """``r_t`` (§7): fraction of all mask entries that changed since the previous mask update."""
    return _rate(prev, cur, ("prev", "cur"))


def initial_flip_rate(initial: TensorOrSeq, cur: TensorOrSeq) -> float:
    """``i_t`` (§7): fraction of all mask entries that differ from the initial masks ``M_0``."""
    return _rate(initial, cur, ("initial", "cur"))


def changed_groups(initial: TensorOrSeq, cur: TensorOrSeq, m: int,
                   transposed: bool | Sequence[bool] = False) -> tuple[int, int]:
    """``(changed, total)``: how many N:M groups of ``m`` keep a different set of entries in ``cur`` than in
    ``initial``, out of all groups. Groups run along the last dim (dim 0 where ``transposed``, per layer).

    Unlike ``i_t``, a group counts once whether one of its kept entries was swapped or all of them: this is
    the share of the model whose sparsity pattern the training actually moved."""
    changed, total = changed_group_counts(initial, cur, m, transposed)
    return int(changed), total


def changed_group_counts(initial: TensorOrSeq, cur: TensorOrSeq, m: int,
                         transposed: bool | Sequence[bool] = False) -> tuple[Tensor, int]:
    """:func:`changed_groups` with the count left on the masks' device as a 0-d tensor (no host sync; a caller
    reads it with its other numbers)."""
    pairs = _pairs(initial, cur, ("initial", "cur"), (True, True))
    flags = [transposed] * len(pairs) if isinstance(transposed, bool) else list(transposed)
    if len(flags) != len(pairs):
        raise ValueError(f"transposed has {len(flags)} entries for {len(pairs)} layers")
    counts, total = [], 0
    for (a, b), t in zip(pairs, flags):
        a, b = (a.t(), b.t()) if t else (a, b)
        if a.shape[-1] % m:
            raise ValueError(f"a mask of shape {tuple(a.shape)} has no groups of {m} along its N:M dim")
        diff = torch.ne(a.to(b.device), b).reshape(*a.shape[:-1], a.shape[-1] // m, m).any(-1)
        counts.append(diff.sum().to(counts[0].device if counts else diff.device))
        total += diff.numel()
    return (torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)), total


def changed_group_rate(initial: TensorOrSeq, cur: TensorOrSeq, m: int,
                       transposed: bool | Sequence[bool] = False) -> float:
    """``g_t``: the share of N:M groups whose kept set differs from ``initial`` (see :func:`changed_groups`)."""
    changed, total = changed_groups(initial, cur, m, transposed)
    if total == 0:
        raise ValueError("no mask entries: pass at least one non-empty mask")
    return changed / total


@torch.no_grad()
def sparse_weight_ratio(weights: TensorOrSeq, masks: TensorOrSeq) -> float:
    """``S_t`` (§7): share of the total L1 weight mass held by kept entries, Σ‖W⊙M‖₁ / Σ‖W‖₁.

    Sums run in float64. If every weight is exactly zero the ratio is defined as 1.0 (no mass is
    outside the masks).
    """
    kept, total = l1_mass(weights, masks)
    return 1.0 if total == 0.0 else kept / total


def l1_mass(weights: TensorOrSeq, masks: TensorOrSeq) -> tuple[float, float]:
    """``(Σ‖W⊙M‖₁, Σ‖W‖₁)`` in float64: the two sums of ``S_t``, for callers that add them up across
    processes (pass each rank's local shards) before dividing."""
    kept = 0.0
    total = 0.0
    for w, msk in _pairs(weights, masks, ("weights", "masks"), (False, True)):
        mag = w.detach().abs()
        total += float(mag.sum(dtype=torch.float64))
        kept += float(mag.masked_fill(~msk.to(w.device), 0).sum(dtype=torch.float64))
    return kept, total
