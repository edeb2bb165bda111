"""Token buckets: the unit the 2:4 dispatch decides per (:mod:`.dispatch`) and the cuSPARSELt plans search per
(:mod:`.plans`) — the power of two at or above a token count, capped at :data:`MAX_BUCKET`."""

from __future__ import annotations

__all__ = ["MAX_BUCKET", "token_bucket"]

MAX_BUCKET = 16384


def token_bucket(tokens: int) -> int:
    """The power of two ≥ ``tokens`` (1 for 0 or 1), at most :data:`MAX_BUCKET`."""
    if tokens < 0:
        raise ValueError(f"token count must be >= 0, got {tokens}")
    return min(MAX_BUCKET, 1 << max(0, int(tokens) - 1).bit_length())
