"""Sparse forward ``y = x (W ⊙ M)ᵀ + b`` for the baselines of method.md §6 (naive retraining, SR-STE, AST).

CAST itself never masks in the forward (§5). The baselines do, in two flavours that differ only in the
backward pass:

* ``ste=False`` — the plain product ``W ⊙ M``: autograd gives pruned entries a gradient of exactly 0, so
  with zeroed pruned weights and Adam(W) they stay exactly 0 forever and their optimizer state stays 0
  too (naive retraining: the mask is fixed and the weights under it never move).
* ``ste=True`` — the straight-through estimator: the forward uses ``W ⊙ M`` but the backward passes the
  gradient of the *masked* weight to *every* entry of the dense ``W`` (SR-STE, AST), so pruned weights keep
  learning and can win their place back when the mask is recomputed from ``|W|``.

:class:`SparseForwardLinear` wraps an ``nn.Linear`` / GPT-2 ``Conv1D`` or a :class:`ScaledLinear` (CAST
with ``--mask-learner srste``: the scale is constant inside every N:M group, so masking before or after
scaling is the same). The mask is a persistent bool buffer in the weight's own layout, so it is part of the
model's ``state_dict`` and a checkpoint resumes it exactly. :meth:`SparseForwardLinear.to_linear` prunes
the weight in place and returns the wrapped layer, so the exported model has the original module types and
``state_dict`` keys.
"""

from __future__ import annotations

import torch
from torch import nn

from cast_llm.layers import is_linear_like, linear_features, linear_forward, set_submodule
from cast_llm.nn.scaled_linear import ScaledLinear

__all__ = ["SparseForwardLinear", "ste_masked", "wrap_sparse_forward_", "unwrap_sparse_forward_"]


class _StraightThroughMask(torch.autograd.Function):
    """forward ``W ⊙ M``; backward: the incoming gradient, unmasked, to every entry of ``W``."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, weight, 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def ste_masked(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``W ⊙ M`` whose gradient w.r.t. ``W`` is the dense straight-through gradient (SR-STE)."""
    return _StraightThroughMask.apply(weight, mask)


class SparseForwardLinear(nn.Module):
    """A linear layer whose forward uses its weight masked by a fixed-shape N:M ``mask`` buffer.

    ``base_layer`` is the wrapped ``nn.Linear`` / ``Conv1D`` / :class:`ScaledLinear` (kept, as in peft, so
    its parameters keep their objects); ``mask`` is bool in the weight's own layout (``(in, out)`` for
    Conv1D), True = kept. Replace the mask contents in place (``mask.copy_(new)``) to change it.
    """

    def __init__(self, base_layer: nn.Module, mask: torch.Tensor, *, ste: bool):
        super().__init__()
        if not (isinstance(base_layer, ScaledLinear) or is_linear_like(base_layer)):
            raise TypeError(f"SparseForwardLinear wraps nn.Linear, Conv1D or ScaledLinear, got "
                            f"{type(base_layer).__name__}")
        weight = base_layer.weight
        if mask.dtype != torch.bool or tuple(mask.shape) != tuple(weight.shape):
            raise ValueError(f"mask must be bool of the weight's shape {tuple(weight.shape)}, "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        self.base_layer = base_layer
        self.ste = ste
        self.in_features, self.out_features, self.transposed = linear_features(base_layer)
        self.register_buffer("mask", mask.to(weight.device).clone(), persistent=True)

    @classmethod
    def from_linear(cls, linear: nn.Module, mask: torch.Tensor, *, ste: bool) -> SparseForwardLinear:
        """Wrap ``linear`` (``nn.Linear``, ``Conv1D`` or :class:`ScaledLinear`) with the bool ``mask`` (its
        weight's layout, True = kept)."""
        return cls(linear, mask, ste=ste)

    @property
    def weight(self) -> nn.Parameter:
        """The dense (unmasked, unscaled) weight Parameter."""
        return self.base_layer.weight

    def masked_weight(self) -> torch.Tensor:
        w = self.base_layer.weight
        # naive: autograd's own product, so pruned entries get a zero gradient; SR-STE: dense gradient
        w = ste_masked(w, self.mask) if self.ste else torch.where(self.mask, w, 0.0)
        inner = self.base_layer
        if isinstance(inner, ScaledLinear):  # Diag(A)(W ⊙ M): A is constant inside every N:M group
            w = inner._scale_weight(w, inner.scale).to(inner.weight.dtype)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.masked_weight()
        return linear_forward(x, weight, self.base_layer.bias, self.transposed)

    @torch.no_grad()
    def to_linear(self) -> nn.Module:
        """Prune the weight in place (``W ← W ⊙ M``, exact +0.0) and return the wrapped layer."""
        self.base_layer.weight.masked_fill_(~self.mask, 0.0)
        return self.base_layer

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, ste={self.ste}"


def wrap_sparse_forward_(model: nn.Module, masks: dict[str, torch.Tensor], *, ste: bool) -> dict[str, SparseForwardLinear]:
    """Replace each module named in ``masks`` (fqn -> bool mask in its weight's layout) by a
    :class:`SparseForwardLinear`; returns ``{fqn: wrapper}``. All wrappers are built before any is
    installed, so a bad mask leaves the model untouched."""
    planned = {fqn: SparseForwardLinear.from_linear(model.get_submodule(fqn), mask, ste=ste)
               for fqn, mask in masks.items()}
    for fqn, wrapper in planned.items():
        set_submodule(model, fqn, wrapper)
    return planned


def unwrap_sparse_forward_(model: nn.Module) -> list[str]:
    """Prune and unwrap every :class:`SparseForwardLinear` of ``model`` in place; returns their fqns."""
    found = [(fqn, mod) for fqn, mod in model.named_modules() if isinstance(mod, SparseForwardLinear)]
    for fqn, mod in found:
        set_submodule(model, fqn, mod.to_linear())
    return [fqn for fqn, _ in found]
