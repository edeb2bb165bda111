"""Sparsity-preserving weight quantization (method.md §7): RTN and AWQ, packed storage.

* :mod:`.rtn` — group-wise asymmetric integer quantization with integer zero-points (pure math), and
  round-to-nearest over a model's targets;
* :mod:`.awq` — AWQ's scale search and exact scale folding (pure math); :mod:`.calibration` — its
  block-by-block lifecycle;
* :mod:`.pack` — packed integer checkpoints (codes + fp16 scales + zero-points) with a loader, and the
  fake-quant (dequantized) HF checkpoint beside them.

:func:`quantize_model_` (:mod:`.quantize`) is the entry point: it quantizes the N:M targets (all linears in the decoder
blocks) in place to their fake-quant values and verifies, before anything is written, that every weight
that was zero before is still exactly zero. The settings of a quantization job (``cast-llm quantize``) are :class:`.config.QuantizeConfig`; the job itself is
:func:`cast_llm.jobs.quantize.quantize_job`.
"""

from __future__ import annotations

import importlib

# name -> submodule; loaded on first use, so that `cast-llm --help` (which reads quant.config) imports no torch
_EXPORTS = {
    "METHODS": "quantize", "QuantResult": "quantize", "default_group_size": "quantize", "quantize_model_": "quantize",
    "verify_zeros": "quantize",
    "QuantizedWeight": "rtn", "dequantize_codes": "rtn", "fake_quantize": "rtn", "quant_params": "rtn",
    "rtn_quantize_": "rtn",
    "QuantizeConfig": "config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # a submodule not imported yet (as the eager imports of this package used to load it)
        try:
            return importlib.import_module(f"cast_llm.quant.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"cast_llm.quant.{name}":
                raise
        raise AttributeError(f"module 'cast_llm.quant' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"cast_llm.quant.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
