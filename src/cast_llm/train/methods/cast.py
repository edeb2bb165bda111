"""CAST (method.md §5, Algorithm 2): dense forward with learnable weight scaling, AdamS on all parameters,
masks recomputed every ``mask_interval`` steps, KD from the frozen dense model (handled by the loop)."""

from __future__ import annotations

import torch

from cast_llm.train.methods.base import TrainingMethod


class CastMethod(TrainingMethod):
    name = "cast"

    def prepare_model(self, model, cfg) -> None:
        from cast_llm.nn import wrap_scaling_
        from cast_llm.targets import find_targets

        if cfg.scaling:
            targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
            fqns = {t.fqn for t in targets}
            wrap_scaling_(model, filter_fn=lambda mod, fqn: fqn in fqns, n_groups=cfg.scale_groups, m=cfg.m)

    def build_optimizer(self, model, cfg, total_steps: int):
        from cast_llm.optim import AdamS
        from cast_llm.targets import find_targets, param_groups

        targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
        groups = param_groups(model, targets=targets, l1_decay=cfg.l1_decay, weight_decay=cfg.weight_decay)
        self._names = {id(t.weight): t.fqn for t in targets}
        return AdamS(
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            l1_decay=cfg.l1_decay,
            total_steps=total_steps,
            mask_interval=cfg.mask_interval,
            n=cfg.n,
            m=cfg.m,
            weight_decay=cfg.weight_decay,
        )

    def current_masks(self, model, optimizer) -> dict[str, torch.Tensor]:
        return {self._names[id(p)]: mask for p, mask in optimizer.masks().items()}

    def finalize(self, model, optimizer) -> None:
        from cast_llm.nn import fold_scaling_

        optimizer.prune_()  # θ_T ← θ_T ⊙ m_T (Algorithm 1, last line)
        fold_scaling_(model)  # W ← Diag(A)(W ⊙ M): plain nn.Linear again, zero inference overhead
