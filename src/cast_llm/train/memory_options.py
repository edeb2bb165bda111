"""What the memory options of ``cast-llm train`` do to the models (section "memory for large models").

* ``--activation-checkpointing full|selective|none``: transformers' own per-block checkpointing of the
  *student* (non-reentrant ``torch.utils.checkpoint``). ``full``: a block keeps only its input and is
  recomputed in backward — one more student forward per step. ``selective``: the block also keeps the
  outputs of its matmuls and of attention (:data:`SAVED_OPS`), and only the cheap operators between them
  (norms, rotary embedding, activation, products, casts — and the scaled weights ``Diag(A)·W``) are
  recomputed, through torch's selective activation checkpoint API (``create_selective_checkpoint_contexts``):
  per-operator recomputation as public large-model trainers run it at long sequences (torchtitan's "op"
  mode saves the same operators; it also recomputes every second matmul). Same gradients either way (the
  recomputation repeats the forward exactly). Both free the scaled weights that the matmuls would otherwise
  save for the whole step (:mod:`cast_llm.plan.memory`). Off in evaluation (transformers checkpoints only in
  training mode) and switched off before the export.
* ``--teacher-dtype``: the teacher's weights. Its forward runs under ``torch.no_grad`` (no graph, nothing
  saved; :meth:`cast_llm.train.trainer.PretrainJob.loss`), so its cost is its weights and one block's
  temporaries; under ``--fsdp`` it is sharded over the same mesh as the student (``train/distributed.py``).
* ``--fused-head``: :mod:`cast_llm.distill.head`. ``--packed-masks``: AdamS's ``mask_storage="packed"``.
"""

from __future__ import annotations

import torch

from cast_llm.config import RECOMPUTE_MODES, recompute_mode
from cast_llm.errors import CastError

__all__ = ["teacher_dtype", "enable_activation_checkpointing", "disable_activation_checkpointing", "RECOMPUTE_MODES",
           "recompute_mode", "SAVED_OPS", "selective_policy"]


def _saved_ops() -> frozenset:
    """The operators whose outputs selective recomputation keeps: the matmuls (what ``F.linear`` and the
    attention's products lower to) and every fused attention kernel (its output and log-sum-exp)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_mm")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


SAVED_OPS = _saved_ops()


def selective_policy(ctx, op, *args, **kwargs):
    """The per-operator policy of ``--activation-checkpointing selective``: keep :data:`SAVED_OPS`' outputs,
    recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy)


def teacher_dtype(cfg, precision: str) -> torch.dtype:
    """``--teacher-dtype`` as a dtype; ``auto`` follows the training precision (bf16 autocast → bf16: no
    weight casts by autocast at every teacher forward, half the memory)."""
    choice = cfg.teacher_dtype
    if choice == "auto":
        return torch.bfloat16 if precision == "bf16" else torch.float32
    return torch.bfloat16 if choice == "bf16" else torch.float32


def enable_activation_checkpointing(model, mode: str = "full") -> None:
    """Checkpoint every decoder block of a transformers model (non-reentrant); ``mode`` ``full`` or
    ``selective`` (``none``: nothing to do)."""
    mode = recompute_mode(mode)
    if mode == "none":
        return
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _selective_contexts
    try:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError as e:  # the architecture has no checkpointing support in transformers
        raise CastError(f"--activation-checkpointing {mode}: {type(model).__name__} does not support it ({e})") from None
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
