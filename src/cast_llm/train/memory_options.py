"""What the memory options of ``cast-llm train`` do to the models (section "memory for large models").

* ``--activation-checkpointing``: transformers' own per-block checkpointing of the *student*
  (non-reentrant ``torch.utils.checkpoint``): a block keeps only its input and is recomputed in backward.
  Same gradients (the recomputation repeats the forward exactly); one more student forward per step. It
  also frees the scaled weights ``Diag(A)·W`` that the matmuls would otherwise save for the whole step
  (:mod:`cast_llm.plan.memory`). Off in evaluation (transformers checkpoints only in training mode) and
  switched off before the export.
* ``--teacher-dtype``: the teacher's weights. Its forward runs under ``torch.no_grad`` (no graph, nothing
  saved; :meth:`cast_llm.train.trainer.PretrainJob.loss`), so its cost is its weights and one block's
  temporaries; under ``--fsdp`` it is sharded over the same mesh as the student (``train/distributed.py``).
* ``--fused-head``: :mod:`cast_llm.distill.head`. ``--packed-masks``: AdamS's ``mask_storage="packed"``.
"""

from __future__ import annotations

import torch

from cast_llm.errors import CastError

__all__ = ["teacher_dtype", "enable_activation_checkpointing", "disable_activation_checkpointing"]


def teacher_dtype(cfg, precision: str) -> torch.dtype:
    """``--teacher-dtype`` as a dtype; ``auto`` follows the training precision (bf16 autocast → bf16: no
    weight casts by autocast at every teacher forward, half the memory)."""
    choice = getattr(cfg, "teacher_dtype", "auto")
    if choice == "auto":
        return torch.bfloat16 if precision == "bf16" else torch.float32
    return torch.bfloat16 if choice == "bf16" else torch.float32


def enable_activation_checkpointing(model) -> None:
    """Checkpoint every decoder block of a transformers model (non-reentrant)."""
    kwargs = {"use_reentrant": False}
    try:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError as e:  # the architecture has no checkpointing support in transformers
        raise CastError(f"--activation-checkpointing: {type(model).__name__} does not support it ({e})") from None
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a cache is meaningless in training and conflicts with recomputation


def disable_activation_checkpointing(model) -> None:
    on = model.is_activation_checkpointing if hasattr(model, "activation_checkpointing_disable") else \
        getattr(model, "is_gradient_checkpointing", False)
    if not on:
        return
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
