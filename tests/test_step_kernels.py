"""The training step's Triton kernels — ScaledLinear's fused backward and the fused KD loss — against float64
references (tests/step_kernel_checks.py), and the dispatch that chooses them.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (a process of its own with TRITON_INTERPRET=1);
on a CUDA machine they run compiled. The dispatch (CUDA → kernel, CPU → the torch paths, which the other
tests check) is tested here on CPU.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import cast_llm.distill as distill
import cast_llm.nn.scaled_weight as sw
from cast_llm import triton_support
from cast_llm.kernels.switch import triton_runs_on

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _tolerances(interpreter: bool) -> dict[str, float]:
    """fp32: float32 rounding (reduction order; Triton's exp/log are a few ulps off). Autocast bf16 and bf16
    logits: bf16 rounding of the matmul inputs / of the stored gradient (2^-8 relative; the interpreter
    TRUNCATES fp32 -> bf16 where a GPU rounds to nearest, so up to 2^-7 there)."""
    return {"fp32": 1e-5, "autocast_bf16": 3e-2, "kernel_grad_w": 0.0, "kernel_grad_a": 1e-6,
            "kernel_calls_missing": 0.0, "float32_loss": 1e-5, "float32_grad": 1e-5, "bfloat16_loss": 1e-5,
            "bfloat16_grad": 1.6e-2 if interpreter else 8e-3,
            # block-grouped vs per-layer scaling: the same float32 math, bitwise; in bf16 the grouped kernel's
            # store truncates in the interpreter where torch rounds (a GPU rounds both to nearest)
            "fp32_logits": 0.0, "fp32_grads": 0.0, "bf16_logits": 2e-2 if interpreter else 1e-3,
            "bf16_grads": 5e-2 if interpreter else 1e-3, "launch_count_mismatch": 0.0, "kd_label_stride": 0.0}


def _check(errors: dict[str, float], interpreter: bool) -> None:
    tol = _tolerances(interpreter)
    bad = {k: v for k, v in errors.items() if v > tol[k]}
    assert not bad, f"errors above tolerance: {bad} (all: {errors})"


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter runs the kernels on CPU tensors)")
@pytest.mark.skipif(HAS_CUDA, reason="a GPU runs the compiled kernels instead")
def test_kernels_match_float64_in_triton_interpreter(triton_interpreter):
    code = ("import json, step_kernel_checks as c\n"
            "print('RESULT ' + json.dumps({**c.check_scaled_weight('cpu'), **c.check_kd('cpu'),\n"
            "                              **c.check_grouped('cpu')}))\n")
    out = triton_interpreter.run(code, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    _check(json.loads(line.removeprefix("RESULT ")), interpreter=True)


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and Triton")
def test_kernels_match_float64_on_cuda():
    sys.path.insert(0, str(Path(__file__).parent))
    import step_kernel_checks as c

    _check({**c.check_scaled_weight("cuda"), **c.check_kd("cuda"), **c.check_grouped("cuda")}, interpreter=False)


# ------------------------------------------------------------------------------------------------ dispatch
def test_cpu_tensors_take_the_torch_paths(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    s = torch.randn(4, 8)
    assert distill.kd_path(s, s, 1.0, True) == "reference"
    assert triton_runs_on(torch.device("cpu")) is not None
    # ScaledLinear's CPU backward never asks for the kernel
    monkeypatch.setattr(sw, "_kernel", lambda: pytest.fail("the CPU backward must not load the CUDA kernel"))
    w = torch.randn(4, 8, requires_grad=True)
    a = torch.ones(4, 2, requires_grad=True)
    sw.scaled_weight(w, a, 2, False, torch.float32).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(4, 8))


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_kernels_refuse_what_they_do_not_take(monkeypatch):
    # imported BEFORE the interpreter switch: @triton.jit decides at import whether a kernel is interpreted,
    # and the compile tests below need real JIT functions
    from cast_llm.distill import triton_kd
    from cast_llm.nn import triton_scaled_weight

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors count as kernel tensors: only the checks below decide

    f32 = torch.zeros(4, 8)
    assert triton_kd.unsupported_reason(f32, f32) is None
    assert "float64" in triton_kd.unsupported_reason(f32.double(), None)
    assert "contiguous" in triton_kd.unsupported_reason(torch.zeros(8, 4).t(), None)
    assert triton_scaled_weight.unsupported_reason(f32, f32, torch.ones(4, 2)) is None
    assert "scale dtype" in triton_scaled_weight.unsupported_reason(f32, f32, torch.ones(4, 2, dtype=torch.float64))
    assert "float64" in triton_scaled_weight.unsupported_reason(f32.double(), f32.double(), torch.ones(4, 2))
    # float64 logits (the reference tests) keep the torch path even where the kernel could run
    assert distill.kd_path(f32.double(), None, 1.0, True) == "reference"


def test_triton_runs_on_says_triton_is_missing(monkeypatch):
    monkeypatch.setattr(triton_support, "IMPORT_ERROR", "Triton is not importable (test)")
    assert triton_runs_on(torch.device("cuda")) == "Triton is not importable (test)"


# ------------------------------------------------------------------------------ compiled for an H100
def _compile_for_h100(fn, sig: dict, consts: dict, num_warps: int, plain: tuple[str, ...] = ()):
    """Compile ``fn`` for sm_90 ahead of time, specialised as Triton's JIT specialises a real launch:
    integers equal to 1 become constants, pointers and the other integers (but ``plain``) are 16-divisible
    (aligned allocations, widths that are multiples of 16). Returns the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **{k: "constexpr" for k in consts}}
    names = fn.arg_names
    div = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
           if t != "constexpr" and not t.startswith("fp") and n not in plain}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=div),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert kernel.asm["cubin"]
    return kernel.asm["ptx"]


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its bundled ptxas compiles without a GPU)")
@pytest.mark.parametrize("has_t,unit_t,need_grad", [(True, True, True), (True, False, True), (False, True, False)])
def test_kd_kernel_compiles_for_h100_with_vector_loads(monkeypatch, has_t, unit_t, need_grad):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    from cast_llm.distill.triton_kd import _BLOCK, _NUM_WARPS, _kd_kernel

    sig = {"s_ptr": "*bf16", "t_ptr": "*bf16", "y_ptr": "*i64", "g_ptr": "*bf16", "kl_ptr": "*fp32",
           "ce_ptr": "*fp32", "inv_n_ptr": "*fp32", "V": "i32", "s_stride": "i32", "t_stride": "i32",
           "g_stride": "i32", "ignore_index": "i32", "eta": "fp32", "temperature": "fp32", "inv_t": "fp32"}
    consts = dict(y_stride=1, HAS_T=has_t, UNIT_T=unit_t, NEED_GRAD=need_grad, BLOCK=_BLOCK)  # contiguous labels
    ptx = _compile_for_h100(_kd_kernel, sig, consts, _NUM_WARPS, plain=("ignore_index",))
    assert "ld.global.v" in ptx  # 16-byte loads of the logits rows
    assert ("st.global.v" in ptx) == need_grad  # the gradient row, only when asked for


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its bundled ptxas compiles without a GPU)")
@pytest.mark.parametrize("layout,grad_dtype,w_dtype,need_w,need_a", [
    ("row-major", "bf16", "fp32", True, True),  # nn.Linear under bf16 autocast, fp32 master weights
    ("transposed", "fp16", "bf16", True, False),  # Conv1D, a frozen scale
])
def test_scaled_weight_kernel_compiles_for_h100(monkeypatch, layout, grad_dtype, w_dtype, need_w, need_a):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    from cast_llm.nn.triton_scaled_weight import _NUM_WARPS, _scaled_weight_grad_kernel

    sig = {"g_ptr": f"*{grad_dtype}", "w_ptr": f"*{w_dtype}", "a_ptr": "*fp32", "gw_ptr": f"*{w_dtype}",
           "ga_ptr": "*fp32", "R": "i32", "K": "i32"}
    unit = ("g_sc", "w_sc", "gw_sc") if layout == "row-major" else ("g_sr", "w_sr", "gw_sr")
    sig.update({n: "i32" for n in ("g_sr", "g_sc", "w_sr", "w_sc", "gw_sr", "gw_sc", "a_sr", "a_sg", "ga_sr",
                                   "ga_sg") if n not in unit})
    consts = {n: 1 for n in unit}
    block = (16, 128) if layout == "row-major" else (128, 16)
    consts.update(NEED_W=need_w, NEED_A=need_a, BLOCK_R=block[0], BLOCK_K=block[1])
    # the scale's strides (n_groups, 1): 2 is no multiple of 16
    ptx = _compile_for_h100(_scaled_weight_grad_kernel, sig, consts, _NUM_WARPS, plain=("a_sr", "ga_sr", "a_sg", "ga_sg"))
    assert "ld.global.v" in ptx


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its bundled ptxas compiles without a GPU)")
@pytest.mark.parametrize("direction,transposed", [("fwd", False), ("bwd", False), ("bwd", True)])
def test_grouped_scaled_weight_kernels_compile_for_h100_with_vector_loads(monkeypatch, direction, transposed):
    """The block-grouped kernels (addresses from a table, UNIT = 16: aligned, sizes multiples of 16)."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    from cast_llm.nn import triton_scaled_weight as k

    block = (128, 16) if transposed else (16, 128)
    consts = dict(TRANSPOSED=transposed, UNIT=16, BLOCK_R=block[0], BLOCK_K=block[1])
    sig = {"table_ptr": "*i64", "n_members": "i32", "n_groups": "i32"}
    if direction == "fwd":
        sig.update(w0="*fp32", a0="*fp32", out0="*bf16")
        fn = k._grouped_fwd_kernel
    else:
        sig.update(g0="*bf16", w0="*fp32", a0="*fp32", gw0="*fp32", ga0="*fp32")
        consts.update(NEED_W=True, NEED_A=True)
        fn = k._grouped_bwd_kernel
    ptx = _compile_for_h100(fn, sig, consts, k._NUM_WARPS, plain=("n_members", "n_groups"))
    assert "ld.global.v" in ptx


def test_every_triton_launch_pins_floating_point_fusion():
    """Triton's default for contracting a*b+c into an FMA is due to change (3.10): every launch says what it was
    checked and measured with (cast_llm.triton_support.FP_FUSION)."""
    import re

    src = Path(__file__).parents[1] / "src" / "cast_llm"
    launches = pinned = 0
    for f in (src / "distill" / "triton_kd.py", src / "nn" / "triton_scaled_weight.py", src / "optim" / "triton_adams.py"):
        text = f.read_text()
        launches += len(re.findall(r"_kernel\[.*?\]\(", text))
        pinned += text.count("enable_fp_fusion=FP_FUSION")
    assert launches == 7 and pinned == launches, (launches, pinned)
