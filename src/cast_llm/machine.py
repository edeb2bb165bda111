"""What this machine has, read from the operating system: this process's resident memory and the machine's
RAM, the CPU model. A core module (no torch), used by the plan (``cast-llm plan``: the capacity of a CPU run) and by the
trainer (peak resident memory in its log and results)."""

from __future__ import annotations

import os

__all__ = ["available_memory", "cpu_model", "process_rss", "machine_ram"]


def process_rss() -> int:
    """This process's resident set (bytes; 0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


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
