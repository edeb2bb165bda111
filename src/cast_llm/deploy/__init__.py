"""Deploying N:M sparse models (method.md §7): compact checkpoints, semi-structured kernels, benchmarks.

* :mod:`.bitpack` — dense packing of 1-8-bit integers;
* :mod:`.nm_codec` — :class:`NMSparseWeight`, one N:M weight as kept values + bit-packed positions;
* :mod:`.compressed` — ``--format compressed``: save / load a whole model in that form;
* :mod:`.compressed_tensors` — ``--format compressed-tensors``: the legacy ``sparse-24-bitmask`` layout;
* :mod:`.model_card` — the ``README.md`` model card written into every model folder, from recorded facts only;
* :mod:`.sparse24` — 2:4 inference layers: compressed once, cuSPARSELt / CUTLASS kernels, measured per-shape
  dispatch to dense where 2:4 does not pay, a CUDA-graph decoder (docs/deployment.md);
* :mod:`.semi_structured` — swap 2:4 weights to ``torch.sparse`` semi-structured tensors (CUDA ≥ sm80; the
  simple path of ``load_compressed(semi_structured=True)``, slow: a plan per matmul);
* :mod:`.bench` — dense vs 2:4 prefill / decode throughput, per-linear latency, weight memory;
* :mod:`.config` — the settings of ``cast-llm export`` and ``bench-inference`` (torch-free; their jobs:
  :mod:`cast_llm.jobs`).
"""

from __future__ import annotations

from cast_llm import lazy_exports as _lazy_exports

# name -> submodule; loaded on first use, so that `cast-llm --help` (which reads deploy.config) imports no torch
_EXPORTS = {
    "load_compressed": "compressed", "save_compressed": "compressed",
    "load_compressed_tensors": "compressed_tensors", "save_compressed_tensors": "compressed_tensors",
    "NMSparseWeight": "nm_codec",
    "from_semi_structured_": "semi_structured", "semi_structured_unavailable_reason": "semi_structured",
    "to_semi_structured_": "semi_structured",
    "BenchConfig": "config", "BenchInferenceConfig": "config", "ExportConfig": "config",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, submodules=True)
