"""cast-llm: CAST (Continuous Adaptive Sparse Trainer) for N:M semi-structured sparse LLMs.

The public API, imported lazily so that ``import cast_llm`` is cheap::

    from cast_llm import AdamS, nm_mask, is_nm, apply_mask_, pack_mask, unpack_mask
    from cast_llm.nn import ScaledLinear, wrap_scaling_, fold_scaling_
    from cast_llm.targets import find_targets, param_groups
    from cast_llm.distill import kd_loss
"""

from __future__ import annotations

import importlib
import sys

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


def lazy_exports(package: str, exports: dict[str, str], *, submodules: bool = False):
    """``(__getattr__, __dir__)`` for a package of ours whose public names are imported on first use (PEP 562):
    ``exports`` maps each name to its module (``"cast_llm.optim.adams"``, or relative to ``package``:
    ``"adams"``); ``submodules``: an attribute that is no export may be a submodule not imported yet (as the
    eager imports such a package once had loaded it). A name, once imported, is kept in the package. Internal:
    the packages write ``__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)``."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            if submodules:
                try:
                    return importlib.import_module(f"{package}.{name}")
                except ModuleNotFoundError as e:
                    if e.name != f"{package}.{name}":
                        raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module if module.startswith("cast_llm.") else f"{package}.{module}"),
                        name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
