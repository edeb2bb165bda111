"""2:4 inference that is never slower than dense and exact (method.md §7, docs/deployment.md).

* :mod:`.kernels` — the 2:4 GEMMs (torch's cuSPARSELt op, cuSPARSELt with cached plans, CUTLASS on Ampere,
  the CPU extension's kernels, a pure-torch emulation), their shape and padding rules;
* :mod:`.cpu` — the CPU extension (csrc/sparse24_cpu.cpp): build, compressed form, ops; :mod:`.cycles` — CPU
  timing with weights cycled past the cache; :mod:`.dense_cpu` — the careful dense GEMV for the LM head;
* :mod:`.cusparselt_direct` — the cached-plan cuSPARSELt binding and its crash-safe probe;
* :mod:`.dispatch` — measured per-(shape, dtype, token bucket, mode) choice between dense and 2:4, cached in
  memory and in a JSON file;
* :mod:`.timing` — eager / CUDA-graph timing of one GEMM, with a correctness check;
* :mod:`.linear` — :class:`Sparse24Linear` (``from_linear`` / ``to_linear``);
* :mod:`.model` — :func:`to_sparse24_`, :func:`from_sparse24_`, :func:`plan_sparse24_`, :func:`sparse24_memory`;
* :mod:`.decode` — greedy decoding with the whole decoder step in one CUDA graph (manual capture or
  ``torch.compile(mode="reduce-overhead")``).
"""

from cast_llm.deploy.sparse24.dispatch import Dispatcher, token_bucket
from cast_llm.deploy.sparse24.kernels import KERNELS, available_kernels
from cast_llm.deploy.sparse24.linear import Sparse24Linear, check_sparse24_weight
from cast_llm.deploy.sparse24.model import (
    from_sparse24_,
    plan_sparse24_,
    sparse24_layers,
    sparse24_memory,
    to_sparse24_,
)

__all__ = [
    "KERNELS",
    "Dispatcher",
    "Sparse24Linear",
    "available_kernels",
    "check_sparse24_weight",
    "from_sparse24_",
    "plan_sparse24_",
    "sparse24_layers",
    "sparse24_memory",
    "to_sparse24_",
    "token_bucket",
]
