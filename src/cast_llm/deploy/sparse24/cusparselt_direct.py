"""cuSPARSELt called directly, one matmul plan per shape: the ``cusparselt-direct`` kernel.

Why: torch's ``_cslt_sparse_mm`` initialises descriptors, a plan and a workspace on **every** call and destroys
them again (aten/src/ATen/native/sparse/cuda/cuSPARSELtOps.cpp), which cost ≈0.5-1 ms of host time per
matmul on the H100 of docs/results/gpu — more than the GEMM itself at most LLaMA shapes. This module builds
the same plan once per (device, dtype, out, in, rows) and then only calls ``cusparseLtMatmul``; the plans
live in a :class:`~cast_llm.deploy.sparse24.plans.PlanCache` (the algorithm searched once per token bucket,
evicted plans destroyed, nothing created during a CUDA-graph capture), built and run with the tensors'
device current.

What it calls: the ``libcusparseLt`` that torch itself loaded (found in ``/proc/self/maps``), so the
compressed weights of ``torch._cslt_compress`` are in this library's own format. The C signatures and enum
values are those of cuSPARSELt 0.6 (its ``cusparseLt.h``) and 0.7.1-0.8.1 (NVIDIA's nvmath-python bindings,
generated from those headers); other versions are refused. The layouts are torch's: ``A`` = the weight,
structured, ``(out, in)`` row-major; ``B`` = the activations ``(n, in)`` row-major used with
``opB = TRANSPOSE``; ``C = D = (out, n)`` column-major, i.e. ``y (n, out)`` row-major. Alpha/beta are host
floats (compute type 32F).

A wrong ctypes binding crashes instead of raising, so before first use :func:`unavailable_reason` runs
:func:`_probe_main` in a child process (GEMMs at SmolLM2 and LLaMA shapes checked against ``F.linear``, and
once inside a CUDA graph); a crash or a wrong result there disables this kernel with the reason. Set
``CAST_SPARSE24_DIRECT=0`` to disable it, ``=1`` to skip the probe.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from cast_llm.deploy.sparse24.capture import capturing
from cast_llm.deploy.sparse24.plans import PlanCache
from cast_llm.errors import CastError
from cast_llm.sparsity.mask import nm_mask

__all__ = ["PLANS", "binding_reason", "crash_probe_reason", "has_plan", "library_version", "mm", "plan_config",
           "start_probe", "unavailable_reason"]

# opaque structs are uint8 arrays: 13,072 bytes in cuSPARSELt 0.6, 512 in 0.7-0.8; this covers both
_STRUCT_BYTES = 16384
SUPPORTED_MINOR = range(6, 9)  # 0.6.x - 0.8.x

# enum values: library_types.h (cudaDataType, libraryPropertyType), cusparse.h (order, operation, status),
# cusparseLt.h 0.6-0.8 (sparsity, compute type, algorithm attributes)
_CUDA_TYPE = {torch.float16: 2, torch.bfloat16: 14}
_ORDER_COL, _ORDER_ROW = 1, 2
_OP_NON_TRANSPOSE, _OP_TRANSPOSE = 0, 1
_SPARSITY_50_PERCENT = 0
_COMPUTE_32F = 2
_ALG_DEFAULT = 0
_ALG_CONFIG_ID, _SPLIT_K, _SPLIT_K_MODE = 0, 3, 4
_MAJOR_VERSION, _MINOR_VERSION, _PATCH_LEVEL = 0, 1, 2
_ALIGNMENT = 16  # bytes, as torch passes

_SIGNATURES = {
    "Init": ["p"],
    "GetProperty": ["i", "P"],
    "StructuredDescriptorInit": ["p", "p", "q", "q", "q", "u", "i", "i", "i"],
    "DenseDescriptorInit": ["p", "p", "q", "q", "q", "u", "i", "i"],
    "MatmulDescriptorInit": ["p", "p", "i", "i", "p", "p", "p", "p", "i"],
    "MatmulAlgSelectionInit": ["p", "p", "p", "i"],
    "MatmulAlgSetAttribute": ["p", "p", "i", "p", "z"],
    "MatmulAlgGetAttribute": ["p", "p", "i", "p", "z"],
    "MatmulPlanInit": ["p", "p", "p", "p"],
    "MatmulGetWorkspace": ["p", "p", "p"],
    "Matmul": ["p", "p", "p", "p", "p", "p", "p", "p", "p", "p", "i"],
    "MatmulSearch": ["p", "p", "p", "p", "p", "p", "p", "p", "p", "p", "i"],
    "MatmulPlanDestroy": ["p"],
    "MatDescriptorDestroy": ["p"],
}
_CTYPES = {"p": ctypes.c_void_p, "P": ctypes.POINTER(ctypes.c_int), "i": ctypes.c_int, "q": ctypes.c_int64,
           "u": ctypes.c_uint32, "z": ctypes.c_size_t}


def _mapped_library() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcusparseLt" in line:
                    return line.split(None, 5)[-1].strip()
    except OSError:
        pass
    return None


def _find_library() -> str | None:
    """Path of the libcusparseLt torch loaded (so ours is the same build torch compresses with)."""
    path = _mapped_library()
    if path is None and torch.cuda.is_available() and torch.backends.cusparselt.is_available():
        # a torch that loads it lazily: one tiny compression maps it in
        torch._cslt_compress(torch.zeros(16, 16, dtype=torch.float16, device="cuda"))
        path = _mapped_library()
    return path


class _Library:
    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, "cusparseLt" + name)  # AttributeError: not the API this binding knows
            fn.argtypes = [_CTYPES[a] for a in args]
            fn.restype = ctypes.c_int
            setattr(self, name, fn)
        self.path = path
        value = ctypes.c_int()
        parts = []
        for prop in (_MAJOR_VERSION, _MINOR_VERSION, _PATCH_LEVEL):
            _check(self.GetProperty(prop, ctypes.byref(value)), "GetProperty")
            parts.append(value.value)
        self.version = tuple(parts)
        self.handles: dict[int, ctypes.Array] = {}

    def handle(self, device_index: int) -> int:
        buf = self.handles.get(device_index)
        if buf is None:
            buf = ctypes.create_string_buffer(_STRUCT_BYTES)
            with torch.cuda.device(device_index):  # a handle is bound to the device current at init
                _check(self.Init(ctypes.addressof(buf)), "Init")
            self.handles[device_index] = buf
        return ctypes.addressof(buf)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CastError(f"cuSPARSELt {what} failed with cusparseStatus_t {status}")


_LIB: _Library | None = None
_LIB_REASON: str | None = None
_LIB_TRIED = False


def _library() -> tuple[_Library | None, str | None]:
    global _LIB, _LIB_REASON, _LIB_TRIED
    if not _LIB_TRIED:
        _LIB_TRIED = True
        path = _find_library()
        if path is None:
            _LIB_REASON = "libcusparseLt is not loaded in this process (torch without cuSPARSELt?)"
        else:
            try:
                _LIB = _Library(path)
                major, minor, _ = _LIB.version
                if major != 0 or minor not in SUPPORTED_MINOR:
                    _LIB_REASON = (f"cuSPARSELt {'.'.join(map(str, _LIB.version))} is outside the versions this "
                                   f"binding follows (0.6-0.8)")
                    _LIB = None
            except (OSError, AttributeError, CastError) as e:
                _LIB_REASON = f"cannot bind {path}: {e}"
                _LIB = None
    return _LIB, _LIB_REASON


def library_version() -> str | None:
    """The loaded cuSPARSELt's version (``"0.8.0"``), or None if it cannot be bound."""
    lib, _ = _library()
    return None if lib is None else ".".join(map(str, lib.version))


