"""N:M masks (Eq. 6) and mask-learning statistics (method.md §7)."""

from cast_llm.sparsity.mask import apply_mask_, is_nm, magnitude_mask, nm_mask, pack_mask, unpack_mask

__all__ = ["nm_mask", "magnitude_mask", "is_nm", "apply_mask_", "pack_mask", "unpack_mask"]
