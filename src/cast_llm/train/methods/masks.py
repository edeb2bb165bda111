"""Masks shared by the training methods: the initial one-shot mask (``--init-mask``), when magnitude
refreshes (Eq. 6, :func:`cast_llm.sparsity.mask.magnitude_mask`) are due, and the names under which a method
reports its masks to the loop.

The initial mask is magnitude (Eq. 6) by default, Wanda / SparseGPT (method.md §6) calibrated on
``--calib-samples`` sequences of the run's own training data (cut to the one-shot methods' calibration
length, :data:`cast_llm.prune.oneshot.CALIBRATION_SEQ_LEN`, when longer) through :func:`cast_llm.prune.prune_model`, or
a mask from a file (``--mask-file``: :mod:`cast_llm.sparsity.mask_io`; only the mask is taken).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from cast_llm.data import calibration_samples
from cast_llm.errors import CastError
from cast_llm.models import load_model
from cast_llm.prune import prune_model
from cast_llm.prune.oneshot import CALIBRATION_SEQ_LEN
from cast_llm.sparsity.mask import magnitude_mask
from cast_llm.sparsity.mask_io import load_masks, mask_of_zeros
from cast_llm.targets import find_targets

__all__ = ["initial_masks", "mask_keys", "masks_from", "refresh_due"]


def initial_masks(model: nn.Module, cfg, *, data=None, device=None, apply: bool = False) -> dict[str, torch.Tensor]:
    """``{target fqn: bool mask in the weight's layout}`` from the one-shot method ``cfg.effective_init_mask``.

    ``apply=True`` prunes ``model`` itself with it (naive retraining starts from the one-shot *model*:
    pruned weights zeroed, and SparseGPT's reconstructed kept weights); ``apply=False`` leaves the weights
    untouched (the mask learners start from the dense weights and take only the mask).
    """
    targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
    if cfg.effective_init_mask in ("magnitude", "file"):
        masks = (masks_from(cfg.mask_file, targets, cfg.n, cfg.m) if cfg.effective_init_mask == "file" else
                 {t.fqn: magnitude_mask(t.weight, t.transposed, cfg.n, cfg.m) for t in targets})
        if apply:
            with torch.no_grad():
                for t in targets:
                    t.weight.masked_fill_(~masks[t.fqn], 0.0)
        return masks
    if data is None:
        raise CastError(f"--init-mask {cfg.effective_init_mask} needs calibration data; pass the run's data to prepare_model")
    samples = min(cfg.calib_samples, data.train.shape[0])
    calib = calibration_samples(data, samples, seed=cfg.seed)[:, :CALIBRATION_SEQ_LEN]  # (the one-shot methods' own)
    subject = model if apply else copy.deepcopy(model)  # a copy: the one-shot pruner edits weights in place
    sub_targets = targets if apply else find_targets(subject, n=cfg.n, m=cfg.m,
                                                     skip_incompatible=cfg.skip_incompatible)
    result = prune_model(subject, cfg.effective_init_mask, calib, n=cfg.n, m=cfg.m, device=device, targets=sub_targets)
    by_fqn = {t.fqn: t for t in targets}
    # prune_model's masks are (out, in); Conv1D weights are stored (in, out)
    return {fqn: (mask.t().contiguous() if by_fqn[fqn].transposed else mask).to(by_fqn[fqn].weight.device)
            for fqn, mask in result.masks.items()}


def mask_keys(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{target fqn: key}`` under which the loop's observers find each weight (``{key}.weight`` or
    ``{key}.base_layer.weight``), for weights nested in one or two wrappers."""
    names = {id(p): name for name, p in model.named_parameters()}
    keys = {}
    for fqn, w in weights.items():
        owner = names[id(w)].removesuffix(".weight")
        keys[fqn] = owner.removesuffix(".base_layer")
    return keys


def refresh_due(step: int, interval: int) -> bool:
    """Whether the masks are recomputed before optimizer step ``t = step + 1``: ``t mod T1 == 0``, the rule
    of Algorithm 1 (so every mask learner refreshes at the same steps as AdamS)."""
    return interval > 0 and (step + 1) % interval == 0


def masks_from(source: str | Path, targets, n: int, m: int) -> dict[str, torch.Tensor]:
    """``{fqn: bool mask}`` for ``targets`` (:func:`cast_llm.targets.find_targets`) from a mask file or a sparse
    model folder, checked against every target's shape and the N:M pattern."""
    source = Path(source).expanduser()
    if source.is_file():
        masks, meta = load_masks(source)
        if (meta.get("n"), meta.get("m")) != (str(n), str(m)):
            raise CastError(f"{source}: a {meta.get('n')}:{meta.get('m')} mask file; this run is {n}:{m}")
    elif source.is_dir():
        sparse = load_model(str(source), dtype=torch.float32)
        masks = {t.fqn: mask_of_zeros(t.weight, t.transposed, n, m, name=f"{source}: {t.fqn}")
                 for t in find_targets(sparse, n=n, m=m, skip_incompatible=True)}
        del sparse
    else:
        raise CastError(f"--mask-file {source}: no such file or folder (a mask file or a sparse model folder)")
    out = {}
    for t in targets:
        mask = masks.get(t.fqn)
        if mask is None:
            raise CastError(f"{source} holds no mask for target {t.fqn} (it has {len(masks)} masks: was it made for "
                            "this model?)")
        if tuple(mask.shape) != tuple(t.weight.shape):
            raise CastError(f"{source}: the mask of {t.fqn} is {tuple(mask.shape)}, the weight {tuple(t.weight.shape)}")
        counts = (mask.t() if t.transposed else mask).reshape(-1, m).sum(1)
        if not bool((counts == n).all()):
            raise CastError(f"{source}: the mask of {t.fqn} does not keep exactly {n} of every {m}")
        out[t.fqn] = mask.to(t.weight.device)
    return out
