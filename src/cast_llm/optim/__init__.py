"""Optimizers: AdamS (Algorithm 1, Eq. 7-8) and the SR-STE AdamW of the baselines (method.md §6); the
learning-rate schedule every run uses (:mod:`~cast_llm.optim.schedule`).

The optimizers load on first use, so that the schedule's names (which ``--help`` lists) import no torch."""

from __future__ import annotations

from cast_llm import lazy_exports as _lazy_exports

_EXPORTS = {"AdamS": "cast_llm.optim.adams", "SRSTEAdamW": "cast_llm.optim.srste"}
__all__ = ["AdamS", "SRSTEAdamW"]


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
