"""Fine-tuning N:M sparse models without losing sparsity (method.md §7): ``cast-llm finetune``.

* :mod:`~cast_llm.finetune.lora` — LoRA through peft, merged as ``W + M ⊙ (B A)·s`` (stays exactly N:M);
* :mod:`~cast_llm.finetune.sparse` — full fine-tuning where pruned weights stay exactly 0;
* :mod:`~cast_llm.finetune.modes` — the modes' common base and ``dense`` (ordinary full fine-tuning);
* :mod:`~cast_llm.finetune.data`, :mod:`~cast_llm.finetune.evaluate` — examples, losses, metrics;
* :mod:`~cast_llm.finetune.job` — the job the one training loop runs; :mod:`~cast_llm.finetune.config` — its
  options.

The registry of modes (:data:`MODES`, :func:`get_mode`) and the mode classes are loaded on first use:
``cast-llm --help`` reads :class:`~cast_llm.finetune.config.FinetuneConfig` from this package and must not
pay for importing torch and peft.
"""

from __future__ import annotations

import importlib

from cast_llm.errors import CastError

# mode name -> (module, class); the names are cast_llm.finetune.config.MODES
_REGISTRY = {"lora": ("cast_llm.finetune.lora", "LoraMode"), "sparse": ("cast_llm.finetune.sparse", "SparseMode"),
             "dense": ("cast_llm.finetune.modes", "DenseMode")}
_CLASSES = {cls: module for module, cls in _REGISTRY.values()} | {"FinetuneMode": "cast_llm.finetune.modes"}

__all__ = ["MODES", "get_mode", "FinetuneMode", "LoraMode", "SparseMode", "DenseMode"]


def _load(name: str):
    if name not in globals():
        if name == "MODES":  # dict[str, type[FinetuneMode]]
            globals()[name] = {mode: _load(cls) for mode, (_, cls) in _REGISTRY.items()}
        else:
            globals()[name] = getattr(importlib.import_module(_CLASSES[name]), name)
    return globals()[name]


def __getattr__(name: str):
    if name in _CLASSES or name == "MODES":
        return _load(name)
    raise AttributeError(f"module 'cast_llm.finetune' has no attribute {name!r}")


def get_mode(name: str):
    """A new instance of the fine-tuning mode ``name`` (lora, sparse, dense)."""
    if name not in _REGISTRY:
        raise CastError(f"unknown --mode {name!r} (choose from {', '.join(_REGISTRY)})")
    return _load("MODES")[name]()
