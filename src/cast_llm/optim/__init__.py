"""Optimizers: AdamS (Algorithm 1, Eq. 7-8) and the SR-STE AdamW of the baselines (method.md §6); the
learning-rate schedule every run uses (:mod:`~cast_llm.optim.schedule`).

The optimizers load on first use, so that the schedule's names (which ``--help`` lists) import no torch."""

from __future__ import annotations

import importlib

_EXPORTS = {"AdamS": "cast_llm.optim.adams", "SRSTEAdamW": "cast_llm.optim.srste"}
__all__ = ["AdamS", "SRSTEAdamW"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cast_llm.optim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
