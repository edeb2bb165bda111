"""Optimizers: AdamS (Algorithm 1, Eq. 7-8)."""

from cast_llm.optim.adams import AdamS

__all__ = ["AdamS"]
