"""cast-llm: CAST (Continuous Adaptive Sparse Trainer) for N:M semi-structured sparse LLMs.

The public API, imported lazily so that ``import cast_llm`` is cheap::

    from cast_llm import AdamS, nm_mask, is_nm, apply_mask_, pack_mask, unpack_mask
    from cast_llm.nn import ScaledLinear, wrap_scaling_, fold_scaling_
    from cast_llm.targets import find_targets, param_groups
    from cast_llm.distill import kd_loss
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "nm_mask": "cast_llm.sparsity.mask",
    "is_nm": "cast_llm.sparsity.mask",
    "apply_mask_": "cast_llm.sparsity.mask",
    "pack_mask": "cast_llm.sparsity.mask",
    "unpack_mask": "cast_llm.sparsity.mask",
    "AdamS": "cast_llm.optim.adams",
    "ScaledLinear": "cast_llm.nn.scaled_linear",
    "wrap_scaling_": "cast_llm.nn.scaled_linear",
    "fold_scaling_": "cast_llm.nn.scaled_linear",
    "find_targets": "cast_llm.targets",
    "param_groups": "cast_llm.targets",
    "kd_loss": "cast_llm.distill",
    "CastError": "cast_llm.errors",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cast_llm' has no attribute {name!r}")


def __dir__():
    return __all__
