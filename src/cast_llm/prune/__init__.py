"""One-shot N:M pruning baselines (method.md §6): magnitude, Wanda, SparseGPT.

The tensor math of each method lives in its own module (:mod:`.magnitude`, :mod:`.wanda`,
:mod:`.sparsegpt`); the block-by-block calibration through the decoder in :mod:`.blockwise`; the
whole-model entry point :func:`prune_model` in :mod:`.oneshot`.
"""

from cast_llm.prune.blockwise import decoder_blocks, prune_blockwise
from cast_llm.prune.magnitude import magnitude_prune_
from cast_llm.prune.oneshot import METHODS, LayerReport, PruneResult, prune_model
from cast_llm.prune.sparsegpt import (
    SparseGPTInfo,
    accumulate_hessian,
    finalize_hessian,
    inverse_hessian_cholesky,
    sparsegpt_prune_,
)
from cast_llm.prune.wanda import accumulate_col_sq_norm, wanda_prune_, wanda_scores

__all__ = [
    "METHODS",
    "LayerReport",
    "PruneResult",
    "SparseGPTInfo",
    "accumulate_col_sq_norm",
    "accumulate_hessian",
    "decoder_blocks",
    "finalize_hessian",
    "inverse_hessian_cholesky",
    "magnitude_prune_",
    "prune_blockwise",
    "prune_model",
    "sparsegpt_prune_",
    "wanda_prune_",
    "wanda_scores",
]
