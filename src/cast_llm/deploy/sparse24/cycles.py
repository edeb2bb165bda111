"""Timing a CPU GEMM the way a model's forward meets it: the weight comes from DRAM, not from a cache the call
before warmed. :func:`cycled` calls ``fn(copy)`` round-robin over copies of the weight that together hold at least
twice the last-level cache (:func:`l3_bytes`) and returns the median seconds per call. Timing one warm weight
would flatter the smaller compressed form most."""

from __future__ import annotations

import glob
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["MAX_COPIES", "cycled", "l3_bytes", "nbytes"]

MAX_COPIES = 512  # tiny layers (tests) would need thousands of copies to fill the cache: their timing is host-bound


def l3_bytes() -> int:
    """This CPU's last-level cache size (Linux sysfs; 32 MiB where it cannot be read)."""
    sizes = []
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(f).read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * mult)
    return max(sizes) if sizes else 32 << 20


def nbytes(held) -> int:
    """Bytes of a tensor or of a compressed state (a dict of tensors)."""
    if isinstance(held, torch.Tensor):
        return held.numel() * held.element_size()
    return sum(t.numel() * t.element_size() for t in held.values())


def _clone(held):
    return held.clone() if isinstance(held, torch.Tensor) else {k: t.clone() for k, t in held.items()}


def cycled(fn: Callable[[object], object], held, *, repeats: int = 5, min_time: float = 0.02) -> float:
    """Median seconds per ``fn(copy)`` call over copies of ``held`` (a weight or a compressed state) that hold
    at least 2× the last-level cache together (at most :data:`MAX_COPIES`)."""
    count = min(MAX_COPIES, max(2, -(-2 * l3_bytes() // max(nbytes(held), 1))))
    copies = [held] + [_clone(held) for _ in range(count - 1)]
    for c in copies[:2]:
        fn(c)
    t0 = time.perf_counter()
    for c in copies:
        fn(c)
    rounds = max(1, int(min_time / max(time.perf_counter() - t0, 1e-9)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(rounds):
            for c in copies:
                fn(c)
        times.append((time.perf_counter() - t0) / (rounds * len(copies)))
    return statistics.median(times)
