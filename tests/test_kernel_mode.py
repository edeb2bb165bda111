"""``--kernels`` / ``CAST_LLM_KERNELS`` switch back: auto after reference in one process, ``reset()`` restores the
default, ``with kernels.mode("reference"):`` restores what was in force, and the user's own variable wins; the
interpreter switch (``TRITON_INTERPRET``) is read in one place."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import cast_llm
from cast_llm import kernels
from cast_llm.errors import CastError


def test_auto_after_reference_switches_back_and_reset_restores_the_default(monkeypatch):
    monkeypatch.delenv(kernels.MODE_ENV, raising=False)
    assert kernels.apply_flag("reference") == "reference" and os.environ[kernels.MODE_ENV] == "reference"
    assert kernels.apply_flag("auto") == "auto" and os.environ[kernels.MODE_ENV] == "auto"
    kernels.set_mode("reference")
    kernels.reset()
    assert kernels.mode() == "auto" and kernels.MODE_ENV not in os.environ


def test_the_users_variable_is_kept_by_auto_and_by_reset(monkeypatch):
    monkeypatch.setenv(kernels.MODE_ENV, "reference")
    assert kernels.apply_flag("auto") == "reference"  # the flag's default leaves the user's choice in force
    kernels.set_mode("auto")  # a library call may override it for this process ...
    assert kernels.mode() == "auto"
    kernels.reset()  # ... and reset() gives the user's choice back
    assert kernels.mode() == "reference" and os.environ[kernels.MODE_ENV] == "reference"


def test_mode_as_a_context_manager_restores_what_was_in_force(monkeypatch):
    monkeypatch.delenv(kernels.MODE_ENV, raising=False)
    with kernels.mode("reference") as m:
        assert m == "reference" and kernels.mode() == "reference"
        assert os.environ[kernels.MODE_ENV] == "reference"  # processes started inside inherit it
        with kernels.mode("auto"):
            assert kernels.mode() == "auto"
        assert kernels.mode() == "reference"
    assert kernels.mode() == "auto" and kernels.MODE_ENV not in os.environ
    kernels.set_mode("reference")
    with kernels.mode("auto"):
        assert kernels.mode() == "auto"
    assert kernels.mode() == "reference"


def test_a_bad_mode_is_a_one_line_error():
    with pytest.raises(CastError, match="kernels.mode must be one of auto, reference"):
        kernels.mode("fast")
    with pytest.raises(CastError, match="--kernels must be one of"):
        kernels.apply_flag("fast")


def test_the_interpreter_switch_is_read_in_one_place(monkeypatch):
    """``TRITON_INTERPRET`` is read by ``kernels.switch.interpreting`` alone: every other site calls it, so the
    CPU-stands-for-CUDA rule cannot drift between the kernel modules."""
    src = Path(cast_llm.__file__).parent
    reads, definitions = [], []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(src).as_posix()
        reads += [name for _ in re.finditer(r"""(environ\.get|environ\[|getenv)\(?\s*["']TRITON_INTERPRET""", text)]
        definitions += [name for _ in re.finditer(r"^def _?interpreting\(", text, re.MULTILINE)]
    assert reads == ["kernels/switch.py"] and definitions == ["kernels/switch.py"], (reads, definitions)
    # and it is what the rest reads: CPU tensors count as kernel tensors only under the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.switch.interpreting() and kernels.switch.host_runs_on(torch.device("cpu")) is not None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels.switch.interpreting() and kernels.switch.host_runs_on(torch.device("cpu")) is None
