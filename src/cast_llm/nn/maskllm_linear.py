"""MaskLLM's learnable N:M masks (Fang et al., 2024; the MaskLLM baseline of method.md §6).

Every group of ``m`` consecutive input weights of a row chooses one of the ``C(m, n)`` candidate patterns
(6 for 2:4). The choice is a categorical distribution with learnable logits ``ℓ`` (one vector per group).
Training samples a *soft* mask with the Gumbel-softmax::

    z = κ · ℓ                                   (logit scaling: κ grows, the distribution sharpens)
    y = softmax((z + g) / τ),  g ~ Gumbel(0, 1)  (τ anneals: soft early, almost one-hot late)
    M~ = Σ_k y_k · S_k                           (S_k: the k-th candidate pattern, 0/1 of length m)

and the forward uses ``W ⊙ M~`` with the weights ``W`` frozen: only the logits learn. Evaluation (``eval()``)
and export use the hard mask ``S_argmax(ℓ)``, which is exactly N:M by construction.

Choices (ours, documented because the baseline is only named in the paper): the logits of a group start at
0 except the pattern of a one-shot *prior* mask, which starts at ``prior / κ_0`` (so its scaled logit is
``prior``, 3 by default); ``τ`` and ``κ`` are set by the training method every step (linear schedules, see
:class:`cast_llm.train.methods.maskllm.MaskLLMMethod`). MaskLLM's sparse-weight regulariser is not used.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from cast_llm.layers import is_linear_like, linear_features, linear_forward

__all__ = ["MaskLLMLinear", "nm_patterns", "pattern_index"]


def nm_patterns(n: int, m: int) -> torch.Tensor:
    """(C(m, n), m) bool: every way to keep ``n`` of ``m`` entries, in lexicographic order of kept indices."""
    rows = [[j in keep for j in range(m)] for keep in itertools.combinations(range(m), n)]
    return torch.tensor(rows, dtype=torch.bool)


def pattern_index(mask_rows: torch.Tensor, patterns: torch.Tensor) -> torch.Tensor:
    """For an exact N:M mask (R, C) with groups along the last dim: (R, C/m) index of each group's pattern."""
    m = patterns.shape[1]
    weights = 2 ** torch.arange(m, device=mask_rows.device)  # a group's bits -> one integer code
    codes = (mask_rows.unflatten(-1, (-1, m)).long() * weights).sum(-1)  # (R, C/m)
    pattern_codes = (patterns.to(mask_rows.device).long() * weights).sum(-1)  # (K,)
    match = codes.unsqueeze(-1) == pattern_codes  # (R, C/m, K)
    if not bool(match.any(-1).all()):
        raise ValueError("the prior mask is not an exact N:M mask (some group matches no candidate pattern)")
    return match.int().argmax(-1)


class MaskLLMLinear(nn.Module):
    """A frozen ``nn.Linear`` / ``Conv1D`` whose N:M mask is learned by Gumbel-softmax over candidate patterns.

    ``prior`` is a bool N:M mask in the weight's own layout; ``tau`` and ``kappa`` are plain attributes that
    the training method updates every step.
    """

    def __init__(self, base_layer: nn.Module, prior: torch.Tensor, *, n: int = 2, m: int = 4,
                 prior_bonus: float = 3.0, tau: float = 4.0, kappa: float = 100.0):
        super().__init__()
        if not is_linear_like(base_layer):
            raise TypeError(f"MaskLLMLinear wraps nn.Linear or Conv1D, got {type(base_layer).__name__}")
        if kappa <= 0 or tau <= 0:
            raise ValueError(f"tau and kappa must be > 0, got tau={tau}, kappa={kappa}")
        self.base_layer = base_layer
        self.in_features, self.out_features, self.transposed = linear_features(base_layer)
        self.n, self.m = n, m
        self.tau, self.kappa = float(tau), float(kappa)
        weight = base_layer.weight
        patterns = nm_patterns(n, m)
        self.register_buffer("patterns", patterns.to(weight.device), persistent=False)
        rows = prior.t() if self.transposed else prior  # (out, in): groups along the last dim
        idx = pattern_index(rows.to(weight.device), self.patterns)  # (out, in/m)
        logits = torch.zeros(*idx.shape, patterns.shape[0], device=weight.device, dtype=torch.float32)
        logits.scatter_(-1, idx.unsqueeze(-1), prior_bonus / self.kappa)
        self.logits = nn.Parameter(logits)  # (out, in/m, K), fp32 whatever the weight dtype

    @classmethod
    def from_linear(cls, linear: nn.Module, prior: torch.Tensor, *, n: int = 2, m: int = 4,
                    prior_bonus: float = 3.0, tau: float = 4.0, kappa: float = 100.0) -> MaskLLMLinear:
        """Wrap ``linear`` (``nn.Linear`` or ``Conv1D``) with learnable mask logits that start at ``prior``."""
        return cls(linear, prior, n=n, m=m, prior_bonus=prior_bonus, tau=tau, kappa=kappa)

    @property
    def weight(self) -> nn.Parameter:
        return self.base_layer.weight

    def _rows_to_layout(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.t() if self.transposed else rows

    def soft_mask(self) -> torch.Tensor:
        """The mask the forward multiplies with: Gumbel-softmax sample in training, hard argmax in eval."""
        if not self.training:
            return self.hard_mask().to(self.weight.dtype)
        z = self.kappa * self.logits
        # -log(Exp(1)) ~ Gumbel(0, 1); an exponential sample of exactly 0 (u = 0, ~1 in 2^24 per entry: several
        # per step at LLM sizes) would give +inf and a NaN softmax, so it is clamped to the smallest normal
        gumbel = torch.empty_like(z).exponential_().clamp_min_(torch.finfo(z.dtype).tiny).log_().neg_()
        y = F.softmax((z + gumbel) / self.tau, dim=-1)  # (out, in/m, K)
        rows = (y @ self.patterns.to(y.dtype)).flatten(-2)  # (out, in/m, m) -> (out, in)
        return self._rows_to_layout(rows).to(self.weight.dtype)

    @torch.no_grad()
    def hard_mask(self) -> torch.Tensor:
        """bool, the weight's layout: the most likely pattern of every group (exactly N:M)."""
        rows = self.patterns[self.logits.argmax(-1)].flatten(-2)  # (out, in/m, m) -> (out, in)
        return self._rows_to_layout(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.base_layer.weight * self.soft_mask()
        return linear_forward(x, weight, self.base_layer.bias, self.transposed)

    @torch.no_grad()
    def to_linear(self) -> nn.Module:
        """``W ← W ⊙ M_hard`` in place (kept weights bit-identical, pruned exactly 0); returns the base layer."""
        self.base_layer.weight.masked_fill_(~self.hard_mask(), 0.0)
        return self.base_layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, pattern={self.n}:{self.m}, "
                f"candidates={self.patterns.shape[0]}")
