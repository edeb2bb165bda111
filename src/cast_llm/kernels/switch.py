"""The switch of the checked kernel paths: ``auto`` or ``reference`` (torch operations only), whether the
``torch.compile`` candidates take part, and where each kind of candidate can run."""

from __future__ import annotations

import os

import torch

from cast_llm.errors import CastError

__all__ = ["MODES", "MODE_ENV", "COMPILE_ENV", "mode", "set_mode", "reset_mode", "apply_flag", "compile_enabled", "interpreting",
           "triton_runs_on", "host_runs_on", "compiled_runs_on"]

MODES = ("auto", "reference")
MODE_ENV = "CAST_LLM_KERNELS"
COMPILE_ENV = "CAST_LLM_COMPILE"

_MODE: list[str] = []  # set_mode's value (the environment variable otherwise)
_ENV_BEFORE: list[str | None] = []  # the variable as it was before this process's set_mode first wrote it
_WROTE: list[str] = []  # what set_mode wrote into it (so that a later read tells the user's value from ours)


def _valid(value: str, where: str) -> str:
    if value not in MODES:
        raise CastError(f"{where} must be one of {', '.join(MODES)}, got {value!r} (reference: torch operations "
                        "only, every custom kernel off)")
    return value


def _from_env(value: str | None) -> str:
    return _valid((value or "auto").strip().lower() or "auto", MODE_ENV)


class _Scope:
    """``with mode("reference"):`` — the mode in force inside the block, the previous one restored after."""

    def __init__(self, value: str):
        self.value = _valid(value, "kernels.mode")

    def __enter__(self) -> str:
        self.saved = (list(_MODE), list(_ENV_BEFORE), list(_WROTE), os.environ.get(MODE_ENV))
        set_mode(self.value)
        return self.value

    def __exit__(self, *exc) -> None:
        modes, before, wrote, env = self.saved
        _MODE[:], _ENV_BEFORE[:], _WROTE[:] = modes, before, wrote
        if env is None:
            os.environ.pop(MODE_ENV, None)
        else:
            os.environ[MODE_ENV] = env


def mode(value: str | None = None):
    """``mode()``: ``auto`` (checked fast paths) or ``reference`` (torch operations only) — the mode in force.
    ``mode("reference")``: a context manager for library users, ``with cast_llm.kernels.mode("reference"): ...``,
    which restores the previous mode (and the environment variable) when the block ends."""
    if value is not None:
        return _Scope(value)
    if _MODE:
        return _MODE[0]
    return _from_env(os.environ.get(MODE_ENV))


def set_mode(value: str) -> None:
    """``--kernels``: this process and the processes it starts (the variable is set too); :func:`reset_mode`
    undoes it."""
    value = _valid(value, "--kernels")
    if not _ENV_BEFORE:
        _ENV_BEFORE.append(os.environ.get(MODE_ENV))
    _MODE[:] = [value]  # (the registry keys its decisions by the mode: none taken under the other one is reused)
    _WROTE[:] = [value]
    os.environ[MODE_ENV] = value


def reset_mode() -> None:
    """Back to the default: the mode the environment gave before this process set one (the variable restored
    where it still holds what :func:`set_mode` wrote; a value someone else put there since is left alone)."""
    if _ENV_BEFORE and _WROTE and os.environ.get(MODE_ENV) == _WROTE[0]:
        if _ENV_BEFORE[0] is None:
            os.environ.pop(MODE_ENV, None)
        else:
            os.environ[MODE_ENV] = _ENV_BEFORE[0]
    _MODE.clear(), _ENV_BEFORE.clear(), _WROTE.clear()


def apply_flag(value: str | None) -> str:
    """``--kernels VALUE`` of a command: ``reference`` forces the references; ``auto`` (the flag's default) leaves
    the user's ``CAST_LLM_KERNELS=reference`` in force where it is set — the variable as the user set it, not this
    process's own earlier write (so ``auto`` after ``reference`` in one process switches back). Returns the mode
    in force."""
    if value is not None:
        _valid(value, "--kernels")
    env = _from_env(_ENV_BEFORE[0] if _ENV_BEFORE else os.environ.get(MODE_ENV))
    set_mode("reference" if "reference" in (value, env) else "auto")
    return mode()


def compile_enabled() -> bool:
    return os.environ.get(COMPILE_ENV, "1").strip() not in ("0", "false", "no", "off")


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels on CPU tensors, which then stand for CUDA ones (tests). The one
    place the variable is read; Triton reads it when it decorates the kernels, so callers that must agree with
    a decorated kernel read this once at import."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runs_on(device: torch.device) -> str | None:
    """Where a Triton candidate runs: CUDA, or CPU tensors under the interpreter (None), else why not."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return f"a Triton kernel runs on CUDA (on {device.type} only under TRITON_INTERPRET=1)"
    from cast_llm.triton_support import IMPORT_ERROR  # in-function: imports Triton (~1 s): where it may run

    return IMPORT_ERROR


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
