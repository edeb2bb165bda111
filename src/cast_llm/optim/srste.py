"""AdamW with the SR-STE decay on pruned weights (Zhou et al., 2021; the SR-STE baseline of method.md §6).

SR-STE trains with a sparse forward ``W ⊙ M`` and a straight-through gradient to all of ``W``
(:func:`cast_llm.nn.sparse_forward.ste_masked`), and regularises the entries the mask currently prunes by
adding ``λ_W (1 − M) ⊙ W`` to their gradient::

    g~ = g + λ_W (1 − M) ⊙ W           (pruned entries only; kept entries get g)
    AdamW step on g~                    (so the decay also enters the moments, unlike AdamS / AST)

This optimizer only adds that term and then runs ``torch.optim.AdamW`` unchanged, so it matches AdamW
exactly when ``λ_W = 0``. The masks are *not* owned here: they are the bool ``mask`` buffers of the model's
sparse-forward wrappers, passed as callables that return the current buffer, so the optimizer reads the
buffer the model holds at each step — also after ``model.to(device)`` or ``accelerator.prepare`` replaced it
(a tensor captured at construction would stay on the old device, with the old mask). The decay is added
after gradient clipping and accumulation, once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["SRSTEAdamW"]


class SRSTEAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` plus ``srste_decay · (1 − M) ⊙ W`` on the gradient of every masked parameter.

    Args:
        params: parameters or param groups, as for AdamW.
        masks: ``{parameter: mask}``, the mask a bool tensor of the parameter's shape (True = kept) or a
            zero-argument callable returning it (read at every step: pass ``lambda: module.mask`` when the
            model may be moved after the optimizer is built).
        srste_decay: λ_W (SR-STE paper: 2e-4).
        **adamw: lr, betas, eps, weight_decay, ... as for ``torch.optim.AdamW``.
    """

    def __init__(self, params: Iterable[Any], masks: Mapping[Tensor, Tensor | Callable[[], Tensor]],
                 srste_decay: float = 2e-4, **adamw: Any) -> None:
        if isinstance(srste_decay, bool) or not math.isfinite(srste_decay) or srste_decay < 0:
            raise ValueError(f"srste_decay must be a finite number >= 0, got {srste_decay!r}")
        super().__init__(params, **adamw)
        managed = {id(p) for g in self.param_groups for p in g["params"]}
        for p, mask in masks.items():
            if id(p) not in managed:
                raise ValueError(f"a masked parameter of shape {tuple(p.shape)} is not in the optimizer")
            _check_mask(p, mask() if callable(mask) else mask)
        self.srste_decay = float(srste_decay)
        # a list: parameters hash by identity, but keep the order stable
        self._masks = [(p, m if callable(m) else (lambda m=m: m)) for p, m in masks.items()]

    def masks(self) -> dict[Tensor, Tensor]:
        return {p: get() for p, get in self._masks}

    @torch.no_grad()
    def add_srste_decay_(self) -> None:
        """``g ← g + λ_W (1 − M) ⊙ W`` for every masked parameter that has a gradient."""
        if self.srste_decay == 0:
            return
        for p, get in self._masks:
            if p.grad is not None:
                mask = get()
                if mask.device != p.device:
                    raise RuntimeError(f"SR-STE: the mask of a parameter of shape {tuple(p.shape)} is on "
                                       f"{mask.device}, the parameter on {p.device}: pass the mask as a "
                                       "callable (lambda: module.mask) so the optimizer reads the moved buffer")
                # a multiply, not add_(alpha=λ): torch rounds alpha to float32 on some CPU paths
                p.grad.add_(torch.where(mask, 0.0, p).mul_(self.srste_decay))

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.add_srste_decay_()
        super().step()
        return loss


def _check_mask(p: Tensor, mask: Tensor) -> None:
    if not torch.is_tensor(mask) or mask.dtype != torch.bool or mask.shape != p.shape:
        got = f"{mask.dtype} {tuple(mask.shape)}" if torch.is_tensor(mask) else type(mask).__name__
        raise ValueError(f"mask for a parameter of shape {tuple(p.shape)} must be bool of that shape, got {got}")
