"""The 2:4 sparse GEMMs a :class:`~cast_llm.deploy.sparse24.Sparse24Linear` can call, behind one interface.

Every kernel computes ``y = x Wᵀ (+ b)`` for a weight ``W (out, in)`` that is exactly 2:4 along ``in``, from a
compressed form made **once** at load (:meth:`Kernel.compress`). The caller (:func:`sparse_linear`) flattens
``x`` to ``(n, in)`` rows, pads ``n`` up to the kernel's row multiple, calls :meth:`Kernel.mm` and slices the
padding off again — a view, no copy.

* ``cusparselt`` — torch's cuSPARSELt op ``torch._cslt_sparse_mm(packed, xᵀ, bias, transpose_result=True,
  alg_id, …)`` (aten/src/ATen/native/sparse/cuda/cuSPARSELtOps.cpp). ``packed = torch._cslt_compress(W)``
  holds the kept half and the metadata in one tensor. The weight is the sparse operand ``A (m=out, k=in)``,
  row-major; ``xᵀ`` is passed as a transposed view, which the op describes as a row-major ``(n, k)`` matrix
  with ``opB = TRANSPOSE`` (no copy); ``transpose_result=True`` makes the op write ``D = W xᵀ`` column-major,
  i.e. ``y (n, out)`` row-major — again no copy. Bias is fused (cuSPARSELt's bias pointer, one value per
  output feature); the output dtype is the input's (``out_dtype`` is for int8/fp8 inputs only). The algorithm
  is searched once per shape and token count (``torch._C._cusparselt.mm_search`` where torch has it, which
  also returns split-K settings; ``torch._cslt_sparse_mm_search`` before that) and cached per token bucket
  (the dispatch's). **Every call still builds and destroys a cuSPARSELt plan inside the op** (≈0.5 ms of host
  time on the H100 of docs/results/gpu): fine inside a CUDA graph, where only the kernel is replayed, ruinous
  in eager mode.
* ``cusparselt-direct`` — the same packed weight and the same cuSPARSELt library, called through
  :mod:`.cusparselt_direct` with the plan built once per shape (a few µs of host time per call). Probed in a
  child process before first use, because a wrong C binding would crash rather than raise.
* ``cutlass`` — torch's CUTLASS ops ``torch._sparse_semi_structured_mm / _addmm`` with
  ``(values, meta) = torch._to_sparse_semi_structured(W)``. These are Ampere (sm8x) kernels and torch refuses
  them on any other compute capability, so on Hopper this kernel is unavailable. The op writes ``W xᵀ``
  row-major, so ``y`` needs one transpose copy.
* ``cpu-avx512-bf16`` / ``cpu-avx512`` / ``cpu-avx2`` / ``cpu-unpack`` (and the lossy ``cpu-w8-*``) — the CPU
  extension's kernels (:mod:`.cpu`, docs/deployment.md "On the CPU"): they read kept values + 2-bit positions
  directly; checked paths ``sparse24.cpu_gemm.bfloat16`` / ``.float32`` against a float64 product;
* ``emulated`` — a pure-torch reference of the compressed form (kept values + 2-bit positions, decompressed,
  accumulated in fp32, rounded once): it runs on the CPU so that the padding, slicing, bias and layout logic
  around the real kernels is tested without a GPU.

Shape rules (``shape_error``) follow torch's own tables (``SparseSemiStructuredTensor*._DTYPE_SHAPE_CONSTRAINTS``)
and are pure functions, tested on CPU.

The three GPU kernels are the candidates of the checked kernel path ``sparse24.gemm`` (:mod:`cast_llm.kernels`):
before a kernel is offered to a layer (:func:`available_kernels`) it is probed once per device and dtype —
a 2:4 GEMM at SmolLM2 shapes against ``F.linear`` (max|Δ|/max|y| ≤ 0.02) — and a kernel that fails is never
offered again on this machine (the verdict is cached); ``CAST_LLM_KERNELS=reference`` offers none (dense).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cast_llm import kernels
from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24 import cusparselt_direct
from cast_llm.deploy.sparse24.buckets import token_bucket
from cast_llm.deploy.sparse24.capture import capturing
from cast_llm.deploy.sparse24.cycles import cycled
from cast_llm.sparsity.mask import nm_mask

__all__ = [
    "CPU_KERNELS",
    "CPU_W8_KERNELS",
    "GPU_KERNELS",
    "default_kernels",
    "KERNELS",
    "Kernel",
    "available_kernels",
    "padded_rows",
    "sparse_linear",
    "SPARSE24_GEMM",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def padded_rows(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (at least one multiple: the kernels need ``n ≥ 1``)."""
    if multiple < 1:
        raise ValueError(f"row multiple must be >= 1, got {multiple}")
    return max(multiple, -(-n // multiple) * multiple)


def _torch_constraints(cls_name: str, dtype: torch.dtype, default: tuple[int, int, int, int]):
    """(sparse_min_rows, sparse_min_cols, dense_min_rows, dense_min_cols) from torch's own table, where it has
    one for ``dtype``; ``default`` otherwise (older torch, or a dtype torch does not list)."""
    try:
        import torch.sparse as ts

        table = getattr(ts, cls_name)._DTYPE_SHAPE_CONSTRAINTS
        c = table[dtype]
        return (c.sparse_min_rows, c.sparse_min_cols, c.dense_min_rows, c.dense_min_cols)
    except (AttributeError, KeyError, ImportError):
        return default


def _cuda_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"2:4 tensor-core kernels run on CUDA devices only, not on {device}"
    if not torch.cuda.is_available():
        return "2:4 tensor-core kernels need a CUDA GPU; no CUDA device is available here"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 0):
        return (f"2:4 tensor-core kernels need compute capability >= 8.0; {torch.cuda.get_device_name(device)} "
                f"has {cap[0]}.{cap[1]}")
    return None


class Kernel:
    """One 2:4 GEMM. ``fmt`` names the compressed form (kernels of one format share a compressed tensor);
    ``fuses_bias``: the kernel adds the bias in its epilogue (else :func:`sparse_linear` adds it after)."""

    def __init__(self, name: str, fmt: str, fuses_bias: bool = True):
        self.name, self.fmt, self.fuses_bias = name, fmt, fuses_bias

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- what it can run -------------------------------------------------------------------------
    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        raise NotImplementedError

    def shape_error(self, out_features: int, in_features: int, dtype: torch.dtype) -> str | None:
        raise NotImplementedError

    def row_multiple(self, dtype: torch.dtype) -> int:
        raise NotImplementedError

    # -- the work --------------------------------------------------------------------------------
    def compress(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def decompress(self, state: dict[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        raise NotImplementedError

    def mm(self, x2d: torch.Tensor, state: dict[str, torch.Tensor], bias: torch.Tensor | None,
           out_features: int) -> torch.Tensor:
        """``(n, in)`` contiguous rows (``n`` a multiple of :meth:`row_multiple`) → ``(n, out)`` contiguous."""
        raise NotImplementedError

    def bind(self, state: dict[str, torch.Tensor], bias: torch.Tensor | None, in_features: int, out_features: int):
        """``x -> x Wᵀ + b`` for one layer's compressed weight: the callable its forward runs (the hot path)."""
        return lambda x: sparse_linear(self, x, state, bias, out_features)


def _multiple_error(out_features: int, in_features: int, rows: int, cols: int, what: str) -> str | None:
    if out_features % rows or in_features % cols or out_features < rows or in_features < cols:
        return (f"shape ({out_features}, {in_features}) is not a multiple of ({rows}, {cols}) as {what} "
                f"requires")
    return None


class _CusparseltBase(Kernel):
    def unavailable_reason(self, device, dtype):
        reason = _cuda_reason(torch.device(device))
        if reason:
            return reason
        if not torch.backends.cusparselt.is_available():
            return "this torch build has no cuSPARSELt (torch.backends.cusparselt.is_available() is False)"
        if dtype not in HALF_DTYPES:
            # torch dropped fp32 from its cuSPARSELt path (wrong results on Hopper, pytorch#134022)
            return f"cuSPARSELt 2:4 kernels take float16 or bfloat16 here, not {dtype}; load the model in bf16/fp16"
        return None

    def shape_error(self, out_features, in_features, dtype):
        rows, cols, _, _ = _torch_constraints("SparseSemiStructuredTensorCUSPARSELT", dtype, (16, 16, 8, 8))
        return _multiple_error(out_features, in_features, rows, cols, "cuSPARSELt")

    def row_multiple(self, dtype):
        # torch pads the dense operand to this many rows (8 for 16-bit types in torch 2.13); never fewer than 8
        return max(8, _torch_constraints("SparseSemiStructuredTensorCUSPARSELT", dtype, (16, 16, 16, 16))[2])

    def compress(self, weight):
        return {"packed": torch._cslt_compress(weight.contiguous())}

    def decompress(self, state, out_features, in_features):
        # W @ I: every output sums one non-zero product, accumulated in fp32 -> exact (torch's own to_dense)
        eye = torch.eye(in_features, dtype=state["packed"].dtype, device=state["packed"].device)
        return torch._cslt_sparse_mm(state["packed"], eye)


def _cslt_mm_kwargs() -> tuple[str | None, type]:
    """The split-K mode argument of this torch's ``_cslt_sparse_mm`` (``split_k_mode: int`` in torch ≥ 2.9,
    ``split_k_one_kernel: bool`` in 2.6-2.8, none before) and its type."""
    names = [a.name for a in torch.ops.aten._cslt_sparse_mm.default._schema.arguments]
    if "split_k_mode" in names:
        return "split_k_mode", int
    if "split_k_one_kernel" in names:
        return "split_k_one_kernel", bool
    return None, int


class CusparseltOpKernel(_CusparseltBase):
    """torch's ``_cslt_sparse_mm`` with the algorithm searched once per (shape, rows) and cached."""

    def __init__(self):
        super().__init__(name="cusparselt", fmt="cusparselt", fuses_bias=True)
        self._configs: dict = {}

    def _search(self, packed: torch.Tensor, dense_t: torch.Tensor) -> dict:
        mode_name, mode_type = _cslt_mm_kwargs()
        search = getattr(getattr(torch._C, "_cusparselt", None), "mm_search", None)
        if search is not None and mode_name is not None:
            try:
                alg_id, split_k, mode, _max_alg = search(packed, dense_t, None, None, None, True)
                return {"alg_id": int(alg_id), "split_k": int(split_k), mode_name: mode_type(mode)}
            except (RuntimeError, TypeError, ValueError):
                pass  # fall back to the older search, which only chooses the algorithm
        try:
            return {"alg_id": int(torch._cslt_sparse_mm_search(packed, dense_t, transpose_result=True))}
        except (RuntimeError, AttributeError):
            return {"alg_id": 0}

    def mm(self, x2d, state, bias, out_features):
        packed = state["packed"]
        # one search per token bucket (the dispatch's): a new prompt length reuses its bucket's algorithm
        key = (packed.dtype, out_features, x2d.shape[1], token_bucket(x2d.shape[0]), packed.device.index)
        cfg = self._configs.get(key)
        if cfg is None:
            if capturing():
                cfg = {"alg_id": 0}  # a search times kernels and synchronises: impossible while capturing
            else:
                cfg = self._configs[key] = self._search(packed, x2d.t())
        return torch._cslt_sparse_mm(packed, x2d.t(), bias=bias, transpose_result=True, **cfg)


class CusparseltDirectKernel(_CusparseltBase):
    """The cuSPARSELt library called with plans built once per shape (:mod:`.cusparselt_direct`)."""

    def __init__(self):
        super().__init__(name="cusparselt-direct", fmt="cusparselt", fuses_bias=False)

    def unavailable_reason(self, device, dtype):
        reason = super().unavailable_reason(device, dtype)
        if reason:
            return reason
        # the child-process probe runs as part of this kernel's check (sparse24.gemm): see available_kernels
        return cusparselt_direct.binding_reason(torch.device(device))

    def mm(self, x2d, state, bias, out_features):
        return cusparselt_direct.mm(state["packed"], x2d, out_features)


class CutlassKernel(Kernel):
    """torch's CUTLASS 2:4 ops (Ampere only)."""

    def __init__(self):
        super().__init__(name="cutlass", fmt="cutlass", fuses_bias=True)

    def unavailable_reason(self, device, dtype):
        reason = _cuda_reason(torch.device(device))
        if reason:
            return reason
        cap = torch.cuda.get_device_capability(device)
        if cap[0] != 8:
            # aten/src/ATen/native/sparse/cuda/SparseSemiStructuredOps.cu: "Supported only on GPUs with
            # compute capability 8.x"
            return f"torch's CUTLASS 2:4 kernels run on compute capability 8.x only, this GPU has {cap[0]}.{cap[1]}"
        if dtype not in HALF_DTYPES:
            return f"the CUTLASS 2:4 kernels are used here for float16/bfloat16 only, not {dtype}"
        return None

    def shape_error(self, out_features, in_features, dtype):
        rows, cols, _, _ = _torch_constraints("SparseSemiStructuredTensorCUTLASS", dtype, (32, 64, 8, 8))
        return _multiple_error(out_features, in_features, rows, cols, "CUTLASS")

    def row_multiple(self, dtype):
        return max(8, _torch_constraints("SparseSemiStructuredTensorCUTLASS", dtype, (32, 64, 8, 8))[2])

    def compress(self, weight):
        values, meta = torch._to_sparse_semi_structured(weight.contiguous())
        return {"values": values, "meta": meta}

    def decompress(self, state, out_features, in_features):
        from torch.sparse._semi_structured_conversions import sparse_semi_structured_to_dense_cutlass

        return sparse_semi_structured_to_dense_cutlass(state["values"], state["meta"])

    def mm(self, x2d, state, bias, out_features):
        if bias is None:
            res = torch._sparse_semi_structured_mm(state["values"], state["meta"], x2d.t())
        else:
            res = torch._sparse_semi_structured_addmm(bias, state["values"], state["meta"], x2d.t())
        return res.t().contiguous()  # the op writes W xᵀ row-major: one transpose copy is unavoidable here


class EmulatedKernel(Kernel):
    """Pure-torch reference of a 2:4 compressed GEMM (CPU or any device; used by the CPU tests).

    Compressed form: ``values (out, in/2)`` — the two kept entries of every group of four, in order — and
    ``positions (out, in/2)`` uint8 in 0..3 (2 bits of information each, as in the hardware metadata).
    """

    def __init__(self, row_multiple: int = 8):
        super().__init__(name="emulated", fmt="emulated", fuses_bias=True)
        self._rows = row_multiple

    def unavailable_reason(self, device, dtype):
        if not dtype.is_floating_point:
            return f"the emulated kernel takes floating-point weights, not {dtype}"
        return None

    def shape_error(self, out_features, in_features, dtype):
        return None if in_features % 4 == 0 else f"{in_features} input features are not a multiple of 4"

    def row_multiple(self, dtype):
        return self._rows

    def compress(self, weight):
        out_f, in_f = weight.shape
        keep = nm_mask(weight, 2, 4).reshape(out_f, in_f // 4, 4)  # the non-zeros, ties to the lower index
        groups = weight.reshape(out_f, in_f // 4, 4)
        pos = torch.arange(4, device=weight.device).expand_as(groups)
        values = groups[keep].reshape(out_f, in_f // 2)  # boolean indexing keeps row-major order
        positions = pos[keep].reshape(out_f, in_f // 2).to(torch.uint8)
        return {"values": values, "positions": positions}

    def decompress(self, state, out_features, in_features):
        values = state["values"].reshape(out_features, in_features // 4, 2)
        pos = state["positions"].reshape(out_features, in_features // 4, 2).long()
        dense = torch.zeros(out_features, in_features // 4, 4, dtype=values.dtype, device=values.device)
        return dense.scatter_(2, pos, values).reshape(out_features, in_features)

    def mm(self, x2d, state, bias, out_features):
        acc = torch.promote_types(x2d.dtype, torch.float32)  # fp32 accumulation, one rounding: like the hardware
        w = self.decompress(state, out_features, x2d.shape[1]).to(acc)
        y = x2d.to(acc) @ w.t()
        if bias is not None:
            y = y + bias.to(acc)
        return y.to(x2d.dtype)


class CpuKernel(Kernel):
    """The CPU extension's 2:4 GEMM on one instruction path (:mod:`.cpu`): reads kept values + 2-bit positions
    directly, no row padding, bias added in the kernel. ``w8``: the kept values stored as int8 with one fp32
    scale per output row (2:4 + W8: a lossy form, never chosen unless asked for by name)."""

    def __init__(self, path: str, w8: bool = False):
        super().__init__(name=f"cpu-{'w8-' if w8 else ''}{path}", fmt="cpu24-w8" if w8 else "cpu24", fuses_bias=True)
        self.path, self.w8 = path, w8

    def unavailable_reason(self, device, dtype):
        return cpu24.unavailable_reason(self.path, torch.device(device), dtype, values="int8" if self.w8 else "same")

    def shape_error(self, out_features, in_features, dtype):
        return None if in_features % 4 == 0 else f"{in_features} input features are not a multiple of 4"

    def row_multiple(self, dtype):
        return 1

    def compress(self, weight):
        state = cpu24.compress(weight)
        return cpu24.quantize_values(state) if self.w8 else state

    def decompress(self, state, out_features, in_features):
        return cpu24.decompress(state, out_features, in_features)

    def mm(self, x2d, state, bias, out_features):
        return cpu24.sparse24_mm(self.path, x2d, state, bias)

    def bind(self, state, bias, in_features, out_features):
        # the extension's op called directly on the input as it comes (it flattens the leading dimensions and
        # shapes the output itself): no row padding, the bias in the kernel, no reshape / view in Python
        op, isa = cpu24.load_extension().sparse24_mm, cpu24.PATHS[self.path]
        values, meta, scale = state["values"], state["meta"], state.get("scale")
        return lambda x: op(x, values, meta, scale, bias, isa)


class CpuUnpackKernel(CpuKernel):
    """Rebuild the dense weight from the CPU compressed form into a shared scratch buffer, then torch's dense
    GEMM (:func:`.cpu.unpack_mm`): how a layer that holds only its compressed bytes runs large token counts."""

    def __init__(self):
        super().__init__("avx512")
        self.name, self.path = "cpu-unpack", "unpack"

    def unavailable_reason(self, device, dtype):
        return cpu24.unavailable_reason("avx2", torch.device(device), dtype)  # any x86-64 build runs it

    def mm(self, x2d, state, bias, out_features):
        return cpu24.unpack_mm(x2d, state, bias, out_features)

    def bind(self, state, bias, in_features, out_features):
        return Kernel.bind(self, state, bias, in_features, out_features)


KERNELS: dict[str, Kernel] = {k.name: k for k in (CusparseltDirectKernel(), CusparseltOpKernel(), CutlassKernel(),
                                                  EmulatedKernel(), *(CpuKernel(p) for p in cpu24.PATHS),
                                                  CpuUnpackKernel(),
                                                  *(CpuKernel(p, w8=True) for p in cpu24.PATHS
                                                    if p not in cpu24.NO_W8_PATHS))}
# preference order when measurements tie (or are not taken): the direct cuSPARSELt path has the least host cost
GPU_KERNELS = ("cusparselt-direct", "cusparselt", "cutlass")
# the exact CPU kernels, widest instructions first (the dispatcher times those that run here)
CPU_KERNELS = tuple(f"cpu-{p}" for p in cpu24.PATHS) + ("cpu-unpack",)
CPU_W8_KERNELS = tuple(f"cpu-w8-{p}" for p in cpu24.PATHS if p not in cpu24.NO_W8_PATHS)  # 2:4 + W8 (int8 values)


def default_kernels(device) -> tuple[str, ...]:
    """The 2:4 kernels a layer on ``device`` may use unless told otherwise (the exact ones)."""
    return CPU_KERNELS if torch.device(device).type == "cpu" else GPU_KERNELS


def available_kernels(device, dtype, names=GPU_KERNELS) -> tuple[list[str], dict[str, str]]:
    """(kernels of ``names`` that can run on ``device`` in ``dtype`` and passed their check there, {kernel: why
    not} for the others)."""
    ok, why = [], {}
    device = torch.device(device)
    for name in names:
        if name not in KERNELS:
            raise ValueError(f"unknown 2:4 kernel {name!r}; known: {', '.join(KERNELS)}")
        reason = KERNELS[name].unavailable_reason(device, dtype)
        checked = (SPARSE24_GEMM if name in GPU_KERNELS else
                   SPARSE24_CPU_GEMM.get(dtype) if name in KERNELS_CHECKED_ON_CPU else None)
        if reason is None and checked is not None:
            if kernels.choose(checked.name, device, (dtype,), only=(name,)) == kernels.REFERENCE:
                reason = kernels.why_not(checked.name, device, (dtype,))
        if reason is None:
            ok.append(name)
        else:
            why[name] = reason
    return ok, why


def _gemm_probe(impl: Kernel, device: torch.device, variant: tuple) -> kernels.Check:
    """``impl`` against ``F.linear`` on random exactly-2:4 weights at SmolLM2 shapes, padded and unpadded rows
    (the direct binding first passes its crash-safe child-process probe)."""
    (dtype,) = variant
    if impl.name == "cusparselt-direct":
        reason = cusparselt_direct.crash_probe_reason(device)
        if reason is not None:
            raise RuntimeError(reason)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for (m, k), n in (((192, 576), 16), ((576, 1536), 5)):
        w = torch.randn(m, k, generator=gen)
        w = w.masked_fill_(~nm_mask(w, 2, 4), 0).to(device=device, dtype=dtype)
        x = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype)
        ref = F.linear(x, w).float()
        y = sparse_linear(impl, x, impl.compress(w), None, m).float()
        worst = max(worst, float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
    return kernels.Check(worst, 0.02)


def _gemm_runs_on(name: str):
    def runs_on(device: torch.device) -> str | None:
        return KERNELS[name].unavailable_reason(device, torch.float16)
    return runs_on


SPARSE24_GEMM = kernels.register(kernels.CheckedPath(
    name="sparse24.gemm",
    what="2:4 GEMM of a Sparse24Linear layer (deploy/sparse24/kernels.py)",
    reference="dense F.linear",
    measure="max |Δ| / max |y| against F.linear",
    candidates=tuple(kernels.Candidate(name, lambda name=name: KERNELS[name], _gemm_runs_on(name))
                     for name in GPU_KERNELS),
    probe=_gemm_probe,
    variants=lambda device: [(torch.bfloat16,), (torch.float16,)],
))


KERNELS_CHECKED_ON_CPU = CPU_KERNELS + CPU_W8_KERNELS


def _cpu_gemm_probe(impl: Kernel, device: torch.device, variant: tuple) -> kernels.Check:
    """``impl`` against a float64 product of the same exactly-2:4 weight (the W8 kernels: of their dequantized
    weight), at shapes with odd tails (in % 64, % 32 and % 16 not 0), 1 to 9 rows, with a bias."""
    (dtype,) = variant
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for (m, k), n in (((192, 576), 1), ((64, 1540), 5), ((37, 100), 9)):
        w = torch.randn(m, k, generator=gen)
        w = w.masked_fill_(~nm_mask(w, 2, 4), 0).to(dtype)
        x = torch.randn(n, k, generator=gen).to(dtype)
        b = torch.randn(m, generator=gen).to(dtype)
        state = impl.compress(w)
        w_ref = impl.decompress(state, m, k) if "scale" in state else w
        ref = x.double() @ w_ref.double().t() + b.double()
        y = sparse_linear(impl, x, state, b, m).double()
        worst = max(worst, float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
    # the output is rounded once to the layer's dtype: bf16 half an ulp is 2^-9 of |y|, fp32 accumulation noise
    return kernels.Check(worst, 8e-3 if dtype == torch.bfloat16 else 1e-5)


@functools.lru_cache(maxsize=2)
def _cpu_timer_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The timers' 2:4 weight (4096 x 4096) and one token, built once per dtype (every candidate times the same)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 4096, generator=gen)
    return w.masked_fill_(~nm_mask(w, 2, 4), 0).to(dtype), torch.randn(1, 4096, generator=gen).to(dtype)


@functools.lru_cache(maxsize=4)
def _cpu_timer_state(dtype: torch.dtype, fmt: str) -> dict[str, torch.Tensor]:
    """The timers' weight compressed once per (dtype, storage format): the candidates of one format share it
    (compressing 4096 x 4096 costs ~0.15 s, more than timing a candidate)."""
    impl = next(k for k in KERNELS.values() if k.fmt == fmt and k.name.startswith("cpu-"))
    return impl.compress(_cpu_timer_inputs(dtype)[0])


def _cpu_gemm_timer(impl: Kernel | None, device: torch.device, variant: tuple) -> float:
    """Seconds per batch-1 call at a LLaMA-7B shape (4096 x 4096), weights cycled past the L3 cache."""
    (dtype,) = variant
    w, x = _cpu_timer_inputs(dtype)
    if impl is None:  # the registry times the reference after its candidates: the shared inputs are let go here
        seconds = cycled(lambda w_: F.linear(x, w_), w)
        _cpu_timer_inputs.cache_clear(), _cpu_timer_state.cache_clear()
        return seconds
    return cycled(bound_call(impl, x, 4096, 4096), cpu24.state_on_huge_pages(_cpu_timer_state(dtype, impl.fmt)),
                  place=cpu24.on_huge_pages)  # laid out as a layer's (linear.py)


def _cpu_runs_on(name: str, dtype: torch.dtype):
    def runs_on(device: torch.device) -> str | None:
        return KERNELS[name].unavailable_reason(device, dtype)
    return runs_on


def _cpu_path(dtype: torch.dtype) -> kernels.CheckedPath:
    """One checked path per layer dtype (the avx512-bf16 and amx-bf16 kernels exist for bf16 layers only)."""
    short = str(dtype).removeprefix("torch.")
    names = tuple(n for n in KERNELS_CHECKED_ON_CPU
                  if dtype == torch.bfloat16 or KERNELS[n].path not in cpu24.BF16_PATHS)
    return kernels.register(kernels.CheckedPath(
        name=f"sparse24.cpu_gemm.{short}",
        what=f"CPU 2:4 GEMM of a {short} Sparse24Linear layer, read from the compressed weight (deploy/sparse24/cpu.py)",
        reference="dense F.linear",
        measure="max |Δ| / max |y| against a float64 product",
        candidates=tuple(kernels.Candidate(n, lambda n=n: KERNELS[n], _cpu_runs_on(n, dtype)) for n in names),
        probe=_cpu_gemm_probe,
        timer=_cpu_gemm_timer,
        variants=lambda device: [(dtype,)],
        cuda_only=False,
    ))


SPARSE24_CPU_GEMM = {dtype: _cpu_path(dtype) for dtype in (torch.bfloat16, torch.float32)}


def bound_call(kernel: Kernel, x: torch.Tensor, in_features: int, out_features: int):
    """``fn(state)``: ``kernel``'s call on ``x`` as a layer holding ``state`` runs it (:meth:`Kernel.bind`, bound
    once per state, looked up by id), for timings that cycle copies of a state: what a layer pays, not the
    general :func:`sparse_linear`'s few µs of Python more a call (docs/results/cpu24-notes.md §37)."""
    bound: dict[int, Callable] = {}

    def run(state):
        fn = bound.get(id(state))
        if fn is None:
            fn = bound[id(state)] = kernel.bind(state, None, in_features, out_features)
        return fn(x)

    return run


def sparse_linear(kernel: Kernel, x: torch.Tensor, state: dict[str, torch.Tensor], bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """``x Wᵀ + b`` with a 2:4 kernel: flatten to rows, pad the rows to the kernel's multiple, slice back."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    n = x2d.shape[0]
    if n == 0:
        return x.new_empty(*lead, out_features)
    n_pad = padded_rows(n, kernel.row_multiple(x.dtype))
    if n_pad != n:  # only short inputs (decode) pay this copy: the kernels need whole row blocks
        x2d = F.pad(x2d, (0, 0, 0, n_pad - n))
    y = kernel.mm(x2d, state, bias if kernel.fuses_bias else None, out_features)
    if n_pad != n:
        y = y[:n]  # leading rows of a row-major tensor: still contiguous, no copy
    if bias is not None and not kernel.fuses_bias:
        y.add_(bias)
    return y.view(*lead, out_features)
