"""Weight tracking on a fixed random sample of target weights (method.md §7; the paper's Table 2).

A seeded sample of ``k`` entries, drawn uniformly over all target weights (so a layer is represented in
proportion to its size), is looked at on every *check* — every step at which masks can change. For each
sampled entry ``j`` we keep its mask bit at the previous check, the step ``s_j`` of its last flip (a
change of the bit between two consecutive checks) and ``|w_j|`` at that check. The summary:

    kept_mean_abs        mean |w_j| over sampled entries kept now                     (paper: CAST 0.142)
    pruned_mean_abs      mean |w_j| over sampled entries pruned now                   (→ 0 under CAST)
    last_flip_mean_abs   mean over entries that flipped at least once of |w_j| at s_j (CAST 0.106, SR-STE 0.006)
    last_flip_progress   mean over the same entries of s_j / T                        (CAST 16.9 %, SR-STE 46.6 %)
    flipped_fraction     share of sampled entries that flipped at least once
    mean_flips           flips per sampled entry

``|w|`` is the raw target weight (before weight scaling, Eq. 11): the quantity the mask is chosen from.
A check sees the weight after the step in which the mask was recomputed, i.e. θ_t rather than the θ_{t-1}
the mask was computed from (Algorithm 1); the difference is one update, ~lr. Entries that never flip are
left out of the two ``last_flip`` means (they have no last flip); ``flipped_fraction`` says how many
entered them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["sample_positions", "TrackerState"]


def sample_positions(numels: list[int], k: int, seed: int) -> list[Tensor]:
    """``k`` distinct entries drawn uniformly from layers of sizes ``numels``, as sorted flat indices per layer.

    Seeded with a private generator (the training RNG is not touched, so enabling tracking never changes
    the data order or a resumed run). Memory is O(k), not O(Σ numels): indices are drawn with
    replacement and deduplicated until ``k`` distinct ones exist, instead of permuting billions of ids.
    """
    total = sum(numels)
    k = min(int(k), total)
    gen = torch.Generator().manual_seed(int(seed))
    if k * 4 >= total:  # dense enough that a permutation is cheap and rejection would loop long
        chosen = torch.randperm(total, generator=gen)[:k]
    else:
        chosen = torch.empty(0, dtype=torch.int64)
        while chosen.numel() < k:
            chosen = torch.unique(torch.cat([chosen, torch.randint(total, (2 * k,), generator=gen)]))
        # the distinct draws are an exchangeable set, so a random k-subset of them is uniform too
        # (taking the k smallest would favour the first layers)
        chosen = chosen[torch.randperm(chosen.numel(), generator=gen)[:k]]
    chosen = chosen.sort().values
    bounds = torch.tensor([0, *numels], dtype=torch.int64).cumsum(0)
    layer = torch.bucketize(chosen, bounds[1:], right=True)  # entry e lies in layer i iff b_i ≤ e < b_{i+1}
    return [chosen[layer == i] - bounds[i] for i in range(len(numels))]


class TrackerState:
    """Per-entry flip history of the sampled weights; ``update`` once per check, ``summary`` any time.

    All tensors live on the CPU and have ``k`` entries, so the state is a few hundred kB at most and goes
    into checkpoints as it is (exact resume).
    """

    def __init__(self):
        self.mask: Tensor | None = None  # bool (k,): mask bits at the last check
        self.abs: Tensor | None = None  # float32 (k,): |w| at the last check
        self.last_flip_step: Tensor | None = None  # int64 (k,), -1 = never flipped
        self.abs_at_last_flip: Tensor | None = None  # float32 (k,)
        self.flips: Tensor | None = None  # int32 (k,)
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.checks = 0

    def update(self, step: int, abs_w: Tensor, mask: Tensor) -> None:
        """Record the sampled ``|w|`` (float, (k,)) and mask bits (bool, (k,)) seen at ``step``."""
        abs_w = abs_w.detach().to("cpu", torch.float32)
        mask = mask.detach().to("cpu", torch.bool)
        if abs_w.shape != mask.shape or abs_w.dim() != 1:
            raise ValueError(f"need two (k,) tensors, got {tuple(abs_w.shape)} and {tuple(mask.shape)}")
        if self.mask is None:  # the first check only sets the reference bits: nothing can have flipped yet
            k = mask.numel()
            self.last_flip_step = torch.full((k,), -1, dtype=torch.int64)
            self.abs_at_last_flip = torch.zeros(k, dtype=torch.float32)
            self.flips = torch.zeros(k, dtype=torch.int32)
            self.first_step = step
        else:
            if mask.shape != self.mask.shape:
                raise ValueError(f"sample size changed from {self.mask.numel()} to {mask.numel()}")
            flipped = mask != self.mask
            self.last_flip_step[flipped] = step
            self.abs_at_last_flip[flipped] = abs_w[flipped]
            self.flips += flipped.to(torch.int32)
        self.mask, self.abs = mask.clone(), abs_w.clone()
        self.last_step = step
        self.checks += 1

    def current_means(self) -> tuple[float | None, float | None]:
        """(mean |w| of sampled kept entries, of sampled pruned entries) at the last check."""
        if self.mask is None:
            return None, None
        return _mean(self.abs[self.mask]), _mean(self.abs[~self.mask])

    def summary(self, total_steps: int) -> dict[str, Any]:
        """The Table 2 numbers (module docstring); None where a mean has no entries."""
        kept, pruned = self.current_means()
        out: dict[str, Any] = {"sample_size": 0 if self.mask is None else self.mask.numel(), "checks": self.checks,
                               "first_step": self.first_step, "last_step": self.last_step,
                               "kept_mean_abs": kept, "pruned_mean_abs": pruned, "last_flip_mean_abs": None,
                               "last_flip_progress": None, "flipped_fraction": None, "mean_flips": None}
        if self.mask is None:
            return out
        ever = self.last_flip_step >= 0
        out.update(
            last_flip_mean_abs=_mean(self.abs_at_last_flip[ever]),
            last_flip_progress=_mean(self.last_flip_step[ever].double() / total_steps),
            flipped_fraction=float(ever.double().mean()),
            mean_flips=float(self.flips.double().mean()),
        )
        return out

    _FIELDS = ("mask", "abs", "last_flip_step", "abs_at_last_flip", "flips", "first_step", "last_step", "checks")

    def state_dict(self) -> dict[str, Any]:
        return {f: (v.clone() if isinstance(v, Tensor) else v) for f in self._FIELDS for v in [getattr(self, f)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in self._FIELDS:
            v = state[f]
            setattr(self, f, v.clone() if isinstance(v, Tensor) else v)


def _mean(x: Tensor) -> float | None:
    if x.numel() == 0:
        return None
    v = float(x.double().mean())
    return None if math.isnan(v) else v
