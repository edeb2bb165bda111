"""SparseGPT one-shot N:M pruning with OBS reconstruction (method.md §6).

Pure tensor math; the calibration (hooks, block-by-block pass) lives in :mod:`cast_llm.prune.blockwise`.

For a layer ``Y = W X`` with W (R, C) and calibration inputs X (C, tokens), the layer-wise objective is
``‖W X − Ŵ X‖²``, whose Hessian with respect to every row is ``H = 2/n X Xᵀ`` (C, C), n = tokens. The
columns are processed left to right. When column j is fixed to its pruned value q_j, the Optimal Brain
Surgeon (OBS) update moves the not-yet-processed columns F = {j+1, …} of every row by
``−(w_j − q_j) / [H_F⁻¹]_jj · [H_F⁻¹]_{j,F}``, where ``H_F⁻¹`` is the inverse of H restricted to the
columns not yet processed (j included). All these rows come from one factorisation: with ``U`` the upper
Cholesky factor of ``H⁻¹`` (``H⁻¹ = Uᵀ U``), ``[H_F⁻¹]_{j,F} = U_jj · U_{j,F}``, so the update is
``−(w_j − q_j) / U_jj · U_{j,F}`` and ``[H_F⁻¹]_jj = U_jj²``. Pruning choice per row and group of M
columns: drop the M−N entries with the smallest OBS saliency ``w² / [H_F⁻¹]_jj = w² / U_jj²`` (method.md
writes the denominator as ``[H⁻¹]_jj²``, meaning the squared diagonal of this Cholesky factor), computed
on the weights as already updated by the earlier columns.

Lazy batching: the update inside a block of ``blocksize`` columns is applied column by column, and the
accumulated errors of the block are pushed to the remaining columns in one matrix product afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cast_llm.errors import CastError
from cast_llm.sparsity.mask import is_nm_mask, nm_mask

log = logging.getLogger(__name__)

MAX_DAMP_RETRIES = 4  # damping ×10 each time: 1 % → 10 % → 100 % → 1000 % → 10000 % of mean(diag H)
RETRY_DAMP_FROM_ZERO = 0.01  # with --damp 0 there is nothing to multiply: the first retry uses 1 %


@dataclass
class SparseGPTInfo:
    """What :func:`sparsegpt_prune_` did to one layer."""

    mask: torch.Tensor  # (R, C) bool, True = kept
    damp: float  # relative damping (× mean diag H) that made the factorisation succeed
    retries: int  # Cholesky failures before that (0 = the requested damping worked)
    dead_columns: int  # input columns that never saw a non-zero activation (diag H = 0)
    loss: float  # OBS estimate of ½ Σ_rows (w − q)² / [H_F⁻¹]_jj summed over the pruned entries


def accumulate_hessian(xxt: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Add ``Xᵀ X`` of a batch of inputs ``x`` (tokens, C) to the running sum (C, C), in float32."""
    x = x.float()
    if xxt is None:
        return x.t() @ x
    return xxt.addmm_(x.t(), x)


def finalize_hessian(xxt: torch.Tensor, tokens: int) -> torch.Tensor:
    """``H = 2/n X Xᵀ`` from the running sum of outer products over ``n = tokens`` inputs."""
    if tokens <= 0:
        raise ValueError("no calibration tokens reached this layer")
    return xxt * (2.0 / tokens)


@contextmanager
def _single_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """The column loop is thousands of tiny ops: on CPU, intra-op threads only add synchronisation, so it
    runs on one thread (docs/results/performance.md, §5)."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _next_damp(damp: float) -> float:
    return damp * 10 if damp > 0 else RETRY_DAMP_FROM_ZERO


def inverse_hessian_cholesky(
    hessian: torch.Tensor, damp: float = 0.01, *, max_retries: int = MAX_DAMP_RETRIES, name: str = "layer"
) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor ``U`` of ``(H + λI)⁻¹``, λ = damp · mean(diag H); returns ``(U, damp, retries)``.

    ``hessian`` must already have its dead columns fixed (diag > 0). When either factorisation fails
    (H is singular or badly conditioned), retry with ten times the damping, up to ``max_retries`` times.
    """
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    mean_diag = hessian.diagonal().mean()
    tried = []
    for retries in range(max_retries + 1):
        damped = hessian + (damp * mean_diag) * eye
        chol, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0 and bool(torch.isfinite(upper).all()):
                if retries:
                    log.warning("SparseGPT %s: Cholesky failed with damping %s; succeeded with %g",
                                name, ", ".join(f"{d:g}" for d in tried), damp)
                return upper, damp, retries
        tried.append(damp)
        damp = _next_damp(damp)
    raise CastError(
        f"SparseGPT: the Hessian of {name} could not be factorised even with damping "
        f"{', '.join(f'{d:g}' for d in tried)} × mean(diag H); the calibration inputs of this layer are "
        "degenerate (check the data, or raise --damp)"
    )


