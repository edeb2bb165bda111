"""``W_scale = Diag(A) W`` (method.md §3, Eq. 11-12) with a backward that moves as little memory as possible.

ScaledLinear builds the scaled weight once per forward and runs one dense matmul. Through plain autograd
(``(W.unflatten(...) * A).to(dtype)``, then autocast's cast) that costs, per weight entry and step, two
extra full-size temporaries and about 8 memory passes (fp32; more under bf16 autocast: 46 bytes moved per
entry against 14 for a plain autocast linear). :func:`scaled_weight` does the same math in:

* forward: ONE pass — the product is formed in fp32 (the promoted dtype) and written straight in the
  dtype the matmul will use (the autocast dtype, else the weight's), so autocast has nothing left to cast;
* backward: ONE pass over ``(∂L/∂W_scale, W)`` producing both ``∂L/∂W = A ⊙ ∂L/∂W_scale`` (in W's dtype)
  and ``∂L/∂A = Σ_block ∂L/∂W_scale ⊙ W`` (in A's dtype); on CPU the product for ``∂L/∂A`` is formed in
  cache-sized blocks of rows, so it never goes to memory; on CUDA both come from one Triton kernel
  (:mod:`cast_llm.nn.triton_scaled_weight`: 10 bytes per entry, one launch), else from three torch ops.

Numerically it is the autograd version: every product is formed in the same dtype and rounded once, and
``∂L/∂A`` is reduced row by row as autograd reduces it (for the transposed Conv1D layout, the CPU sums
each block's entries slice by slice: equal to rounding).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from cast_llm import kernels
from cast_llm.kernels.switch import interpreting, triton_runs_on
from cast_llm.nn import scaled_weight_probes

__all__ = ["scaled_weight", "scaled_weight_grads", "torch_scaled_weight", "torch_scaled_weight_grads", "layer_path",
           "matmul_dtype", "SCALED_WEIGHT_LAYER"]

# Entries per block of the CPU backward: its product temporary (1 MiB in fp32) stays in cache while it is
# summed, and the rows of ∂L/∂W_scale it read are still in cache for ∂L/∂W. Not smaller: every block costs
# ~5 op dispatches, and at 2**16 (1,600 blocks per step on SmolLM2-135M) the profiler put their Python
# overhead at ~0.25 s per step.
_BLOCK = 1 << 18
_KERNEL: list = []  # the fused CUDA backward's module, imported on first use (Triton's import takes ~1 s)


def _kernel():
    """:mod:`cast_llm.nn.triton_scaled_weight`, or None when it cannot be imported (then torch ops do the math)."""
    if not _KERNEL:
        try:
            from cast_llm.nn import triton_scaled_weight  # in-function: imports Triton (optional, ~1 s)
        except Exception:  # pragma: no cover - a broken Triton install must not break the torch path
            triton_scaled_weight = None
        _KERNEL.append(triton_scaled_weight)
    return _KERNEL[0]


def scaled_weight(weight: Tensor, scale: Tensor, n_groups: int, transposed: bool, out_dtype: torch.dtype) -> Tensor:
    """``Diag(A) W`` block-wise (Eq. 12) in ``weight``'s layout and ``out_dtype``; differentiable in both.

    ``weight``: ``(out, in)`` (``(in, out)`` when ``transposed``, GPT-2 Conv1D); ``scale``: ``(out, n_groups)``.
    """
    return _ScaledWeight.apply(weight, scale, n_groups, transposed, out_dtype)


def _blocks(t: Tensor, n_groups: int, transposed: bool) -> Tensor:
    """``t`` in the weight's layout as column blocks: ``(out, g, in/g)``, or ``(g, in/g, out)`` when transposed."""
    if transposed:
        return t.unflatten(0, (n_groups, t.shape[0] // n_groups))
    return t.unflatten(1, (n_groups, t.shape[1] // n_groups))


def _scale_view(scale: Tensor, transposed: bool) -> Tensor:
    """``scale`` (out, g) broadcastable against :func:`_blocks`: ``(out, g, 1)`` or ``(g, 1, out)``."""
    return scale.t().unsqueeze(1) if transposed else scale.unsqueeze(-1)


class _ScaledWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, scale, n_groups, transposed, out_dtype):
        ctx.save_for_backward(weight, scale)
        ctx.n_groups, ctx.transposed = n_groups, transposed
        return torch_scaled_weight(weight, scale, n_groups, transposed, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        grad_w, grad_a = scaled_weight_grads(grad, weight, scale, ctx.n_groups, ctx.transposed,
                                             ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_w, grad_a, None, None, None


def scaled_weight_grads(grad: Tensor, weight: Tensor, scale: Tensor, n_groups: int, transposed: bool,
                        need_w: bool = True, need_a: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """``(∂L/∂W, ∂L/∂A)`` from ``grad`` = ∂L/∂W_scale: on CUDA one Triton launch (the checked kernel path
    ``scaled_weight.layer``), else — or when it fails — :func:`torch_scaled_weight_grads`."""
    path = layer_path(grad, weight, scale, transposed, need_w, need_a)
    if path != kernels.REFERENCE:  # CUDA: one Triton launch for both gradients
        try:
            return kernels.implementation("scaled_weight.layer", path)(grad, weight, scale, n_groups, transposed,
                                                                       need_w, need_a)
        except Exception as e:  # noqa: BLE001 - e.g. a shape class that fails to compile: the torch ops
            kernels.record("scaled_weight.layer", grad.device, _layer_variant(grad, weight, transposed, need_w,
                                                                               need_a), path, e)
    return torch_scaled_weight_grads(grad, weight, scale, n_groups, transposed, need_w, need_a)


def torch_scaled_weight(weight: Tensor, scale: Tensor, n_groups: int, transposed: bool, out_dtype: torch.dtype
                        ) -> Tensor:
    """``Diag(A) W`` in torch ops, no autograd: the product in the promoted dtype (fp32 for a bf16 weight times
    an fp32 scale), rounded once into ``out_dtype``."""
    out = torch.empty(weight.shape, dtype=out_dtype, device=weight.device)
    torch.mul(_blocks(weight, n_groups, transposed), _scale_view(scale, transposed),
              out=_blocks(out, n_groups, transposed))
    return out


def torch_scaled_weight_grads(grad: Tensor, weight: Tensor, scale: Tensor, n_groups: int, transposed: bool,
                              need_w: bool = True, need_a: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """The reference backward of ``W_scale = Diag(A) W`` in torch ops: ``(∂L/∂W, ∂L/∂A)`` from ``grad``."""
    g = n_groups
    gb, wb, a = _blocks(grad, g, transposed), _blocks(weight, g, transposed), _scale_view(scale, transposed)
    # the dtype autograd forms ∂L/∂A's products in: the promotion of all three (fp32 for bf16 weights)
    acc = torch.promote_types(torch.promote_types(grad.dtype, weight.dtype), scale.dtype)
    upcast = gb.dtype != acc and wb.dtype != acc  # else torch.mul promotes by itself, exactly
    grad_w = torch.empty_like(weight) if need_w else None
    gwb = _blocks(grad_w, g, transposed) if need_w else None
    grad_a = None
    if need_a:
        grad_a = torch.empty((g, scale.shape[0]) if transposed else tuple(scale.shape), dtype=scale.dtype,
                             device=scale.device)
    # Slices along the rows of (out, g, in/g), or along the entries (dim 1) of the transposed
    # (g, in/g, out) view; one slice off the CPU (no cache to fit), cache-sized slices on it.
    dim = 1 if transposed else 0
    n = gb.shape[dim]
    per_index = gb.numel() // max(1, n)
    step = n if grad.device.type != "cpu" else max(1, _BLOCK // max(1, per_index))
    for lo in range(0, n, step):
        sl = (slice(None), slice(lo, lo + step)) if transposed else (slice(lo, lo + step),)
        if need_a:
            prod = torch.mul(gb[sl].to(acc) if upcast else gb[sl], wb[sl])
            if not transposed:  # each row's blocks are reduced whole, as autograd does
                torch.sum(prod, dim=-1, dtype=scale.dtype, out=grad_a[lo : lo + step])
            elif lo == 0:  # partial sums over this slice of every block's entries: (g, out)
                torch.sum(prod, dim=1, dtype=scale.dtype, out=grad_a)
            else:
                grad_a.add_(prod.sum(dim=1, dtype=scale.dtype))
        if need_w:  # ∂L/∂W = A ⊙ ∂L/∂W_scale, formed in the promoted dtype, rounded once to W's
            torch.mul(gb[sl], a if transposed else a[lo : lo + step], out=gwb[sl])
    if need_a and transposed:
        grad_a = grad_a.t()
    return grad_w, grad_a


def _layer_variant(grad: Tensor, weight: Tensor, transposed: bool, need_w: bool, need_a: bool) -> tuple:
    return (grad.dtype, weight.dtype, "transposed" if transposed else "rows",
            "+".join(x for x, need in (("dW", need_w), ("dA", need_a)) if need))


def layer_path(grad: Tensor, weight: Tensor, scale: Tensor, transposed: bool, need_w: bool, need_a: bool) -> str:
    """Which implementation forms this layer's two gradients: ``triton`` (the checked kernel path
    ``scaled_weight.layer``) or ``REFERENCE`` (the torch ops: CPU, float64, a kernel that failed its check)."""
    if grad.device.type == "cpu" and not interpreting():
        return kernels.REFERENCE  # the common CPU case decides without importing Triton
    kernel = _kernel()
    if kernel is None or kernel.unsupported_reason(grad, weight, scale) is not None:
        return kernels.REFERENCE
    return kernels.choose("scaled_weight.layer", grad.device, _layer_variant(grad, weight, transposed, need_w,
                                                                               need_a))


def _triton_layer(*args, **kwargs):
    return _kernel().scaled_weight_grads(*args, **kwargs)


SCALED_WEIGHT_LAYER = kernels.register(kernels.CheckedPath(
    name="scaled_weight.layer",
    what="ScaledLinear backward, one layer, Eq. 11-12 (nn/scaled_weight.py)",
    reference="the torch-ops backward (∂L/∂W) and float64 (∂L/∂A)",
    measure="max |Δ| / max |ref| of ∂L/∂W or ∂L/∂A",
    candidates=(kernels.Candidate("triton", lambda: _triton_layer, triton_runs_on),),
    probe=functools.partial(scaled_weight_probes.layer_probe, reference=torch_scaled_weight_grads),
    timer=functools.partial(scaled_weight_probes.layer_timer, reference=torch_scaled_weight_grads),
    variants=scaled_weight_probes.layer_variants,
))


def matmul_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the matmul will see the weight in: the autocast dtype where autocast would cast it."""
    device = weight.device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except TypeError:  # pragma: no cover - torch < 2.4: no per-device query
        enabled = torch.is_autocast_enabled() if device == "cuda" else False
    if enabled and weight.dtype in (torch.float32, torch.float16, torch.bfloat16):  # autocast leaves fp64 alone
        return torch.get_autocast_dtype(device)
    return weight.dtype
