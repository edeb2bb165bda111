"""The functional core of AdamS (method.md §2, Algorithm 1, Eq. 7-8), like ``torch.optim.adamw.adamw``.

:func:`adams` updates lists of tensors in place through one of three implementations with the same math
(see :class:`~cast_llm.optim.adams.AdamS` for it written out):

* ``_single_tensor_adams``: the reference, Eq. 7-8 one tensor at a time (``foreach=False``, and every
  CUDA tensor the kernels below do not take);
* ``_multi_tensor_adams``: the CPU fast path — Eq. 7 and the mask select per cache block into a scratch
  vector, and the rest of Eq. 8 through torch's fused Adam. CPU only: on an H100 it disagreed with the
  float64 reference (docs/results/gpu/README.md) while agreeing on CPU, so CUDA never takes it;
* the multi-tensor Triton kernels of :mod:`cast_llm.optim.triton_adams` on CUDA: one launch per parameter
  group, one pass over memory, the step count and α_t / bias corrections on the device.

:func:`dense_adam` is the plain Adam(W) of the non-target parameter groups (method.md §2, last paragraph),
through torch's own kernels so that it equals ``torch.optim.AdamW`` exactly.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor
from torch.optim.adam import adam as _torch_adam

from cast_llm.sparsity.mask import packed_numel, unpack_mask

__all__ = ["adams", "dense_adam", "fused_dense_takes", "kernel_device", "DECAY_MODES"]

# "proportional": CAST's Eq. 7 (the default); "additive": AST's annealed SR-STE decay on the momentum signal
DECAY_MODES = ("proportional", "additive")
# Elements per cache block in the CPU fast path: its two scratch vectors (8 MiB in fp32) stay in L2/L3
# while the 4-5 passes of Eq. 7-8 run over them (the choice: docs/results/performance.md, §5).
_CHUNK = 1 << 20


def adams(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    masks: list[Tensor],
    state_steps: list[Tensor],
    *,
    foreach: bool | None = None,
    fused: bool | None = None,
    beta1: float,
    beta2: float,
    lr: float,
    eps: float,
    l1_decay: float,
    total_steps: int,
    weight_decay: float = 0.0,
    maximize: bool = False,
    decay_mode: str = "proportional",
) -> None:
    """Functional AdamS (Eq. 7-8; see :class:`~cast_llm.optim.adams.AdamS` for the math), in place.

    ``masks[i]`` is the kept-mask of ``params[i]``: bool of its shape, or the 1-D uint8 of
    :func:`~cast_llm.sparsity.mask.pack_mask`. ``state_steps`` are float32 scalar tensors holding ``t - 1``;
    they are incremented here. Where they live picks the path for a CUDA tensor: on its device (as torch's
    fused Adam keeps them), the multi-tensor Triton kernels read and increment them there; on the CPU, the
    reference path reads them on the host.

    ``foreach=False`` runs the single-tensor reference for everything. Otherwise: ``fused=None`` = the
    Triton kernels for every CUDA tensor they take (Triton importable, float32/bf16/fp16, contiguous, the
    step on the device) and the reference for the other CUDA tensors; ``fused=True`` = the same, but an
    error for a CUDA tensor the kernels cannot take; ``fused=False`` = the reference for every CUDA tensor.
    CPU tensors take the cache-blocked fast path (same results to rounding). Gradients must be finite
    (the class checks them).
    """
    lists = (params, grads, exp_avgs, exp_avg_sqs, masks, state_steps)
    if decay_mode not in DECAY_MODES:
        raise ValueError(f"adams: decay_mode must be one of {DECAY_MODES}, got {decay_mode!r}")
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"adams: list lengths differ: {[len(x) for x in lists]}")
    if foreach is False and fused:
        raise ValueError("adams: foreach=False (the reference path) and fused=True exclude each other")
    hp = dict(beta1=beta1, beta2=beta2, lr=lr, eps=eps, l1_decay=l1_decay, total_steps=total_steps,
              weight_decay=weight_decay, maximize=maximize, decay_mode=decay_mode)
    if foreach is False:
        return _single_tensor_adams(*lists, **hp)
    rest = list(range(len(params)))
    if fused is not False and any(kernel_device(p) for p in params):
        rest = _triton_adams(*lists, required=bool(fused), **hp)
    # Tensors off the CPU that the kernels did not take run the reference path: the block-wise path below
    # disagreed with the float64 reference on an H100 (docs/results/gpu/README.md) and is kept CPU-only
    other = [i for i in rest if params[i].device.type != "cpu"]
    if other:
        _single_tensor_adams(*([x[i] for i in other] for x in lists), **hp)
        rest = [i for i in rest if params[i].device.type == "cpu"]
    if rest:
        _multi_tensor_adams(*([x[i] for i in rest] for x in lists), **hp)


# Triton's interpreter runs the kernels on CPU tensors (how they are tested without a GPU). Read once, as
# Triton reads it once when it decorates the kernels.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_device(t: Tensor) -> bool:
    """Whether ``t`` is where the Triton kernels run: CUDA, or the CPU under Triton's interpreter."""
    return t.is_cuda or (_INTERPRET and t.device.type == "cpu")