@torch.no_grad()
def sparsegpt_prune_(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    n: int = 2,
    m: int = 4,
    *,
    blocksize: int = 128,
    damp: float = 0.01,
    dtype: torch.dtype = torch.float32,
    max_retries: int = MAX_DAMP_RETRIES,
    name: str = "layer",
    mask: torch.Tensor | None = None,
) -> SparseGPTInfo:
    """Prune ``weight`` (R, C) in place to N:M with SparseGPT, given ``hessian`` = 2/n X Xᵀ (C, C).

    ``mask`` (R, C) bool, True = kept, fixes which entries are pruned instead of choosing them by OBS
    saliency: only the OBS update runs (the compensated prune of a trained CAST model, whose masks were
    learned). It must be an exact ``n``:``m`` mask along the last dim.

    ``weight`` may be a non-contiguous view (e.g. ``conv1d.weight.t()``): the result is copied into it.
    Computation happens in ``dtype`` (float32; float64 for reference tests) on the weight's device.
    Pruned entries are exact zeros, so every group of ``m`` holds at most ``n`` non-zeros.
    """
    rows, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({cols}, {cols}) for {name}")
    if cols % m or blocksize % m or blocksize <= 0:
        raise ValueError(f"{name}: columns ({cols}) and blocksize ({blocksize}) must be multiples of m={m}")
    if not bool(torch.isfinite(hessian).all()):
        raise CastError(f"SparseGPT: the calibration inputs of {name} contain NaN/Inf; cannot prune it")
    if mask is not None:
        if mask.dtype != torch.bool or tuple(mask.shape) != (rows, cols):
            raise ValueError(f"{name}: mask must be bool of shape {(rows, cols)}, got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        if not is_nm_mask(mask, n, m):
            raise ValueError(f"{name}: the given mask is not an exact {n}:{m} mask along the last dim")

    W = weight.detach().to(dtype=dtype, copy=True)  # (R, C) working copy
    H = hessian.detach().to(device=W.device, dtype=dtype, copy=True)  # (C, C)
    # An input column that is always 0 has diag H = 0 and makes H singular; its weights never affect the
    # output, so zero them (pruning them is then free) and put 1 on the diagonal to keep H invertible.
    dead = H.diagonal() == 0
    dead_idx = dead.nonzero().squeeze(1)
    H[dead_idx, dead_idx] = 1.0
    W[:, dead] = 0.0

    U, damp_used, retries = inverse_hessian_cholesky(H, damp, max_retries=max_retries, name=name)
    del H

    keep = (torch.ones(rows, cols, dtype=torch.bool, device=W.device) if mask is None
            else mask.to(W.device, copy=True))
    loss = torch.zeros(rows, dtype=dtype, device=W.device)
    with _single_thread_on_cpu(W.device):
        for b0 in range(0, cols, blocksize):
            b1 = min(b0 + blocksize, cols)
            W1 = W[:, b0:b1].clone()  # (R, B) weights of this lazy block, updated column by column
            Q1 = torch.zeros_like(W1)  # (R, B) final (pruned) values
            E1 = torch.zeros_like(W1)  # (R, B) scaled errors (w − q) / U_jj, for the later blocks
            U1 = U[b0:b1, b0:b1]  # (B, B) upper triangular
            d1 = U1.diagonal()  # (B,)
            keep1 = keep[:, b0:b1]  # a view: writing it fills ``keep``
            for j in range(b1 - b0):
                if mask is None and j % m == 0:  # a new group of m columns: choose per row the n to keep
                    g = slice(j, j + m)
                    keep1[:, g] = nm_mask(W1[:, g].square() / d1[g].square(), n, m)
                w = W1[:, j]
                q = torch.where(keep1[:, j], w, torch.zeros_like(w))
                err = (w - q) / d1[j]  # (R,)
                loss += err.square() / 2
                W1[:, j:] -= err[:, None] * U1[j, j:][None, :]  # OBS update of this block's remaining columns
                Q1[:, j] = q
                E1[:, j] = err
            W[:, b0:b1] = Q1
            W[:, b1:] -= E1 @ U[b0:b1, b1:]  # lazy OBS update of all later blocks: (R, B) @ (B, C − b1)

    weight.copy_(W.to(weight.dtype))
    return SparseGPTInfo(mask=keep, damp=damp_used, retries=retries, dead_columns=int(dead.sum()),
                         loss=float(loss.sum()))
