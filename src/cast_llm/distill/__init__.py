"""Distillation from the dense model (method.md §4, Eq. 13), one concern per module:

* :mod:`~cast_llm.distill.loss` — the loss ``η·KL + (1−η)·CE`` in chunks of tokens (:func:`kd_loss`,
  :func:`causal_kd_loss`, :class:`KDLoss`), its torch reference;
* :mod:`~cast_llm.distill.triton_kd` — the same loss in one Triton kernel, and
  :mod:`~cast_llm.distill.paths` — its checked fast paths (Triton, compiled) beside the reference;
* :mod:`~cast_llm.distill.head` — the LM head and the loss together, a chunk of tokens at a time
  (``--fused-head``);
* :mod:`~cast_llm.distill.teacher` — the frozen teacher's forward (inference mode, optionally one CUDA graph).
"""

from cast_llm.distill.loss import (
    KD_LOSS,
    KDLoss,
    causal_kd_loss,
    check_labels,
    kd_loss,
    kd_path,
    shift_labels,
)

__all__ = ["KDLoss", "kd_loss", "causal_kd_loss", "shift_labels", "kd_path", "check_labels", "KD_LOSS"]
