"""Wanda one-shot pruning (method.md §6): score ``|W_ij| · ‖X_j‖₂``, keep the top N of every group of M.

Pure tensor math; the calibration (hooks, block-by-block pass) lives in :mod:`cast_llm.prune.blockwise`.
``X_j`` is input feature j over all calibration tokens, so the statistic a layer needs is one number per
input column, the squared norm ``‖X_j‖²`` (summed over tokens; a common scale does not change any ranking).
"""

from __future__ import annotations

import torch

from cast_llm.sparsity.mask import nm_mask


def accumulate_col_sq_norm(col_sq_norm: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Add the squared per-column norms of a batch of inputs ``x`` (tokens, C) to the running sum (C,)."""
    batch = x.float().square().sum(dim=0)  # (C,)
    return batch if col_sq_norm is None else col_sq_norm.add_(batch)


def wanda_scores(weight: torch.Tensor, col_sq_norm: torch.Tensor) -> torch.Tensor:
    """Wanda importance ``|W_ij| · ‖X_j‖₂`` for a weight (R, C) and squared input-column norms (C,)."""
    if col_sq_norm.shape != weight.shape[-1:]:
        raise ValueError(f"col_sq_norm has shape {tuple(col_sq_norm.shape)}, expected ({weight.shape[-1]},)")
    return weight.abs().float() * col_sq_norm.float().clamp_min(0).sqrt()  # (R, C) * (C,) broadcast over rows


def wanda_prune_(weight: torch.Tensor, col_sq_norm: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """Prune ``weight`` (R, C) in place to N:M by Wanda scores; returns the mask (True = kept).

    The weights that survive are left unchanged (Wanda does no reconstruction). Ties, e.g. within a dead
    input column whose norm is 0, are broken by ``nm_mask``'s deterministic rule.
    """
    mask = nm_mask(wanda_scores(weight, col_sq_norm), n, m)
    weight.masked_fill_(~mask, 0.0)
    return mask
