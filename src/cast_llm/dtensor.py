"""FSDP2's ``DTensor``, probed in one place: whether a tensor is one, and this rank's shard of it.

``fully_shard`` turns parameters, their gradients and the optimizer's moments into DTensors; the code that reads
them elementwise (AdamS, the l1_decay forecast, the methods' statistics, the memory count) works on this rank's
shard (:func:`local`). A torch build without ``torch.distributed`` has no DTensor: every tensor is then local.
"""

from __future__ import annotations

from typing import Any

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = Shard = None

__all__ = ["DTensor", "Shard", "is_dtensor", "local"]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Any) -> Any:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t
