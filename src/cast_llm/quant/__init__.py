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

from cast_llm import lazy_exports as _lazy_exports

# name -> submodule; loaded on first use, so that `cast-llm --help` (which reads quant.config) imports no torch
_EXPORTS = {
    "METHODS": "quantize", "QuantResult": "quantize", "default_group_size": "quantize", "quantize_model_": "quantize",
    "verify_zeros": "quantize",
    "QuantizedWeight": "rtn", "dequantize_codes": "rtn", "fake_quantize": "rtn", "quant_params": "rtn",
    "rtn_quantize_": "rtn",
    "QuantizeConfig": "config",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, submodules=True)
