"""Fine-tuning N:M sparse models without losing sparsity (method.md §7): ``cast-llm finetune``.

* :mod:`~cast_llm.finetune.lora` — LoRA through peft, merged as ``W + M ⊙ (B A)·s`` (stays exactly N:M);
* :mod:`~cast_llm.finetune.sparse` — full fine-tuning where pruned weights stay exactly 0;
* :mod:`~cast_llm.finetune.modes` — the modes' common base and ``dense`` (ordinary full fine-tuning);
* :mod:`~cast_llm.finetune.data`, :mod:`~cast_llm.finetune.evaluate` — examples, losses, metrics;
* :mod:`~cast_llm.finetune.job` — the job the one training loop runs; :mod:`~cast_llm.finetune.config` — its
  options.
"""

from __future__ import annotations

from cast_llm.errors import CastError
from cast_llm.finetune.lora import LoraMode
from cast_llm.finetune.modes import DenseMode, FinetuneMode
from cast_llm.finetune.sparse import SparseMode

MODES: dict[str, type[FinetuneMode]] = {"lora": LoraMode, "sparse": SparseMode, "dense": DenseMode}


def get_mode(name: str) -> FinetuneMode:
    if name not in MODES:
        raise CastError(f"unknown --mode {name!r} (choose from {', '.join(MODES)})")
    return MODES[name]()


__all__ = ["MODES", "get_mode", "FinetuneMode", "LoraMode", "SparseMode", "DenseMode"]
