"""Where a kernel's verdict is kept between runs: one JSON file per user, keyed by what the verdict depends on.

A verdict (did a custom kernel match its reference on this machine, and how fast was it) holds as long as the
GPU, its driver and the libraries that compiled the kernel are the same, so the key of every entry starts with
:func:`identity` — GPU name and driver (or the CPU's model), torch, Triton and cast-llm versions — followed by
the kernel path, the device index and the variant. A new driver or library version therefore probes again;
nothing is ever invalidated by hand (delete the file to probe everything again: it only holds verdicts).

The file is ``$CAST_LLM_KERNEL_VERDICTS`` if set, else ``kernel-verdicts.json`` in the cache folder
(:func:`cast_llm.io.cache_dir`: ``$CAST_LLM_CACHE``, ``$XDG_CACHE_HOME/cast-llm`` or ``~/.cache/cast-llm``).
Writes merge with what is on disk (two processes probing at once each add their entries) and are atomic. A
file that exists without our marker is neither read nor overwritten; a damaged one of ours is rewritten.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import time
from pathlib import Path

import torch

from cast_llm import __version__
from cast_llm.io import atomic_write_json, cache_dir

__all__ = ["MARKER", "VERDICTS_ENV", "identity", "verdict_path", "VerdictFile"]

MARKER = "cast-llm kernel verdicts"
FORMAT = 1
VERDICTS_ENV = "CAST_LLM_KERNEL_VERDICTS"


def verdict_path() -> Path:
    env = os.environ.get(VERDICTS_ENV)
    return Path(env).expanduser() if env else cache_dir() / "kernel-verdicts.json"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)  # no import: Triton's import alone takes ~1 s
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_version() -> str | None:
    """The NVIDIA driver's release (``550.54.15``) from the kernel module, else the CUDA driver API version."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            first = f.readline()
        for word in first.split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return word
    except OSError:
        pass
    if torch.cuda.is_available():
        try:
            v = torch._C._cuda_getDriverVersion()  # e.g. 12040: the CUDA version the driver supports
            return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
        except (AttributeError, RuntimeError):
            return None
    return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


@functools.cache
def identity(device_type: str, index: int | None = None) -> str:
    """What a verdict on this device depends on, as one string (the start of its cache key)."""
    if device_type == "cuda":
        name = torch.cuda.get_device_name(index or 0)
        major, minor = torch.cuda.get_device_capability(index or 0)
        hardware = f"{name} (sm_{major}{minor}), driver {driver_version()}"
    else:
        hardware = f"{device_type}: {cpu_name()}"
    return (f"{hardware} | torch {torch.__version__} | triton {_version('triton')} | "
            f"cast-llm {__version__}")


class VerdictFile:
    """The verdicts on disk: ``get(key)`` / ``put(key, entry)`` (written through at once)."""

    def __init__(self, path: Path | None = None):
        self.path = verdict_path() if path is None else Path(path)
        self.problem: str | None = None  # why the file is not used (a file that is not ours)
        self._entries: dict[str, dict] | None = None

    def _read(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            return {}  # damaged (a torn write cannot happen, a hand edit can): probe again and rewrite it
        if not isinstance(data, dict) or data.get("written_by") != MARKER:
            self.problem = (f"{self.path} exists but was not written by cast-llm (no \"written_by\": \"{MARKER}\"); "
                            f"kernel verdicts are neither read from it nor written to it: set {VERDICTS_ENV} to "
                            "another file")
            return {}
        if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            return {}
        return data["entries"]

    def entries(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = self._read()
        return self._entries

    def get(self, key: str) -> dict | None:
        """The entry of ``key``; None when there is none or it is not of the shape cast-llm writes (a hand edit:
        the kernels are probed again and the entry rewritten, instead of a run failing mid-way on it)."""
        entry = self.entries().get(key)
        return entry if well_formed(entry) else None

    def put(self, key: str, entry: dict) -> None:
        self.entries()[key] = entry
        if self.problem is not None:
            return
        merged = self._read()  # what other processes wrote since we read it
        merged[key] = entry
        self._entries.update(merged)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, {"written_by": MARKER, "format": FORMAT,
                                          "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "entries": merged})
        except OSError as e:  # a read-only home: the verdicts still hold for this process
            self.problem = f"cannot write {self.path} ({e.strerror or e}); verdicts are kept for this run only"


def _number(v) -> bool:
    return v is None or isinstance(v, (int, float)) and not isinstance(v, bool)


def well_formed(entry) -> bool:
    """Whether a verdict entry has the shape :mod:`cast_llm.kernels.registry` writes: ``{"candidates": {name:
    {"ok": bool, "seconds": number | None, "error": str | None, …}}, "reference_seconds": number | None, …}``."""
    if not isinstance(entry, dict) or not _number(entry.get("reference_seconds")):
        return False
    candidates = entry.get("candidates", {})
    return isinstance(candidates, dict) and all(
        isinstance(name, str) and isinstance(r, dict) and isinstance(r.get("ok", False), bool)
        and all(_number(r.get(k)) for k in ("seconds", "max_error", "tolerance"))
        and isinstance(r.get("error") or "", str) for name, r in candidates.items())
