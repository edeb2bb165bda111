""":class:`Sparse24Linear`: a linear layer whose exactly-2:4 weight is compressed once at load and multiplied
by a 2:4 kernel — tensor-core kernels on a GPU, the CPU extension's kernels that read the compressed form on a
CPU (:mod:`.cpu`) — or by dense ``F.linear`` where that measures faster (method.md §7).

What it holds (plain attributes, not Parameters — the compressed bytes must never be cast by ``model.to``):

* ``states[fmt]`` — the compressed weight in each kernel format it may use (``cusparselt``: one packed tensor
  of the kept half plus metadata, shared by the ``cusparselt`` and ``cusparselt-direct`` kernels;
  ``cutlass``: values + metadata);
* ``dense_weight`` — the original ``(out, in)`` weight, **only if** the layer keeps a dense fallback
  (``keep_dense``). That copy costs the full dense bytes on top of the compressed ~56 %;
  :func:`~cast_llm.deploy.sparse24.model.plan_sparse24_` with ``release=True`` drops whatever the measured
  decisions do not use, and :meth:`nbytes` reports what is held either way;
* ``bias`` — added in the kernel's epilogue where it can (cuSPARSELt via torch's op), else after.

``forward`` flattens the input to rows, asks the dispatcher (:mod:`.dispatch`) which kernel wins for that
many rows — ``eager`` decisions normally, ``graph`` decisions while a CUDA graph is being captured — and
runs it (:func:`~cast_llm.deploy.sparse24.kernels.sparse_linear`: pad rows to the kernel's block, slice the
padding off, no other copy). Under ``torch.compile`` the layer is one opaque custom op
(``cast_llm::sparse24_linear``), so ``mode="reduce-overhead"`` can capture it whole.
"""

from __future__ import annotations

import itertools
import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24 import cusparselt_direct
from cast_llm.deploy.sparse24.capture import capturing
from cast_llm.deploy.sparse24.dispatch import DENSE, DENSE_CAREFUL, DENSE_FORMS, Dispatcher, token_bucket
from cast_llm.deploy.sparse24.kernels import (
    KERNELS,
    available_kernels,
    default_kernels,
    padded_rows,
)
from cast_llm.errors import CastError
from cast_llm.layers import is_linear_like, linear_features
from cast_llm.sparsity.mask import is_nm

__all__ = ["Sparse24Linear", "check_sparse24_weight"]

_IDS = itertools.count()
_LAYERS: dict[int, weakref.ReferenceType] = {}  # for the torch.compile custom op
_SAID: set[str] = set()  # layers that said they run another kernel inside a capture


def check_sparse24_weight(weight: torch.Tensor, name: str = "weight",
                          kernels=None) -> tuple[list[str], str | None]:
    """(the kernels of ``kernels`` that can run this ``(out, in)`` weight, None) or ([], one-line error).

    Checks, in order: 2-D; a kernel runs on its device and dtype; the shape fits a kernel's block rules;
    the weight is exactly 2:4 along ``in`` (at most 2 non-zeros in every group of 4 — the compressors keep
    two entries per group without checking, so a denser weight would be silently pruned).
    """
    if weight.dim() != 2:
        return [], f"{name}: weight is {weight.dim()}-D; a 2:4 linear needs a 2-D (out, in) weight"
    ok, why = available_kernels(weight.device, weight.dtype, default_kernels(weight.device) if kernels is None
                                else kernels)
    if not ok:
        first = next(iter(why.items()))
        return [], f"{name}: no 2:4 kernel can run it ({first[0]}: {first[1]})"
    out_f, in_f = weight.shape
    fitting = [k for k in ok if KERNELS[k].shape_error(out_f, in_f, weight.dtype) is None]
    if not fitting:
        return [], (f"{name}: {KERNELS[ok[0]].shape_error(out_f, in_f, weight.dtype)}; leave this layer dense "
                    f"(filter_fn)")
    if not is_nm(weight, 2, 4):
        return [], (f"{name}: weight {tuple(weight.shape)} is not exactly 2:4 (a group of 4 inputs has more than "
                    f"2 non-zeros); prune it to 2:4 first (cast-llm prune) or leave the layer out (filter_fn)")
    return fitting, None


