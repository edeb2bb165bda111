"""Whole-model observers of the training loop: mask statistics and validation perplexity, and the default set.

The observer protocol (:class:`~cast_llm.analysis.base.Observer`, :class:`~cast_llm.analysis.base.StepContext`)
lives in :mod:`cast_llm.analysis.base`; the per-layer analysis observers in :mod:`cast_llm.analysis.observers`.
"""

from __future__ import annotations

import torch

from cast_llm.analysis import analysis_observers
from cast_llm.analysis.base import Observer, StepContext, groups_transposed, target_weight, with_masks_applied
from cast_llm.sparsity.mask import pack_mask, unpack_mask
from cast_llm.sparsity.stats import changed_group_rate, flip_rate, initial_flip_rate, sparse_weight_ratio

__all__ = ["Observer", "StepContext", "target_weight", "with_masks_applied", "MaskStats", "ValidationPerplexity",
           "default_observers"]


class MaskStats(Observer):
    """Flip rate, initial flip rate, the share of N:M groups changed since the start, and the sparse-weight
    ratio (method.md §7) on every log step.

    The flip rate of a record counts the mask changes since the previous record (so with the default
    ``log_every == mask_interval`` it is the paper's per-update ``r_t``). Snapshots are kept bit-packed.
    """

    name = "mask_stats"

    def __init__(self):
        self.initial: dict[str, torch.Tensor] | None = None
        self.prev: dict[str, torch.Tensor] | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}

    def on_step(self, ctx: StepContext):
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
        m = int(getattr(ctx.cfg, "m", 4))
        transposed = [groups_transposed(ctx.model, k, c, m) for k, c in zip(names, cur)]
        return {
            "flip_rate": flip_rate(prev, cur),
            "initial_flip_rate": initial_flip_rate(init, cur),
            "changed_groups": changed_group_rate(init, cur, m, transposed),
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
    return [MaskStats(), ValidationPerplexity(), *analysis_observers(cfg)]
