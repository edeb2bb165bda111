"""The observer protocol of the training loop: what an observer receives each step and what it implements.

The loop calls every observer's ``on_step(ctx)`` after each optimizer step with a :class:`StepContext`; an
observer returns a dict of scalars to add to the step's log record (only merged on log steps) or None.
Observers that keep state across steps implement ``state_dict`` / ``load_state_dict`` so that a resumed
run logs exactly what an uninterrupted run would; ``on_end(ctx)`` runs once before the final prune. The
observers themselves live above this module: :mod:`cast_llm.analysis.observers` (per-layer statistics,
weight tracking, ratio histograms) and :mod:`cast_llm.train.observers` (whole-model mask statistics,
validation perplexity).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cast_llm.layers import linear_features

__all__ = ["StepContext", "Observer", "target_weight", "with_masks_applied"]


@dataclass
class StepContext:
    step: int  # optimizer steps done (1-based)
    total_steps: int
    model: torch.nn.Module  # the unwrapped student
    masks_fn: Callable[[], dict[str, torch.Tensor]]  # fqn -> current bool mask, computed on first use
    is_log_step: bool
    run_dir: Path
    is_main: bool
    cfg: Any
    evaluator: Any = None
    _masks: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def masks(self) -> dict[str, torch.Tensor]:
        if self._masks is None:
            self._masks = self.masks_fn()
        return self._masks


class Observer:
    name = "observer"

    def on_step(self, ctx: StepContext) -> dict[str, float] | None:
        return None

    def on_end(self, ctx: StepContext) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def groups_transposed(model, fqn: str, mask: torch.Tensor, m: int) -> bool:
    """Whether target ``fqn``'s N:M groups run along dim 0 (GPT-2 ``Conv1D`` stores ``(in, out)``)."""
    try:
        module = model.get_submodule(fqn)
        while hasattr(module, "base_layer"):  # a training method's wrapper: the layer it holds decides
            module = module.base_layer
        return bool(linear_features(module)[2])
    except (AttributeError, TypeError):  # not a linear we know: the groups run along a dim m divides
        return mask.shape[-1] % m != 0


def target_weight(params: dict[str, torch.nn.Parameter], fqn: str) -> torch.nn.Parameter:
    """The weight Parameter of target ``fqn`` (plain or wrapped in a ``base_layer``)."""
    for key in (f"{fqn}.weight", f"{fqn}.base_layer.weight"):
        if key in params:
            return params[key]
    raise KeyError(f"no weight for target {fqn}")


@torch.no_grad()
def with_masks_applied(model, masks: dict[str, torch.Tensor], fn):
    """Run ``fn(model)`` with the target weights hard-masked, then restore them exactly.

    Only the entries the masks remove are kept aside (half of the targets at 2:4), on the weights' device."""
    params = dict(model.named_parameters())
    removed = {}
    for fqn, mask in masks.items():
        w = target_weight(params, fqn)
        pruned = ~mask.to(w.device)
        removed[fqn] = (pruned, w[pruned].clone())
        w.masked_fill_(pruned, 0.0)
    try:
        return fn(model)
    finally:
        for fqn, (pruned, values) in removed.items():
            target_weight(params, fqn).masked_scatter_(pruned, values)
