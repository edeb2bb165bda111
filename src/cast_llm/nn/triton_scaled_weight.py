"""The backward of ``W_scale = Diag(A) W`` (Eq. 11-12) as ONE Triton kernel per layer, for CUDA.

Given ``G = ∂L/∂W_scale`` (the matmul's weight gradient, bf16 under autocast) it forms both gradients in
one read of ``G`` and ``W``::

    ∂L/∂W[r, c] = A[r, b(c)] · G[r, c]                 (in W's dtype, rounded once)
    ∂L/∂A[r, b] = Σ_{c in block b} G[r, c] · W[r, c]    (float32 accumulation)

Bytes per weight entry: read G (2 in bf16) and W (4), write ∂L/∂W (4) — 10, against 20 for the same
math in torch ops (the ``G ⊙ W`` product is written in fp32 and read back for the sum) and 6 for what a
plain autocast linear does anyway (cast G to the fp32 ``.grad``). One launch instead of three ops also
matters at SmolLM2's widths, where a step's 210 layers are bound by host time per op.

Layouts: every tensor is addressed through (row, column) strides, row = output feature, column = input
feature, so nn.Linear's ``(out, in)`` and GPT-2 Conv1D's ``(in, out)`` are the same kernel with swapped
strides; the tile is wide along whichever axis is contiguous in memory. Each program owns ``BLOCK_R`` rows
of one column block and walks the block in ``BLOCK_K`` slices, so every ∂L/∂A entry is reduced by one
program: deterministic, no atomics. ∂L/∂W is bitwise what torch's ``mul`` gives (same fp32 product, one
rounding); ∂L/∂A differs from torch's reduction only in summation order (float32 rounding).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from cast_llm.triton_support import kernel_device_reason, tl, triton

__all__ = ["scaled_weight_grads", "unsupported_reason"]

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_NUM_WARPS = 4


def unsupported_reason(grad: Tensor, weight: Tensor, scale: Tensor) -> str | None:
    """None if :func:`scaled_weight_grads` takes these tensors, else why not (the caller uses torch ops)."""
    reason = kernel_device_reason(weight.device)
    if reason is not None:
        return reason
    if weight.dtype not in _FLOAT or grad.dtype not in _FLOAT:
        return f"weight {weight.dtype} / gradient {grad.dtype} (the kernel takes float32, bfloat16, float16)"
    if scale.dtype != torch.float32:
        return f"scale dtype {scale.dtype} (the kernel takes a float32 scale)"
    if grad.device != weight.device or scale.device != weight.device:
        return "gradient, weight and scale on different devices"
    if weight.numel() == 0:
        return "an empty weight"
    return None


if triton is not None:

    @triton.jit
    def _scaled_weight_grad_kernel(
        g_ptr, w_ptr, a_ptr, gw_ptr, ga_ptr,
        R, K,  # rows (output features), columns per block (in_features / n_groups)
        g_sr, g_sc, w_sr, w_sc, gw_sr, gw_sc, a_sr, a_sg, ga_sr, ga_sg,  # (row, column) strides of each
        NEED_W: tl.constexpr, NEED_A: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(1)  # the column block: one scale per (row, block)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        rows = rows.to(tl.int64)  # offsets in int64: a weight may exceed 2^31 entries
        a = tl.load(a_ptr + rows * a_sr + b * a_sg, mask=rmask, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            cols = (b * K + ks).to(tl.int64)
            m = rmask[:, None] & (ks < K)[None, :]
            g = tl.load(g_ptr + rows[:, None] * g_sr + cols[None, :] * g_sc, mask=m, other=0.0).to(tl.float32)
            if NEED_A:
                w = tl.load(w_ptr + rows[:, None] * w_sr + cols[None, :] * w_sc, mask=m, other=0.0).to(tl.float32)
                acc += g * w
            if NEED_W:
                gw = (g * a[:, None]).to(gw_ptr.dtype.element_ty)
                tl.store(gw_ptr + rows[:, None] * gw_sr + cols[None, :] * gw_sc, gw, mask=m)
        if NEED_A:
            tl.store(ga_ptr + rows * ga_sr + b * ga_sg, tl.sum(acc, axis=1), mask=rmask)


def _rc(t: Tensor, transposed: bool) -> tuple[int, int]:
    """(row, column) strides of a tensor in the weight's layout (row = output feature)."""
    return (t.stride(1), t.stride(0)) if transposed else (t.stride(0), t.stride(1))


def scaled_weight_grads(grad: Tensor, weight: Tensor, scale: Tensor, n_groups: int, transposed: bool,
                        need_w: bool = True, need_a: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """``(∂L/∂W, ∂L/∂A)`` of ``W_scale = Diag(A) W`` from ``grad = ∂L/∂W_scale`` (None where not needed).

    ``weight``: ``(out, in)``, or ``(in, out)`` when ``transposed`` (Conv1D); ``grad`` in the same layout,
    any strides; ``scale``: ``(out, n_groups)`` float32. ∂L/∂W comes back contiguous in W's dtype, ∂L/∂A
    ``(out, n_groups)`` in float32. Check :func:`unsupported_reason` first.
    """
    reason = unsupported_reason(grad, weight, scale)
    if reason is not None:
        raise RuntimeError(f"scaled-weight kernel cannot run: {reason}")
    out_f = scale.shape[0]
    k = weight.numel() // out_f // n_groups
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
    grad_a = torch.empty((out_f, n_groups), dtype=scale.dtype, device=scale.device) if need_a else None
    if not (need_w or need_a):
        return None, None
    row_major = _rc(weight, transposed)[1] == 1  # columns contiguous: wide tiles along them
    block_r, block_k = (16, 128) if row_major else (128, 16)
    gw, ga = (grad_w if need_w else weight), (grad_a if need_a else scale)  # placeholders are never touched
    grid = (triton.cdiv(out_f, block_r), n_groups)
    with _on(weight.device):
        _scaled_weight_grad_kernel[grid](
            grad, weight, scale, gw, ga, out_f, k,
            *_rc(grad, transposed), *_rc(weight, transposed), *_rc(gw, transposed), scale.stride(0), scale.stride(1),
            ga.stride(0), ga.stride(1),
            NEED_W=need_w, NEED_A=need_a, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=_NUM_WARPS,
        )  # fmt: skip
    return grad_w, grad_a


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it ``device`` when it is not (multi-GPU processes)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
