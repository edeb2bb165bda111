"""Compensated prune: apply given N:M masks and let SparseGPT's OBS update absorb what they cut off.

A CAST run ends with ``W ← W ⊙ M`` (Algorithm 1's last line). When the decay has not finished (S_t < 1),
that hard prune removes weight mass the model was trained with. The compensated prune keeps the learned
masks and only changes the *kept* weights: block by block through the decoder (as SparseGPT does), each
target's calibration Hessian ``H = 2/n XXᵀ`` is built from the inputs the already-compensated earlier
blocks produce, and the OBS rule of :func:`~cast_llm.prune.sparsegpt.sparsegpt_prune_` with ``mask=`` fixed
moves the remaining weights of every row to minimise ``‖W X − Ŵ X‖²`` (ours; not in the paper).

Weight scaling (:class:`~cast_llm.nn.ScaledLinear`) is respected: the OBS update runs on the effective
weight ``Diag(A) W`` (the one the layer's output depends on; A is constant inside every N:M group, so the
mask is the same) and the result is divided back by A, so the wrapper computes the compensated layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cast_llm.errors import CastError
from cast_llm.nn.scaled_linear import ScaledLinear
from cast_llm.prune.blockwise import LayerInputs, prune_blockwise
from cast_llm.prune.sparsegpt import accumulate_hessian, finalize_hessian, sparsegpt_prune_
from cast_llm.targets import find_targets

__all__ = ["CompensationReport", "compensated_prune_", "reconstruction_error"]


@dataclass
class CompensationReport:
    """What :func:`compensated_prune_` did: per target, the OBS estimate of the output error it left."""

    losses: dict[str, float]
    calib_samples: int
    calib_seq_len: int


def _effective_rows(target) -> torch.Tensor:
    """The target's effective weight (``Diag(A) W`` for a ScaledLinear) as (out, in), a detached copy."""
    module = target.module
    w = module.scaled_weight() if isinstance(module, ScaledLinear) else target.weight
    w = w.detach()
    return (w.t() if target.transposed else w).clone()


def _scale_rows(module: nn.Module, transposed: bool) -> torch.Tensor | None:
    """A ScaledLinear's scale expanded to the (out, in) layout of its weight, or None for a plain layer."""
    if not isinstance(module, ScaledLinear):
        return None
    a = module.scale.detach()  # (out, g)
    per_col = module.in_features // module.n_groups
    return a.repeat_interleave(per_col, dim=1)  # (out, in)


@torch.no_grad()
def compensated_prune_(
    model: nn.Module,
    masks: dict[str, torch.Tensor],
    calib_ids: torch.Tensor,
    *,
    n: int = 2,
    m: int = 4,
    damp: float = 0.01,
    blocksize: int = 128,
    batch_size: int = 1,
    device: str | torch.device | None = None,
    targets: list | None = None,
    progress: bool = False,
) -> CompensationReport:
    """Prune every target named in ``masks`` (fqn -> bool mask in the weight's own layout, True = kept)
    in place, with the OBS update of the kept weights computed on ``calib_ids`` (samples, seq_len).

    Afterwards every masked-out entry is exactly 0 and each kept weight has moved to compensate. Targets
    without a mask are left untouched (but still run, so later blocks see their outputs).
    """
    if targets is None:
        targets = find_targets(model, n=n, m=m, skip_incompatible=True)
    by_fqn = {t.fqn: t for t in targets}
    unknown = sorted(set(masks) - set(by_fqn))
    if unknown:
        raise CastError(f"compensated prune: mask(s) for {', '.join(unknown[:3])}, which are not N:M targets "
                        "of this model")
    chosen = [by_fqn[f] for f in masks]
    for t in chosen:
        if tuple(masks[t.fqn].shape) != tuple(t.weight.shape):
            raise CastError(f"compensated prune: the mask of {t.fqn} has shape {tuple(masks[t.fqn].shape)}, "
                            f"its weight {tuple(t.weight.shape)} (masks are in the weight's own layout)")
    losses: dict[str, float] = {}

    def prune_layer(target, inputs: LayerInputs) -> None:
        if inputs.stat is None:
            raise CastError(f"no calibration input reached {target.fqn}; cannot build its Hessian")
        rows = _effective_rows(target)  # (out, in)
        mask = masks[target.fqn]
        mask = (mask.t() if target.transposed else mask).to(rows.device, dtype=torch.bool)
        hessian = finalize_hessian(inputs.stat, inputs.tokens).to(rows.device)
        info = sparsegpt_prune_(rows, hessian, n, m, blocksize=blocksize, damp=damp, name=target.fqn,
                                mask=mask.contiguous())
        scale = _scale_rows(target.module, target.transposed)
        if scale is not None:  # W = W_eff / A, block by block (A is the same across each N:M group)
            if bool((scale.abs() < 1e-12).any()):
                raise CastError(f"compensated prune: {target.fqn} has a weight scale of 0; cannot divide it out")
            rows = torch.where(mask, rows / scale.to(rows.dtype), torch.zeros_like(rows))
        rows = rows.to(target.weight.dtype)
        target.weight.copy_(rows.t() if target.transposed else rows)
        losses[target.fqn] = info.loss

    prune_blockwise(model, chosen, calib_ids, accumulate=accumulate_hessian, prune_layer=prune_layer,
                    batch_size=batch_size, device=device, progress=progress, desc="compensated prune")
    return CompensationReport(losses, calib_samples=int(calib_ids.shape[0]), calib_seq_len=int(calib_ids.shape[1]))


def reconstruction_error(weight: torch.Tensor, pruned: torch.Tensor, x: torch.Tensor) -> float:
    """``‖W X − Ŵ X‖²_F`` for (out, in) weights and inputs ``x`` (tokens, in): what the OBS update minimises."""
    diff = (weight.double() - pruned.double()) @ x.double().t()
    return float(diff.square().sum())
