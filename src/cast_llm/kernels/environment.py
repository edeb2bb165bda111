"""What ``cast-llm doctor`` says about the machine: the versions a kernel verdict depends on, and the GPUs."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from cast_llm import __version__
from cast_llm.kernels.switch import COMPILE_ENV, compile_enabled, interpreting, mode
from cast_llm.kernels.verdicts import cpu_name, driver_version, verdict_path

__all__ = ["environment"]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _triton() -> dict:
    version = _version("triton")
    if version is None:
        return {"version": None, "importable": False, "why": "not installed (pip install triton)"}
    # in-function: imports Triton (~1 s), only when it is installed; triton_support is the one import
    # guard (a broken install fails there)
    from cast_llm.triton_support import IMPORT_ERROR

    if IMPORT_ERROR is not None:
        return {"version": version, "importable": False, "why": IMPORT_ERROR}
    return {"version": version, "importable": True}


def environment() -> dict:
    """Versions, devices and switches, as one dict (``cast-llm doctor --json``'s ``environment``)."""
    cuda = torch.cuda.is_available()
    gpus = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            props = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": torch.cuda.get_device_name(i), "compute_capability": f"{major}.{minor}",
                         "memory_gib": round(props.total_memory / 2**30, 1)})
    cslt = None
    if cuda and torch.backends.cusparselt.is_available():
        cslt = torch.backends.cusparselt.version()
    nccl = None
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (RuntimeError, AttributeError):
            nccl = None
    return {
        "cast_llm": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda, "cuda_available": cuda, "driver": driver_version(),
        "triton": _triton(), "transformers": _version("transformers"), "cusparselt": cslt, "nccl": nccl,
        "cpu": cpu_name(), "cpu_threads": torch.get_num_threads(), "gpus": gpus, "kernels_mode": mode(),
        "compile_candidates": "on" if compile_enabled() else f"off ({COMPILE_ENV}=0)",
        "triton_interpret": interpreting(), "verdict_file": str(verdict_path()),
    }
