"""Training methods: strategies plugged into the one training loop (``cast_llm.train.trainer``).

A method decides how the model is prepared (weight scaling, sparse-forward wrappers), which optimizer
updates it, what the current masks are, and how the final N:M model is produced. The loop itself —
data, KD, accumulation, clipping, logging, checkpoints, export — is shared by every method.
"""

from __future__ import annotations

from cast_llm.train.methods.base import TrainingMethod
from cast_llm.train.methods.cast import CastMethod

REGISTRY: dict[str, type[TrainingMethod]] = {"cast": CastMethod}


def get_method(name: str) -> TrainingMethod:
    from cast_llm.errors import CastError

    if name not in REGISTRY:
        raise CastError(f"unknown training method '{name}' (choose from {', '.join(REGISTRY)})")
    return REGISTRY[name]()


__all__ = ["TrainingMethod", "CastMethod", "REGISTRY", "get_method"]
