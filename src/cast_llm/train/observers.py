"""Observers: per-step measurements plugged into the training loop without touching it.

The loop calls every observer's ``on_step(ctx)`` after each optimizer step. An observer returns a dict of
scalars to add to the step's log record (only merged on log steps) or None. Observers that keep state
across steps implement ``state_dict`` / ``load_state_dict`` so that a resumed run logs exactly what an
uninterrupted run would; ``on_end(ctx)`` runs once before the final prune.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


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


def target_weight(params: dict[str, torch.nn.Parameter], fqn: str) -> torch.nn.Parameter:
    """The weight Parameter of target ``fqn`` (plain or wrapped in a ``base_layer``)."""
    for key in (f"{fqn}.weight", f"{fqn}.base_layer.weight"):
        if key in params:
            return params[key]
    raise KeyError(f"no weight for target {fqn}")


@torch.no_grad()
def with_masks_applied(model, masks: dict[str, torch.Tensor], fn):
    """Run ``fn(model)`` with the target weights hard-masked, then restore them exactly."""
    params = dict(model.named_parameters())
    saved = {}
    for fqn, mask in masks.items():
        w = target_weight(params, fqn)
        saved[fqn] = w.detach().clone()
        w.mul_(mask.to(w.dtype))
    try:
        return fn(model)
    finally:
        for fqn, w0 in saved.items():
            target_weight(params, fqn).copy_(w0)


class MaskStats(Observer):
    """Flip rate, initial flip rate and sparse-weight ratio (method.md §7) on every log step.

    The flip rate of a record counts the mask changes since the previous record (so with the default
    ``log_every == mask_interval`` it is the paper's per-update ``r_t``). Snapshots are kept bit-packed.
    """

    name = "mask_stats"

    def __init__(self):
        self.initial: dict[str, torch.Tensor] | None = None
        self.prev: dict[str, torch.Tensor] | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}

    def on_step(self, ctx: StepContext):
        from cast_llm.sparsity.mask import pack_mask, unpack_mask
        from cast_llm.sparsity.stats import flip_rate, initial_flip_rate, sparse_weight_ratio

        if self.initial is None:  # the masks of the first step are the pretrained (Eq. 6) ones
            self.shapes = {k: tuple(v.shape) for k, v in ctx.masks.items()}
            self.initial = {k: pack_mask(v) for k, v in ctx.masks.items()}
            self.prev = dict(self.initial)
        if not ctx.is_log_step:
            return None
        names = list(ctx.masks)
        cur = [ctx.masks[k] for k in names]
        prev = [unpack_mask(self.prev[k], self.shapes[k]).to(c.device) for k, c in zip(names, cur)]
        init = [unpack_mask(self.initial[k], self.shapes[k]).to(c.device) for k, c in zip(names, cur)]
        params = dict(ctx.model.named_parameters())
        weights = [target_weight(params, k).detach() for k in names]
        self.prev = {k: pack_mask(ctx.masks[k]) for k in names}
        return {
            "flip_rate": flip_rate(prev, cur),
            "initial_flip_rate": initial_flip_rate(init, cur),
            "sparse_weight_ratio": sparse_weight_ratio(weights, cur),
        }

    def state_dict(self):
        return {"initial": self.initial, "prev": self.prev, "shapes": self.shapes}

    def load_state_dict(self, state):
        self.initial, self.prev, self.shapes = state["initial"], state["prev"], state["shapes"]


class ValidationPerplexity(Observer):
    """Every ``eval_every`` steps: held-out perplexity of the dense in-training model and of the same model
    hard-masked (method.md §7 / the paper's Fig. 4: CAST keeps the dense model healthy)."""

    name = "validation"

    def on_step(self, ctx: StepContext):
        every = ctx.cfg.eval_every
        if not every or ctx.step % every or ctx.step == ctx.total_steps or ctx.evaluator is None:
            return None
        dense = ctx.evaluator.heldout(ctx.model)
        masked = with_masks_applied(ctx.model, ctx.masks, ctx.evaluator.heldout)
        ctx.model.train()
        return {"val_ppl_dense": dense, "val_ppl_masked": masked}


def default_observers(cfg) -> list[Observer]:
    from cast_llm.analysis import analysis_observers  # per-layer stats, weight tracking, ratio histograms

    return [MaskStats(), ValidationPerplexity(), *analysis_observers(cfg)]
