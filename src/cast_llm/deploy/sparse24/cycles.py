"""Timing a CPU GEMM the way a model's forward meets it: the weight comes from DRAM, not from a cache the call
before warmed. :func:`cycled` calls ``fn(copy)`` round-robin over copies of the weight that together hold at least
twice the cache this process can hold (:func:`cold_bytes`) and returns the median seconds per call. Timing one warm
weight would flatter the smaller compressed form most."""

from __future__ import annotations

import functools
import glob
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from cast_llm.errors import CastError

__all__ = ["MAX_COPIES", "MIN_TIME", "REPEATS", "cold_bytes", "cycled", "cycled_many", "cycled_rounds", "l3_bytes",
           "nbytes"]

MAX_COPIES = 512  # tiny layers (tests) would need thousands of copies to fill the cache: their timing is host-bound
# what a timing spends by default: REPEATS rounds of every candidate, each round MIN_TIME seconds of calls (read
# at each call, so the test suite can shorten them for its tiny layers: tests/conftest.py)
REPEATS, MIN_TIME = 5, 0.02
# a reported last-level cache above this is checked by reading (:func:`cold_bytes`): a VM's sysfs may report the
# whole socket's (480 MiB on a 2-vCPU Xeon that read at DRAM speed from 256 MB on, cpu24-notes.md §42, §46)
PROBE_ABOVE = 64 << 20
PROBE_READS = 5  # passes a size's read is the best of (:func:`measured_cache_bytes`)


L3_ENV = "CAST_LLM_L3_BYTES"


def l3_given() -> bool:
    """Whether :data:`L3_ENV` sets the cache size (then :func:`l3_bytes` and :func:`cold_bytes` are that)."""
    return bool(os.environ.get(L3_ENV, "").strip())


