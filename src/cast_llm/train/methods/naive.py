"""Naive retraining (method.md §6): one-shot N:M mask, then training with the mask FIXED.

The run starts from the one-shot pruned model (``--init-mask``: magnitude by default; Wanda, or SparseGPT
with its reconstructed kept weights), and its pruned weights stay exactly 0 throughout: the forward uses
``W ⊙ M`` through autograd's own product, so a pruned entry's gradient is exactly 0, its AdamW moments stay
exactly 0, and AdamW's update of it (``0 / (sqrt(0) + ε)``, decoupled decay of 0) is exactly 0. The mask
never changes (``--mask-interval`` does not apply).

The paper's ablation chain is expressed as configurations of the existing methods:

* naive retraining ............ ``--method naive``             (no teacher by default)
* naive + KD .................. ``--method naive --kd``
* naive + KD + AdamS .......... ``--method cast --fixed-mask --no-scaling``: the same fixed one-shot mask,
  but pruned weights are decayed to 0 by AdamS during training (dense forward) instead of zeroed at once.
"""

from __future__ import annotations

from cast_llm.train.methods.sparse_forward import SparseForwardMethod


class NaiveMethod(SparseForwardMethod):
    name = "naive"
    ste = False  # pruned weights get no gradient at all
    prune_at_start = True

    def prepare_model(self, model, cfg, *, data=None, device=None, start="compute") -> None:
        super().prepare_model(model, cfg, data=data, device=device)
        self.interval = 0  # the mask is fixed by definition

    def build_optimizer(self, model, cfg, total_steps: int):
        import torch

        # plain AdamW (the param groups' extra keys -- name, sparse -- are carried along unused)
        return torch.optim.AdamW(self.weight_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                 eps=cfg.eps, weight_decay=cfg.weight_decay)

    def export_metadata(self, cfg):
        meta = super().export_metadata(cfg)
        meta["training"]["mask_interval"] = 0  # fixed by definition, whatever --mask-interval says
        return meta
