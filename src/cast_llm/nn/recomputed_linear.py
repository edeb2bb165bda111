"""``y = x · (Diag(A) W)ᵀ`` that keeps ``x``, ``W`` and ``A`` for backward, not the scaled weight.

Through :func:`~cast_llm.nn.scaled_weight.scaled_weight` and ``F.linear``, the matmul saves its weight — the
product ``Diag(A)·W`` (Eq. 11-12), a new tensor per layer — until that layer's backward: over a forward,
one copy of every target weight. Under FSDP2 that copy is the one whole-model term on every GPU, since the
weights themselves are all-gathered one block at a time and freed after (their saved references are
refilled by the backward's all-gather; a new tensor is not). :func:`recomputed_scaled_linear` saves the
layer's input, its (unsharded) weight and its scale, and forms the product again in backward, so a scaled
weight lives one layer at a time: one elementwise product per layer and step more, no matmul more.

Numerically it is the two-step path: the product is formed by the same :func:`torch_scaled_weight` (in the
promoted dtype, rounded once into the matmul's), the matmuls are those ``F.linear`` and its backward run
(``x·Wᵀ``, ``∂y·W``, ``∂yᵀ·x`` on the flattened tokens), and ``(∂L/∂W, ∂L/∂A)`` come from the same
:func:`scaled_weight_grads` (tests/test_recomputed_linear.py: equal bit for bit, fp32 and bf16, both
layouts). ``cast-llm train --fsdp`` uses it under the mixed-precision policy (:mod:`cast_llm.train.fsdp`);
under autocast the product replaces the bf16 weight copy autocast would keep anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cast_llm.nn.scaled_weight import scaled_weight_grads, torch_scaled_weight

__all__ = ["recomputed_scaled_linear"]


def recomputed_scaled_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None, n_groups: int,
                             transposed: bool, out_dtype: torch.dtype) -> Tensor:
    """``linear(x, Diag(A) W, b)`` (``nn.Linear`` layout ``(out, in)``; GPT-2 ``Conv1D`` ``(in, out)`` when
    ``transposed``) in ``out_dtype``, differentiable in ``x``, ``W``, ``A`` and ``b``; see the module docstring."""
    return _RecomputedScaledLinear.apply(x, weight, scale, bias, n_groups, transposed, out_dtype)


class _RecomputedScaledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, scale, bias, n_groups, transposed, out_dtype):
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen here, as autocast would
            w = torch_scaled_weight(weight.detach(), scale.detach(), n_groups, transposed, out_dtype)
            x2 = x.reshape(-1, x.shape[-1]).to(out_dtype)
            wt = w if transposed else w.t()
            # addmm with a bias, as F.linear (2-D and contiguous 3-D inputs) and Conv1D run it
            y = torch.mm(x2, wt) if bias is None else torch.addmm(bias.to(out_dtype), x2, wt)
        ctx.save_for_backward(x, weight, scale)
        ctx.n_groups, ctx.transposed, ctx.out_dtype, ctx.has_bias = n_groups, transposed, out_dtype, bias is not None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, weight, scale = ctx.saved_tensors
        g, transposed, dtype = ctx.n_groups, ctx.transposed, ctx.out_dtype
        need_x, need_w, need_a, need_b = ctx.needs_input_grad[:4]
        grad_x = grad_w = grad_a = grad_b = None
        with torch.autocast(grad.device.type, enabled=False):
            g2 = grad.reshape(-1, grad.shape[-1]).to(dtype)
            if need_x:  # ∂L/∂x = ∂y · W_scale (the product formed again: the point of this function)
                w = torch_scaled_weight(weight, scale, g, transposed, dtype)
                grad_x = (torch.mm(g2, w.t()) if transposed else torch.mm(g2, w)).view(x.shape)
                del w
            if need_w or need_a:  # ∂L/∂W_scale = ∂yᵀ · x in the weight's layout, then Eq. 12's backward
                x2 = x.reshape(-1, x.shape[-1]).to(dtype)
                grad_ws = torch.mm(x2.t(), g2) if transposed else torch.mm(g2.t(), x2)
                grad_w, grad_a = scaled_weight_grads(grad_ws, weight, scale, g, transposed, need_w, need_a)
            if need_b and ctx.has_bias:
                grad_b = g2.sum(0)
        return grad_x, grad_w, grad_a, grad_b, None, None, None
