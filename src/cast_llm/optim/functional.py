"""The functional core of AdamS (method.md §2, Algorithm 1, Eq. 7-8), like ``torch.optim.adamw.adamw``.

:func:`adams` updates lists of tensors in place through implementations with the same math (see
:class:`~cast_llm.optim.adams.AdamS` for it written out), the candidates of the checked kernel path
``adams.update`` (registered at the end of this module: each is probed against the reference on first use per
device and variant, and the fastest that passes runs):

* ``_single_tensor_adams``: the reference, Eq. 7-8 one tensor at a time (``foreach=False``, and every
  tensor set no candidate takes or whose candidates failed their check);
* ``blockwise`` (``_multi_tensor_adams``): the CPU fast path — Eq. 7 and the mask select per cache block into
  a scratch vector, and the rest of Eq. 8 through torch's fused Adam. CPU only: on an H100 it disagreed with
  the float64 reference (docs/results/gpu/README.md) while agreeing on CPU, so CUDA never takes it;
* ``triton``: the multi-tensor Triton kernels of :mod:`cast_llm.optim.triton_adams` on CUDA: one launch per
  parameter group, one pass over memory, the step count and α_t / bias corrections on the device;
* ``compiled``: the same update written with torch operations and compiled by ``torch.compile``
  (:mod:`cast_llm.optim.compiled_adams`: inductor's C++ on CPU, its Triton on CUDA).

:func:`dense_adam` is the plain Adam(W) of the non-target parameter groups (method.md §2, last paragraph),
through torch's own kernels so that it equals ``torch.optim.AdamW`` exactly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim.adam import adam as _torch_adam

from cast_llm import kernels
from cast_llm.kernels.switch import compiled_runs_on, host_runs_on, interpreting, triton_runs_on
from cast_llm.optim import adams_probes, compiled_adams
from cast_llm.optim.adams_probes import fast_path_unsupported
from cast_llm.sparsity.mask import magnitude_mask, pack_mask, packed_numel, unpack_mask

__all__ = ["adams", "dense_adam", "fused_dense_takes", "kernel_device", "fast_path_unsupported", "update_path",
           "run_update", "update_variant", "nm_masks", "placed_step", "DECAY_MODES", "DEVICE_STEP_PATHS"]

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
    masks: list[Tensor | None],
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
    found_inf: Tensor | None = None,
    refresh: list[bool] | None = None,
    n: int = 2,
    m: int = 4,
    transposed: bool = False,
    packed: bool | None = None,
    host_steps: list[int] | None = None,
    name_of: Callable[[int], str] | None = None,
) -> None:
    """Functional AdamS (Eq. 6-8; see :class:`~cast_llm.optim.adams.AdamS` for the math), in place — the one
    place that decides which implementation updates a tensor set and which computes a mask.

    ``masks[i]`` is the kept-mask of ``params[i]``: bool of its shape, or the 1-D uint8 of
    :func:`~cast_llm.sparsity.mask.pack_mask`. ``state_steps`` are float32 scalar tensors holding ``t - 1``;
    they are incremented here. Where they live picks the path for a CUDA tensor: on its device (as torch's
    fused Adam keeps them), a checked fast path (:func:`update_path`: the Triton kernels or the compiled
    update) reads and increments them there; on the CPU, the reference path reads them on the host.

    ``foreach=False`` runs the single-tensor reference for everything. Otherwise every tensor set takes the
    candidate of the checked path ``adams.update`` (:mod:`cast_llm.kernels`) that passed its probe on this
    device — the Triton kernels or the ``torch.compile``'d update on CUDA, the cache-blocked path or the
    compiled update on CPU — or the reference: ``fused=True`` raises for a tensor set no fused candidate
    takes, ``fused=False`` allows the CPU's cache-blocked path only (CUDA tensors run the reference).
    ``found_inf`` (a float32 scalar, as torch's ``GradScaler`` passes it): when non-zero, the whole update is
    skipped — on the device for the fast paths, no host read. Gradients must be finite (the class checks).

    What the optimizer class passes besides (all optional):

    * ``refresh``: ``refresh[i]`` (or ``masks[i] is None``) — Eq. 6 of ``params[i]`` *before* this update,
      through :func:`nm_masks` (``n``, ``m``, ``transposed``, ``packed`` say which masks); the new tensor
      replaces ``masks[i]`` in the list, so the caller keeps it.
    * ``host_steps``: ``t - 1`` of every set, known on the host. Then the path is chosen first and each
      ``state_steps[i]`` is replaced in the list by a count placed where that path reads it (the device for
      the fused paths, the CPU otherwise), built from the host value without reading the device.
    * ``name_of(i)``: how an error names ``params[i]``.
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
    # the path of every tensor set, looked up once per kind of tensor (this runs for every parameter at every
    # step: a few attribute reads per tensor); with host counts the step and mask are placed after the choice
    by_path: dict[str, list[int]] = {}
    paths: dict[tuple, tuple[str, str | None]] = {}
    for i, p in enumerate(params):
        g, mu, v = grads[i], exp_avgs[i], exp_avg_sqs[i]
        if host_steps is None:
            path, reason = update_path(p, g, mu, v, masks[i], state_steps[i], foreach=foreach, fused=fused, **hp)
        else:
            kind = (p.device, p.dtype, mu.dtype, p.is_contiguous(), g.dtype, g.is_contiguous())
            chosen = paths.get(kind)
            if chosen is None:
                chosen = paths[kind] = update_path(p, g, mu, v, None, None, foreach=foreach, fused=fused,
                                                   packed=packed, **hp)
            path, reason = chosen
        if reason is not None:
            name = name_of(i) if name_of is not None else "a parameter"
            raise RuntimeError(f"AdamS(fused=True): {name} of shape {tuple(p.shape)} cannot use the fused "
                               f"Triton kernel: {reason}. Pass fused=None to fall back to the reference path.")
        if host_steps is not None:
            state_steps[i] = placed_step(state_steps[i], host_steps[i],
                                          p.device if path in DEVICE_STEP_PATHS else _CPU)
        by_path.setdefault(path, []).append(i)
    due = [i for i in range(len(params)) if masks[i] is None or (refresh is not None and refresh[i])]
    if due:
        new = nm_masks([params[i] for i in due], transposed=transposed, n=n, m=m,
                       packed=bool(packed) if packed is not None else False)
        for i, mask in zip(due, new):
            masks[i] = mask
    for path, idx in by_path.items():
        run_update(path, *([x[i] for i in idx] for x in lists), found_inf=found_inf, **hp)


_CPU = torch.device("cpu")


def placed_step(step: Tensor, t: int, device: torch.device) -> Tensor:
    """A count ``t`` on ``device``: ``step`` itself if it is there, else a new one from the host value (a move
    that never waits for the device)."""
    if step.device == device:
        return step
    return torch.full((), float(t), dtype=torch.float32, device=device)


def nm_masks(params: list[Tensor], *, transposed: bool, n: int, m: int, packed: bool) -> list[Tensor]:
    """Eq. 6 — the N:M magnitude masks of ``params`` (new tensors, bool or packed), through the checked path
    ``adams.masks`` (the Triton mask kernel, one launch per kind of tensor) where a candidate passed its
    probe, the reference (:func:`~cast_llm.sparsity.mask.magnitude_mask`) elsewhere."""
    by_path: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        path = kernels.REFERENCE
        # (no candidate runs on a plain CPU: a dict lookup; none takes float64, which goes to the reference
        # without a probe that could only fail)
        if p.dim() == 2 and p.is_contiguous() and p.dtype in adams_probes.DTYPES:
            variant = (p.dtype, "transposed" if transposed else "rows", "packed" if packed else "bool", f"{n}:{m}")
            path = kernels.choose("adams.masks", p.device, variant)
        by_path.setdefault(path, []).append(i)
    out: list[Tensor | None] = [None] * len(params)
    for path, idx in by_path.items():
        group = [params[i] for i in idx]
        if path == kernels.REFERENCE:
            new = _reference_masks(group, transposed=transposed, n=n, m=m, packed=packed)
        else:
            new = kernels.implementation("adams.masks", path)(group, transposed=transposed, n=n, m=m, packed=packed)
        for i, mask in zip(idx, new):
            out[i] = mask
    return out


# Triton's interpreter runs the kernels on CPU tensors (how they are tested without a GPU). Read once, as
# Triton reads it once when it decorates the kernels.
_INTERPRET = interpreting()
# candidates that read and increment the step count where the parameter lives (as torch's fused Adam does)
DEVICE_STEP_PATHS = ("triton", "compiled")


def kernel_device(t: Tensor) -> bool:
    """Whether ``t`` is where the Triton kernels run: CUDA, or the CPU under Triton's interpreter."""
    return t.is_cuda or (_INTERPRET and t.device.type == "cpu")


def update_variant(param: Tensor, exp_avg: Tensor, packed: bool, decay_mode: str, maximize: bool,
                   weight_decay: float) -> tuple:
    """What the fused update is compiled for: dtypes, mask storage and the flags it is specialised on."""
    return (param.dtype, exp_avg.dtype, "packed" if packed else "bool", decay_mode,
            "maximize" if maximize else "minimize", "decoupled decay" if weight_decay != 0 else "no decay")


def update_path(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, mask: Tensor | None,
                step: Tensor | None, *, foreach: bool | None, fused: bool | None, decay_mode: str, maximize: bool,
                weight_decay: float, packed: bool | None = None, **_) -> tuple[str, str | None]:
    """``(path, refusal)``: which implementation updates this tensor set — a candidate of the checked path
    ``adams.update`` or ``REFERENCE`` — and, with ``fused=True``, why no fused one can (else None).

    ``mask`` / ``step`` may be None (the optimizer places them after choosing); ``packed`` then says the
    storage."""
    if foreach is False:
        return kernels.REFERENCE, None
    packed = bool(mask is not None and mask.dtype == torch.uint8) if packed is None else packed
    reason = fast_path_unsupported(param, grad, exp_avg, exp_avg_sq, mask, step)
    cpu = param.device.type == "cpu" and not _INTERPRET
    only = ("blockwise",) if (fused is False or reason is not None) else None
    if reason is not None and not cpu and fused:
        return kernels.REFERENCE, reason
    if only is not None and not cpu:
        return kernels.REFERENCE, None
    variant = update_variant(param, exp_avg, packed, decay_mode, maximize, weight_decay)
    path = kernels.choose("adams.update", param.device, variant, only)
    if fused and path not in DEVICE_STEP_PATHS and kernel_device(param):
        return path, f"no fused update passed its check here ({kernels.why_not('adams.update', param.device, variant)})"
    return path, None


def run_update(path: str, params, grads, exp_avgs, exp_avg_sqs, masks, state_steps, *,
               found_inf: Tensor | None = None, **hp) -> None:
    """One AdamS step of these tensor sets by ``path`` (see :func:`update_path`)."""
    if path == kernels.REFERENCE:
        if found_inf is not None and bool(found_inf):  # the reference reads its counts on the host anyway
            return
        _single_tensor_adams(params, grads, exp_avgs, exp_avg_sqs, masks, state_steps, **hp)
        return
    kernels.implementation("adams.update", path)(params, grads, exp_avgs, exp_avg_sqs, masks, state_steps,
                                                 found_inf=found_inf, **hp)


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
                        eps, l1_decay, total_steps, weight_decay, maximize, decay_mode="proportional",
                        found_inf=None) -> None:
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
    if found_inf is not None and bool(found_inf):  # a CPU flag: reading it waits for nothing
        return
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
               beta1: float, beta2: float, lr: float, eps: float, weight_decay: float, maximize: bool,
               found_inf: Tensor | None = None) -> None:
    """Plain Adam (AdamW when ``weight_decay > 0``) for the non-target groups, with torch's own kernels.

    ``foreach=False``: torch's single-tensor loop; ``fused=False``: torch's foreach path (both equal
    ``torch.optim.AdamW`` with the same flag bitwise). Otherwise torch's fused Adam kernel — one pass over
    memory instead of ~7, equal to ``torch.optim.AdamW(fused=True)`` bitwise — for every contiguous real
    floating tensor on CPU or CUDA; the rest goes through the foreach path. The kernel reads the step count
    where it lives: on the parameter's device (what AdamS keeps for CUDA tensors, as torch's
    ``AdamW(fused=True)`` does: no synchronisation) or, for a CPU count of a CUDA tensor, from a device copy
    made per distinct ``t``. ``found_inf`` (non-zero: skip the step) is read on the device by the fused kernel
    (as with torch's ``GradScaler``), on the host for the tensors the other paths take.
    """
    rest = list(range(len(params)))
    if foreach is not False and fused is not False:
        rest = _fused_dense(params, grads, exp_avgs, exp_avg_sqs, state_steps, beta1=beta1, beta2=beta2, lr=lr,
                            eps=eps, weight_decay=weight_decay, maximize=maximize, found_inf=found_inf)
    if not rest or (found_inf is not None and bool(found_inf)):
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
                 maximize, found_inf=None) -> list[int]:
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
        counts = steps = [state_steps[i] for i in idx]
        torch._foreach_add_(steps, 1)
        if t is not None:
            steps = [_step_on(device, t, st, cache) for st in steps]
        skip = None if found_inf is None else found_inf.to(device, non_blocking=True)
        kernel([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
               [exp_avg_sqs[i] for i in idx], [], steps, lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=maximize, found_inf=skip)
        if skip is not None and t is None:  # a skipped step takes its count back, as torch's fused Adam does
            torch._foreach_sub_(counts, [skip] * len(counts))
        elif skip is not None and bool(found_inf):  # counts on the host: read the flag there (a rare layout)
            torch._foreach_sub_(counts, 1)
    return rest


# ------------------------------------------------------------------------------------------- checked paths
def _triton_update(*args, **kwargs):
    # in-function: imports Triton (optional, ~1 s); looked up at every call (tests wrap it)
    from cast_llm.optim import triton_adams

    return triton_adams.fused_adams_(*args, **kwargs)


def _compiled_update(*args, **kwargs):
    return compiled_adams.compiled_adams_(*args, **kwargs)


def _triton_masks(*args, **kwargs):
    from cast_llm.optim import triton_adams  # in-function: imports Triton (optional, ~1 s)

    return triton_adams.fused_nm_masks(*args, **kwargs)


def _reference_masks(params, *, transposed, n, m, packed):
    return [pack_mask(k) if packed else k.contiguous() for k in (magnitude_mask(p, transposed, n, m) for p in params)]


ADAMS_UPDATE = kernels.register(kernels.CheckedPath(
    name="adams.update",
    what="AdamS update, Eq. 7-8 (optim/functional.py)",
    reference="the single-tensor AdamS in float64",
    measure="max |x - ref| / max |ref| of θ, μ or v",
    candidates=(
        kernels.Candidate("triton", lambda: _triton_update, triton_runs_on),
        kernels.Candidate("compiled", lambda: _compiled_update, compiled_runs_on, compiles=True),
        kernels.Candidate("blockwise", lambda: _multi_tensor_adams, host_runs_on),
    ),
    probe=functools.partial(adams_probes.update_probe, reference=_single_tensor_adams),
    timer=functools.partial(adams_probes.update_timer, reference=_single_tensor_adams,
                            host_counts=(_multi_tensor_adams,)),
    variants=adams_probes.update_variants, cuda_only=False,
))
ADAMS_MASKS = kernels.register(kernels.CheckedPath(
    name="adams.masks",
    what="AdamS mask refresh, Eq. 6 (optim/functional.py)",
    reference="magnitude_mask (nm_mask's rule, ties to the lower index)",
    measure="fraction of mask entries that differ",
    candidates=(kernels.Candidate("triton", lambda: _triton_masks, triton_runs_on),),
    probe=functools.partial(adams_probes.mask_probe, reference=_reference_masks),
    timer=functools.partial(adams_probes.mask_timer, reference=_reference_masks),
    variants=adams_probes.mask_variants,
))
