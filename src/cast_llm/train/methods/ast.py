"""AST, the Adaptive Sparse Trainer (Huang et al., AAAI-25; CAST's predecessor, method.md §6).

STE sparse forward ``W ⊙ M`` (as SR-STE), and the decay of pruned weights applied *inside* the Adam update:
added to the momentum signal (never stored in ``μ``), ``v`` built from that signal, and ramped up linearly
over training — AdamS with ``decay_mode="additive"``::

    μ~ = μ + (t/T) λ_W θ   on pruned entries        (μ~ = μ on kept ones; v from μ~²)

plus distillation from the dense model (on by default). λ_W is ``--srste-decay``. Masks are recomputed
from ``|W|`` every ``--mask-interval`` steps before the forward and handed to AdamS with ``set_mask`` (AdamS
itself never recomputes them here, so forward and decay always use the same mask). AST's SLoRB extra
parameters are not part of this baseline.
"""

from __future__ import annotations

from cast_llm.optim import AdamS
from cast_llm.train.methods.sparse_forward import SparseForwardMethod


class ASTMethod(SparseForwardMethod):
    name = "ast"
    ste = True

    def build_optimizer(self, model, cfg, total_steps: int):
        groups = self.weight_groups(model, cfg)
        for g in groups:
            if g["sparse"]:
                g["l1_decay"] = cfg.srste_decay
        opt = AdamS(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, l1_decay=cfg.srste_decay,
                    total_steps=total_steps, mask_interval=0, n=cfg.n, m=cfg.m, weight_decay=cfg.weight_decay,
                    decay_mode="additive")
        self.on_masks_changed(opt, {w.weight: w.mask for w in self.wrappers.values()})
        return opt

    def on_masks_changed(self, optimizer, masks) -> None:
        for p, mask in masks.items():
            optimizer.set_mask(p, mask.clone())  # AdamS keeps its own copy (in its state_dict)

    def export_metadata(self, cfg):
        meta = super().export_metadata(cfg)
        meta["training"]["srste_decay"] = cfg.srste_decay
        return meta
