"""Triton's import guard and what the Triton kernels share (:mod:`cast_llm.nn.triton_scaled_weight`,
:mod:`cast_llm.distill.triton_kd`, :mod:`cast_llm.optim.triton_adams`).

A kernel runs on CUDA tensors when Triton imports, and — with ``TRITON_INTERPRET=1`` set before Triton is
imported — on CPU tensors through Triton's interpreter, which is how the kernels are tested without a GPU.
Every caller keeps a torch path for the other cases, and asks :func:`cast_llm.kernels.switch.triton_runs_on`
first (which reads :data:`IMPORT_ERROR` here, and the interpreter switch, ``kernels.switch.interpreting``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["triton", "tl", "IMPORT_ERROR", "FP_FUSION", "LRU", "to_device"]

# Every launch passes this explicitly: Triton's default for contracting a*b+c into one FMA is due to change,
# and every check and measurement of these kernels was made with contraction on (as nvcc's default, which
# torch's own CUDA kernels are built with).
FP_FUSION = True

IMPORT_ERROR: str | None = None
try:
    import triton
    import triton.language as tl
except Exception as err:  # ImportError, or a broken install: either way no kernel
    triton = tl = None
    IMPORT_ERROR = f"Triton is not importable ({type(err).__name__}: {err}); pip install triton"


class LRU(OrderedDict):
    """A small least-recently-used cache of device tables (a few live keys per caller)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, key, make):
        hit = self.get(key)
        if hit is None:
            hit = self[key] = make()
            if len(self) > self.size:
                self.popitem(last=False)
        else:
            self.move_to_end(key)
        return hit


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without a synchronisation: through pinned memory, asynchronously
    (the caching host allocator keeps the pinned buffer alive until the copy is done)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
