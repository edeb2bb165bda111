"""How AdamS's fast paths are checked (:mod:`cast_llm.kernels`): the probes and timers of the kernel paths
``adams.update`` (Eq. 7-8) and ``adams.masks`` (Eq. 6), declared in :mod:`cast_llm.optim.functional`, and the
cheap test of whether a tensor set fits the fused update at all.

* ``adams.update``: the probe runs two steps on two launches' worth of tensors — every length a multiple of 16
  (the vectorised kernel variant, one tensor over two chunks) and ragged ones (the scalar variant, partial
  packed bytes) — against the reference in float64 from the same rounded start, with fixed masks that keep
  and prune entries of both signs, and checks that the step counts moved on the device. Weights stay clear of
  0 over the two steps (no sign flips), so the error is rounding only: ``max |x − ref| / max |ref|`` of θ, μ
  and v, at most 1e-5 in float32, 4e-3 for bf16 θ (half an ulp is 2e-3) and 1.2e-2 for bf16 moments (rounded
  at every step), 1e-3 / 4e-3 in float16, 1e-12 in float64.
* ``adams.masks``: ties and signed zeros in most groups, lengths over two chunks; the masks must equal
  :func:`~cast_llm.sparsity.mask.magnitude_mask`'s (packed by ``pack_mask``) bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cast_llm.kernels import Check, seconds_per_call
from cast_llm.sparsity.mask import nm_mask, pack_mask, packed_numel

__all__ = ["fast_path_unsupported", "update_probe", "update_timer", "update_variants", "mask_probe", "mask_timer",
           "mask_variants", "DTYPES"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_ALIGNED = [(16, 64), (64, 320), (8, 16)]  # 64 x 320 = 20,480 entries: two of the kernel's 16K chunks
_RAGGED = [(6, 20), (5, 12), (3, 36)]
_THETA_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 1e-3, torch.float64: 1e-12}
_STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.2e-2, torch.float16: 4e-3, torch.float64: 1e-12}


def fast_path_unsupported(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                          mask: Tensor | None = None, step: Tensor | None = None) -> str | None:
    """None if the fused update paths (the Triton kernels, the compiled update) take this tensor set, else why
    not (the caller falls back or raises).

    Cheap on purpose (it runs for every parameter at every step). torch already guarantees that ``.grad``
    has its parameter's shape, dtype and device; what is left to check is dtypes, contiguity and where the
    mask and the step count live."""
    if param.dtype not in DTYPES:
        return f"dtype {param.dtype} (the kernel takes float32, bfloat16 and float16)"
    if grad.dtype != param.dtype:
        return f"its gradient is {grad.dtype}, the parameter {param.dtype}"
    if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.dtype not in (torch.float32, param.dtype):
        return f"its states are {exp_avg.dtype}/{exp_avg_sq.dtype} (float32 or the parameter's dtype)"
    if exp_avg.shape != param.shape or exp_avg_sq.shape != param.shape:
        return f"its states have shape {tuple(exp_avg.shape)}, not the parameter's {tuple(param.shape)}"
    if not (param.is_contiguous() and grad.is_contiguous() and exp_avg.is_contiguous()
            and exp_avg_sq.is_contiguous()):
        return "a non-contiguous parameter, gradient or state"
    if exp_avg.device != param.device or exp_avg_sq.device != param.device:
        return f"its states are on {exp_avg.device}"
    if mask is not None:
        if mask.device != param.device or not mask.is_contiguous():
            return f"its mask is on {mask.device} or not contiguous"
        if mask.dtype == torch.bool:
            if mask.shape != param.shape:
                return f"its bool mask has shape {tuple(mask.shape)}"
        elif mask.dtype == torch.uint8:
            if mask.dim() != 1 or mask.numel() != packed_numel(param.numel()):
                return f"its packed mask has {mask.numel()} bytes for {param.numel()} entries"
        else:
            return f"mask dtype {mask.dtype} (bool or packed uint8)"
    if step is not None and (step.device != param.device or step.dtype != torch.float32 or step.numel() != 1):
        return (f"its step count is a {step.dtype} tensor on {step.device}; the kernel reads and increments it "
                "on the parameter's device (a float32 scalar there, as torch's fused Adam keeps it)")
    return None


def _hp(variant: tuple) -> dict:
    _, _, _, decay_mode, maximize, decay = variant
    return dict(beta1=0.9, beta2=0.99, lr=1e-3, eps=1e-8, l1_decay=0.05, total_steps=4,
                weight_decay=0.1 if decay == "decoupled decay" else 0.0, maximize=maximize == "maximize",
                decay_mode=decay_mode)


def update_probe(impl, device: torch.device, variant: tuple, *, reference) -> Check:
    dtype, state_dtype, storage, *_ = variant
    hp = _hp(variant)
    worst = Check(0.0, 1.0)
    for shapes in (_ALIGNED, _RAGGED):
        gen = torch.Generator().manual_seed(len(shapes))
        sign = [torch.randint(0, 2, s, generator=gen, dtype=torch.float64) * 2 - 1 for s in shapes]
        theta = [sg * (0.25 + 0.75 * torch.rand(s, generator=gen, dtype=torch.float64)) for sg, s in zip(sign, shapes)]
        mu = [0.01 * torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        v = [0.01 * (0.5 + torch.rand(s, generator=gen, dtype=torch.float64)) for s in shapes]
        P = [x.to(device=device, dtype=dtype) for x in theta]
        MU, V = ([x.to(device=device, dtype=state_dtype) for x in xs] for xs in (mu, v))
        RP, RMU, RV = ([x.cpu().double() for x in xs] for xs in (P, MU, V))  # the same rounded start
        masks = [nm_mask(x) for x in theta]
        K = [(pack_mask(k) if storage == "packed" else k).to(device) for k in masks]
        steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in shapes]
        ref_steps = [torch.zeros((), dtype=torch.float32) for _ in shapes]
        for _ in range(2):
            g = [0.1 * torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
            G = [x.to(device=device, dtype=dtype) for x in g]
            impl(P, G, MU, V, K, steps, **hp)
            reference(RP, [x.cpu().double() for x in G], RMU, RV, masks, ref_steps, **hp)
        if any(float(s) != 2.0 for s in steps):
            return Check(float("inf"), 1.0)  # the counts did not move as the contract says
        for xs, refs, dt, tol in ((P, RP, dtype, _THETA_TOL), (MU, RMU, state_dtype, _STATE_TOL),
                                  (V, RV, state_dtype, _STATE_TOL)):
            err = max(float((x.cpu().double() - r).abs().max() / r.abs().max()) for x, r in zip(xs, refs))
            if not err / tol[dt] <= worst.error / worst.tolerance:  # (a NaN error is the worst)
                worst = Check(err, tol[dt])
    return worst


def update_timer(impl, device: torch.device, variant: tuple, *, reference, host_counts=()) -> float:
    """One step over 8 tensors of 1M entries: 256 MB of fp32 state, past any cache, so the candidates compare as
    they run on a model (at 1M entries in all, the CPU's block-wise path ran from cache and won; on SmolLM2's
    134M it was the slower one: docs/results/compiled-candidates-cpu.md)."""
    dtype, state_dtype, storage, *_ = variant
    rows = 1024
    shapes = [(rows, 1024)] * 8
    P = [torch.randn(s, device=device).to(dtype) for s in shapes]
    G = [0.1 * torch.randn(s, device=device).to(dtype) for s in shapes]
    MU, V = ([torch.zeros(s, device=device, dtype=state_dtype) for s in shapes] for _ in range(2))
    masks = [nm_mask(p) for p in P]
    K = [pack_mask(k) if storage == "packed" else k for k in masks]
    hp = _hp(variant)
    if impl is None:  # the reference reads its counts on the host
        steps = [torch.zeros(()) for _ in shapes]
        return seconds_per_call(lambda: reference(P, G, MU, V, K, steps, **hp), device)
    on = torch.device("cpu") if impl in host_counts else device
    steps = [torch.zeros((), device=on) for _ in shapes]
    return seconds_per_call(lambda: impl(P, G, MU, V, K, steps, **hp), device)


def update_variants(device: torch.device) -> list[tuple]:
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    return [(d, torch.float32, "bool", "proportional", "minimize", "no decay") for d in dtypes]


# --------------------------------------------------------------------------------------------- mask refresh
def mask_probe(impl, device: torch.device, variant: tuple, *, reference) -> Check:
    dtype, layout, storage, pattern = variant
    n, m = (int(x) for x in pattern.split(":"))
    transposed, packed = layout == "transposed", storage == "packed"
    gen = torch.Generator().manual_seed(3)
    # m divides the grouped dim; partial packed bytes; the last one spans two 16K chunks
    shapes = [(2 * m, 3), (3 * m, 4 * m), (1024 * m, 5)] if transposed else [(3, 4 * m), (5, 2 * m), (5, 1024 * m)]
    # a few distinct magnitudes with signs and zeros of both signs: ties in most groups
    ws = [(torch.randint(-3, 4, s, generator=gen) * 0.25).to(device=device, dtype=dtype) for s in shapes]
    ws[0][0, :] = -0.0
    got = impl(ws, transposed=transposed, n=n, m=m, packed=packed)
    wanted = reference([w.cpu() for w in ws], transposed=transposed, n=n, m=m, packed=packed)
    wrong = total = 0
    for mask, want in zip(got, wanted):
        wrong += int((mask.cpu() != want).sum()) if mask.shape == want.shape else want.numel()
        total += want.numel()
    return Check(wrong / total, 0.0)


def mask_timer(impl, device: torch.device, variant: tuple, *, reference) -> float:
    dtype, layout, storage, pattern = variant
    n, m = (int(x) for x in pattern.split(":"))
    ws = [torch.randn(1024, 1024, device=device).to(dtype) for _ in range(4)]
    transposed, packed = layout == "transposed", storage == "packed"
    if impl is None:
        return seconds_per_call(lambda: reference(ws, transposed=transposed, n=n, m=m, packed=packed), device)
    return seconds_per_call(lambda: impl(ws, transposed=transposed, n=n, m=m, packed=packed), device)


def mask_variants(device: torch.device) -> list[tuple]:
    return [(torch.float32, "rows", "bool", "2:4"), (torch.bfloat16, "transposed", "packed", "2:4")]
