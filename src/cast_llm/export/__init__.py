"""Moved to :mod:`cast_llm.deploy.export` (beside the other checkpoint formats); this import path keeps working
for code written against it."""

from cast_llm.deploy.export import (
    EXPORT_MARKER,
    LayerSparsity,
    format_sparsity_report,
    read_sparsity_metadata,
    save_hf_checkpoint,
    save_sparse_checkpoint,
    sparsity_report,
    verify_nm,
)

__all__ = ["EXPORT_MARKER", "LayerSparsity", "sparsity_report", "format_sparsity_report", "verify_nm",
           "save_sparse_checkpoint", "save_hf_checkpoint", "read_sparsity_metadata"]
