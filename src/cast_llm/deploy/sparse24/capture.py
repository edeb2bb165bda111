"""Whether a CUDA graph is being captured right now: the 2:4 layers then use their graph-mode choices, and
nothing that synchronises (an algorithm search, a measurement) may run."""

from __future__ import annotations

import torch

__all__ = ["capturing"]

_QUERY = None


def capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (False without CUDA). Called on every
    forward of a 2:4 layer, so the CUDA check is made once and the query goes straight to the C binding."""
    global _QUERY
    if _QUERY is None:
        _QUERY = torch._C._cuda_isCurrentStreamCapturing if torch.cuda.is_available() else (lambda: False)
    return _QUERY()
