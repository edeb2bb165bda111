"""Modules: learnable weight scaling (Eq. 11-12)."""

from cast_llm.nn.scaled_linear import ScaledLinear, fold_scaling_, wrap_scaling_

__all__ = ["ScaledLinear", "wrap_scaling_", "fold_scaling_"]
