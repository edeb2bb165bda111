"""AdamS (method.md §2, Eq. 7-8) as one Triton kernel: one pass over memory per parameter, on CUDA.

Per element it reads θ, g, μ, v and the mask (1 byte as bool, or 1 bit packed) and writes θ, μ, v —
the minimum an Adam-type update must move (AdamW(fused=True) moves the same minus the mask)::

    θ ← θ (1 - lr·wd)                                         (decoupled weight decay, if any)
    μ ← lerp(μ, ±g, 1-β1)                                      (μ_t: the loss gradient only)
    s = (1-α) μ + α λ sign(θ)     [additive mode: μ + α λ θ]   (Eq. 7, computed for every entry)
    μ~ = μ where kept else s
    v ← β2 v + (1-β2) μ~²                                      (from μ~, every entry)
    θ ← θ - lr/(1-β1^t) · μ~ / (sqrt(v) / sqrt(1-β2^t) + ε)    (Eq. 8)

All arithmetic is float32 whatever the storage dtype (bf16/fp16 parameters and states are rounded once
per store), with the host-side scalars computed in float64 exactly as the reference path computes them.

Multi-tensor: ONE launch updates every tensor of a list (like torch's ``_foreach``/fused kernels), so a
model's 200+ target matrices cost one launch, not 200+ (at 10-20 µs of launch overhead each that would be
as long as the memory traffic of a 135M model). The kernel reads each tensor's address from a small int64
table and casts it to a typed pointer; the grid is ``(blocks of the largest tensor, tensors)`` and the
blocks past a smaller tensor's end are fully masked no-ops. Tensors that share one ``t`` go into one
launch (``t`` differs only for a parameter that missed a gradient at some step).

Importing this module imports Triton; :func:`unavailable_reason` is the cheap guard that says why it
cannot be used. With ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (slowly): that is how it is
tested on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import Tensor

__all__ = ["fused_adams_", "unavailable_reason", "unsupported_reason"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 4096  # elements per program: 16 per thread at 8 warps, wide vector loads, few programs
_NUM_WARPS = 8
_MAX_TENSORS = 65535  # CUDA's limit on grid dimension 1 (one row of programs per tensor)

_IMPORT_ERROR: str | None = None
try:
    import triton
    import triton.language as tl
except Exception as err:  # ImportError, or a broken install: either way no kernel
    triton = tl = None
    _IMPORT_ERROR = f"Triton is not importable ({type(err).__name__}: {err}); pip install triton"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason() -> str | None:
    """None if the kernel can run here, else why not (Triton missing, or no CUDA device)."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if not _interpreting() and not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def unsupported_reason(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, mask: Tensor) -> str | None:
    """None if the kernel takes this tensor set, else why not (the caller falls back or raises)."""
    if param.dtype not in _DTYPES:
        return f"dtype {param.dtype} (the kernel takes float32, bfloat16 and float16)"
    for name, x in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if x.dtype != param.dtype or x.shape != param.shape or x.device != param.device:
            return f"its {name} is {x.dtype} {tuple(x.shape)} on {x.device}, not like the parameter"
    if not all(x.is_contiguous() for x in (param, grad, exp_avg, exp_avg_sq, mask)):
        return "a non-contiguous tensor (parameter, gradient, state or mask)"
    if mask.device != param.device:
        return f"its mask is on {mask.device}"
    if mask.dtype == torch.bool:
        if mask.shape != param.shape:
            return f"its bool mask has shape {tuple(mask.shape)}"
    elif mask.dtype == torch.uint8:
        if mask.dim() != 1 or mask.numel() != (param.numel() + 7) // 8:
            return f"its packed mask has {mask.numel()} bytes for {param.numel()} entries"
    else:
        return f"mask dtype {mask.dtype} (bool or packed uint8)"
    return None


