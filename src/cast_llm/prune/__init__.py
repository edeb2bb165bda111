"""One-shot N:M pruning baselines (method.md §6): magnitude, Wanda, SparseGPT.

The tensor math of each method lives in its own module (:mod:`.magnitude`, :mod:`.wanda`,
:mod:`.sparsegpt`); the block-by-block calibration through the decoder in :mod:`.blockwise`; the
whole-model entry point :func:`prune_model` in :mod:`.oneshot`; the settings of a pruning job
(``cast-llm prune``) in :mod:`.config` (:class:`PruneConfig`; the job itself: :func:`cast_llm.jobs.prune.prune_job`).
"""

from __future__ import annotations

from cast_llm import lazy_exports as _lazy_exports

# name -> submodule; loaded on first use, so that `cast-llm --help` (which reads prune.config) imports no torch
_EXPORTS = {
    "decoder_blocks": "blockwise", "prune_blockwise": "blockwise",
    "magnitude_prune_": "magnitude",
    "METHODS": "oneshot", "LayerReport": "oneshot", "PruneResult": "oneshot", "prune_model": "oneshot",
    "SparseGPTInfo": "sparsegpt", "accumulate_hessian": "sparsegpt", "finalize_hessian": "sparsegpt",
    "inverse_hessian_cholesky": "sparsegpt", "sparsegpt_prune_": "sparsegpt",
    "accumulate_col_sq_norm": "wanda", "wanda_prune_": "wanda", "wanda_scores": "wanda",
    "PruneConfig": "config",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, submodules=True)