def _size(text: str) -> int | None:
    """``text`` as bytes: digits, with a K / M / G suffix (binary) or none, as sysfs and :data:`L3_ENV` write a
    size; None where it is not one (or is 0)."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if mult > 1 else text
    return int(digits) * mult if digits.isdigit() and int(digits) > 0 else None


def l3_bytes() -> int:
    """This CPU's last-level cache size as given or reported: ``CAST_LLM_L3_BYTES`` where set (bytes, or with a K / M
    / G suffix), else Linux sysfs; 32 MiB where neither says. What a cold timing overflows is :func:`cold_bytes`:
    this, checked by reading where sysfs reports a large one."""
    env = os.environ.get(L3_ENV, "").strip()
    if env:
        if (size := _size(env)) is None:
            raise CastError(f"CAST_LLM_L3_BYTES={env!r}: give the last-level cache as a size in bytes, or with K, M "
                            f"or G (e.g. 64M), or unset it to read sysfs")
        return size
    sizes = []
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            size = _size(open(f).read().strip())
        except OSError:
            continue
        if size:
            sizes.append(size)
    return max(sizes) if sizes else 32 << 20


def cold_bytes() -> int:
    """The cache a cold timing must overflow (its copies hold twice this together): ``CAST_LLM_L3_BYTES`` where set;
    else the last-level cache sysfs reports (:func:`l3_bytes`), and where that is over 64 MiB, the smallest size from
    8 MiB up, doubling, that this process reads no faster than DRAM (:func:`measured_cache_bytes`, once a process)."""
    reported = l3_bytes()
    if l3_given():
        return reported
    # (a probe holds twice its limit: sysfs's figure is capped at 1 GiB for it, a size no core's share reaches)
    return reported if reported <= PROBE_ABOVE else measured_cache_bytes(min(reported, 1 << 30))


@functools.cache
def measured_cache_bytes(limit: int, *, faster: float = 1.25) -> int:
    """The smallest of 8 MiB, 16 MiB, ... below ``limit`` whose read (``Tensor.sum`` over a buffer already read)
    is less than ``faster``× the read of ``2 × limit`` bytes (DRAM: larger than any cache of this machine): from
    that size on nothing caches what a timing walks, so its copies need hold only twice that. ``limit`` where
    every size below it reads faster (the reported cache is real). About a second, 2 × ``limit`` bytes held
    meanwhile.

    Read with **one thread**, each size's speed the **best of** :data:`PROBE_READS` passes: a pass of a 2-thread
    ``sum`` waits for a core another process holds (small reads then look slower than DRAM), and interference
    only ever slows a pass, while what a cache holds shows in the fastest one (cpu24-notes.md §48)."""
    buf = torch.ones(2 * limit // 4, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def gbps(nbytes: int) -> float:
        view = buf[: nbytes // 4]
        view.sum()  # the pass that would fill a cache
        best = 0.0
        for _ in range(PROBE_READS):
            t0 = time.perf_counter()
            view.sum()
            best = max(best, nbytes / (time.perf_counter() - t0))
        return best

    try:
        return smallest_uncached(limit, gbps, faster=faster)
    finally:
        torch.set_num_threads(threads)


def smallest_uncached(limit: int, gbps: Callable[[int], float], *, faster: float = 1.25) -> int:
    """:func:`measured_cache_bytes`'s rule on a read speed ``gbps(nbytes)``: the first of 8 MiB, 16 MiB, ... below
    ``limit`` that reads under ``faster`` × ``gbps(2 * limit)``, else ``limit``."""
    dram = gbps(2 * limit)
    size = 8 << 20
    while size < limit:
        if gbps(size) < faster * dram:
            return size
        size *= 2
    return limit


def nbytes(held) -> int:
    """Bytes of a tensor or of a compressed state (a dict of tensors)."""
    if isinstance(held, torch.Tensor):
        return held.numel() * held.element_size()
    return sum(t.numel() * t.element_size() for t in held.values())


def _clone(held, place: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """A copy of ``held`` laid out as ``place`` lays a tensor (e.g. :func:`.cpu.on_huge_pages`: the copies are
    where the layer's own tensors are, so they are timed as they run); ``None``: torch's allocator."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        out = place(t) if place else t
        return t.clone() if out is t else out  # (``place`` hands back its argument where it does not apply)

    return copy(held) if isinstance(held, torch.Tensor) else {k: copy(t) for k, t in held.items()}


def cycled(fn: Callable[[object], object], held, *, place: Callable[[torch.Tensor], torch.Tensor] | None = None,
           repeats: int | None = None, min_time: float | None = None) -> float:
    """Median seconds per ``fn(copy)`` call over copies of ``held`` (a weight or a compressed state) that hold
    at least 2× :func:`cold_bytes` together (at most :data:`MAX_COPIES`), each laid out by ``place``
    (:func:`_clone`)."""
    return cycled_many([(fn, held, place)], repeats=repeats, min_time=min_time)[0]


def cycled_many(cases: Sequence[tuple], *, repeats: int | None = None, min_time: float | None = None) -> list[float]:
    """Median seconds per call of each case over :func:`cycled_rounds`' rounds, in order."""
    return [statistics.median(t) for t in cycled_rounds(cases, repeats=repeats, min_time=min_time)]


def cycled_rounds(cases: Sequence[tuple], *, repeats: int | None = None,
                  min_time: float | None = None) -> list[list[float]]:
    """:func:`cycled` for several ``(fn, held)`` candidates at once, **interleaved**: each of the ``repeats``
    runs one round (``min_time`` of calls, at least one) of every candidate in turn, so a slow spell of the
    memory system (a CPU's bandwidth moves by ±30 % over tenths of a second, docs/results/cpu24-notes.md §11)
    falls on all of them alike and their comparison is paired. A case is ``(fn, held)`` or ``(fn, held, place)``:
    ``place`` lays out each copy's tensors as the running layer's are (:func:`_clone`). Seconds per call of each
    case in each round: ``out[i][r]`` is case ``i`` in round ``r``, and ``out[i][r] / out[j][r]`` a paired ratio
    (``repeats`` / ``min_time``: :data:`REPEATS` / :data:`MIN_TIME` where None).

    The copies form rings walked from where the last round stopped, so a copy is called again only after every
    other copy of its ring was (cold, as in a model's forward) while a round costs ``min_time``, not a pass over
    every copy: on a CPU whose sysfs reports a large last-level cache (480 MiB on a 2-vCPU Xeon VM) a pass over
    the copies of a slow candidate at 512 tokens took minutes (cpu24-notes.md §43). Candidates that read the same
    ``held`` object with the same ``place`` share one ring and its cursor (torch's dense GEMM and the careful kernel
    read one weight; the CPU 2:4 paths one compressed state): each call still meets a copy no candidate read since
    the ring's last pass, and a key holds 2 × :func:`cold_bytes` per distinct tensor, not per candidate (§48)."""
    repeats = REPEATS if repeats is None else repeats
    min_time = MIN_TIME if min_time is None else min_time
    rings: dict[tuple[int, object], list] = {}  # (id(held), place) -> [copies, cursor]
    plans = []
    for fn, held, *place in cases:
        key = (id(held), place[0] if place else None)
        ring = rings.get(key)
        if ring is None:
            count = min(MAX_COPIES, max(2, -(-2 * cold_bytes() // max(nbytes(held), 1))))
            ring = rings[key] = [
                [held] + [_clone(held, *place) for _ in range(count - 1)], 2 % count]
        copies = ring[0]
        for c in copies[:2]:  # first calls: code paths, the output's pages
            fn(c)
        # calls a round holds: timed on the ring's next stretch (at least 2 calls, at most one pass)
        calls, t0 = 0, time.perf_counter()
        while calls < len(copies) and (calls < 2 or time.perf_counter() - t0 < min_time):
            fn(copies[ring[1]])
            ring[1], calls = (ring[1] + 1) % len(copies), calls + 1
        per_call = (time.perf_counter() - t0) / calls
        plans.append((fn, ring, max(1, int(min_time / max(per_call, 1e-9)))))
    times: list[list[float]] = [[] for _ in plans]
    for _ in range(repeats):
        for i, (fn, ring, calls) in enumerate(plans):
            copies, at = ring
            t0 = time.perf_counter()
            for j in range(calls):
                fn(copies[(at + j) % len(copies)])
            times[i].append((time.perf_counter() - t0) / calls)
            ring[1] = (at + calls) % len(copies)
    return times
