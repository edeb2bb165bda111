"""Modules: learnable weight scaling (Eq. 11-12); the sparse forward and learnable masks of the baselines."""

from cast_llm.nn.maskllm_linear import MaskLLMLinear
from cast_llm.nn.scaled_linear import ScaledLinear, fold_scaling_, wrap_scaling_
from cast_llm.nn.sparse_forward import SparseForwardLinear, unwrap_sparse_forward_, wrap_sparse_forward_

__all__ = ["ScaledLinear", "wrap_scaling_", "fold_scaling_", "SparseForwardLinear", "wrap_sparse_forward_",
           "unwrap_sparse_forward_", "MaskLLMLinear"]
