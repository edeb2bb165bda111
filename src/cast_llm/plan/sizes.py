"""Memory sizes as people write them: ``80GB`` (decimal, as GPU vendors label cards), ``80GiB`` (binary).

An H100 "80GB" holds 81,559 MiB = 85.5 GB = 79.6 GiB; reading the label as 80·10⁹ bytes (74.5 GiB) leaves
the CUDA context and the allocator some room, so the label is a safe value to type.
"""

from __future__ import annotations

import re

from cast_llm.errors import CastError

__all__ = ["parse_size", "fmt_size", "GiB"]

GiB = 2**30
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int | float, what: str = "--gpu-memory") -> int:
    """``"80GB"`` → 80·10⁹, ``"80 GiB"`` → 80·2³⁰, ``"1.5TB"``; a bare number is refused (GB or GiB?)."""
    if isinstance(text, bool):
        raise CastError(f"{what}: expected a size such as 80GB or 80GiB, got {text!r}")
    s = str(text).strip().replace("_", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]?i?b)?", s, flags=re.IGNORECASE)
    if not m:
        raise CastError(f"{what}: expected a size such as 80GB or 80GiB, got {text!r}")
    if not m.group(2):
        raise CastError(f"{what}: {text!r} has no unit; write {s}GB (10⁹ bytes, the card's label) or {s}GiB (2³⁰)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise CastError(f"{what} must be > 0, got {text!r}")
    return int(value)


def fmt_size(n: float) -> str:
    """Bytes as GiB with one decimal (MiB below 1 GiB): the unit the allocator and nvidia-smi report."""
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / 2**20:.0f} MiB"
