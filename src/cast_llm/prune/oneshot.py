"""``prune_model``: the one-shot baselines of method.md §6 on a whole model, returning the masks.

* ``magnitude`` — Eq. 6 once on every target (no calibration data);
* ``wanda`` — ``|W|·‖X_j‖₂`` scores, block by block through the decoder;
* ``sparsegpt`` — OBS pruning with reconstruction from ``H = 2/n XXᵀ``, block by block.

The masks are returned as well as applied, so the training baselines can start from a Wanda or SparseGPT
mask (``--init-mask``) instead of a magnitude one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from cast_llm.errors import CastError
from cast_llm.prune.blockwise import LayerInputs, prune_blockwise
from cast_llm.prune.magnitude import magnitude_prune_
from cast_llm.prune.sparsegpt import accumulate_hessian, finalize_hessian, sparsegpt_prune_
from cast_llm.prune.wanda import accumulate_col_sq_norm, wanda_prune_
from cast_llm.targets import TargetList, find_targets

log = logging.getLogger(__name__)

METHODS = ("magnitude", "wanda", "sparsegpt")
# the calibration window of the one-shot methods' papers (SparseGPT, Wanda: 128 sequences of 2048 tokens). A
# training run calibrates its initial mask on training windows cut to this length when they are longer: the
# Hessian statistics need tokens, not long contexts, and the calibration activations of one block grow with
# the tokens (at 32k-token sequences 128 whole windows would hold ~136 GiB of them for an 8B model).
CALIBRATION_SEQ_LEN = 2048


@dataclass
class LayerReport:
    """One pruned target: its name, (out, in) shape and, for SparseGPT, the damping it needed."""

    fqn: str
    shape: tuple[int, int]
    damp: float | None = None
    retries: int = 0
    dead_columns: int = 0
    loss: float | None = None  # SparseGPT's OBS error estimate


@dataclass
class PruneResult:
    """What :func:`prune_model` did. ``masks`` maps target name -> bool (out, in) mask on the CPU, True = kept."""

    method: str
    n: int
    m: int
    masks: dict[str, torch.Tensor]
    layers: list[LayerReport]
    calib_samples: int = 0
    calib_seq_len: int = 0
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # layers left dense (width not a multiple of m)

    @property
    def retried(self) -> list[LayerReport]:
        """Layers whose Cholesky factorisation needed more damping than asked for."""
        return [r for r in self.layers if r.retries]

    def metadata(self) -> dict:
        """The entries recorded in the checkpoint's ``sparsity`` metadata."""
        out = {"oneshot": {"method": self.method, **self.settings}}
        if self.calib_samples:
            out["oneshot"]["calibration"] = {"samples": self.calib_samples, "seq_len": self.calib_seq_len}
        if self.skipped:
            out["oneshot"]["left_dense"] = list(self.skipped)
        if self.retried:
            out["oneshot"]["damping_retries"] = {r.fqn: r.damp for r in self.retried}
        return out


def _rows_view(target) -> torch.Tensor:
    """The target's weight as (out, in) with N:M groups along the last dim; a view sharing storage."""
    w = target.weight.data  # the unscaled weight, also when the module is a ScaledLinear wrapper
    return w.t() if target.transposed else w  # GPT-2 Conv1D stores (in, out)


