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

from cast_llm.kernels.switch import triton_runs_on
from cast_llm.triton_support import FP_FUSION, LRU, tl, to_device, triton

__all__ = ["scaled_weight_grads", "unsupported_reason", "grouped_scaled_weights", "grouped_scaled_weight_grads",
           "grouped_unsupported_reason"]

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_NUM_WARPS = 4
# (host code divides with -(-a // b): triton.cdiv is a constexpr_function in Triton 3.9, ~20 µs per host call)


def unsupported_reason(grad: Tensor, weight: Tensor, scale: Tensor) -> str | None:
    """None if :func:`scaled_weight_grads` takes these tensors, else why not (the caller uses torch ops)."""
    reason = triton_runs_on(weight.device)
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
    grid = (-(-out_f // block_r), n_groups)
    with _on(weight.device):
        _scaled_weight_grad_kernel[grid](
            grad, weight, scale, gw, ga, out_f, k,
            *_rc(grad, transposed), *_rc(weight, transposed), *_rc(gw, transposed), scale.stride(0), scale.stride(1),
            ga.stride(0), ga.stride(1),
            NEED_W=need_w, NEED_A=need_a, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=_NUM_WARPS,
            enable_fp_fusion=FP_FUSION,
        )  # fmt: skip
    return grad_w, grad_a


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it ``device`` when it is not (multi-GPU processes)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------ grouped (multi-tensor)
# The layers of one decoder block in ONE launch each way (cast_llm.nn.scaled_group): every tensor is
# contiguous in its weight's layout, so strides follow from the shape; the kernels read each member's
# addresses and sizes from a small int64 table (field f of member i at table[f * M + i]) and cast the
# addresses to typed pointers (the anchors' pointer types). UNIT = 16 when every address is 16-byte aligned and
# every R and K a multiple of 16 (sizes are stored divided by UNIT): the compiler then knows the alignment
# and uses vector accesses.
_G_FWD = ("w", "a", "out", "R", "K")
_G_BWD = ("g", "w", "a", "gw", "ga", "R", "K")

if triton is not None:

    @triton.jit
    def _member_tile(pid, R, K, n_groups, BLOCK_R: tl.constexpr):
        n_rb = tl.cdiv(R, BLOCK_R)
        return pid % n_rb, pid // n_rb  # (row block, column block); column block >= n_groups: nothing to do

    @triton.jit
    def _offsets(rows, cols, R, C, TRANSPOSED: tl.constexpr):
        if TRANSPOSED:  # Conv1D: weight (in, out), entry (r, c) at c * R + r
            return rows[:, None] + cols[None, :] * R
        return rows[:, None] * C + cols[None, :]

    @triton.jit
    def _grouped_fwd_kernel(
        table_ptr, n_members, n_groups, w0, a0, out0,
        TRANSPOSED: tl.constexpr, UNIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        mid = tl.program_id(1)
        R = tl.load(table_ptr + 3 * n_members + mid) * UNIT
        K = tl.load(table_ptr + 4 * n_members + mid) * UNIT
        rb, b = _member_tile(tl.program_id(0), R, K, n_groups, BLOCK_R)
        if b < n_groups:
            w_ptr = tl.load(table_ptr + mid).to(w0.dtype)
            a_ptr = tl.load(table_ptr + n_members + mid).to(a0.dtype)
            out_ptr = tl.load(table_ptr + 2 * n_members + mid).to(out0.dtype)
            if UNIT == 16:
                w_ptr = tl.multiple_of(w_ptr, 16)
                out_ptr = tl.multiple_of(out_ptr, 16)
            rows = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
            rmask = rows < R
            a = tl.load(a_ptr + rows * n_groups + b, mask=rmask, other=0.0).to(tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                m = rmask[:, None] & (ks < K)[None, :]
                offs = _offsets(rows, b * K + ks, R, K * n_groups, TRANSPOSED)
                w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
                tl.store(out_ptr + offs, (w * a[:, None]).to(out0.dtype.element_ty), mask=m)

    @triton.jit
    def _grouped_bwd_kernel(
        table_ptr, n_members, n_groups, g0, w0, a0, gw0, ga0,
        NEED_W: tl.constexpr, NEED_A: tl.constexpr, TRANSPOSED: tl.constexpr, UNIT: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        mid = tl.program_id(1)
        R = tl.load(table_ptr + 5 * n_members + mid) * UNIT
        K = tl.load(table_ptr + 6 * n_members + mid) * UNIT
        rb, b = _member_tile(tl.program_id(0), R, K, n_groups, BLOCK_R)
        if b < n_groups:
            g_ptr = tl.load(table_ptr + mid).to(g0.dtype)
            w_ptr = tl.load(table_ptr + n_members + mid).to(w0.dtype)
            a_ptr = tl.load(table_ptr + 2 * n_members + mid).to(a0.dtype)
            gw_ptr = tl.load(table_ptr + 3 * n_members + mid).to(gw0.dtype)
            ga_ptr = tl.load(table_ptr + 4 * n_members + mid).to(ga0.dtype)
            if UNIT == 16:
                g_ptr = tl.multiple_of(g_ptr, 16)
                w_ptr = tl.multiple_of(w_ptr, 16)
                gw_ptr = tl.multiple_of(gw_ptr, 16)
            rows = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
            rmask = rows < R
            a = tl.load(a_ptr + rows * n_groups + b, mask=rmask, other=0.0).to(tl.float32)
            acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                m = rmask[:, None] & (ks < K)[None, :]
                offs = _offsets(rows, b * K + ks, R, K * n_groups, TRANSPOSED)
                g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
                if NEED_A:
                    acc += g * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
                if NEED_W:
                    tl.store(gw_ptr + offs, (g * a[:, None]).to(gw0.dtype.element_ty), mask=m)
            if NEED_A:
                tl.store(ga_ptr + rows * n_groups + b, tl.sum(acc, axis=1), mask=rmask)


# a few entries per decoder block and direction: 256 hold a 60-block model's both ways, the least recently used
# are dropped one by one (not the whole cache at once)
_GROUP_TABLES = LRU(256)


def _group_table(fields: list[list[int]], sizes: list[tuple[int, int]], device: torch.device) -> tuple[Tensor, int]:
    """The int64 (fields + 2, M) table on ``device`` (addresses, then R and K divided by the unit) and the unit.
    Cached by content: weights and scales never move, and the caching allocator mostly hands gradients and
    outputs the same addresses step after step, so most calls upload nothing; a new table is copied from pinned
    memory, asynchronously (no wait for the device)."""
    key = (device, tuple(map(tuple, fields)), tuple(sizes))

    def make() -> tuple[Tensor, int]:
        aligned = all(a % 16 == 0 for f in fields for a in f) and all(r % 16 == 0 and k % 16 == 0 for r, k in sizes)
        unit = 16 if aligned else 1
        rows = [*fields, [r // unit for r, _ in sizes], [k // unit for _, k in sizes]]
        return to_device(rows, torch.int64, device), unit

    return _GROUP_TABLES.get_or(key, make)


def grouped_unsupported_reason(weights: list[Tensor], scales: list[Tensor], n_groups: int) -> str | None:
    """None if the grouped kernels take these layers (one device, one weight dtype, contiguous weights,
    float32 scales), else why not."""
    w0 = weights[0]
    reason = triton_runs_on(w0.device)
    if reason is not None:
        return reason
    if w0.dtype not in _FLOAT:
        return f"weight dtype {w0.dtype}"
    for w, a in zip(weights, scales):
        if w.device != w0.device or a.device != w0.device or w.dtype != w0.dtype:
            return "weights on several devices or in several dtypes"
        if a.dtype != torch.float32 or not a.is_contiguous() or a.shape[1] != n_groups:
            return f"a scale of {a.dtype} {tuple(a.shape)} (float32, (out, {n_groups}), contiguous)"
        if not w.is_contiguous() or w.numel() == 0:
            return "a non-contiguous or empty weight"
    return None


def _rk(w: Tensor, a: Tensor, n_groups: int) -> tuple[int, int]:
    out_f = a.shape[0]
    return out_f, w.numel() // out_f // n_groups


def grouped_scaled_weights(weights: list[Tensor], scales: list[Tensor], n_groups: int, transposed: bool,
                           out_dtype: torch.dtype) -> list[Tensor]:
    """``Diag(A_i) W_i`` (Eq. 12) of every layer in one launch, each in ``out_dtype`` and its weight's layout
    (product formed in float32, rounded once, as :func:`cast_llm.nn.scaled_weight.scaled_weight`)."""
    outs = [torch.empty(w.shape, dtype=out_dtype, device=w.device) for w in weights]
    sizes = [_rk(w, a, n_groups) for w, a in zip(weights, scales)]
    table, unit = _group_table([[w.data_ptr() for w in weights], [a.data_ptr() for a in scales],
                                [o.data_ptr() for o in outs]], sizes, weights[0].device)
    block_r, block_k = (128, 16) if transposed else (16, 128)
    grid = (max(-(-r // block_r) for r, _ in sizes) * n_groups, len(weights))
    with _on(weights[0].device):
        _grouped_fwd_kernel[grid](table, len(weights), n_groups, weights[0], scales[0], outs[0],
                                  TRANSPOSED=transposed, UNIT=unit, BLOCK_R=block_r, BLOCK_K=block_k,
                                  num_warps=_NUM_WARPS, enable_fp_fusion=FP_FUSION)
    return outs


def grouped_scaled_weight_grads(grads: list[Tensor], weights: list[Tensor], scales: list[Tensor], n_groups: int,
                                transposed: bool, need_w: bool, need_a: bool
                                ) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """``(∂L/∂W_i, ∂L/∂A_i)`` of every layer from ``grads[i] = ∂L/∂W_scale_i`` in one launch (see
    :func:`scaled_weight_grads`); gradients must be in their weight's layout (made contiguous here if not)."""
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    gws = [torch.empty(w.shape, dtype=w.dtype, device=w.device) for w in weights] if need_w else None
    gas = [torch.empty(a.shape, dtype=a.dtype, device=a.device) for a in scales] if need_a else None
    if not (need_w or need_a):
        return [None] * len(weights), [None] * len(weights)
    sizes = [_rk(w, a, n_groups) for w, a in zip(weights, scales)]
    gw_list = gws if need_w else weights  # placeholders are never touched
    ga_list = gas if need_a else scales
    table, unit = _group_table([[g.data_ptr() for g in grads], [w.data_ptr() for w in weights],
                                [a.data_ptr() for a in scales], [x.data_ptr() for x in gw_list],
                                [x.data_ptr() for x in ga_list]], sizes, weights[0].device)
    block_r, block_k = (128, 16) if transposed else (16, 128)
    grid = (max(-(-r // block_r) for r, _ in sizes) * n_groups, len(weights))
    with _on(weights[0].device):
        _grouped_bwd_kernel[grid](table, len(weights), n_groups, grads[0], weights[0], scales[0], gw_list[0],
                                  ga_list[0], NEED_W=need_w, NEED_A=need_a, TRANSPOSED=transposed, UNIT=unit,
                                  BLOCK_R=block_r, BLOCK_K=block_k, num_warps=_NUM_WARPS, enable_fp_fusion=FP_FUSION)
    return (gws or [None] * len(weights)), (gas or [None] * len(weights))