def _triton_adams(params, grads, exp_avgs, exp_avg_sqs, masks, state_steps, *, required, **hp) -> list[int]:
    """Run the multi-tensor kernels on every tensor they take; return the indices left to the other paths."""
    from cast_llm.optim import triton_adams  # lazy: it imports Triton (optional, heavy)

    why = triton_adams.unavailable_reason()
    take, rest = [], []
    for i, p in enumerate(params):
        if not kernel_device(p):
            rest.append(i)
            continue
        reason = why or triton_adams.unsupported_reason(p, grads[i], exp_avgs[i], exp_avg_sqs[i], masks[i],
                                                        state_steps[i])
        if reason is None:
            take.append(i)
        elif required:
            raise RuntimeError(f"AdamS(fused=True): a parameter of shape {tuple(p.shape)} cannot use the fused "
                               f"Triton kernel: {reason}. Pass fused=None to fall back to the reference path.")
        else:
            rest.append(i)
    if take:
        lists = (params, grads, exp_avgs, exp_avg_sqs, masks, state_steps)
        triton_adams.fused_adams_(*([x[i] for i in take] for x in lists), **hp)
    return rest


def _kept(mask: Tensor, param: Tensor) -> Tensor:
    return unpack_mask(mask, param.shape) if mask.dtype == torch.uint8 else mask


def _single_tensor_adams(params, grads, exp_avgs, exp_avg_sqs, masks, state_steps, *, beta1, beta2, lr,
                         eps, l1_decay, total_steps, weight_decay, maximize, decay_mode="proportional") -> None:
    """Reference path: Eq. 7-8 written out with one tensor at a time."""
    for i, param in enumerate(params):
        grad = -grads[i] if maximize else grads[i]
        exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
        state_steps[i] += 1
        t = int(state_steps[i].item())
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)  # μ_t: the loss gradient only
        alpha = min(t / total_steps, 1.0)
        if decay_mode == "proportional":
            pruned_target = torch.sign(param).mul_(alpha * l1_decay).add_(exp_avg, alpha=1 - alpha)  # Eq. 7
        else:  # AST: the decay is added to the momentum signal, ramped up by α
            pruned_target = torch.mul(param, alpha * l1_decay).add_(exp_avg)
        mu_tilde = torch.where(_kept(masks[i], param), exp_avg, pruned_target)
        exp_avg_sq.mul_(beta2).addcmul_(mu_tilde, mu_tilde, value=1 - beta2)  # from μ~, every entry
        bias_correction1 = 1 - beta1**t
        bias_correction2 = 1 - beta2**t
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        param.addcdiv_(mu_tilde, denom, value=-lr / bias_correction1)  # Eq. 8


_BIT_TABLES: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _bit_table(device: torch.device, dtype: torch.dtype) -> Tensor:
    """(256, 8): row b holds the 8 bits of byte b as 0/1 in ``dtype`` (pack_mask's bit order)."""
    key = (device, dtype)
    if key not in _BIT_TABLES:
        b = torch.arange(256, device=device).unsqueeze(1)
        _BIT_TABLES[key] = ((b >> torch.arange(8, device=device)) & 1).to(dtype)
    return _BIT_TABLES[key]


def _fused_kernel_ok(device: torch.device) -> bool:
    """Whether torch's fused Adam kernel exists for ``device`` (CPU and CUDA, torch >= 2.4)."""
    return hasattr(torch, "_fused_adam_") and device.type in ("cpu", "cuda")