def prune_model(
    model: nn.Module,
    method: str,
    calib_ids: torch.Tensor | None = None,
    *,
    n: int = 2,
    m: int = 4,
    damp: float = 0.01,
    blocksize: int = 128,
    batch_size: int = 1,
    device: str | torch.device | None = None,
    skip_incompatible: bool = False,
    targets: TargetList | list | None = None,
    keep_masks: bool = True,
    progress: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> PruneResult:
    """Prune every target of ``model`` in place to N:M with a one-shot ``method`` (method.md §6).

    ``calib_ids`` (samples, seq_len) int64 token ids are required for ``wanda`` and ``sparsegpt``; they are
    run ``batch_size`` sequences at a time through one decoder block at a time on ``device``. ``targets``
    defaults to ``find_targets(model, n=n, m=m, skip_incompatible=skip_incompatible)``, which raises a
    CastError naming any layer whose width is not a multiple of ``m`` unless ``skip_incompatible``.
    """
    if method not in METHODS:
        raise CastError(f"unknown pruning method '{method}' (choose from {', '.join(METHODS)})")
    if not 0 < n < m:
        raise CastError(f"an N:M pattern needs 0 < n < m, got {n}:{m}")
    if method == "sparsegpt" and (blocksize <= 0 or blocksize % m):
        raise CastError(f"--blocksize must be a positive multiple of m={m} (groups may not straddle blocks), got {blocksize}")
    if damp < 0:
        raise CastError(f"--damp must be ≥ 0, got {damp}")
    if targets is None:
        targets = find_targets(model, n=n, m=m, skip_incompatible=skip_incompatible)
    elif not isinstance(targets, TargetList):  # a caller's own list: nothing it left out is known
        targets = TargetList(targets)
    if not targets:
        raise CastError("the model has no linear layers inside its decoder blocks to prune")
    if method != "magnitude":
        if calib_ids is None:
            raise CastError(f"{method} needs calibration data (calib_ids)")
        calib_ids = torch.as_tensor(calib_ids)
        if calib_ids.ndim != 2 or calib_ids.shape[0] == 0 or calib_ids.shape[1] == 0:
            raise CastError(f"calibration ids must be (samples, seq_len), got shape {tuple(calib_ids.shape)}")
    skipped = [t.fqn for t in targets.skipped]
    t0 = time.perf_counter()
    masks: dict[str, torch.Tensor] = {}
    reports: list[LayerReport] = []

    def record(target, mask: torch.Tensor, **extra) -> None:
        if keep_masks:
            masks[target.fqn] = mask.to("cpu", copy=True)
        reports.append(LayerReport(target.fqn, tuple(mask.shape), **extra))

    if method == "magnitude":
        with torch.no_grad():
            for t in targets:
                record(t, magnitude_prune_(_rows_view(t), n, m))
        return PruneResult(method, n, m, masks, reports, seconds=time.perf_counter() - t0, skipped=skipped)

    def prune_wanda(target, inputs: LayerInputs) -> None:
        if inputs.stat is None:
            raise CastError(f"no calibration input reached {target.fqn}; cannot score it with Wanda")
        rows = _rows_view(target)
        record(target, wanda_prune_(rows, inputs.stat.to(rows.device), n, m))

    def prune_sparsegpt(target, inputs: LayerInputs) -> None:
        if inputs.stat is None:
            raise CastError(f"no calibration input reached {target.fqn}; cannot build its Hessian")
        rows = _rows_view(target)
        hessian = finalize_hessian(inputs.stat, inputs.tokens).to(rows.device)
        info = sparsegpt_prune_(rows, hessian, n, m, blocksize=blocksize, damp=damp, dtype=compute_dtype,
                                name=target.fqn)
        record(target, info.mask, damp=info.damp, retries=info.retries, dead_columns=info.dead_columns,
               loss=info.loss)

    wanda = method == "wanda"
    prune_blockwise(
        model, targets, calib_ids,
        accumulate=accumulate_col_sq_norm if wanda else accumulate_hessian,
        prune_layer=prune_wanda if wanda else prune_sparsegpt,
        batch_size=batch_size, device=device, progress=progress, desc=method,
    )
    settings = {} if wanda else {"damp": damp, "blocksize": blocksize}
    result = PruneResult(method, n, m, masks, reports, calib_samples=int(calib_ids.shape[0]),
                         calib_seq_len=int(calib_ids.shape[1]), seconds=time.perf_counter() - t0,
                         settings=settings, skipped=skipped)
    for r in result.retried:
        log.warning("SparseGPT: %s needed damping %g (%d retr%s)", r.fqn, r.damp, r.retries,
                    "y" if r.retries == 1 else "ies")
    return result
