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
* :mod:`.bench` — dense vs 2:4 prefill / decode throughput, per-linear latency, weight memory.
"""

from cast_llm.deploy.compressed import load_compressed, save_compressed
from cast_llm.deploy.compressed_tensors import load_compressed_tensors, save_compressed_tensors
from cast_llm.deploy.nm_codec import NMSparseWeight
from cast_llm.deploy.semi_structured import (
    from_semi_structured_,
    semi_structured_unavailable_reason,
    to_semi_structured_,
)

__all__ = [
    "NMSparseWeight",
    "from_semi_structured_",
    "load_compressed",
    "load_compressed_tensors",
    "save_compressed",
    "save_compressed_tensors",
    "semi_structured_unavailable_reason",
    "to_semi_structured_",
]
