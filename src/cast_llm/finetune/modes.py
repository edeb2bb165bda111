"""The fine-tuning modes' common base, a :class:`~cast_llm.train.methods.base.TrainingMethod` of the one
training loop, and ``dense`` (ordinary full fine-tuning). The other modes live in their own modules
(``lora``, ``sparse``); the registry is :data:`cast_llm.finetune.MODES`.

What a mode adds to the training-method hooks: ``check_input`` (is the model N:M where the mode needs it?)
and ``keeps_nm`` (whether the exported model must be N:M: checked at every checkpoint and at the end).
The optimizer of every mode is AdamW on the trainable parameters; the task's loss comes from the job.
"""

from __future__ import annotations

import torch

from cast_llm.deploy.export import format_sparsity_report, verify_nm
from cast_llm.errors import CastError
from cast_llm.targets import find_targets
from cast_llm.train.methods.base import TrainingMethod


def param_groups(model, weight_decay: float) -> list[dict]:
    """Trainable parameters; decoupled weight decay on matrices only (not on norms, biases)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class FinetuneMode(TrainingMethod):
    name = "base"
    keeps_nm = True  # the exported model must be N:M (and so must the input model)

    @property
    def method_name(self) -> str:
        return f"{self.name}-finetune"

    def uses_kd(self, cfg) -> bool:
        return False

    def check_input(self, rows, cfg) -> None:
        """Refuse, in one line that shows its sparsity, a model that is not N:M when the mode keeps N:M."""
        bad = [r for r in rows if not r.is_nm]
        if self.keeps_nm and bad:
            worst = ", ".join(f"{r.name} {r.sparsity:.1%} zero" for r in bad[:2])
            raise CastError(
                f"--mode {self.name} keeps an N:M model N:M, but {cfg.model} is not {cfg.n}:{cfg.m}: "
                f"{format_sparsity_report(rows, n=cfg.n, m=cfg.m)} (e.g. {worst}); make it {cfg.n}:{cfg.m} "
                "first (cast-llm train, or cast-llm prune --method magnitude) or use --mode dense")

    def prepare_model(self, model, cfg, *, data=None, device=None, start="compute"):
        self.cfg = cfg
        self.targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
        return self.prepare(model, self.targets, cfg)

    def prepare(self, model, targets, cfg):
        """Wrap the model for this mode (adapters, masks); returns the model to train."""
        return model

    def build_optimizer(self, model, cfg, total_steps: int):
        return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.peak_lr)

    def verify(self, model) -> None:
        """The mode's own invariants, then N:M where the mode keeps it (before every checkpoint and the export)."""
        self.check_invariants(model)
        if self.keeps_nm:
            verify_nm(model, n=self.cfg.n, m=self.cfg.m, targets=self.targets)

    def check_invariants(self, model) -> None:
        pass

    def finalize(self, model, optimizer, *, out, is_main: bool):
        self.verify(model)
        return model

    def export_metadata(self, cfg) -> dict:
        return {}


class DenseMode(FinetuneMode):
    """Ordinary full fine-tuning with AdamW: every weight moves, so pruned zeros fill in."""

    name = "dense"
    keeps_nm = False
