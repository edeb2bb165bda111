"""The switch of the checked kernel paths: ``auto`` or ``reference`` (torch operations only), whether the
``torch.compile`` candidates take part, and where each kind of candidate can run."""

from __future__ import annotations

import os

import torch

from cast_llm.errors import CastError

__all__ = ["MODES", "MODE_ENV", "COMPILE_ENV", "mode", "set_mode", "apply_flag", "compile_enabled", "interpreting",
           "triton_runs_on", "host_runs_on", "compiled_runs_on"]

MODES = ("auto", "reference")
MODE_ENV = "CAST_LLM_KERNELS"
COMPILE_ENV = "CAST_LLM_COMPILE"

_MODE: list[str] = []  # set_mode's value (the environment variable otherwise)


def _valid(value: str, where: str) -> str:
    if value not in MODES:
        raise CastError(f"{where} must be one of {', '.join(MODES)}, got {value!r} (reference: torch operations "
                        "only, every custom kernel off)")
    return value


def mode() -> str:
    """``auto`` (checked fast paths) or ``reference`` (torch operations only)."""
    if _MODE:
        return _MODE[0]
    return _valid(os.environ.get(MODE_ENV, "auto").strip().lower() or "auto", MODE_ENV)


def set_mode(value: str) -> None:
    """``--kernels``: this process and the processes it starts (the variable is set too)."""
    value = _valid(value, "--kernels")
    _MODE[:] = [value]  # (the registry keys its decisions by the mode: none taken under the other one is reused)
    os.environ[MODE_ENV] = value


def apply_flag(value: str | None) -> str:
    """``--kernels VALUE`` of a command: ``reference`` forces the references; ``auto`` (the flag's default) leaves
    ``CAST_LLM_KERNELS=reference`` in force where it is set. Returns the mode in force."""
    if value is not None:
        _valid(value, "--kernels")
    set_mode("reference" if "reference" in (value, mode()) else "auto")
    return mode()


def compile_enabled() -> bool:
    return os.environ.get(COMPILE_ENV, "1").strip() not in ("0", "false", "no", "off")


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels on CPU tensors, which then stand for CUDA ones (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runs_on(device: torch.device) -> str | None:
    """Where a Triton candidate runs: CUDA, or CPU tensors under the interpreter (None), else why not."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return f"a Triton kernel runs on CUDA (on {device.type} only under TRITON_INTERPRET=1)"
    from cast_llm.triton_support import kernel_device_reason  # imports Triton (~1 s): only where it may run

    return kernel_device_reason(device)


def host_runs_on(device: torch.device) -> str | None:
    """Where a CPU-only candidate runs: CPU tensors, except under the interpreter (they stand for CUDA ones)."""
    if device.type != "cpu" or interpreting():
        return f"a CPU path (not for {device.type} tensors{' under TRITON_INTERPRET=1' if interpreting() else ''})"
    return None


def compiled_runs_on(device: torch.device) -> str | None:
    """Where a ``torch.compile`` candidate runs: inductor's C++ on CPU, its Triton on CUDA."""
    if interpreting():
        return "torch.compile candidates are left out under TRITON_INTERPRET=1"
    if device.type == "cpu":
        return None
    return triton_runs_on(device)
