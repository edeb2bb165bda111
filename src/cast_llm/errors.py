"""User-facing errors.

Everything the user can fix (a bad path, a layer whose shape cannot be made N:M, an unknown flag in a
YAML file) raises :class:`CastError` with a message naming the offending thing and what to do. The CLI
prints such errors as one line and exits non-zero; it never shows a stack trace for them.
"""

from __future__ import annotations


class CastError(Exception):
    """An error caused by user input, with a message meant to be read by a person."""


class NonFiniteError(CastError, FloatingPointError):
    """A NaN/Inf appeared where training cannot continue (gradient, loss)."""
