"""Optimizers: AdamS (Algorithm 1, Eq. 7-8) and the SR-STE AdamW of the baselines (method.md §6)."""

from cast_llm.optim.adams import AdamS
from cast_llm.optim.srste import SRSTEAdamW

__all__ = ["AdamS", "SRSTEAdamW"]
