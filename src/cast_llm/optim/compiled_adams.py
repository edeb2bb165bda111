"""AdamS's update (Eq. 7-8) as torch operations compiled by ``torch.compile``: the ``compiled`` candidate of the
checked path ``adams.update``, beside the hand-written kernels.

One function updates ONE tensor set, flattened to 1-D, in one pass: inductor fuses the whole update into one
loop (vectorised C++ on a CPU, one Triton kernel on CUDA) that reads θ, g, μ, v and the mask once and writes θ,
μ, v — what ``AdamW(fused=True)`` moves plus the mask. It is compiled once per kind of tensor set (dtypes, mask
storage, decay mode, the maximize and weight-decay flags) with dynamic sizes, so every tensor of a model
reuses one compiled kernel; the step scalars and the skip flag are tensors, so neither a learning-rate
schedule nor the step count recompiles anything. The scalars of Eq. 8 (α_t, the bias corrections) are computed
for the whole group at once from the devices' step counts, in float64 — no host read of t — as the Triton
kernels' scalar pass does (:func:`_step_scalars`).

Arithmetic is float32 whatever the storage, rounded once per store, like the Triton kernels; ``lerp`` is
torch's two-sided formula (exact at both ends). Compile time (tens of seconds on a CPU) is paid once per
process and kind; ``CAST_LLM_COMPILE=0`` leaves this candidate out.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["compiled_adams_", "forget_compiled"]

_HPARAMS: dict[tuple, Tensor] = {}
_NO_SKIP: dict[torch.device, Tensor] = {}


def _update_one(theta, grad, mu, v, kept, sc, skip, *, packed: bool, additive: bool, maximize: bool,
                weight_decay: bool, lerp_from_end: bool) -> None:
    # theta, grad, mu, v: (numel,) in their storage dtypes; kept: (numel,) 0/1 bytes or (ceil(numel/8),) bits;
    # sc: float32 (9,) this tensor's step scalars (_step_scalars); skip: float32 scalar
    step_size, bc2_sqrt, decay, keep_signal, lerp_w, beta2, one_minus_beta2, eps, wd_keep = sc.unbind()
    th, g, m, vv = theta.float(), grad.float(), mu.float(), v.float()
    if maximize:
        g = -g
    if weight_decay:
        th = th * wd_keep  # decoupled (AdamW): before the sign of Eq. 7, as in the reference
    m = g - (g - m) * (1.0 - lerp_w) if lerp_from_end else m + lerp_w * (g - m)  # μ_t: the loss gradient only
    s = th * decay + m if additive else torch.sign(th) * decay + m * keep_signal  # Eq. 7 (AST: additive)
    # the mask as a 0/1 float weight: lerp by an exact 0 or 1 is a select with no rounding (weight 1 gives m, 0
    # gives s), and inductor's C++ vectorises a float weight where a select on bool or uint8 masks is ~30x slower
    if packed:  # element i is bit (i % 8) of byte i // 8 (pack_mask's order): an affine load, no gather
        idx = torch.arange(theta.shape[0], device=kept.device)
        weight = ((kept[idx // 8].to(torch.int32) >> (idx % 8).to(torch.int32)) & 1).to(torch.float32)
    else:  # a bool mask arrives viewed as uint8 (the view is taken outside: inductor lowers it slowly)
        weight = kept.to(torch.float32)
    mt = torch.lerp(s, m, weight)  # μ~: kept → μ, pruned → Eq. 7; the decay never enters the stored μ
    vv = vv * beta2 + one_minus_beta2 * (mt * mt)
    th = th - step_size * (mt / (torch.sqrt(vv) / bc2_sqrt + eps))  # Eq. 8
    skipped = skip != 0
    theta.copy_(torch.where(skipped, theta, th.to(theta.dtype)))
    mu.copy_(torch.where(skipped, mu, m.to(mu.dtype)))
    v.copy_(torch.where(skipped, v, vv.to(v.dtype)))


def _step_scalars(steps: list[Tensor], hp: Tensor, skip: Tensor) -> Tensor:
    """Every tensor's per-step scalars at once, ``(tensors, 9)`` float32, from its device step count (t - 1 on
    entry, incremented here unless ``skip``), in float64 like the Triton kernels' scalar pass: a dozen small
    ops per step for the whole group, kept out of the compiled loop (where inductor would recompute them —
    two float64 ``pow`` — for every vector of entries)."""
    t_old = torch.stack(steps)
    t = t_old.double() + 1.0
    lr, beta1, beta2, eps, l1, total, wd = hp.unbind()
    alpha = torch.clamp(t / total, max=1.0)
    ones = torch.ones_like(t)
    sc = torch.stack([lr / (1.0 - beta1**t), torch.sqrt(1.0 - beta2**t), alpha * l1, 1.0 - alpha, (1.0 - beta1) * ones,
                      beta2 * ones, (1.0 - beta2) * ones, eps * ones, (1.0 - lr * wd) * ones], dim=1)
    # float32 as torch's scalars reach its float kernels; sqrt(1 - β2^t) rounded after the float64 sqrt
    torch._foreach_copy_(steps, list(torch.where(skip != 0, t_old, t.to(t_old.dtype)).unbind(0)))
    return sc.float()


@functools.cache
def _compiled(**flags):
    """One compiled update per kind (cached: the process compiles each kind once)."""
    return torch.compile(functools.partial(_update_one, **flags), dynamic=True, fullgraph=True)


def forget_compiled() -> None:
    """Drop this process's compiled updates, so that the next call compiles again (how a benchmark times the
    compile a run pays once)."""
    _compiled.cache_clear()


def _hparams(device: torch.device, values: tuple) -> Tensor:
    key = (device, values)
    hit = _HPARAMS.get(key)
    if hit is None:
        if len(_HPARAMS) > 64:  # a schedule changes lr every step: keep the last few only
            _HPARAMS.clear()
        host = torch.tensor(values, dtype=torch.float64)
        hit = _HPARAMS[key] = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    return hit


def compiled_adams_(params, grads, exp_avgs, exp_avg_sqs, masks, state_steps, *, beta1, beta2, lr, eps, l1_decay,
                    total_steps, weight_decay, maximize, decay_mode="proportional", found_inf=None) -> None:
    """AdamS on lists of tensor sets through the compiled update; the contract of
    :func:`cast_llm.optim.triton_adams.fused_adams_` (float32 step counts on the parameters' device, read and
    incremented there; ``found_inf`` non-zero skips the step with no host read). Every tensor set must pass
    :func:`cast_llm.optim.adams_probes.fast_path_unsupported`."""
    if not params:
        return
    flags = dict(additive=decay_mode == "additive", maximize=bool(maximize), weight_decay=weight_decay != 0,
                 lerp_from_end=1.0 - beta1 >= 0.5)
    values = (float(lr), float(beta1), float(beta2), float(eps), float(l1_decay), float(total_steps),
              float(weight_decay))
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    for device, idx in by_device.items():
        skip = found_inf
        if skip is None:
            skip = _NO_SKIP.get(device)
            if skip is None:
                skip = _NO_SKIP[device] = torch.zeros((), dtype=torch.float32, device=device)
        skip = skip.to(device=device, dtype=torch.float32, non_blocking=True)
        sc = _step_scalars([state_steps[i] for i in idx], _hparams(device, values), skip)
        for row, i in enumerate(idx):
            kept = masks[i]
            fn = _compiled(packed=kept.dtype == torch.uint8, **flags)
            fn(params[i].view(-1), grads[i].view(-1), exp_avgs[i].view(-1), exp_avg_sqs[i].view(-1),
               kept.view(-1).view(torch.uint8), sc[row], skip)
