"""CAST (method.md §5, Algorithm 2): dense forward with learnable weight scaling, AdamS on all parameters,
masks recomputed every ``mask_interval`` steps, KD from the frozen dense model (handled by the loop).

The ablations of method.md §6 are switches of this method:

* ``--no-kd``: no teacher;  ``--no-scaling``: no weight scaling;
* ``--fixed-mask``: AdamS keeps the initial mask (``mask_interval = 0``);
* ``--mask-learner srste``: SR-STE (sparse STE forward + SR-STE decay, AdamW) learns the masks instead of
  AdamS — exactly :class:`~cast_llm.train.methods.srste.SRSTEMethod` with CAST's KD and scaling defaults;
* ``--init-mask wanda|sparsegpt``: AdamS starts from that one-shot mask instead of Eq. 6's.
"""

from __future__ import annotations

import torch

from cast_llm.train.methods.base import TrainingMethod


class CastMethod(TrainingMethod):
    name = "cast"

    def __init__(self):
        self._srste = None  # the SR-STE mask learner, when --mask-learner srste
        self._init_masks = None  # a one-shot mask for AdamS to start from (--init-mask wanda|sparsegpt)

    def prepare_model(self, model, cfg, *, data=None, device=None) -> None:
        from cast_llm.nn import wrap_scaling_
        from cast_llm.targets import find_targets

        if cfg.mask_learner == "srste":
            from cast_llm.train.methods.srste import SRSTEMethod

            self._srste = SRSTEMethod()
            return self._srste.prepare_model(model, cfg, data=data, device=device)
        if cfg.init_mask != "magnitude":  # Eq. 6 is what AdamS computes by itself at its first step
            from cast_llm.train.methods.masks import initial_masks

            self._init_masks = initial_masks(model, cfg, data=data, device=device, apply=False)
        if cfg.use_scaling:
            targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
            fqns = {t.fqn for t in targets}
            wrap_scaling_(model, filter_fn=lambda mod, fqn: fqn in fqns, n_groups=cfg.scale_groups, m=cfg.m)

    def build_optimizer(self, model, cfg, total_steps: int):
        if self._srste is not None:
            return self._srste.build_optimizer(model, cfg, total_steps)
        from cast_llm.optim import AdamS
        from cast_llm.targets import find_targets, param_groups

        targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
        groups = param_groups(model, targets=targets, l1_decay=cfg.l1_decay, weight_decay=cfg.weight_decay)
        self._names = {id(t.weight): t.fqn for t in targets}
        opt = AdamS(
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            l1_decay=cfg.l1_decay,
            total_steps=total_steps,
            mask_interval=cfg.effective_mask_interval,
            n=cfg.n,
            m=cfg.m,
            weight_decay=cfg.weight_decay,
        )
        if self._init_masks is not None:
            for t in targets:
                opt.set_mask(t.weight, self._init_masks[t.fqn])
        return opt

    def begin_step(self, model, optimizer, step: int) -> None:
        if self._srste is not None:
            self._srste.begin_step(model, optimizer, step)

    def current_masks(self, model, optimizer) -> dict[str, torch.Tensor]:
        if self._srste is not None:
            return self._srste.current_masks(model, optimizer)
        return {self._names[id(p)]: mask for p, mask in optimizer.masks().items()}

    def finalize(self, model, optimizer) -> None:
        if self._srste is not None:
            return self._srste.finalize(model, optimizer)
        from cast_llm.nn import fold_scaling_

        optimizer.prune_()  # θ_T ← θ_T ⊙ m_T (Algorithm 1, last line)
        fold_scaling_(model)  # W ← Diag(A)(W ⊙ M): plain nn.Linear again, zero inference overhead

    def export_metadata(self, cfg):
        meta = super().export_metadata(cfg)
        meta["training"]["mask_learner"] = cfg.mask_learner
        if cfg.mask_learner == "srste":
            meta["training"]["srste_decay"] = cfg.srste_decay
        return meta
