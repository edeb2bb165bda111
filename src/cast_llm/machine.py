"""What this machine has, read from the operating system: this process's resident memory and the machine's
RAM, the CPU model and its feature flags. A core module (no torch), used by the plan (``cast-llm plan``: the
capacity of a CPU run), by the trainer (peak resident memory in its log and results) and by ``bench-inference``
(whether this CPU multiplies bf16 natively, i.e. which dense path is the honest baseline)."""

from __future__ import annotations

import os

__all__ = ["available_memory", "cpu_flags", "cpu_model", "machine_ram", "native_half_matmul", "process_rss",
           "release_freed_memory"]


def process_rss() -> int:
    """This process's resident set (bytes; 0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def release_freed_memory() -> None:
    """Collect Python's garbage and hand freed heap pages back to the system (glibc's ``malloc_trim``; nothing
    where there is no glibc): a model load's transient copies are freed but glibc keeps their pages in its arenas,
    so resident memory after a load moved by ~0.8 GB between two loads of one 135M model (cpu24-notes.md §48)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def machine_ram() -> int:
    """The machine's total RAM (bytes): /proc/meminfo's MemTotal, else the page count times the page size."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) if hasattr(os, "sysconf") else 0


def available_memory() -> int | None:
    """RAM available to a new allocation without swapping (bytes): /proc/meminfo's MemAvailable, None where it
    cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's first ``flags`` line, or ``Features`` on Arm); empty where they
    cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next(x for x in f if x.split(":", 1)[0].strip() in ("flags", "Features"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


# the flags of the instructions that multiply bf16 / fp16 values natively (x86-64, then Arm); without them torch's
# bf16 / fp16 GEMM on the CPU widens to fp32 in software (on a Zen 3: 3.95-6.19x slower than its fp32 GEMM at
# 128-512 tokens, docs/results/cpu24-notes.md §35)
NATIVE_HALF_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16", "bf16"), "fp16": ("avx512_fp16", "amx_fp16", "asimdhp")}


def native_half_matmul(dtype: str) -> bool | None:
    """Whether this CPU multiplies ``dtype`` ("bf16" or "fp16") natively (None: its flags cannot be read)."""
    flags = cpu_flags()
    if not flags:
        return None
    return any(f in flags for f in NATIVE_HALF_FLAGS[dtype])
