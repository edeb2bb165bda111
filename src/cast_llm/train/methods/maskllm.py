"""MaskLLM (Fang et al., NeurIPS 2024; method.md §6): learn the N:M masks only, weights frozen.

Every target becomes a :class:`~cast_llm.nn.MaskLLMLinear`: per group of ``m`` weights, logits over the
``C(m, n)`` candidate patterns (6 for 2:4), sampled with the Gumbel-softmax in the forward. Every other
parameter of the model is frozen, so the final model's kept weights are bit-identical to the dense ones.

Schedules (MaskLLM's, linear in the step, set before every step's forward so a resumed run sees the same):
temperature ``τ`` from ``--maskllm-tau`` start → end (4 → 0.05), logit scaling ``κ`` from
``--maskllm-kappa`` start → end (100 → 500). Prior: the ``--init-mask`` pattern of every group starts with a
scaled-logit bonus ``--maskllm-prior`` (3). The logits are trained by AdamW (no weight decay) at
``--maskllm-lr`` (default 10 × ``--lr``: logits need a far larger step than weights, as in MaskLLM) with the
run's schedule. Final mask: the argmax pattern of every group. No KD by default.
"""

from __future__ import annotations

import torch

from cast_llm.layers import set_submodule
from cast_llm.nn import MaskLLMLinear
from cast_llm.train.methods.base import TrainingMethod
from cast_llm.train.methods.masks import initial_masks, mask_keys


class MaskLLMMethod(TrainingMethod):
    name = "maskllm"

    def prepare_model(self, model, cfg, *, data=None, device=None, start="compute") -> None:
        priors = initial_masks(model, cfg, data=data, device=device, apply=False)
        model.requires_grad_(False)  # weights frozen: only the mask logits learn
        self.tau, self.kappa = cfg.schedule("maskllm_tau"), cfg.schedule("maskllm_kappa")
        self.wrappers = {}
        for fqn, prior in priors.items():
            wrapper = MaskLLMLinear.from_linear(model.get_submodule(fqn), prior, n=cfg.n, m=cfg.m,
                                                prior_bonus=cfg.maskllm_prior, tau=self.tau[0],
                                                kappa=self.kappa[0])
            set_submodule(model, fqn, wrapper)
            self.wrappers[fqn] = wrapper
        self.keys = mask_keys(model, {fqn: w.weight for fqn, w in self.wrappers.items()})

    def build_optimizer(self, model, cfg, total_steps: int):
        self.total_steps = total_steps
        logits = [w.logits for w in self.wrappers.values()]
        lr = cfg.maskllm_lr if cfg.maskllm_lr is not None else 10 * cfg.lr
        return torch.optim.AdamW([{"name": "mask_logits", "params": logits}], lr=lr,
                                 betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.0)

    def begin_step(self, model, optimizer, step: int) -> None:
        progress = step / max(self.total_steps - 1, 1)  # 0 at the first step, 1 at the last
        tau = self.tau[0] + (self.tau[1] - self.tau[0]) * progress
        kappa = self.kappa[0] + (self.kappa[1] - self.kappa[0]) * progress
        for w in self.wrappers.values():
            w.tau, w.kappa = tau, kappa

    def current_masks(self, model, optimizer) -> dict[str, torch.Tensor]:
        return {self.keys[fqn]: w.hard_mask() for fqn, w in self.wrappers.items()}

    @torch.no_grad()
    def finalize(self, model, optimizer, *, out=None, is_main=True):
        for fqn, w in self.wrappers.items():
            set_submodule(model, fqn, w.to_linear())  # W ← W ⊙ M_argmax; kept weights untouched
        model.requires_grad_(True)
        return model

    def export_metadata(self, cfg):
        meta = super().export_metadata(cfg)
        meta["training"].update(maskllm_tau=cfg.maskllm_tau, maskllm_kappa=cfg.maskllm_kappa,
                                maskllm_prior=cfg.maskllm_prior)
        del meta["training"]["mask_interval"]
        return meta