class Sparse24Linear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` exactly 2:4, run by a 2:4 kernel or dense, per token count (see module doc)."""

    def __init__(self, in_features: int, out_features: int, *, states: dict[str, dict[str, torch.Tensor]],
                 kernels: list[str], dense_weight: torch.Tensor | None, bias: torch.Tensor | None,
                 dtype: torch.dtype, device: torch.device, dispatcher: Dispatcher | None = None, name: str = "",
                 requires_grad: bool = False):
        super().__init__()
        if not kernels and dense_weight is None:
            raise ValueError("a Sparse24Linear needs a 2:4 kernel or a dense weight to run")
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.device = dtype, torch.device(device)
        # CPU compressed tensors on huge pages where the OS allows (cpu.on_huge_pages: a 4 KB page per row cost
        # the one-token GEMM 20-27 %); GPU states and small tensors pass through unchanged
        self.states = {fmt: cpu24.state_on_huge_pages(st) for fmt, st in states.items()}
        self.kernels = list(kernels)
        self.dense_weight = dense_weight
        self.bias = bias
        self.dispatcher = dispatcher
        self.name = name
        self._requires_grad = requires_grad
        self._choices: dict[tuple[int, str], str] = {}
        self._runs: dict[int, object] = {}  # exact token count -> bound eager-mode runner (the hot path)
        self._op_id = next(_IDS)
        _LAYERS[self._op_id] = weakref.ref(self)

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module, *, kernels=None, dispatcher: Dispatcher | None = None,
                    keep_dense: bool | None = None, name: str = "") -> Sparse24Linear:
        """Compress ``linear`` (``nn.Linear`` or GPT-2 ``Conv1D``; exactly 2:4 along its inputs) once.

        ``kernels``: the 2:4 kernels it may use (default: every exact kernel of the weight's device that can
        run it: the GPU kernels on a GPU, the CPU extension's on the CPU). ``dispatcher``:
        measured per-token-count choice including dense (None: always the first kernel). ``keep_dense``:
        hold the dense weight as the fallback (default: only when dispatching).
        """
        if not is_linear_like(linear):
            raise TypeError(f"{name or 'layer'}: Sparse24Linear wraps nn.Linear or Conv1D, got {type(linear).__name__}")
        in_f, out_f, transposed = linear_features(linear)
        weight = linear.weight.detach()
        weight = weight.t().contiguous() if transposed else weight  # Conv1D stores (in, out)
        usable, error = check_sparse24_weight(weight, name or "weight", kernels)
        if error:
            raise CastError(error)
        keep_dense = dispatcher is not None if keep_dense is None else keep_dense
        states: dict[str, dict[str, torch.Tensor]] = {}
        for k in usable:
            fmt = KERNELS[k].fmt
            if fmt not in states:
                states[fmt] = KERNELS[k].compress(weight)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(in_f, out_f, states=states, kernels=usable, dense_weight=weight if keep_dense else None, bias=bias,
                   dtype=weight.dtype, device=weight.device, dispatcher=dispatcher, name=name,
                   requires_grad=linear.weight.requires_grad)

    @torch.no_grad()
    def dense(self) -> torch.Tensor:
        """The dense ``(out, in)`` weight: the held copy, or decompressed from a compressed form."""
        if self.dense_weight is not None:
            return self.dense_weight
        for fmt, state in self.states.items():
            kernel = next(KERNELS[k] for k in KERNELS if KERNELS[k].fmt == fmt)
            return kernel.decompress(state, self.out_features, self.in_features)
        raise RuntimeError(f"{self.name}: holds no weight")

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` computing the same map with the dense weight (GPT-2 ``Conv1D`` comes back as Linear)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = nn.Parameter(self.dense(), requires_grad=self._requires_grad)
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias, requires_grad=self._requires_grad)
        return lin

    # -- running ----------------------------------------------------------------------------------------------
    def candidates(self, mode: str = "eager") -> list[str]:
        """What the dispatcher chooses from: dense (if held) and the 2:4 kernels. In graph mode torch's
        cuSPARSELt op is left out when the direct binding is there: inside a graph both replay the same
        cuSPARSELt kernel (the op's per-call plan cost is host time), and a capture that fails inside torch's
        op could leave the caching allocator mid-capture for the rest of the process."""
        kernels = self.kernels
        if mode == "graph" and "cusparselt-direct" in kernels:
            kernels = [k for k in kernels if k != "cusparselt"]
        if self.dense_weight is None:
            return list(kernels)
        kernels = [k for k in kernels if k != "cpu-unpack"]  # rebuilding the dense weight only pays when none is held
        return [DENSE, *([DENSE_CAREFUL] if self._careful_dense_runs() else []), *kernels]

    def _careful_dense_runs(self) -> bool:
        """Whether the held dense weight can also run on the CPU extension's careful dense GEMM (bf16, CPU)."""
        return (self.dense_weight.device.type == "cpu" and self.dtype == torch.bfloat16
                and cpu24.dense_unavailable_reason() is None)

    def kernel_for(self, tokens: int, mode: str | None = None) -> str:
        """The kernel this layer runs for ``tokens`` rows (``mode`` default: ``graph`` while capturing)."""
        if self.dispatcher is None:
            return self.kernels[0] if self.kernels else DENSE
        mode = mode or ("graph" if capturing() else "eager")
        key = (token_bucket(tokens), mode)
        kernel = self._choices.get(key)
        if kernel is None:
            if capturing():
                raise CastError(f"{self.name}: no measured {mode}-mode kernel choice for {tokens} tokens; call "
                                f"plan_sparse24_(model, token_counts=[{tokens}], modes=('graph',)) before "
                                f"capturing a CUDA graph (a measurement cannot run inside a capture)")
            kernel = self.dispatcher.decide(self.out_features, self.in_features, self.dtype, tokens, mode,
                                            self.candidates(mode)).kernel
            self._choices[key] = kernel
        return kernel

    def set_choice_(self, tokens: int, mode: str, kernel: str) -> None:
        """Run ``kernel`` for ``tokens``'s token bucket in ``mode`` from now on, in this process (the dispatcher's
        cached decision is not changed): what a whole-model check decides
        (:func:`~cast_llm.deploy.sparse24.model.check_plan_against_dense_`)."""
        if kernel not in self.candidates(mode):
            raise CastError(f"{self.name or 'Sparse24Linear'}: {kernel!r} is not one of its kernels here "
                            f"({', '.join(self.candidates(mode))})")
        self._choices[(token_bucket(tokens), mode)] = kernel
        self._runs.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the hot path costs a dtype check, a dict lookup and (when dispatching) a capture query: a model
        # decoding eagerly is host-bound, so every microsecond here is paid ~200 times per token
        if x.dtype != self.dtype:
            raise CastError(f"{self.name or 'Sparse24Linear'}: holds {self.dtype} weights but got a {x.dtype} input; "
                            f"run the model in {self.dtype} (swap back with from_sparse24_ to change dtype)")
        if torch.compiler.is_compiling():
            return _OP(x, self._op_id, self.out_features)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // self.in_features
        run = self._runs.get(tokens)
        if run is None or (self.dispatcher is not None and capturing()):
            run = self._runner(tokens)
        return run(x)

    def _runner(self, tokens: int):
        kernel = self.kernel_for(tokens)
        if kernel == "cusparselt-direct" and capturing() and not self._direct_plan_ready(tokens):
            kernel = self._capture_fallback(tokens)
        if kernel == DENSE:
            weight, bias = self.dense_weight, self.bias
            run = lambda x: F.linear(x, weight, bias)  # noqa: E731
        elif kernel == DENSE_CAREFUL:
            weight, bias, k, n = self.dense_weight, self.bias, self.in_features, self.out_features
            run = lambda x: cpu24.dense_mm(x.reshape(-1, k), weight, bias).view(*x.shape[:-1], n)  # noqa: E731
        else:
            run = KERNELS[kernel].bind(self.states[KERNELS[kernel].fmt], self.bias, self.in_features,
                                       self.out_features)
        if not capturing():
            if len(self._runs) > 512:  # many distinct prompt lengths: forget, decisions stay cached per bucket
                self._runs.clear()
            self._runs[tokens] = run
        return run

    def _direct_plan_ready(self, tokens: int) -> bool:
        """Whether the direct cuSPARSELt plan for these rows exists (none can be built inside a capture)."""
        rows = padded_rows(tokens, KERNELS["cusparselt-direct"].row_multiple(self.dtype))
        return cusparselt_direct.has_plan(self.dtype, self.out_features, self.in_features, rows,
                                          self.device.index or 0)

    def _capture_fallback(self, tokens: int) -> str:
        """Inside a capture, without a plan for this row count: the layer's eager choice (or another kernel, or
        dense), said once per layer."""
        eager = self._choices.get((token_bucket(tokens), "eager"))
        options = [eager] if eager not in (None, "cusparselt-direct") else []
        options += [k for k in self.kernels if k != "cusparselt-direct"]
        options += [DENSE] if self.dense_weight is not None else []
        if not options:
            raise CastError(f"{self.name}: no cuSPARSELt plan for {tokens} tokens exists and none can be built "
                            "during a CUDA-graph capture; run one eager forward with this token count first")
        if self.name not in _SAID:
            _SAID.add(self.name)
            print(f"cast-llm: {self.name or 'Sparse24Linear'}: no cuSPARSELt plan for {tokens} tokens was built "
                  f"before this CUDA-graph capture; the layer runs {options[0]} in the graph (one eager forward "
                  "with this token count before capturing builds the plan)", file=sys.stderr, flush=True)
        return options[0]

    # -- memory -------------------------------------------------------------------------------------------------
    def release_(self, keep: set[str]) -> None:
        """Drop the forms no kernel of ``keep`` (names, ``"dense"`` / ``"dense-careful"`` included) uses; keeps at
        least one."""
        kernels = [k for k in self.kernels if k in keep]
        dense = self.dense_weight if keep & set(DENSE_FORMS) else None
        if not kernels and dense is None:
            return  # nothing chosen yet: keep everything
        self.kernels = kernels
        self.dense_weight = dense
        used = {KERNELS[k].fmt for k in kernels}
        self.states = {fmt: s for fmt, s in self.states.items() if fmt in used}
        self._choices = {key: k for key, k in self._choices.items() if k in keep}
        self._runs.clear()

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``compressed`` (all formats), ``dense`` (the fallback copy), ``bias``."""
        compressed = sum(t.numel() * t.element_size() for s in self.states.values() for t in s.values())
        dense = 0 if self.dense_weight is None else self.dense_weight.numel() * self.dense_weight.element_size()
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return {"compressed": compressed, "dense": dense, "bias": bias}

    def _apply(self, fn, recurse=True):
        # model.to(...) / .half() would leave the compressed bytes behind (they are not Parameters): refuse any
        # move or cast that would change this layer, allow the no-op ones (model.to(its own device)).
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        moved = fn(probe)
        if moved.device != probe.device or moved.dtype != probe.dtype:
            raise CastError(f"{self.name or 'Sparse24Linear'}: a 2:4-compressed layer cannot be moved or cast "
                            f"({self.dtype} on {self.device} -> {moved.dtype} on {moved.device}); call "
                            f"from_sparse24_(model) first, move or cast, then to_sparse24_ again")
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        held = ", ".join(self.kernels) + (", dense fallback" if self.dense_weight is not None else "")
        return f"in_features={self.in_features}, out_features={self.out_features}, kernels=[{held}]"


def _sparse24_linear_impl(x: torch.Tensor, layer_id: int, out_features: int) -> torch.Tensor:
    layer = _LAYERS[layer_id]()
    if layer is None:
        raise RuntimeError(f"Sparse24Linear #{layer_id} no longer exists")
    return layer._forward(x)


# The layer as one opaque op for torch.compile: dynamo does not trace into it (the dispatch and the kernels
# stay Python), and cudagraph trees capture whatever kernels it launches. Registered at import: registering
# while dynamo traces is not allowed. Its fake implementation only gives the output shape.
_OP = torch.library.custom_op("cast_llm::sparse24_linear", _sparse24_linear_impl, mutates_args=(),
                              schema="(Tensor x, int layer_id, int out_features) -> Tensor")


@_OP.register_fake
def _(x, layer_id, out_features):
    return x.new_empty((*x.shape[:-1], out_features))
