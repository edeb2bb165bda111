"""Whole-model observers of the training loop: mask statistics and validation perplexity, and the default set.

The observer protocol (:class:`~cast_llm.analysis.base.Observer`, :class:`~cast_llm.analysis.base.StepContext`)
lives in :mod:`cast_llm.analysis.base`; the per-layer analysis observers in :mod:`cast_llm.analysis.observers`.
"""

from __future__ import annotations

import torch

from cast_llm.analysis import analysis_observers
from cast_llm.analysis.base import Observer, StepContext, groups_transposed, target_weight, with_masks_applied
from cast_llm.analysis.layers import count_tensor, gather_counts
from cast_llm.sparsity.mask import pack_mask, unpack_mask
from cast_llm.sparsity.stats import changed_group_counts

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
        params = dict(ctx.model.named_parameters())
        current = {k: pack_mask(ctx.masks[k]) for k in names}
        # flips counted on the packed snapshots (XOR + popcount, nothing unpacked), L1 sums in float64 as
        # sparse_weight_ratio() forms them; every layer's numbers come to the host in one sync
        counts = gather_counts([ctx.masks[k].numel() for k in names], [
            count_tensor(target_weight(params, k), current[k], ctx.masks[k], self.prev[k], self.initial[k],
                         l1_dtype=torch.float64) for k in names])
        self.prev = current
        size = sum(c.numel for c in counts)
        kept, total = sum(c.kept_l1 for c in counts), sum(c.total_l1 for c in counts)
        # the share of N:M groups whose kept set differs from the first mask (one more transfer, all layers)
        m = ctx.cfg.m
        cur = [ctx.masks[k] for k in names]
        init = [unpack_mask(self.initial[k], self.shapes[k]).to(c.device) for k, c in zip(names, cur)]
        transposed = [groups_transposed(ctx.model, k, c, m) for k, c in zip(names, cur)]
        changed, groups = changed_group_counts(init, cur, m, transposed)
        return {
            "flip_rate": sum(c.flips for c in counts) / size,
            "initial_flip_rate": sum(c.initial_flips for c in counts) / size,
            "changed_groups": changed.reshape(1).tolist()[0] / groups,
            "sparse_weight_ratio": 1.0 if total == 0.0 else kept / total,
        }

    def state_dict(self):
        return {"initial": self.initial, "prev": self.prev, "shapes": self.shapes}

    def load_state_dict(self, state):
        self.initial, self.prev, self.shapes = state["initial"], state["prev"], state["shapes"]


class ValidationPerplexity(Observer):
    """Every ``eval_every`` steps: validation perplexity of the dense in-training model and of the same model
    hard-masked (method.md §7 / the paper's Fig. 4: CAST keeps the dense model healthy)."""

    name = "validation"

    def on_step(self, ctx: StepContext):
        every = ctx.cfg.eval_every
        if not every or ctx.step % every or ctx.step == ctx.total_steps or ctx.evaluator is None:
            return None
        dense = ctx.evaluator.validation(ctx.model)
        masked = with_masks_applied(ctx.model, ctx.masks, ctx.evaluator.validation)
        ctx.model.train()
        return {"val_ppl_dense": dense, "val_ppl_masked": masked}


def default_observers(cfg) -> list[Observer]:
    return [MaskStats(), ValidationPerplexity(), *analysis_observers(cfg)]