class _Plan:
    """Descriptors, algorithm and plan of one ``D (out, n) = W (out, in) · xᵀ`` problem, plus its workspace."""

    def __init__(self, lib: _Library, device: torch.device, dtype: torch.dtype, m: int, k: int, n: int,
                 config: dict | None = None):
        self.lib = lib
        self.device = device
        self.handle = lib.handle(device.index or 0)
        self.bufs = [ctypes.create_string_buffer(_STRUCT_BYTES) for _ in range(6)]
        self.a, self.b, self.c, self.matmul, self.alg, self.plan = (ctypes.addressof(b) for b in self.bufs)
        cuda_type = _CUDA_TYPE[dtype]
        h = self.handle
        _check(lib.StructuredDescriptorInit(h, self.a, m, k, k, _ALIGNMENT, cuda_type, _ORDER_ROW,
                                            _SPARSITY_50_PERCENT), "StructuredDescriptorInit")
        _check(lib.DenseDescriptorInit(h, self.b, n, k, k, _ALIGNMENT, cuda_type, _ORDER_ROW), "DenseDescriptorInit")
        _check(lib.DenseDescriptorInit(h, self.c, m, n, m, _ALIGNMENT, cuda_type, _ORDER_COL), "DenseDescriptorInit")
        _check(lib.MatmulDescriptorInit(h, self.matmul, _OP_NON_TRANSPOSE, _OP_TRANSPOSE, self.a, self.b, self.c,
                                        self.c, _COMPUTE_32F), "MatmulDescriptorInit")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.streams = (ctypes.c_void_p * 1)()
        self.config = dict(config or {"alg_id": 0, "split_k": 1, "split_k_mode": 0})
        self._init_plan(device)
        self.pinned = False  # set by the plan cache when a CUDA graph captured this plan

    def _init_plan(self, device: torch.device) -> None:
        lib, h = self.lib, self.handle
        _check(lib.MatmulAlgSelectionInit(h, self.alg, self.matmul, _ALG_DEFAULT), "MatmulAlgSelectionInit")
        for attr, key in ((_ALG_CONFIG_ID, "alg_id"), (_SPLIT_K, "split_k"), (_SPLIT_K_MODE, "split_k_mode")):
            if key == "split_k" and self.config["split_k"] == 1:
                break  # torch sets split-K (and its mode) only when the search chose one
            if key == "split_k_mode" and self.config["split_k_mode"] <= 0:
                break
            value = ctypes.c_int(self.config[key])
            _check(lib.MatmulAlgSetAttribute(h, self.alg, attr, ctypes.addressof(value), ctypes.sizeof(value)),
                   "MatmulAlgSetAttribute")
        _check(lib.MatmulPlanInit(h, self.plan, self.matmul, self.alg), "MatmulPlanInit")
        size = ctypes.c_size_t()
        _check(lib.MatmulGetWorkspace(h, self.plan, ctypes.addressof(size)), "MatmulGetWorkspace")
        self.workspace = torch.empty(max(int(size.value), 1), dtype=torch.uint8, device=device)

    def search(self, packed: torch.Tensor, x2d: torch.Tensor, m: int) -> dict:
        """cusparseLtMatmulSearch on this plan; returns the chosen algorithm and split-K settings."""
        out = torch.empty((x2d.shape[0], m), dtype=x2d.dtype, device=x2d.device)
        self._call(self.lib.MatmulSearch, packed, x2d, out)
        got = {}
        for attr, key in ((_ALG_CONFIG_ID, "alg_id"), (_SPLIT_K, "split_k"), (_SPLIT_K_MODE, "split_k_mode")):
            value = ctypes.c_int()
            _check(self.lib.MatmulAlgGetAttribute(self.handle, self.alg, attr, ctypes.addressof(value),
                                                  ctypes.sizeof(value)), "MatmulAlgGetAttribute")
            got[key] = int(value.value)
        return got

    def _call(self, fn, packed: torch.Tensor, x2d: torch.Tensor, out: torch.Tensor) -> None:
        self.streams[0] = _stream(x2d.device)
        status = fn(self.handle, self.plan, ctypes.addressof(self.alpha), packed.data_ptr(), x2d.data_ptr(),
                    ctypes.addressof(self.beta), out.data_ptr(), out.data_ptr(), self.workspace.data_ptr(),
                    ctypes.addressof(self.streams), 1)
        _check(status, "Matmul")

    def run(self, packed: torch.Tensor, x2d: torch.Tensor, out: torch.Tensor) -> None:
        self._call(self.lib.Matmul, packed, x2d, out)

    def destroy(self) -> None:
        """Release the plan and the three matrix descriptors (and, with this object, the workspace)."""
        _check(self.lib.MatmulPlanDestroy(self.plan), "MatmulPlanDestroy")
        for desc in (self.a, self.b, self.c):
            _check(self.lib.MatDescriptorDestroy(desc), "MatDescriptorDestroy")
        self.workspace = None


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _on(device: torch.device):
    """The cuSPARSELt handle and the current stream belong to a device: make ``device`` current (multi-GPU)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _build(shape: tuple, n: int, config: dict) -> _Plan:
    index, dtype, m, k = shape
    lib, _ = _library()
    return _Plan(lib, torch.device("cuda", index), dtype, m, k, n, config)


def _search(shape: tuple, n: int, inputs) -> dict:
    """The algorithm for ``shape``'s bucket, searched on this ``n``'s inputs with a throw-away plan."""
    packed, x2d = inputs
    index, dtype, m, k = shape
    lib, _ = _library()
    probe = _Plan(lib, torch.device("cuda", index), dtype, m, k, n)
    try:
        return probe.search(packed, x2d, m)
    finally:
        probe.destroy()


PLANS = PlanCache(_build, _search, capacity=256)


def mm(packed: torch.Tensor, x2d: torch.Tensor, out_features: int) -> torch.Tensor:
    """``y (n, out) = x2d (n, in) · Wᵀ`` with ``packed = torch._cslt_compress(W)``; ``n`` already padded.

    The plan comes from :data:`PLANS` (one algorithm search per token bucket); during a CUDA-graph capture a
    missing plan raises :class:`~cast_llm.deploy.sparse24.plans.PlanNotReady` (nothing is created then)."""
    lib, reason = _library()
    if lib is None:
        raise CastError(f"the direct cuSPARSELt kernel is unavailable: {reason}")
    if x2d.data_ptr() % _ALIGNMENT:
        x2d = x2d.clone()  # a view at an odd offset; cuSPARSELt wants 16-byte aligned operands
    n, k = x2d.shape
    device = x2d.device
    with _on(device):
        plan = PLANS.get((device.index or 0, x2d.dtype, out_features, k), n, capturing=capturing(),
                         inputs=(packed, x2d))
        out = torch.empty((n, out_features), dtype=x2d.dtype, device=device)
        plan.run(packed, x2d, out)
    return out


def has_plan(dtype: torch.dtype, out_features: int, in_features: int, rows: int, device_index: int = 0) -> bool:
    """Whether a plan for exactly these ``rows`` exists (a CUDA-graph capture can use it)."""
    return (device_index, dtype, out_features, in_features, rows) in PLANS.plans


def plan_config(dtype: torch.dtype, out_features: int, in_features: int, rows: int, device_index: int = 0) -> dict | None:
    """The algorithm / split-K settings that serve a shape and row count, once its bucket was searched."""
    config = PLANS.config((device_index, dtype, out_features, in_features), rows)
    return None if config is None else dict(config)


# -- the probe ----------------------------------------------------------------------------------------------

_PROBES: dict[int, object] = {}  # device index -> Popen (running) or str | None (result)


def _probe_command(device_index: int) -> list[str]:
    return [sys.executable, "-c",
            f"from cast_llm.deploy.sparse24.cusparselt_direct import _probe_main; _probe_main({device_index})"]


def start_probe(device: torch.device | int = 0) -> None:
    """Start the probe process now (it takes ~10 s, mostly importing torch), so that it overlaps other work."""
    index = device if isinstance(device, int) else (torch.device(device).index or 0)
    if index in _PROBES or os.environ.get("CAST_SPARSE24_DIRECT") in ("0", "1"):
        return
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[3])  # the directory holding cast_llm/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    _PROBES[index] = subprocess.Popen(_probe_command(index), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)


def _probe_result(index: int, timeout: float = 120.0) -> str | None:
    start_probe(index)
    state = _PROBES[index]
    if isinstance(state, subprocess.Popen):
        try:
            out, err = state.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            state.kill()
            out, err = state.communicate()
            _PROBES[index] = f"the direct cuSPARSELt probe did not finish in {timeout:.0f} s"
            return _PROBES[index]
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if state.returncode != 0 or not lines:
            tail = (err.strip().splitlines() or ["no output"])[-1][:200]
            how = f"signal {-state.returncode}" if state.returncode < 0 else f"exit code {state.returncode}"
            _PROBES[index] = f"the direct cuSPARSELt probe process failed ({how}): {tail}"
        else:
            result = json.loads(lines[-1])
            _PROBES[index] = None if result.get("ok") else f"the direct cuSPARSELt probe failed: {result.get('reason')}"
    return _PROBES[index]


def binding_reason(device: torch.device) -> str | None:
    """None if this process can bind the library torch loaded (cheap: no probe), else why not."""
    if os.environ.get("CAST_SPARSE24_DIRECT") == "0":
        return "disabled by CAST_SPARSE24_DIRECT=0"
    torch.cuda.init()  # torch loads libcusparseLt with its CUDA libraries
    return _library()[1]


def crash_probe_reason(device: torch.device) -> str | None:
    """The child-process probe's verdict (a wrong binding crashes instead of raising); skipped with
    ``CAST_SPARSE24_DIRECT=1``."""
    if os.environ.get("CAST_SPARSE24_DIRECT") == "1":
        return None
    return _probe_result(device.index or 0)


def unavailable_reason(device: torch.device) -> str | None:
    """None if the direct kernel can be used on ``device``, else why not (runs the probe once per device)."""
    return binding_reason(device) or crash_probe_reason(device)


def _probe_main(device_index: int = 0) -> None:
    """Child-process check: this binding's GEMMs against ``F.linear`` (eager and in a CUDA graph)."""
    import torch.nn.functional as F

    def fail(reason: str) -> None:
        print(json.dumps({"ok": False, "reason": reason}), flush=True)
        sys.exit(0)

    torch.cuda.set_device(device_index)
    torch.cuda.init()
    lib, reason = _library()
    if lib is None:
        fail(reason)
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for m, k in ((192, 576), (576, 1536), (4096, 4096)):
            w = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
            w.masked_fill_(~nm_mask(w, 2, 4), 0)
            packed = torch._cslt_compress(w)
            for n in (8, 16, 40, 256):
                x = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype)
                ref = F.linear(x, w).float()
                err = float((mm(packed, x, m).float() - ref).abs().max() / ref.abs().max())
                if not err <= 0.02:
                    fail(f"{dtype} ({m}, {k}) x {n} rows: max|Δ|/max|y| = {err:.3g}")
    # inside a CUDA graph: the plan exists, only cusparseLtMatmul is captured
    w = torch.randn(576, 576, generator=gen).to(device=device, dtype=torch.bfloat16)
    w.masked_fill_(~nm_mask(w, 2, 4), 0)
    packed = torch._cslt_compress(w)
    x = torch.randn(16, 576, generator=gen).to(device=device, dtype=torch.bfloat16)
    mm(packed, x, 576)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mm(packed, x, 576)
    x.copy_(torch.randn(16, 576, generator=gen).to(device=device, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    ref = F.linear(x, w).float()
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    if not err <= 0.02:
        fail(f"inside a CUDA graph: max|Δ|/max|y| = {err:.3g}")
    print(json.dumps({"ok": True, "version": library_version(), "library": lib.path}), flush=True)
