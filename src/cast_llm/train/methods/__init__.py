"""Training methods: strategies plugged into the one training loop (:mod:`cast_llm.train.loop`).

A method decides how the model is prepared (weight scaling, sparse-forward wrappers), which optimizer
updates it, what the current masks are, and how the final N:M model is produced. The loop itself —
data, KD, accumulation, clipping, logging, checkpoints, export — is shared by every method.

* ``cast`` — CAST (method.md §5) and its ablations (``--no-kd``, ``--no-scaling``, ``--fixed-mask``;
  ``--mask-learner srste`` is SR-STE with CAST's KD and scaling: :class:`CastSRSTEMethod`);
* ``naive`` — one-shot mask, fixed, pruned weights exactly 0 (§6);
* ``srste`` — sparse STE forward + SR-STE decay, AdamW (§6);
* ``ast`` — STE forward + additive decay inside AdamS + KD (§6);
* ``maskllm`` — learnable Gumbel-softmax masks over the N:M patterns, weights frozen (§6).
"""

from __future__ import annotations

from cast_llm.errors import CastError
from cast_llm.train.methods.ast import ASTMethod
from cast_llm.train.methods.base import TrainingMethod
from cast_llm.train.methods.cast import CastMethod
from cast_llm.train.methods.maskllm import MaskLLMMethod
from cast_llm.train.methods.naive import NaiveMethod
from cast_llm.train.methods.srste import CastSRSTEMethod, SRSTEMethod

REGISTRY: dict[str, type[TrainingMethod]] = {
    "cast": CastMethod,
    "naive": NaiveMethod,
    "srste": SRSTEMethod,
    "ast": ASTMethod,
    "maskllm": MaskLLMMethod,
}


# CAST's mask learners (``--mask-learner``): the method that learns the masks under ``--method cast``
MASK_LEARNERS: dict[str, type[TrainingMethod]] = {"adams": CastMethod, "srste": CastSRSTEMethod}


def get_method(name: str, *, mask_learner: str = "adams") -> TrainingMethod:
    """The training method ``name`` (``--method``); for ``cast``, the one its ``mask_learner`` makes it."""
    if name not in REGISTRY:
        raise CastError(f"unknown training method '{name}' (choose from {', '.join(REGISTRY)})")
    if name == "cast":
        if mask_learner not in MASK_LEARNERS:
            raise CastError(f"unknown mask learner '{mask_learner}' (choose from {', '.join(MASK_LEARNERS)})")
        return MASK_LEARNERS[mask_learner]()
    return REGISTRY[name]()


__all__ = ["TrainingMethod", "CastMethod", "CastSRSTEMethod", "NaiveMethod", "SRSTEMethod", "MASK_LEARNERS", "ASTMethod", "MaskLLMMethod", "REGISTRY",
           "get_method"]
