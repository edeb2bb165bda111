"""Swap 2:4 target weights to ``torch.sparse`` semi-structured tensors for real sparse matmuls (method.md §7).

``torch.sparse.to_sparse_semi_structured`` stores a 2:4 weight as its kept half plus metadata and runs
``F.linear`` through NVIDIA sparse tensor cores (cuSPARSELt, or CUTLASS). Requirements, all checked here
with errors that name the layer: a CUDA GPU of compute capability ≥ 8.0 (Ampere or newer), fp16/bf16
weights (fp32 on the CUTLASS backend only), 2-D weights whose rows and columns are multiples of the
backend's minimum block (cuSPARSELt fp16/bf16: 16 × 16; CUTLASS: 32 × 64), and weights that are *exactly*
2:4 — the compressor keeps two entries of every group of four without checking, so a denser weight would
silently be pruned.

GPT-2 ``Conv1D`` stores its weight ``(in, out)`` with the 2:4 groups along dim 0, but the kernels need them
along the last dim of the sparse operand; such a layer is replaced by an equivalent ``nn.Linear`` holding
``W.T`` before the swap. :func:`from_semi_structured_` undoes the swap (dense weights again).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cast_llm.errors import CastError
from cast_llm.layers import set_submodule
from cast_llm.sparsity.mask import is_nm
from cast_llm.targets import find_targets

MIN_CAPABILITY = (8, 0)
# (min rows, min cols) of the sparse operand per backend and dtype (torch.sparse.semi_structured)
SHAPE_CONSTRAINTS = {
    "cusparselt": {torch.float16: (16, 16), torch.bfloat16: (16, 16)},
    "cutlass": {torch.float16: (32, 64), torch.bfloat16: (32, 64), torch.float32: (32, 32)},
}


def semi_structured_unavailable_reason(device: str | torch.device | None = None) -> str | None:
    """None if semi-structured sparse kernels can run on ``device`` (default: the current CUDA device),
    else a sentence saying why not."""
    if not torch.cuda.is_available():
        return ("semi-structured 2:4 kernels need a CUDA GPU with compute capability >= 8.0 (Ampere or newer); "
                "no CUDA device is available here")
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return f"semi-structured 2:4 kernels run on CUDA devices only, not on {dev}"
    cap = torch.cuda.get_device_capability(dev)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(dev)
        return (f"semi-structured 2:4 kernels need compute capability >= 8.0; {name} has "
                f"{cap[0]}.{cap[1]}")
    return None


def default_backend() -> str:
    return "cusparselt" if torch.backends.cusparselt.is_available() else "cutlass"


def require_semi_structured(device, dtype: torch.dtype, backend: str = "auto") -> str:
    """Raise CastError unless semi-structured kernels can run on ``device`` in ``dtype``; the backend."""
    reason = semi_structured_unavailable_reason(device)
    if reason is not None:
        raise CastError(reason)
    backend = default_backend() if backend == "auto" else backend
    if backend not in SHAPE_CONSTRAINTS:
        raise CastError(f"unknown semi-structured backend {backend!r}; use auto, cusparselt or cutlass")
    if dtype not in SHAPE_CONSTRAINTS[backend]:
        ok = ", ".join(str(d).removeprefix("torch.") for d in SHAPE_CONSTRAINTS[backend])
        raise CastError(f"the {backend} semi-structured backend supports {ok}, not {dtype}; load the model in "
                        "fp16 or bf16")
    return backend


def check_semi_structured_weight(weight: torch.Tensor, backend: str, name: str = "weight") -> str | None:
    """None if ``weight`` (out, in) can be swapped on ``backend``, else why not (shape, dtype or pattern)."""
    if weight.dim() != 2:
        return f"{name}: weight is {weight.dim()}-D, semi-structured sparsity needs 2-D"
    limits = SHAPE_CONSTRAINTS[backend].get(weight.dtype)
    if limits is None:
        return f"{name}: dtype {weight.dtype} is not supported by the {backend} backend"
    rows, cols = weight.shape
    min_rows, min_cols = limits
    if rows % min_rows or cols % min_cols:
        return (f"{name}: shape {tuple(weight.shape)} is not a multiple of ({min_rows}, {min_cols}) as the "
                f"{backend} backend requires")
    if not is_nm(weight, 2, 4):
        return f"{name}: weight {tuple(weight.shape)} is not exactly 2:4 sparse"
    return None


def _linear_from_conv1d(conv) -> nn.Linear:
    """An nn.Linear computing exactly what a GPT-2 Conv1D (weight (in, out)) computes."""
    in_f, out_f = conv.weight.shape
    lin = nn.Linear(in_f, out_f, bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        if conv.bias is not None:
            lin.bias.copy_(conv.bias)
    return lin


def _contiguous_input(module, args):
    return (args[0].contiguous(), *args[1:])


@torch.no_grad()
def to_semi_structured_(
    model: nn.Module,
    *,
    targets=None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    backend: str = "auto",
    skip_incompatible: bool = False,
) -> list[str]:
    """Swap the 2:4 targets of ``model`` (on a CUDA device) to semi-structured sparse weights, in place.

    ``targets`` default to :func:`cast_llm.targets.find_targets` (``filter_fn`` narrows them, torchao-style).
    Layers that cannot be swapped raise a CastError naming them, or with ``skip_incompatible`` stay dense
    (listed in ``model._semi_structured_skipped``). Returns the names of the swapped layers.
    """
    params = [p for p in model.parameters() if p.is_floating_point()]
    device = params[0].device
    backend = require_semi_structured(device, params[0].dtype, backend)
    if targets is None:
        targets = find_targets(model, n=2, m=4, skip_incompatible=True)
    if filter_fn is not None:
        targets = [t for t in targets if filter_fn(t.module, t.fqn)]
    problems = []
    for t in targets:
        w = t.weight.t() if t.transposed else t.weight
        reason = check_semi_structured_weight(w, backend, t.fqn)
        if reason:
            problems.append(reason)
    if problems and not skip_incompatible:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CastError("cannot swap to semi-structured sparse weights: " + "; ".join(problems[:3]) + more)
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

    force_cutlass = SparseSemiStructuredTensor._FORCE_CUTLASS
    SparseSemiStructuredTensor._FORCE_CUTLASS = backend == "cutlass"
    bad = {p.split(":", 1)[0] for p in problems}
    swapped = []
    try:
        for t in targets:
            if t.fqn in bad:
                continue
            module = _linear_from_conv1d(t.module) if t.transposed else t.module
            if t.transposed:
                set_submodule(model, t.fqn, module)
            sparse = to_sparse_semi_structured(module.weight.detach().contiguous())
            module.weight = nn.Parameter(sparse, requires_grad=False)  # the dense tensor is freed here
            # the sparse F.linear flattens its input with .view(): make it contiguous (a no-op when it is)
            module._cast_contiguous_hook = module.register_forward_pre_hook(_contiguous_input)
            swapped.append(t.fqn)
    finally:
        SparseSemiStructuredTensor._FORCE_CUTLASS = force_cutlass
    model._semi_structured_skipped = sorted(bad)
    return swapped


@torch.no_grad()
def from_semi_structured_(model: nn.Module) -> list[str]:
    """Replace every semi-structured sparse weight of ``model`` by its dense equivalent, in place."""
    from torch.sparse import SparseSemiStructuredTensor

    restored = []
    for fqn, module in model.named_modules():
        w = getattr(module, "weight", None)
        if isinstance(w, SparseSemiStructuredTensor):
            module.weight = nn.Parameter(w.to_dense(), requires_grad=False)
            hook = getattr(module, "_cast_contiguous_hook", None)
            if hook is not None:
                hook.remove()
                del module._cast_contiguous_hook
            restored.append(fqn)
    return restored


def sparse_weight_nbytes(weight: torch.Tensor) -> int:
    """Bytes held by a weight: the packed values + metadata of a semi-structured tensor, else dense bytes."""
    from torch.sparse import SparseSemiStructuredTensor

    if isinstance(weight, SparseSemiStructuredTensor):
        parts = [getattr(weight, a, None) for a in ("packed", "meta", "packed_t", "meta_t",
                                                    "compressed_swizzled_bitmask")]
        return sum(p.numel() * p.element_size() for p in parts if p is not None)
    return weight.numel() * weight.element_size()