def _multi_tensor_adams(params, grads, exp_avgs, exp_avg_sqs, masks, state_steps, *, beta1, beta2, lr,
                        eps, l1_decay, total_steps, weight_decay, maximize, decay_mode="proportional") -> None:
    """CPU fast path. Per cache block of ``_CHUNK`` elements: weight decay and μ_t, Eq. 7 and the mask
    select into one scratch vector ``s`` (= μ~), and the rest of Eq. 8 (v from μ~², bias corrections, θ
    update) as ONE pass of torch's fused Adam kernel — every input is read from memory once.

    That kernel computes Adam with β1 = 0 on "gradient" s and "first moment" s, i.e. v ← β2 v + (1-β2) s²
    and θ ← θ - lr' s / (sqrt(v / (1-β2^t)) + ε); passing lr' = lr / (1-β1^t) restores the β1 bias
    correction of Eq. 8. The mask is applied by ``lerp`` with an exact 0/1 weight (a select with no
    rounding: weight 1 returns μ, weight 0 returns s), which vectorises where ``torch.where`` does not.

    CPU tensors only (:func:`adams` sends nothing else here): the same code on an H100 disagreed with the
    float64 reference (docs/results/gpu/README.md), and CUDA has the Triton kernels instead.
    """
    if any(p.device.type != "cpu" for p in params):
        raise ValueError("_multi_tensor_adams is the CPU fast path; CUDA tensors take the Triton kernels or "
                         "the single-tensor reference (see adams())")
    fast = [i for i, p in enumerate(params)
            if all(x.is_contiguous() for x in (p, grads[i], exp_avgs[i], exp_avg_sqs[i], masks[i]))]
    if len(fast) < len(params):  # odd strides: the reference path handles them
        slow = [i for i in range(len(params)) if i not in set(fast)]
        _single_tensor_adams(*([x[i] for i in slow] for x in (params, grads, exp_avgs, exp_avg_sqs, masks,
                                                              state_steps)),
                             beta1=beta1, beta2=beta2, lr=lr, eps=eps, l1_decay=l1_decay,
                             total_steps=total_steps, weight_decay=weight_decay, maximize=maximize,
                             decay_mode=decay_mode)
    by_device: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in fast:
        by_device.setdefault((params[i].device, params[i].dtype), []).append(i)
    for (device, dtype), idx in by_device.items():
        P, G = [params[i] for i in idx], [grads[i] for i in idx]
        MU, V, K, ST = ([x[i] for i in idx] for x in (exp_avgs, exp_avg_sqs, masks, state_steps))
        torch._foreach_add_(ST, 1)
        chunk = min(_CHUNK, max(p.numel() for p in P))
        scratch = torch.empty(2 * chunk + 8, device=device, dtype=dtype)  # +8: a packed tail byte
        s_buf, w_buf = scratch[:chunk], scratch[chunk:]
        table = _bit_table(device, dtype) if any(k.dtype == torch.uint8 for k in K) else None
        fused = _fused_kernel_ok(device)
        for p, grad, mu, v, kept, st in zip(P, G, MU, V, K, ST):
            t = int(st.item())  # a CPU tensor: no synchronisation
            alpha = min(t / total_steps, 1.0)
            bias_correction1 = 1 - beta1**t
            p1, g1, mu1, v1 = p.view(-1), grad.view(-1), mu.view(-1), v.view(-1)
            packed = kept.dtype == torch.uint8
            kept1 = kept if packed else kept.view(-1)
            for lo in range(0, p1.numel(), chunk):
                hi = min(lo + chunk, p1.numel())
                th, m1, s, w = p1[lo:hi], mu1[lo:hi], s_buf[: hi - lo], w_buf[: hi - lo]
                # the whole update of a block runs while it is in cache: θ and μ are read from memory once
                if weight_decay != 0:
                    th.mul_(1 - lr * weight_decay)
                if maximize:
                    m1.lerp_(torch.neg(g1[lo:hi], out=s), 1 - beta1)  # μ_t: the loss gradient only
                else:
                    m1.lerp_(g1[lo:hi], 1 - beta1)
                if decay_mode == "proportional":
                    torch.sign(th, out=s).mul_(alpha * l1_decay).add_(m1, alpha=1 - alpha)  # Eq. 7, all entries
                else:  # AST's additive decay, all entries
                    torch.mul(th, alpha * l1_decay, out=s).add_(m1)
                if packed:  # chunk % 8 == 0, so every block starts on a byte boundary
                    nbytes = packed_numel(hi - lo)
                    rows = w_buf[: 8 * nbytes].view(nbytes, 8)
                    torch.index_select(table, 0, kept1[lo // 8 : lo // 8 + nbytes].int(), out=rows)
                else:  # through uint8: bool -> float conversion does not vectorise, uint8 -> float does
                    w.copy_(kept1[lo:hi].view(torch.uint8))
                s.lerp_(m1, w)  # μ~: kept -> μ, pruned -> Eq. 7
                if fused:
                    torch._fused_adam_([th], [s], [s], [v1[lo:hi]], [], [st], lr=lr / bias_correction1,
                                       beta1=0.0, beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False,
                                       maximize=False)
                else:
                    v1[lo:hi].mul_(beta2).addcmul_(s, s, value=1 - beta2)
                    denom = torch.sqrt(v1[lo:hi], out=w).div_(math.sqrt(1 - beta2**t)).add_(eps)
                    th.addcdiv_(s, denom, value=-lr / bias_correction1)


def _step_on(device: torch.device, t: int, st: Tensor, cache: dict[int, Tensor]) -> Tensor:
    """A CPU step count as torch's fused kernels read it: a float tensor on the parameters' device (one
    small blocking host-to-device copy per distinct ``t``)."""
    if t not in cache:
        cache[t] = torch.tensor(float(t), device=device)
    return cache[t]


# ------------------------------------------------------------------------------------ dense groups
def dense_adam(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, foreach: bool | None, fused: bool | None,
               beta1: float, beta2: float, lr: float, eps: float, weight_decay: float, maximize: bool) -> None:
    """Plain Adam (AdamW when ``weight_decay > 0``) for the non-target groups, with torch's own kernels.

    ``foreach=False``: torch's single-tensor loop; ``fused=False``: torch's foreach path (both equal
    ``torch.optim.AdamW`` with the same flag bitwise). Otherwise torch's fused Adam kernel — one pass over
    memory instead of ~7, equal to ``torch.optim.AdamW(fused=True)`` bitwise — for every contiguous real
    floating tensor on CPU or CUDA; the rest goes through the foreach path. The kernel reads the step count
    where it lives: on the parameter's device (what AdamS keeps for CUDA tensors, as torch's
    ``AdamW(fused=True)`` does: no synchronisation) or, for a CPU count of a CUDA tensor, from a device copy
    made per distinct ``t``.
    """
    rest = list(range(len(params)))
    if foreach is not False and fused is not False:
        rest = _fused_dense(params, grads, exp_avgs, exp_avg_sqs, state_steps, beta1=beta1, beta2=beta2, lr=lr,
                            eps=eps, weight_decay=weight_decay, maximize=maximize)
    if not rest:
        return
    P, G, MU, V, ST = ([x[i] for i in rest] for x in (params, grads, exp_avgs, exp_avg_sqs, state_steps))
    _torch_adam(
        P, G, MU, V, [], ST, foreach=foreach is not False, has_complex=any(torch.is_complex(p) for p in P),
        decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
        weight_decay=weight_decay, eps=eps, maximize=maximize,
    )  # fmt: skip


def fused_dense_takes(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> bool:
    """Whether torch's fused Adam kernel takes this tensor set (what :func:`dense_adam` sends it)."""
    dtype = param.dtype
    return (_fused_kernel_ok(param.device) and param.is_floating_point() and grad.dtype == dtype
            and exp_avg.dtype == dtype and exp_avg_sq.dtype == dtype and exp_avg.device == param.device
            and param.is_contiguous() and grad.is_contiguous() and exp_avg.is_contiguous()
            and exp_avg_sq.is_contiguous())


def _fused_dense(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, beta1, beta2, lr, eps, weight_decay,
                 maximize) -> list[int]:
    """torch's fused Adam(W) on every tensor it takes; returns the indices it did not take."""
    groups: dict[tuple[torch.device, torch.dtype, int | None], list[int]] = {}
    rest = []
    for i, p in enumerate(params):
        if not fused_dense_takes(p, grads[i], exp_avgs[i], exp_avg_sqs[i]):
            rest.append(i)
            continue
        st = state_steps[i]
        # a count on the parameter's device is read there (None: no host t); a CPU count of a CUDA tensor
        # groups the tensors by t, for one device copy of t per group
        t = None if st.device == p.device else int(st.item()) + 1
        groups.setdefault((p.device, p.dtype, t), []).append(i)
    kernel = torch._fused_adamw_ if weight_decay != 0 else torch._fused_adam_
    cache: dict[int, Tensor] = {}
    for (device, _, t), idx in groups.items():
        steps = [state_steps[i] for i in idx]
        torch._foreach_add_(steps, 1)
        if t is not None:
            steps = [_step_on(device, t, st, cache) for st in steps]
        kernel([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
               [exp_avg_sqs[i] for i in idx], [], steps, lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=maximize)
    return rest
