"""One-shot magnitude pruning: Eq. 6 applied once (method.md §1, §6).

Pure tensor math on a weight in (rows, columns) = (out, in) layout, N:M groups along the last dim. The
caller transposes GPT-2 ``Conv1D`` weights (stored (in, out)) before calling.
"""

from __future__ import annotations

import torch

from cast_llm.sparsity.mask import nm_mask


def magnitude_prune_(weight: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """Zero all but the ``n`` largest-|w| entries of every group of ``m`` columns, in place.

    Returns the mask (bool, same shape, True = kept). ``masked_fill_`` writes exact +0.0 (a multiply by the
    mask would leave -0.0 for negative weights).
    """
    mask = nm_mask(weight, n, m)
    weight.masked_fill_(~mask, 0.0)
    return mask
