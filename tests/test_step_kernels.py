"""The training step's Triton kernels — ScaledLinear's fused backward and the fused KD loss — against float64
references (tests/step_kernel_checks.py), and the dispatch that chooses them.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (a subprocess with TRITON_INTERPRET=1);
on a CUDA machine they run compiled. The dispatch (CUDA → kernel, CPU → the torch paths, which the other
tests check) is tested here on CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cast_llm.distill as distill
import cast_llm.nn.scaled_weight as sw
from cast_llm import triton_support

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _tolerances(interpreter: bool) -> dict[str, float]:
    """fp32: float32 rounding (reduction order; Triton's exp/log are a few ulps off). Autocast bf16 and bf16
    logits: bf16 rounding of the matmul inputs / of the stored gradient (2^-8 relative; the interpreter
    TRUNCATES fp32 -> bf16 where a GPU rounds to nearest, so up to 2^-7 there)."""
    return {"fp32": 1e-5, "autocast_bf16": 3e-2, "kernel_grad_w": 0.0, "kernel_grad_a": 1e-6,
            "kernel_calls_missing": 0.0, "float32_loss": 1e-5, "float32_grad": 1e-5, "bfloat16_loss": 1e-5,
            "bfloat16_grad": 1.6e-2 if interpreter else 8e-3}


def _check(errors: dict[str, float], interpreter: bool) -> None:
    tol = _tolerances(interpreter)
    bad = {k: v for k, v in errors.items() if v > tol[k]}
    assert not bad, f"errors above tolerance: {bad} (all: {errors})"


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter runs the kernels on CPU tensors)")
@pytest.mark.skipif(HAS_CUDA, reason="a GPU runs the compiled kernels instead")
def test_kernels_match_float64_in_triton_interpreter():
    here = Path(__file__).parent
    code = ("import json, step_kernel_checks as c\n"
            "print('RESULT ' + json.dumps({**c.check_scaled_weight('cpu'), **c.check_kd('cpu')}))\n")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    _check(json.loads(line.removeprefix("RESULT ")), interpreter=True)


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and Triton")
def test_kernels_match_float64_on_cuda():
    sys.path.insert(0, str(Path(__file__).parent))
    import step_kernel_checks as c

    _check({**c.check_scaled_weight("cuda"), **c.check_kd("cuda")}, interpreter=False)


# ------------------------------------------------------------------------------------------------ dispatch
def test_cpu_tensors_take_the_torch_paths(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    s = torch.randn(4, 8)
    assert distill._fused_kernel(s, s) is None
    assert triton_support.kernel_device_reason(torch.device("cpu")) is not None
    # ScaledLinear's CPU backward never asks for the kernel
    monkeypatch.setattr(sw, "_kernel", lambda: pytest.fail("the CPU backward must not load the CUDA kernel"))
    w = torch.randn(4, 8, requires_grad=True)
    a = torch.ones(4, 2, requires_grad=True)
    sw.scaled_weight(w, a, 2, False, torch.float32).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(4, 8))


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_kernels_refuse_what_they_do_not_take(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors count as kernel tensors: only the checks below decide
    from cast_llm import triton_kd
    from cast_llm.nn import triton_scaled_weight

    f32 = torch.zeros(4, 8)
    assert triton_kd.unsupported_reason(f32, f32) is None
    assert "float64" in triton_kd.unsupported_reason(f32.double(), None)
    assert "contiguous" in triton_kd.unsupported_reason(torch.zeros(8, 4).t(), None)
    assert triton_scaled_weight.unsupported_reason(f32, f32, torch.ones(4, 2)) is None
    assert "scale dtype" in triton_scaled_weight.unsupported_reason(f32, f32, torch.ones(4, 2, dtype=torch.float64))
    assert "float64" in triton_scaled_weight.unsupported_reason(f32.double(), f32.double(), torch.ones(4, 2))
    # float64 logits (the reference tests) keep the torch path even where the kernel could run
    assert distill._fused_kernel(f32.double(), None) is None


def test_kernel_device_reason_without_triton(monkeypatch):
    monkeypatch.setattr(triton_support, "IMPORT_ERROR", "Triton is not importable (test)")
    assert triton_support.kernel_device_reason(torch.device("cuda")) == "Triton is not importable (test)"
