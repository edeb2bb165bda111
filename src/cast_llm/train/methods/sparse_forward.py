"""Shared shell of the methods that mask in the forward (naive retraining, SR-STE, AST; method.md §6).

Each N:M target is wrapped in a :class:`~cast_llm.nn.sparse_forward.SparseForwardLinear` holding its mask
as a model buffer (so the model checkpoint carries it); subclasses choose the backward (plain product or
straight-through), the optimizer and when masks change. Optional weight scaling (``--scaling``) wraps the
layer first, so the scale sits inside the sparse forward: ``Diag(A)(W ⊙ M)``.
"""

from __future__ import annotations

import torch

from cast_llm.nn import fold_scaling_, wrap_scaling_
from cast_llm.nn.sparse_forward import unwrap_sparse_forward_, wrap_sparse_forward_
from cast_llm.sparsity.mask import magnitude_mask
from cast_llm.targets import find_targets, param_groups
from cast_llm.train.methods.base import TrainingMethod
from cast_llm.train.methods.masks import initial_masks, mask_keys, refresh_due


class SparseForwardMethod(TrainingMethod):
    ste = True  # straight-through gradient to pruned weights (False: they get exactly 0)
    prune_at_start = False  # start from the one-shot pruned model instead of the dense weights

    def prepare_model(self, model, cfg, *, data=None, device=None, start="compute") -> None:
        masks = initial_masks(model, cfg, data=data, device=device, apply=self.prune_at_start)
        if cfg.use_scaling:
            wrap_scaling_(model, filter_fn=lambda mod, fqn: fqn in masks, n_groups=cfg.scale_groups, m=cfg.m)
        self.wrappers = wrap_sparse_forward_(model, masks, ste=self.ste)
        self.keys = mask_keys(model, {fqn: w.weight for fqn, w in self.wrappers.items()})
        self.n, self.m = cfg.n, cfg.m
        self.interval = cfg.effective_mask_interval

    def weight_groups(self, model, cfg) -> list[dict]:
        """Param groups (sparse targets / dense / no-decay), as for AdamS, on the wrapped model."""
        weights = {id(w.weight) for w in self.wrappers.values()}
        targets = [t for t in _inner_targets(model, cfg) if id(t.weight) in weights]
        return param_groups(model, targets=targets, weight_decay=cfg.weight_decay)

    @torch.no_grad()
    def refresh_masks_(self) -> dict[torch.Tensor, torch.Tensor]:
        """Eq. 6 from the current dense weights into every mask buffer; returns ``{weight: mask}``."""
        out = {}
        for w in self.wrappers.values():
            w.mask.copy_(magnitude_mask(w.weight, w.transposed, self.n, self.m))
            out[w.weight] = w.mask
        return out

    def begin_step(self, model, optimizer, step: int) -> None:
        if refresh_due(step, self.interval):
            self.on_masks_changed(optimizer, self.refresh_masks_())

    def on_masks_changed(self, optimizer, masks: dict[torch.Tensor, torch.Tensor]) -> None:
        """Tell the optimizer (if it keeps its own copy of the masks)."""

    def current_masks(self, model, optimizer) -> dict[str, torch.Tensor]:
        return {self.keys[fqn]: w.mask for fqn, w in self.wrappers.items()}

    def finalize(self, model, optimizer, *, out=None, is_main=True):
        unwrap_sparse_forward_(model)  # W ← W ⊙ M (exact zeros), original module types back
        fold_scaling_(model)  # then W ← Diag(A) W: the zeros stay zeros
        return model


def _inner_targets(model, cfg):
    # find_targets descends into the sparse-forward wrappers and reports the layers (or ScaledLinears) inside
    return find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
