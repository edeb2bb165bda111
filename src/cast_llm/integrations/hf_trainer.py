"""CAST inside ``transformers.Trainer``: AdamS + weight scaling + distillation + final prune.

Usage::

    from cast_llm.integrations.hf_trainer import CastArguments, CastTrainer

    trainer = CastTrainer(model=model, teacher=dense_copy, args=TrainingArguments(...),
                          train_dataset=ds, cast_args=CastArguments(l1_decay=4e-7, eta=2/3))
    trainer.train()          # ends with prune → fold scales → verify N:M (``finalize=True``)
    trainer.save_model(out)  # a plain HF checkpoint with exact zeros

The Trainer keeps everything it normally does (logging, evaluation, checkpointing, accelerate); this
subclass only swaps the optimizer for AdamS (``create_optimizer``), the loss for Eq. 13
(``compute_loss``, via :func:`cast_kd_loss` which a custom loop can call too), and finalises the model.
``learning_rate``, ``adam_beta1/2``, ``adam_epsilon`` and ``weight_decay`` come from ``TrainingArguments``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Trainer

from cast_llm.config import option
from cast_llm.deploy.export import verify_nm
from cast_llm.distill import kd_loss
from cast_llm.nn import fold_scaling_, wrap_scaling_
from cast_llm.optim import AdamS
from cast_llm.targets import param_groups
from cast_llm.train.config import CastSettings


@dataclass
class CastArguments(CastSettings):
    """CAST's settings for :class:`CastTrainer`: exactly those of ``cast-llm train``
    (:class:`~cast_llm.train.config.CastSettings`: λ, T1, scale blocks, η, temperature, KD chunk), plus the
    N:M pattern, whether to scale weights, and whether ``train()`` finalises the model."""

    n: int = option(2, "N of the N:M pattern (kept per group)", min=1)
    m: int = option(4, "M of the N:M pattern (group size)", min=2)
    scaling: bool = option(True, "learnable weight scale (Eq. 11-12), folded away at the end")
    finalize: bool = option(True, "prune + fold + verify when train() returns")


def cast_kd_loss(model, teacher, inputs: dict, *, eta: float, temperature: float = 1.0,
                 chunk_size: int = CastSettings.kd_chunk_size):
    """Eq. 13 for a batch of causal-LM ``inputs`` (``labels`` optional: defaults to ``input_ids``, -100 ignored).

    Returns ``(loss, outputs)``; without a teacher it is plain next-token cross-entropy.
    """
    labels = inputs.get("labels", inputs["input_ids"])
    fwd = {k: v for k, v in inputs.items() if k != "labels"}
    outputs = model(**fwd)
    logits = outputs.logits[:, :-1]
    target = labels[:, 1:]
    if teacher is None:
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
        return loss, outputs
    with torch.no_grad():
        t_logits = teacher(**fwd).logits[:, :-1]
    out = kd_loss(logits, t_logits, target, eta=eta, temperature=temperature, chunk_size=chunk_size)
    return out.loss, outputs


class CastTrainer(Trainer):
    """``transformers.Trainer`` running CAST. ``teacher``: the frozen dense model (None = no KD)."""

    def __init__(self, *args, teacher: torch.nn.Module | None = None, cast_args: CastArguments | None = None,
                 **kwargs):
        self.cast_args = cast_args or CastArguments()
        model = kwargs.get("model")
        if model is None:
            raise ValueError("CastTrainer needs model=...")
        if self.cast_args.scaling:  # before the optimizer exists, so the scales are trained
            wrap_scaling_(model, n_groups=self.cast_args.scale_groups, m=self.cast_args.m)
        super().__init__(*args, **kwargs)
        # our loss is a per-batch mean: let the Trainer divide it by the accumulation steps
        self.model_accepts_loss_kwargs = False
        self.teacher = None
        if teacher is not None:
            self.teacher = teacher.eval().requires_grad_(False).to(self.args.device)
        self._total_steps = None

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self._total_steps = num_training_steps  # AdamS needs T for α_t = t / T
        super().create_optimizer_and_scheduler(num_training_steps)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            c, a = self.cast_args, self.args
            total = self._total_steps or a.max_steps
            if not total or total <= 0:
                raise ValueError("CastTrainer: set TrainingArguments.max_steps (AdamS needs the total steps)")
            groups = param_groups(model or self.model, l1_decay=c.l1_decay, weight_decay=a.weight_decay)
            self.optimizer = AdamS(groups, lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2),
                                   eps=a.adam_epsilon, l1_decay=c.l1_decay, total_steps=total,
                                   mask_interval=c.mask_interval, n=c.n, m=c.m, weight_decay=a.weight_decay)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        c = self.cast_args
        loss, outputs = cast_kd_loss(model, self.teacher, inputs, eta=c.eta, temperature=c.kd_temperature,
                                     chunk_size=c.kd_chunk_size)
        return (loss, outputs) if return_outputs else loss

    @property
    def adams(self):
        """The AdamS instance (unwrapped from accelerate's optimizer wrapper)."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        if self.cast_args.finalize:
            self.finalize_sparse()
        return result

    def finalize_sparse(self):
        """Prune with the final masks, fold the scales, verify every target is exactly N:M."""
        model = self.accelerator.unwrap_model(self.model)
        self.adams.prune_()
        fold_scaling_(model)
        verify_nm(model, n=self.cast_args.n, m=self.cast_args.m)
        self.model = model
        return model