if triton is not None:

    @triton.jit
    def _adams_kernel(
        table_ptr,  # int64 (5, n_tensors): addresses of θ, g, μ, v, mask of every tensor, in units of UNIT bytes
        numel_ptr,  # int64 (n_tensors,): numels in units of UNIT elements
        n_tensors,
        theta0, grad0, mu0, v0, mask0,  # the first tensor of each list: only their pointer TYPES are used
        lerp_w, lerp_w_rest, beta2, one_minus_beta2, decay, one_minus_alpha, step_size, bc2_sqrt, eps, wd_keep,
        PACKED: tl.constexpr, ADDITIVE: tl.constexpr, MAXIMIZE: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
        LERP_FROM_END: tl.constexpr, RN: tl.constexpr, UNIT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        tid = tl.program_id(1)
        # UNIT = 16 when the host found every address and length a multiple of 16 (else 1: e.g. gradients
        # that are views into a bucket). The compiler cannot know that of values read from memory; told so
        # ("* UNIT" for the lengths, multiple_of for the pointers) it uses 16-byte vector loads and stores
        # (checked in the PTX: ld.global.v4 instead of 4x as many scalar loads).
        numel = tl.load(numel_ptr + tid) * UNIT
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: tensors may exceed 2^31
        inb = offs < numel  # blocks past this tensor's end (the grid fits the largest) touch nothing
        # typed pointers from the address table: an int64 cast to the pointer type of the anchor tensors
        th_ptrs = (tl.load(table_ptr + tid) * UNIT).to(theta0.dtype) + offs
        g_ptrs = (tl.load(table_ptr + n_tensors + tid) * UNIT).to(grad0.dtype) + offs
        mu_ptrs = (tl.load(table_ptr + 2 * n_tensors + tid) * UNIT).to(mu0.dtype) + offs
        v_ptrs = (tl.load(table_ptr + 3 * n_tensors + tid) * UNIT).to(v0.dtype) + offs
        k_ptr = (tl.load(table_ptr + 4 * n_tensors + tid) * UNIT).to(mask0.dtype)
        if UNIT == 16:
            th_ptrs = tl.multiple_of(th_ptrs, 16)
            g_ptrs = tl.multiple_of(g_ptrs, 16)
            mu_ptrs = tl.multiple_of(mu_ptrs, 16)
            v_ptrs = tl.multiple_of(v_ptrs, 16)

        theta = tl.load(th_ptrs, mask=inb, other=0.0).to(tl.float32)
        g = tl.load(g_ptrs, mask=inb, other=0.0).to(tl.float32)
        mu = tl.load(mu_ptrs, mask=inb, other=0.0).to(tl.float32)
        v = tl.load(v_ptrs, mask=inb, other=0.0).to(tl.float32)
        if PACKED:  # element i is bit (i % 8) of byte i // 8 (pack_mask's order)
            byte = tl.load(k_ptr + (offs >> 3), mask=inb, other=0).to(tl.int32)
            kept = ((byte >> (offs & 7).to(tl.int32)) & 1) != 0
        else:
            k_ptrs = k_ptr + offs
            if UNIT == 16:
                k_ptrs = tl.multiple_of(k_ptrs, 16)
            kept = tl.load(k_ptrs, mask=inb, other=0) != 0

        if MAXIMIZE:
            g = -g
        if WEIGHT_DECAY:
            theta = theta * wd_keep  # decoupled (AdamW): before the sign of Eq. 7 is taken, as in the reference
        # μ_t = lerp(μ, g, 1-β1) with torch's two-sided formula (exact at both ends)
        if LERP_FROM_END:
            mu = g - (g - mu) * lerp_w_rest
        else:
            mu = mu + lerp_w * (g - mu)
        if ADDITIVE:  # AST: the decay added to the momentum signal
            s = theta * decay + mu
        else:  # Eq. 7: mixed with it by α; sign(NaN) stays NaN as in torch.sign
            sgn = tl.where(theta > 0, 1.0, tl.where(theta < 0, -1.0, 0.0))
            sgn = tl.where(theta != theta, theta, sgn)
            s = sgn * decay + mu * one_minus_alpha
        mt = tl.where(kept, mu, s)  # μ~: the decay never enters the stored μ
        v = v * beta2 + one_minus_beta2 * (mt * mt)
        if RN:  # IEEE-rounded sqrt/div, as torch's CUDA kernels (Triton's defaults are approximate)
            denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
            theta = theta - step_size * tl.div_rn(mt, denom)
        else:  # pragma: no cover - Triton < 3.0
            denom = tl.sqrt(v) / bc2_sqrt + eps
            theta = theta - step_size * (mt / denom)

        tl.store(th_ptrs, theta.to(theta0.dtype.element_ty), mask=inb)
        tl.store(mu_ptrs, mu.to(mu0.dtype.element_ty), mask=inb)
        tl.store(v_ptrs, v.to(v0.dtype.element_ty), mask=inb)


_TABLES: dict[tuple, tuple[Tensor, Tensor]] = {}


def _address_table(lists: tuple[list[Tensor], ...], device: torch.device) -> tuple[Tensor, Tensor, int]:
    """(addresses (5, n), numels (n,), unit) on ``device``, both divided by ``unit`` (16 when every address
    and length is a multiple of 16, else 1). Cached: gradients are usually reallocated at the same addresses
    by the caching allocator, so most steps reuse the table without a host-to-device copy."""
    addresses = tuple(x.data_ptr() for xs in lists for x in xs)
    numels = tuple(p.numel() for p in lists[0])
    key = (device, addresses, numels)
    hit = _TABLES.get(key)
    if hit is None:
        if len(_TABLES) >= 16:  # a few live keys per optimizer (dtype groups); stale ones are dropped
            _TABLES.clear()
        unit = 16 if all(a % 16 == 0 for a in addresses) and all(n % 16 == 0 for n in numels) else 1
        table = torch.tensor([a // unit for a in addresses], dtype=torch.int64).view(len(lists), len(numels))
        hit = _TABLES[key] = (table.to(device), torch.tensor([n // unit for n in numels]).to(device), unit)
    return hit


def fused_adams_(params, grads, exp_avgs, exp_avg_sqs, masks, state_steps, *, beta1, beta2, lr, eps, l1_decay,
                 total_steps, weight_decay, maximize, decay_mode="proportional") -> None:
    """AdamS on lists of tensors through the Triton kernel; same contract as
    :func:`cast_llm.optim.functional.adams` (``state_steps`` are incremented here). Every tensor set must
    pass :func:`unsupported_reason`; masks are bool of the parameter's shape or packed uint8."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"fused AdamS kernel unavailable: {reason}")
    torch._foreach_add_(state_steps, 1)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        key = (p.device, p.dtype, masks[i].dtype, int(state_steps[i].item()))  # the CPU step: no sync
        groups.setdefault(key, []).append(i)
    for (device, _, mask_dtype, t), idx in groups.items():
        for lo in range(0, len(idx), _MAX_TENSORS):
            part = idx[lo : lo + _MAX_TENSORS]
            _launch(device, [params[i] for i in part], [grads[i] for i in part], [exp_avgs[i] for i in part],
                    [exp_avg_sqs[i] for i in part], [masks[i] for i in part], t,
                    packed=mask_dtype == torch.uint8, beta1=beta1, beta2=beta2, lr=lr, eps=eps,
                    l1_decay=l1_decay, total_steps=total_steps, weight_decay=weight_decay, maximize=maximize,
                    decay_mode=decay_mode)


def _launch(device, P, G, MU, V, K, t, *, packed, beta1, beta2, lr, eps, l1_decay, total_steps, weight_decay,
            maximize, decay_mode) -> None:
    K = [k.view(torch.uint8) for k in K]  # a bool mask is one 0/1 byte per entry
    table, numels, unit = _address_table((P, G, MU, V, K), device)
    alpha = min(t / total_steps, 1.0)
    lerp_w = 1.0 - beta1
    # every scalar in float64 on the host, as the reference path forms them; the kernel rounds them to fp32
    scalars = dict(
        lerp_w=lerp_w, lerp_w_rest=1.0 - lerp_w, beta2=beta2, one_minus_beta2=1.0 - beta2,
        decay=alpha * l1_decay, one_minus_alpha=1.0 - alpha, step_size=lr / (1.0 - beta1**t),
        bc2_sqrt=math.sqrt(1.0 - beta2**t), eps=eps, wd_keep=1.0 - lr * weight_decay,
    )  # fmt: skip
    grid = (triton.cdiv(max(p.numel() for p in P), _BLOCK), len(P))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _adams_kernel[grid](
            table, numels, len(P), P[0], G[0], MU[0], V[0], K[0], **scalars,
            PACKED=packed, ADDITIVE=decay_mode == "additive", MAXIMIZE=bool(maximize),
            WEIGHT_DECAY=weight_decay != 0, LERP_FROM_END=lerp_w >= 0.5, RN=hasattr(tl, "sqrt_rn"), UNIT=unit,
            BLOCK=_BLOCK, num_warps=_NUM_WARPS,
        )  # fmt: skip

