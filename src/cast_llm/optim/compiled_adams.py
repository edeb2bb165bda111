"""AdamS's update (Eq. 7-8) as torch operations compiled by ``torch.compile``: the ``compiled`` candidate of the
checked path ``adams.update``, beside the hand-written kernels.

One function updates ONE tensor set, flattened to 1-D, in one pass: inductor fuses the whole update into one
loop (vectorised C++ on a CPU, one Triton kernel on CUDA) that reads θ, g, μ, v and the mask once and writes θ,
μ, v — what ``AdamW(fused=True)`` moves plus the mask. It is compiled once per kind of tensor set (dtypes, mask
storage, decay mode, the maximize and weight-decay flags) with dynamic sizes, so every tensor of a model
reuses one compiled kernel; the step count, the hyperparameters and the skip flag are tensors, so neither a
learning-rate schedule nor the step count recompiles anything. The scalars of Eq. 8 (α_t, the bias
corrections) are computed from the device's step count in float64 — no host read of t — as the Triton
kernels' scalar pass does.

Arithmetic is float32 whatever the storage, rounded once per store, like the Triton kernels; ``lerp`` is
torch's two-sided formula (exact at both ends). Compile time (tens of seconds on a CPU) is paid once per
process and kind; ``CAST_LLM_COMPILE=0`` leaves this candidate out.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["compiled_adams_"]

_HPARAMS: dict[tuple, Tensor] = {}
_NO_SKIP: dict[torch.device, Tensor] = {}


def _update_one(theta, grad, mu, v, kept, step, hp, skip, *, packed: bool, additive: bool, maximize: bool,
                weight_decay: bool, lerp_from_end: bool) -> None:
    # theta, grad, mu, v: (numel,) in their storage dtypes; kept: (numel,) bool or (ceil(numel/8),) uint8 bits;
    # step: float32 scalar (t - 1 on entry); hp: float64 [lr, β1, β2, ε, λ, T, wd]; skip: float32 scalar
    skipped = skip != 0
    t = step.to(torch.float64) + 1.0
    step.copy_(torch.where(skipped, step, t.to(step.dtype)))
    lr, beta1, beta2, eps, l1, total, wd = hp.unbind()
    alpha = torch.clamp(t / total, max=1.0)
    step_size = (lr / (1.0 - beta1**t)).float()
    bc2_sqrt = torch.sqrt((1.0 - beta2**t).float())
    decay, keep_signal = (alpha * l1).float(), (1.0 - alpha).float()
    lerp_w = (1.0 - beta1).float()
    th, g, m, vv = theta.float(), grad.float(), mu.float(), v.float()
    if maximize:
        g = -g
    if weight_decay:
        th = th * (1.0 - lr * wd).float()  # decoupled (AdamW): before the sign of Eq. 7, as in the reference
    m = g - (g - m) * (1.0 - lerp_w) if lerp_from_end else m + lerp_w * (g - m)  # μ_t: the loss gradient only
    s = th * decay + m if additive else torch.sign(th) * decay + m * keep_signal  # Eq. 7 (AST: additive)
    if packed:  # element i is bit (i % 8) of byte i // 8 (pack_mask's order)
        bits = (kept.unsqueeze(1).to(torch.int32) >> torch.arange(8, device=kept.device, dtype=torch.int32)) & 1
        kept = bits.reshape(-1)[: theta.shape[0]] != 0
    mt = torch.where(kept, m, s)  # μ~: the decay never enters the stored μ
    vv = vv * beta2.float() + (1.0 - beta2).float() * (mt * mt)
    th = th - step_size * (mt / (torch.sqrt(vv) / bc2_sqrt + eps.float()))  # Eq. 8
    theta.copy_(torch.where(skipped, theta, th.to(theta.dtype)))
    mu.copy_(torch.where(skipped, mu, m.to(mu.dtype)))
    v.copy_(torch.where(skipped, v, vv.to(v.dtype)))


@functools.cache
def _compiled(**flags):
    """One compiled update per kind (cached: the process compiles each kind once)."""
    return torch.compile(functools.partial(_update_one, **flags), dynamic=True, fullgraph=True)


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
    :func:`cast_llm.optim.functional.fast_path_unsupported`."""
    flags = dict(additive=decay_mode == "additive", maximize=bool(maximize), weight_decay=weight_decay != 0,
                 lerp_from_end=1.0 - beta1 >= 0.5)
    values = (float(lr), float(beta1), float(beta2), float(eps), float(l1_decay), float(total_steps),
              float(weight_decay))
    for p, g, mu, v, kept, step in zip(params, grads, exp_avgs, exp_avg_sqs, masks, state_steps):
        device = p.device
        skip = found_inf
        if skip is None:
            skip = _NO_SKIP.get(device)
            if skip is None:
                skip = _NO_SKIP[device] = torch.zeros((), dtype=torch.float32, device=device)
        fn = _compiled(packed=kept.dtype == torch.uint8, **flags)
        fn(p.view(-1), g.view(-1), mu.view(-1), v.view(-1), kept.view(-1), step, _hparams(device, values), skip)
