"""``|pruned| / |kept|`` magnitude ratios inside N:M groups (method.md §7; the paper's Fig. 3).

For a group ``g`` (``M`` consecutive entries of a row along the input dimension, §1) with mask ``M_g``:

    ρ_g = max_{j ∈ g, M_j = 0} |W_j|  /  min_{j ∈ g, M_j = 1} |W_j|

— the largest pruned magnitude over the smallest kept one, i.e. the group's *flip margin*. Under a
magnitude mask (Eq. 6) computed from the same weights ρ_g ≤ 1, and ρ_g = 1 means the group is on the verge
of swapping an entry; ρ_g → 0 means the pruned entries have decayed away relative to the kept ones, so
the final hard prune ``W ⊙ M`` barely changes the group. Proportional decay (AdamS, Eq. 7) pushes every
ρ_g towards 0 by the end; additive decay (SR-STE) leaves a tail of groups with ρ_g near 1 (Fig. 3).
Edge cases: ``0/0 := 0`` (a group that is all zeros has nothing left to prune), ``x/0 = inf`` (counted
as overflow). Between mask updates, or under a fixed or non-magnitude mask (naive retraining, Wanda), ρ_g
can exceed 1.

Histograms are stored twice: linear bins on ``[0, LIN_MAX]`` (the paper-style view) and bins of
``log10 ρ`` on ``[LOG_MIN, LOG_MAX]`` (which resolves how *far* below 1 the pruned weights went).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cast_llm.config import parse_hist_steps

__all__ = ["group_ratios", "RatioHistogram", "parse_hist_steps", "resolve_hist_steps"]

LIN_BINS, LIN_MAX = 200, 2.0  # bin width 0.01
LOG_BINS, LOG_MIN, LOG_MAX = 140, -6.0, 1.0  # 20 bins per decade, 1e-6 … 10


@torch.no_grad()
def group_ratios(weight: Tensor, mask: Tensor, m: int, *, transposed: bool = False) -> Tensor:
    """ρ_g of every N:M group of ``weight`` under ``mask`` (module docstring), as a flat float32 tensor.

    ``transposed``: the weight is stored ``(in, out)`` (GPT-2 ``Conv1D``), so groups run along dim 0.
    """
    if mask.shape != weight.shape or mask.dtype != torch.bool:
        raise ValueError(f"need a bool mask of the weight's shape {tuple(weight.shape)}, "
                         f"got {mask.dtype} {tuple(mask.shape)}")
    w, keep = (weight.t(), mask.t()) if transposed else (weight, mask)
    if w.shape[-1] % m:
        raise ValueError(f"group dim of size {w.shape[-1]} is not a multiple of m={m}")
    mag = w.detach().abs().float().reshape(-1, m)  # (R, C) -> (R·C/m, m): one row per group
    keep = keep.to(mag.device).reshape(-1, m)
    pruned_max = mag.masked_fill(keep, 0.0).amax(dim=1)  # |w| ≥ 0, so 0 is a neutral fill for max
    kept_min = mag.masked_fill(~keep, math.inf).amin(dim=1)
    ratio = pruned_max / kept_min
    return torch.where(pruned_max == 0, torch.zeros_like(ratio), ratio)  # 0/0 := 0; x/0 stays inf


@dataclass
class RatioHistogram:
    """Histogram of ρ over all groups of all layers at one step; accumulate layer by layer with ``add``."""

    step: int
    progress: float  # step / total steps
    lin_counts: Tensor = field(default_factory=lambda: torch.zeros(LIN_BINS, dtype=torch.int64))
    lin_overflow: int = 0  # ρ > LIN_MAX (inf included)
    log_counts: Tensor = field(default_factory=lambda: torch.zeros(LOG_BINS, dtype=torch.int64))
    log_underflow: int = 0  # ρ < 10^LOG_MIN (exact zeros included)
    log_overflow: int = 0  # ρ > 10^LOG_MAX
    groups: int = 0
    nonfinite: int = 0  # ρ = inf (a kept entry of |w| = 0 beside a non-zero pruned one)
    finite_sum: float = 0.0  # Σ ρ over finite ρ, for the mean

    def add(self, ratios: Tensor) -> None:
        r = ratios.detach().float().reshape(-1)
        self.groups += r.numel()
        finite = torch.isfinite(r)
        self.nonfinite += int((~finite).sum())
        self.finite_sum += float(r[finite].sum(dtype=torch.float64))
        in_lin = r <= LIN_MAX  # inf and nan compare False
        self.lin_overflow += int((~in_lin).sum())
        self.lin_counts += torch.histc(r[in_lin], LIN_BINS, 0.0, LIN_MAX).to(torch.int64).cpu()
        lo, hi = 10.0 ** LOG_MIN, 10.0 ** LOG_MAX
        self.log_underflow += int((r < lo).sum())
        self.log_overflow += int((~(r <= hi)).sum())
        mid = r[(r >= lo) & (r <= hi)]
        self.log_counts += torch.histc(mid.log10(), LOG_BINS, LOG_MIN, LOG_MAX).to(torch.int64).cpu()

    @property
    def mean(self) -> float | None:
        finite = self.groups - self.nonfinite
        return self.finite_sum / finite if finite else None

    def fraction_below(self, x: float) -> float | None:
        """Share of groups with ρ < x, read off the linear bins (exact when x is a bin edge)."""
        if not self.groups:
            return None
        nb = round(x / LIN_MAX * LIN_BINS)
        return float(self.lin_counts[:nb].sum()) / self.groups

    def quantile(self, q: float) -> float | None:
        """The q-quantile of ρ, read off the bins: the linear ones (to ±0.005) from 0.1 up, the log ones
        (to ±6 %) below 0.1, where CAST's ratios end; 0.0 when it lies below 1e-6, inf beyond 2."""
        if not self.groups:
            return None
        target = torch.tensor(q * self.groups, dtype=torch.float64)
        idx = int(torch.searchsorted(self.lin_counts.cumsum(0).double(), target))
        if idx >= LIN_BINS:
            return math.inf
        if (idx + 1) * LIN_MAX / LIN_BINS > 0.1:
            return (idx + 0.5) * LIN_MAX / LIN_BINS
        if self.log_underflow >= target:
            return 0.0
        cum = self.log_underflow + self.log_counts.cumsum(0).double()
        j = min(int(torch.searchsorted(cum, target)), LOG_BINS - 1)
        return 10.0 ** (LOG_MIN + (j + 0.5) * (LOG_MAX - LOG_MIN) / LOG_BINS)

    def summary(self) -> dict:
        return {"step": self.step, "progress": self.progress, "groups": self.groups, "mean": self.mean,
                "median": self.quantile(0.5), "p90": self.quantile(0.9),
                "below_1e-6": self.log_underflow / self.groups if self.groups else None,
                "below_0.1": self.fraction_below(0.1), "above_0.5": _minus(1.0, self.fraction_below(0.5)),
                "overflow_above_2": self.lin_overflow}

    def state_dict(self) -> dict:
        return {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_state_dict(cls, state: dict) -> RatioHistogram:
        return cls(**state)


def _minus(a: float, b: float | None) -> float | None:
    return None if b is None else a - b


def resolve_hist_steps(spec: str, total_steps: int) -> list[int]:
    """The distinct steps in [1, total_steps] named by ``spec`` (fractions rounded to the nearest step)."""
    steps = set()
    for item in filter(None, parse_hist_steps(spec).split(",")):
        s = round(float(item) * total_steps) if "." in item else int(item)
        s = max(s, 1)  # a tiny fraction of a short run still means "early", not "never"
        if s <= total_steps:  # steps past the end of this run are dropped
            steps.add(s)
    return sorted(steps)
