"""AdamS: the sparsity-inducing Adam of CAST (method.md §2, Algorithm 1, Eq. 7-8).

A ``torch.optim.Optimizer`` whose ``"sparse": True`` param groups hold N:M targets and get the AdamS
update, while every other group gets plain Adam/AdamW, so one optimizer serves a whole model. The math
lives in the functional core :func:`adams` (:mod:`cast_llm.optim.functional`: a single-tensor reference
path, a cache-blocked CPU fast path, and on CUDA multi-tensor Triton kernels); the class only keeps state,
decides when masks are recomputed (Eq. 6) and checks gradients.

Step counts (``state["step"]``, float32 scalars holding t) live where the path that updates the parameter
reads them, as in torch: on the parameter's device for CUDA tensors that a fused kernel updates (the
Triton kernels for sparse groups, torch's fused Adam for dense ones), on the CPU otherwise. The class also
keeps t of every parameter on the host (not in the state dict), which decides the mask refreshes without
reading the device, and moves a count between devices without a synchronisation. State dicts of either
placement load into either.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer

from cast_llm import dtensor
from cast_llm.errors import NonFiniteError
from cast_llm.optim.functional import (
    DECAY_MODES,
    adams,
    dense_adam,
    fused_dense_takes,
    nm_masks,
    placed_step,
)
from cast_llm.sparsity.mask import apply_mask_, is_nm_mask, magnitude_mask, pack_mask, unpack_mask

__all__ = ["AdamS", "adams"]

MASK_STORAGES = ("bool", "packed")
NONFINITE_MODES = ("raise", "skip", "ignore")
UPDATES = ("adams", "adam")  # a sparse group's weight update: Eq. 7-8, or torch's Adam(W) with the masks kept
_CPU = torch.device("cpu")


class AdamS(Optimizer):
    r"""AdamS (Algorithm 1, Eq. 7-8): Adam whose pruned entries are pulled to zero by a proportional,
    selective, momentum-free L1 decay, with N:M masks relearned from ``|θ|`` every ``mask_interval`` steps.

    For every parameter of a ``"sparse": True`` group, with ``g_t = ∂L/∂θ`` and ``m_t`` its N:M mask
    (True = kept)::

        init: μ_0 = 0, v_0 = 0, m = nm_mask(θ_0) (Eq. 6) at the first step, unless set_mask() gave one
        for t = 1, 2, ...:
            if mask_interval and t % mask_interval == 0:  m = nm_mask(θ_{t-1})           (Eq. 6)
            θ_{t-1} ← θ_{t-1} (1 - lr·weight_decay)                   (decoupled, AdamW; off by default)
            μ_t  = β1 μ_{t-1} + (1-β1) g_t                            (loss gradient ONLY)
            α_t  = min(t / total_steps, 1)
            μ~_t = (1-α_t) μ_t + α_t λ sign(θ_{t-1})   where m = 0   (Eq. 7)
            μ~_t = μ_t                                  where m = 1
            v_t  = β2 v_{t-1} + (1-β2) μ~_t²             (ALL entries, from μ~, not from g)
            θ_t  = θ_{t-1} - lr · (μ~_t / (1-β1^t)) / (sqrt(v_t / (1-β2^t)) + ε)       (Eq. 8)
        end:  prune_():  θ ← θ ⊙ m

    ``decay_mode="additive"`` (per group) replaces Eq. 7 by AST's decay (method.md §6, the AST baseline)::

            μ~_t = μ_t + α_t λ θ_{t-1}                 where m = 0   (an L2-type, SR-STE-style decay,
            μ~_t = μ_t                                  where m = 1    ramped up linearly by α_t = t/T)

    with everything else as above: the decay is still kept out of ``μ``, ``v`` is still built from ``μ~²``.
    Added to the gradient signal instead of mixed with it, it leaves pruned weights with a strong gradient
    large at the end — the behaviour CAST's proportional decay was designed to avoid.

    Three deliberate differences from Adam(W) — do not "fix" them (method.md §2):

    1. **Selective**: the L1 decay ``λ sign(θ)`` acts only on currently pruned entries; kept entries
       follow plain Adam. As weights move, the mask moves, and the decay follows it.
    2. **Proportional**: the decay is *mixed* with the gradient by ``α_t = t/T`` rather than added, so by
       the end (``α = 1``) every pruned entry feels only the decay and reaches ~0 however strong its
       gradient; an additive decay leaves some pruned weights large and the final prune then hurts.
    3. **Decoupled from momentum**: the decay enters ``μ~`` but is never stored in ``μ``, so when a
       weight crosses zero the decay direction flips at once (no momentum lag, no oscillation); and ``v``
       is built from ``μ~²``, so the decay is normalised by ``1/sqrt(v)`` like the gradient.

    Param groups (overrides of every hyperparameter work as in torch):

    * ``"sparse": True``: 2-D N:M targets. Groups of ``m`` run along the last dim (``nn.Linear``'s
      ``(out, in)``); with ``"transposed": True`` along dim 0 (GPT-2 ``Conv1D`` stores ``(in, out)``).
      Masks are always kept and returned in the parameter's own layout. ``weight_decay`` here is
      decoupled (AdamW-style) and applies to every entry, independently of ``l1_decay``.
    * ``"sparse": False`` (default): plain Adam, or AdamW when ``weight_decay > 0`` — computed by torch's
      own ``adam`` function, so it equals ``torch.optim.AdamW`` with the same settings.

    Args:
        params: parameters or param-group dicts (named parameters work as in torch).
        lr, betas, eps: as in Adam.
        l1_decay: λ, the L1 strength on pruned entries (paper: 2e-6 OPT, 1e-6 GPT-2, 4e-7 LLaMA).
        total_steps: T in ``α_t = t/T``; required — the decay schedule is meaningless without it.
        mask_interval: T1; masks are recomputed when ``t % mask_interval == 0``. ``0`` or ``None`` keeps
            the first mask forever (naive retraining + AdamS, CAST ``--fixed-mask``).
        n, m: the N:M pattern (2:4).
        weight_decay: decoupled weight decay (AdamW), 0 by default as in the paper.
        maximize: ascend the objective (the L1 decay still pulls towards 0).
        foreach: ``None``/``True`` = fast path, ``False`` = the single-tensor reference path.
        fused: ``None`` (default): on CUDA, every sparse group is updated by the multi-tensor Triton kernels
            (:mod:`cast_llm.optim.triton_adams`: one launch per group, the mask refresh one more) when
            Triton is importable; the tensors they cannot take (Triton missing, float64, odd strides) run the
            single-tensor reference path (the block-wise CPU fast path disagreed with the reference on an
            H100; CUDA never takes it). Dense groups use torch's fused Adam kernel (CPU and CUDA; equal to
            ``AdamW(fused=True)``). ``True``: the same, but a CUDA sparse parameter that cannot use the
            Triton kernels raises instead of falling back. ``False``: no fused kernel for whole tensors
            (CUDA sparse groups run the reference path, dense groups equal ``AdamW(foreach=True)``); the CPU
            fast path is unchanged.
        mask_storage: ``"bool"`` (1 byte per weight) or ``"packed"`` (1 bit per weight, the paper's
            "1/32" overhead); identical results either way.
        decay_mode: ``"proportional"`` (default, Eq. 7) or ``"additive"`` (AST, see above); a per-group
            hyperparameter like the others.
        update: ``"adams"`` (default, Eq. 7-8) or ``"adam"``: a sparse group's weights then take torch's
            Adam(W) step (v from g², no decay; ``l1_decay`` unused) while its masks are kept and refreshed as
            above, for the final prune — AdamW on the dense forward, the ablation of AdamS itself; per group.
        nonfinite: ``"raise"`` (default): a NaN/Inf gradient raises :class:`~cast_llm.errors.NonFiniteError`
            naming the parameter, before anything is modified. ``"skip"``: the whole step is skipped
            (weights, state and step counts untouched) and ``skipped_steps`` is incremented. Both read every
            gradient once more and wait for the device once per step. ``"ignore"``: no check, as in
            ``torch.optim`` (a non-finite gradient reaches the weights) — the mode to compare speed with
            ``AdamW(fused=True)``, or to use when the training loop checks the gradient norm itself.

    FSDP2: ``DTensor`` parameters are updated through their local shards. FSDP2 shards dim 0 (rows), so
    the N:M groups of a ``(out, in)`` weight stay whole on every rank and masks are per-rank local
    tensors (save/restore with the same sharding). A ``transposed`` target sharded along its N:M dim is
    refused with ``NotImplementedError``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        l1_decay: float = 0.0,
        total_steps: int | None = None,
        mask_interval: int | None = 10,
        n: int = 2,
        m: int = 4,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        mask_storage: str = "bool",
        nonfinite: str = "raise",
        decay_mode: str = "proportional",
        update: str = "adams",
    ) -> None:
        if mask_storage not in MASK_STORAGES:
            raise ValueError(f"mask_storage must be one of {MASK_STORAGES}, got {mask_storage!r}")
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, l1_decay=l1_decay, total_steps=total_steps,
            mask_interval=mask_interval, n=n, m=m, weight_decay=weight_decay, maximize=maximize,
            foreach=foreach, fused=fused, sparse=False, transposed=False, decay_mode=decay_mode, update=update,
        )  # fmt: skip
        _check_hparams(defaults, "AdamS")
        self.mask_storage = mask_storage
        self.nonfinite = nonfinite
        self.skipped_steps = 0  # steps skipped for a non-finite gradient (nonfinite="skip")
        self.found_inf: Tensor | None = None  # set by the training step: see step()
        self._host_steps: dict[Tensor, int] = {}  # t of every stepped parameter, on the host (see module doc)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("mask_storage", "bool")
        self.__dict__.setdefault("nonfinite", "raise")
        self.__dict__.setdefault("skipped_steps", 0)
        self.__dict__.setdefault("found_inf", None)
        self.__dict__.setdefault("_host_steps", {})
        for group in self.param_groups:
            group.setdefault("decay_mode", "proportional")
            group.setdefault("update", "adams")
            group.setdefault("fused", None)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group, index = self.param_groups[-1], len(self.param_groups) - 1
        try:
            _check_hparams(group, f"param group {index}")
            if group["sparse"]:
                for i, p in enumerate(group["params"]):
                    _check_sparse_param(p, group, _param_name(group, i, index))
            elif group["transposed"]:
                raise ValueError(f"param group {index}: 'transposed' only applies to a 'sparse' group")
        except Exception:
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    # ------------------------------------------------------------------------------------------ masks
    def _locate(self, p: Tensor) -> tuple[int, dict[str, Any], int]:
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return gi, group, i
        raise ValueError(f"parameter of shape {tuple(p.shape)} is not managed by this optimizer")

    def _sparse_group(self, p: Tensor) -> dict[str, Any]:
        gi, group, i = self._locate(p)
        if not group["sparse"]:
            raise ValueError(f"{_param_name(group, i, gi)} (shape {tuple(p.shape)}) is in a dense param group "
                             "(sparse=False): it has no N:M mask")
        return group

    def _compute_mask(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        return magnitude_mask(dtensor.local(p), group["transposed"], group["n"], group["m"])

    def _encode(self, mask: Tensor) -> Tensor:
        return pack_mask(mask) if self.mask_storage == "packed" else mask.contiguous()

    def mask(self, p: Tensor) -> Tensor:
        """The current N:M mask of sparse parameter ``p`` (bool, ``p``'s own layout, True = kept).

        Before the first step this is the mask the first step will use (``set_mask``'s, or one computed
        now from the current weights). With ``mask_storage="bool"`` the stored tensor itself is returned:
        read it, do not modify it (use :meth:`set_mask`). AdamS never modifies it either — a mask update
        stores a new tensor — so a mask kept from an earlier step stays valid for flip statistics.
        For a DTensor parameter: the local shard's mask.
        """
        group = self._sparse_group(p)
        stored = self.state[p].get("mask") if p in self.state else None
        if stored is None:
            return self._compute_mask(p, group)
        if stored.dtype == torch.uint8:
            return unpack_mask(stored, dtensor.local(p).shape)
        return stored

    def masks(self) -> dict[Tensor, Tensor]:
        """``{parameter: mask}`` for every sparse parameter, in param-group order (see :meth:`mask`)."""
        return {p: self.mask(p) for g in self.param_groups if g["sparse"] for p in g["params"]}

    def set_mask(self, p: Tensor, mask: Tensor) -> None:
        """Use ``mask`` (bool, ``p``'s layout, exactly N:M) as ``p``'s mask from now on — e.g. a Wanda or
        SparseGPT mask before the first step. It is replaced at the next ``t % mask_interval == 0``
        (never, with ``mask_interval=0``)."""
        group = self._sparse_group(p)
        local = dtensor.local(p)
        if dtensor.is_dtensor(p) and not dtensor.is_dtensor(mask) and tuple(mask.shape) == tuple(p.shape) != tuple(local.shape):
            # a full-tensor mask for a sharded parameter: keep this rank's slice (no communication)
            from torch.distributed.tensor import distribute_tensor

            mask = distribute_tensor(mask.to(local.device), p.device_mesh, p.placements, src_data_rank=None)
        mask = dtensor.local(mask)
        if mask.dtype != torch.bool or mask.shape != local.shape:
            raise ValueError(f"set_mask: need a bool mask of shape {tuple(local.shape)}, "
                             f"got {mask.dtype} of shape {tuple(mask.shape)}")
        grouped = mask.t() if group["transposed"] else mask
        if not is_nm_mask(grouped, group["n"], group["m"]):
            where = "dim 0" if group["transposed"] else "the last dim"
            raise ValueError(f"set_mask: the mask is not an exact {group['n']}:{group['m']} mask along {where} "
                             f"(every group of {group['m']} must keep exactly {group['n']})")
        self.state[p]["mask"] = self._encode(mask.to(local.device))

    @torch.no_grad()
    def refresh_masks(self) -> None:
        """Recompute every sparse parameter's mask now from its current weights (Eq. 6), exactly as a
        ``t % mask_interval == 0`` step does — through the fused mask kernel where that step would use it."""
        for group in self.param_groups:
            if group["sparse"]:
                new = nm_masks([dtensor.local(p) for p in group["params"]], transposed=group["transposed"],
                               n=group["n"], m=group["m"], packed=self.mask_storage == "packed")
                for p, mask in zip(group["params"], new):
                    self.state[p]["mask"] = mask

    @torch.no_grad()
    def prune_(self) -> None:
        """``θ ← θ ⊙ m`` for every sparse parameter (Algorithm 1's last line): afterwards each is exactly N:M."""
        for p, mask in self.masks().items():
            apply_mask_(dtensor.local(p), mask)

    # ----------------------------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["adams"] = {"skipped_steps": self.skipped_steps, "mask_storage": self.mask_storage}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("adams", {})
        # Take the masks out first: torch casts every state tensor of a float param to the param's dtype,
        # which would turn a bool/uint8 mask into floats.
        saved = {k: dict(v) for k, v in state_dict["state"].items()}
        masks = {k: v.pop("mask") for k, v in saved.items() if "mask" in v}
        state_dict["state"] = saved
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        id_to_param = dict(zip(saved_ids, params))
        for key, stored in masks.items():
            p = id_to_param[key]
            shape = dtensor.local(p).shape
            if stored.dtype == torch.uint8:
                mask = unpack_mask(stored, shape)
            elif stored.dtype == torch.bool and stored.shape == shape:
                mask = stored
            else:
                raise ValueError(f"saved mask ({stored.dtype}, shape {tuple(stored.shape)}) does not fit a "
                                 f"parameter of shape {tuple(shape)}")
            self.state[p]["mask"] = self._encode(mask.to(dtensor.local(p).device))
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        # the host copies of t are rebuilt from the loaded counts at the next step (once, wherever they are);
        # each count moves to where its parameter's path reads it then, too
        self._host_steps = {}

    # ----------------------------------------------------------------------------------------- step
    def _grads_finite(self, grads: list[Tensor]) -> bool:
        by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        ok = True
        for (_, dtype), gs in by_kind.items():
            # ‖g‖₂ is NaN/Inf if any entry is: one fused read of every gradient and one sync (the
            # inf-norm or isfinite() would be exact but are ~15x slower on CPU). Accumulated in fp32 at
            # least; a finite gradient whose norm overflows anyway is confirmed entry by entry.
            acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
            if not bool(torch.stack(torch._foreach_norm(gs, 2, dtype=acc)).isfinite().all()):
                ok = ok and all(bool(torch.isfinite(g).all()) for g in gs)
        if any(dtensor.is_dtensor(p) for g in self.param_groups for p in g["params"]):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():  # every rank must take the same decision
                flag = torch.tensor([0.0 if ok else 1.0], device=grads[0].device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                ok = flag.item() == 0.0
        return ok

    def _nonfinite_message(self) -> str:
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None and not bool(torch.isfinite(dtensor.local(p.grad)).all()):
                    kind = "sparse" if group["sparse"] else "dense"
                    return (f"AdamS: non-finite gradient (NaN/Inf) in {_param_name(group, i, gi)} of shape "
                            f"{tuple(p.shape)} (param group {gi}, {kind}); no weight or optimizer state was "
                            "changed. Check the loss / lower the learning rate, or pass nonfinite='skip' to "
                            "skip such steps.")
        return "AdamS: non-finite gradient (NaN/Inf) on another rank; no weight or state was changed."

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamS step (Eq. 8) on every parameter that has a gradient.

        ``self.found_inf`` (a float32 scalar tensor on the parameters' device, None by default), set by a
        training loop that checks finiteness later — as torch's ``GradScaler`` sets it on fused optimizers:
        then the gradient check runs on the device and ORs its finding into ``found_inf`` in place, and a
        non-zero ``found_inf`` skips the whole step on the device (weights, moments and step counts
        untouched; no host read on the fast paths). The host copies of t that schedule the mask refreshes
        still advance: the caller stops the run (cast-llm's loop does, at its next check) rather than going
        on from a skipped step. A gradient whose L2 norm overflows float32 counts as non-finite there.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [dtensor.local(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return loss
        if any(g.is_sparse for g in grads):
            raise RuntimeError("AdamS does not support sparse (torch.sparse) gradients")
        found_inf = self.found_inf
        if found_inf is not None:
            if self.nonfinite != "ignore":
                _flag_nonfinite_(grads, found_inf)
                if any(dtensor.is_dtensor(p) for g in self.param_groups for p in g["params"]):
                    import torch.distributed as dist

                    if dist.is_available() and dist.is_initialized():  # every rank skips alike (on the device)
                        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        # before anything is touched: weights never see NaN/Inf (unless the caller asked for no check)
        elif self.nonfinite != "ignore" and not self._grads_finite(grads):
            if self.nonfinite == "raise":
                raise NonFiniteError(self._nonfinite_message())
            self.skipped_steps += 1
            return loss
        for group in self.param_groups:
            if group["sparse"] and group.get("update", "adams") == "adam":
                self._masked_adam_step(group, found_inf)
            elif group["sparse"]:
                self._sparse_step(group, found_inf)
            else:
                self._dense_step(group, found_inf)
        return loss

    def _masked_adam_step(self, group: dict[str, Any], found_inf: Tensor | None = None) -> None:
        """``update="adam"``: the group's weights take torch's Adam(W) step on the dense forward, exactly as a
        dense group's (no decay: ``l1_decay`` and ``decay_mode`` are not used; v from g²), while AdamS keeps its
        masks as for Eq. 7-8 (Eq. 6 at the first step and every ``mask_interval``, from θ_{t-1}), so that
        :meth:`prune_` / :meth:`masks` work: the ablation of AdamS's update itself."""
        interval = group["mask_interval"] or 0
        due = []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._init_state(p)
            if state.get("mask") is None or (interval and (self._steps_done(p, state) + 1) % interval == 0):
                due.append(p)
        if due:
            new = nm_masks([dtensor.local(p).detach() for p in due], transposed=group["transposed"], n=group["n"],
                           m=group["m"], packed=self.mask_storage == "packed")
            for p, mask in zip(due, new):
                self.state[p]["mask"] = mask
        self._dense_step(group, found_inf)

    def _init_state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "step" not in state:  # lazy, as in torch.optim.Adam (same dtypes; the count is placed later)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self._host_steps[p] = 0
        return state

    def _steps_done(self, p: Tensor, state: dict[str, Any]) -> int:
        """t - 1 of ``p`` from the host copy; read from ``state["step"]`` only the first time after a load."""
        t = self._host_steps.get(p)
        if t is None:
            t = self._host_steps[p] = int(float(state["step"]))
        return t

    def _place_step(self, p: Tensor, state: dict[str, Any], device: torch.device) -> Tensor:
        """``state["step"]`` on ``device``, moved there if needed — rebuilt from the host copy of t, so a move
        never waits for the device."""
        step = state["step"]
        if step.device != device:  # (the same placement functional.adams makes for the sparse groups)
            step = state["step"] = placed_step(step, self._steps_done(p, state), device)
        return step

    def _name(self, p: Tensor) -> str:
        """How an error names parameter ``p`` (its name where the group has ``param_names``)."""
        gi, group, i = self._locate(p)
        return _param_name(group, i, gi)

    def _dense_step(self, group: dict[str, Any], found_inf: Tensor | None = None) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps, stepped = [], [], [], [], [], []
        fused_ok = group["foreach"] is not False and group.get("fused") is not False
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._init_state(p)
            local, grad = dtensor.local(p), dtensor.local(p.grad)
            mu, v = dtensor.local(state["exp_avg"]), dtensor.local(state["exp_avg_sq"])
            # torch's fused kernel reads a CUDA tensor's count on the device (no synchronisation)
            on_device = fused_ok and local.is_cuda and fused_dense_takes(local, grad, mu, v)
            steps.append(self._place_step(p, state, local.device if on_device else _CPU))
            params.append(local)
            grads.append(grad)
            exp_avgs.append(mu)
            exp_avg_sqs.append(v)
            stepped.append(p)
        if not params:
            return
        beta1, beta2 = group["betas"]
        # torch's own Adam/AdamW kernels, so dense groups match torch.optim.AdamW exactly
        dense_adam(
            params, grads, exp_avgs, exp_avg_sqs, steps, foreach=group["foreach"], fused=group.get("fused"),
            beta1=beta1, beta2=beta2, lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"],
            maximize=group["maximize"], found_inf=found_inf,
        )  # fmt: skip
        self._advance(stepped)

    def _sparse_step(self, group: dict[str, Any], found_inf: Tensor | None = None) -> None:
        # the lists of this group's tensor sets, as torch.optim's classes collect them; functional.adams then
        # decides, in one place, which implementation updates each set and which computes each due mask
        # (Eq. 6 at every t % mask_interval == 0, from θ_{t-1}), and places each step count where its path
        # reads it. This loop runs for every parameter at every step: a few attribute reads per tensor.
        params, grads, mus, vs, masks, steps, counts, due, stepped = [], [], [], [], [], [], [], [], []
        interval = group["mask_interval"] or 0
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state = self._init_state(p)
            t = self._steps_done(p, state)
            mask = state.get("mask")
            params.append(dtensor.local(p))
            grads.append(dtensor.local(p.grad))
            mus.append(dtensor.local(state["exp_avg"]))
            vs.append(dtensor.local(state["exp_avg_sq"]))
            masks.append(mask)
            steps.append(state["step"])
            counts.append(t)
            due.append(mask is None or bool(interval and (t + 1) % interval == 0))
            stepped.append(p)
        if not params:
            return
        adams(params, grads, mus, vs, masks, steps, foreach=group["foreach"], fused=group.get("fused"),
              beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"], eps=group["eps"],
              l1_decay=group["l1_decay"], total_steps=group["total_steps"], weight_decay=group["weight_decay"],
              maximize=group["maximize"],
              # a state dict saved before decay modes existed has none: it was proportional
              decay_mode=group.get("decay_mode", "proportional"), found_inf=found_inf,
              refresh=due, n=group["n"], m=group["m"], transposed=group["transposed"],
              packed=self.mask_storage == "packed", host_steps=counts,
              name_of=lambda i: self._name(stepped[i]))
        state = self.state
        for p, mask, step in zip(stepped, masks, steps):
            st = state[p]
            st["mask"], st["step"] = mask, step
        self._advance(stepped)

    def _advance(self, stepped: list[Tensor]) -> None:
        host = self._host_steps
        for p in stepped:
            if p in host:  # absent (after a load): the count itself is read when it is next needed
                host[p] += 1


# ------------------------------------------------------------------------------------ validation
def _check_hparams(h: dict[str, Any], where: str) -> None:
    def bad(name: str, why: str) -> ValueError:
        return ValueError(f"{where}: invalid {name}={h.get(name)!r}: {why}")

    for name in ("lr", "eps", "l1_decay", "weight_decay"):
        v = h[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise bad(name, "must be a finite number >= 0")
    betas = h["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise bad("betas", "must be a pair (beta1, beta2)")
    for b in betas:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise bad("betas", "each beta must lie in [0, 1)")
    T = h["total_steps"]
    if T is None:
        raise ValueError(f"{where}: total_steps is required (T in α_t = t/T, Eq. 7): pass the number of "
                         "optimizer steps of the whole run")
    if isinstance(T, bool) or not isinstance(T, int) or T <= 0:
        raise bad("total_steps", "must be an int > 0")
    interval = h["mask_interval"]
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 0):
        raise bad("mask_interval", "must be an int >= 0 (0 or None: never recompute the mask)")
    n, m = h["n"], h["m"]
    if any(isinstance(x, bool) or not isinstance(x, int) for x in (n, m)) or not 1 <= n < m:
        raise ValueError(f"{where}: invalid N:M pattern n={n!r}, m={m!r}: need integers 1 <= n < m (2:4)")
    for name in ("sparse", "transposed", "maximize"):
        if not isinstance(h[name], bool):
            raise bad(name, "must be True or False")
    if h["foreach"] not in (None, True, False):
        raise bad("foreach", "must be None, True or False")
    if h.get("fused") not in (None, True, False):
        raise bad("fused", "must be None, True or False")
    if h["foreach"] is False and h.get("fused"):
        raise ValueError(f"{where}: foreach=False (the reference path) and fused=True exclude each other")
    if h.get("fused"):
        from cast_llm.optim import triton_adams  # in-function: imports Triton (optional, ~1 s)

        reason = triton_adams.unavailable_reason()
        if reason is not None:
            raise ValueError(f"{where}: fused=True needs the Triton kernel, which is unavailable: {reason}. "
                             "Use fused=None (the default) to fall back to the reference path.")
    if h.get("decay_mode", "proportional") not in DECAY_MODES:
        raise bad("decay_mode", f"must be one of {DECAY_MODES}")
    if h.get("update", "adams") not in UPDATES:
        raise bad("update", f"must be one of {UPDATES}")


def _param_name(group: dict[str, Any], i: int, gi: int) -> str:
    names = group.get("param_names")
    if names is not None and i < len(names):
        return f"parameter {names[i]!r}"
    return f"parameter #{i} of param group {gi}"


def _check_sparse_param(p: Tensor, group: dict[str, Any], name: str) -> None:
    m, transposed = group["m"], group["transposed"]
    shape = tuple(p.shape)
    if not p.is_floating_point():
        raise ValueError(f"AdamS: sparse {name} has dtype {p.dtype}; N:M targets must be floating point")
    if p.dim() != 2:
        raise ValueError(f"AdamS: sparse {name} has shape {shape}; N:M targets must be 2-D weights. Put it "
                         "in a dense group (sparse=False) instead.")
    dim = 0 if transposed else 1
    if shape[dim] % m != 0:
        layout = "dim 0 (transposed)" if transposed else "the last dim"
        raise ValueError(f"AdamS: sparse {name} has shape {shape}: its N:M dim, {layout}, is {shape[dim]}, not "
                         f"divisible by m={m}. Leave it dense (sparse=False) or skip it as a target.")
    if dtensor.is_dtensor(p):
        for placement in p.placements:
            if isinstance(placement, dtensor.Shard) and placement.dim % 2 == dim:
                raise NotImplementedError(
                    f"AdamS: sparse {name} of shape {shape} is sharded along its N:M dim ({placement}); "
                    "the groups of m would be split across ranks. FSDP2 shards dim 0, which works for "
                    "(out, in) weights but not for transposed (Conv1D) ones: convert those to nn.Linear "
                    "layout, or keep them unsharded."
                )


# ------------------------------------------------------------------------------------ functional core
def _flag_nonfinite_(grads: list[Tensor], found_inf: Tensor) -> None:
    """``found_inf ← max(found_inf, 1 if any gradient is NaN/Inf)`` on the device, without a host read: one
    fused L2 norm per (device, dtype), accumulated in fp32 at least (a finite gradient whose norm overflows
    float32 counts as non-finite here)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (_, dtype), gs in by_kind.items():
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
        bad = torch.stack(torch._foreach_norm(gs, 2, dtype=acc)).isfinite().all().logical_not()
        torch.maximum(found_inf, bad.to(device=found_inf.device, dtype=found_inf.dtype, non_blocking=True),
                      out=found_inf)


