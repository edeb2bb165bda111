"""Knowledge-distillation loss (method.md §4, Eq. 13), computed in chunks along tokens.

    L = η · T² · KL(P_t^T ‖ P_s^T) + (1 − η) · CE(P_s, labels)            (Eq. 13)

with ``P^T = softmax(z / T)``; the KL term is multiplied by ``T²`` (Hinton et al.'s convention) so that
its gradient, ``η T (P_s^T − P_t^T)``, keeps the same scale whatever the temperature; at the paper's
``T = 1`` this is exactly Eq. 13. The CE term always uses ``T = 1`` (it is the ordinary LM loss). Both terms
are summed over the tokens whose label is not ``ignore_index`` and divided by their number, so padding
is ignored by the KD term too.

**Labels are aligned with the logits**: ``labels[..., i]`` is the target of ``logits[..., i, :]``. Hugging
Face causal LMs shift inside their own loss; with raw logits use :func:`causal_kd_loss`, which shifts
``labels`` (the HF ``labels`` / ``input_ids`` convention) for you — without copying the logits.

Memory. With vocabularies of 50k-130k the logits dominate memory, and a naive loss keeps several
fp32 ``tokens × V`` tensors alive for backward (student log-probs, teacher probs, their product). Here a
custom autograd function walks the tokens in chunks of ``chunk_size`` rows, computes both terms in
float32, and writes the closed-form gradient w.r.t. the student logits, ``(η T (P_s^T − P_t^T) +
(1 − η)(P_s − onehot)) / n_tokens``, straight into one buffer of the logits' shape and dtype. Nothing else
is saved: backward only scales that buffer by the incoming gradient (in place) and hands it over. Peak
memory is therefore the logits (which exist anyway), one logits-sized gradient (which backward would
allocate anyway) and ~3 fp32 ``chunk_size × V`` work tensors, with no recomputation.

The default ``chunk_size`` of 1024 tokens keeps ~0.6 GiB of work space at V = 49152; the memory and time
this saves against autograd versions of the same loss are in docs/results/performance.md (§5).

On CUDA (and on CPU tensors under ``TRITON_INTERPRET=1``, for tests) the same sums and the same gradient
buffer come from ONE fused Triton kernel (:mod:`cast_llm.triton_kd`): per token row an online log-sum-exp
over the vocabulary, then the KL terms and the gradient row — two reads of the (bf16) logits, one write of
the gradient, no float32 copy of any logits, and one host sync per call (the count of valid labels and the
label check together); ``chunk_size`` plays no role there. Float64 logits always take the torch path.

Consequences: only the student receives a gradient (the teacher is treated as a constant), ``kd`` and
``ce`` in the result are detached diagnostics (only ``loss`` is differentiable), and the graph can be
backpropagated once (the buffer is handed over, not copied).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["KDLoss", "kd_loss", "causal_kd_loss", "shift_labels"]


class KDLoss(NamedTuple):
    """``loss = eta * kd + (1 - eta) * ce`` (Eq. 13); ``kd`` includes the ``T²`` factor.

    Only ``loss`` carries a gradient; ``kd`` and ``ce`` are detached, for logging.
    """

    loss: torch.Tensor
    kd: torch.Tensor
    ce: torch.Tensor


def _chunk_terms(
    s: torch.Tensor,
    t: torch.Tensor | None,
    y: torch.Tensor,
    eta: float,
    temperature: float,
    need_grad: bool,
    dtype: torch.dtype = torch.float32,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Summed KL (× T²) and CE over one chunk of rows, and the per-row gradient of ``η·KL·T² + (1−η)·CE``.

    ``s`` / ``t``: (c, V) student / teacher logits of any float dtype; ``y``: (c,) int64 labels, all valid
    unless ``valid`` (c,) bool marks the rows that count: the others are computed (they may hold anything,
    NaN included) but left out of both sums and get a zero gradient row. Works in ``dtype`` (float32;
    float64 for float64 inputs) and reuses buffers in place so that at most ~3 (c, V) such tensors are alive.
    """
    T = temperature
    rows = torch.arange(y.numel(), device=y.device)
    if valid is not None:
        rows = rows[valid]
        y = y[valid]
    kl = s.new_zeros((), dtype=dtype)

    def log_probs(z: torch.Tensor) -> torch.Tensor:
        if T == 1.0:
            return F.log_softmax(z, dim=-1, dtype=dtype)  # the low-precision -> fp32 copy is transient
        return F.log_softmax(z.to(dtype, copy=True).div_(T), dim=-1)

    ls = log_probs(s)  # log P_s^T
    pt = None
    if t is not None:
        lt = log_probs(t)  # log P_t^T
        pt = lt.exp()
        # KL(P_t ‖ P_s) = Σ_v P_t (log P_t − log P_s), reusing lt's storage
        terms = lt.sub_(ls).mul_(pt)
        kl = (terms.sum() if valid is None else terms.sum(dim=1)[valid].sum()) * (T * T)
        del lt
    if T == 1.0:
        ls1 = ls
        ce = -ls1[rows, y].sum()
    else:
        ls1 = F.log_softmax(s, dim=-1, dtype=dtype)  # CE at temperature 1
        ce = -ls1[rows, y].sum()
    if not need_grad:
        return kl, ce, None

    # d/dz_s: η T (P_s^T − P_t^T) + (1 − η)(P_s − onehot(y))
    if T == 1.0:
        grad = ls.exp_()  # P_s, in place of the log-probs
        if eta > 0:
            grad.sub_(pt, alpha=eta)
    elif eta > 0:
        grad = ls.exp_().sub_(pt).mul_(eta * T)  # P_s^T, P_t^T at temperature T
        del pt
        if eta < 1:
            grad.add_(ls1.exp_(), alpha=1.0 - eta)
    else:  # pure CE
        grad = ls1.exp_()
    if eta < 1:
        grad[rows, y] -= 1.0 - eta
    if valid is not None:
        grad[~valid] = 0.0  # the few ignored rows (e.g. the last token of each sequence)
    return kl, ce, grad


class _ChunkedKD(torch.autograd.Function):
    """Eq. 13 over (N, V) logits, chunked; the gradient is formed in the forward (see module docstring)."""

    @staticmethod
    def forward(ctx, student, teacher, labels, eta, temperature, chunk_size, ignore_index, need_grad):
        n_rows, vocab = student.shape
        valid = labels != ignore_index
        # float32 math (float64 inputs stay float64, for reference tests)
        dtype = torch.float64 if student.dtype == torch.float64 else torch.float32
        zero = torch.zeros((), dtype=dtype, device=student.device)
        ctx.grad = None
        ctx.backward_done = False
        kernel = _fused_kernel(student, teacher)
        if kernel is not None:
            # the count and the label check in ONE host sync: the kernel needs nothing else from the host
            bad = valid & ((labels < 0) | (labels >= vocab))
            n, n_bad = torch.stack([valid.sum(), bad.sum()]).tolist()
            idx = None
        else:
            idx = valid.nonzero().squeeze(1)  # one host sync per call, also used to validate labels below
            n = idx.numel()
            n_bad = int(((labels[idx] < 0) | (labels[idx] >= vocab)).sum()) if n else 0
        if n_bad:
            chosen = labels[valid]
            examples = chosen[(chosen < 0) | (chosen >= vocab)][:5].tolist()
            raise ValueError(
                f"labels must be in [0, {vocab}) or ignore_index={ignore_index}; got e.g. {examples}"
            )
        if n == 0:  # everything ignored: a zero loss with a zero gradient, not 0/0 = NaN
            loss, kd, ce = zero, zero.clone(), zero.clone()
            ctx.mark_non_differentiable(kd, ce)
            return loss, kd, ce
        if kernel is not None:
            kd_sum, ce_sum, grad = kernel.fused_kd(student, teacher, labels.long(), n=n, eta=eta,
                                                   temperature=temperature, ignore_index=ignore_index,
                                                   need_grad=need_grad)
        else:
            kd_sum, ce_sum, grad = _chunked(student, teacher, labels, valid, idx, eta, temperature, chunk_size,
                                            need_grad, dtype)
        kd, ce = kd_sum / n, ce_sum / n
        # a term with weight 0 must not leak a NaN/Inf into the loss
        loss = zero.clone()
        if eta > 0:
            loss = loss + eta * kd
        if eta < 1:
            loss = loss + (1.0 - eta) * ce
        ctx.grad = grad
        ctx.mark_non_differentiable(kd, ce)
        return loss, kd, ce

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_kd, _grad_ce):
        if ctx.backward_done:
            raise RuntimeError(
                "kd_loss can be backpropagated only once (its gradient buffer is handed over to save "
                "memory); compute the loss again instead of using retain_graph=True"
            )
        ctx.backward_done = True
        grad, ctx.grad = ctx.grad, None
        if grad is not None:
            grad.mul_(grad_loss.to(grad.dtype))  # in place: the buffer is not used again
        return grad, None, None, None, None, None, None, None


_KERNEL: list = []  # cast_llm.triton_kd, imported on first use (Triton's import takes ~1 s)


def _fused_kernel(student: torch.Tensor, teacher: torch.Tensor | None):
    """The Triton kernel module when it takes these logits (CUDA, or CPU under TRITON_INTERPRET=1), else None."""
    if student.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None  # the common CPU case decides without importing Triton
    if not _KERNEL:
        try:
            from cast_llm import triton_kd
        except Exception:  # pragma: no cover - a broken Triton install: the torch path does the same math
            triton_kd = None
        _KERNEL.append(triton_kd)
    kernel = _KERNEL[0]
    if kernel is None or kernel.unsupported_reason(student, teacher) is not None:
        return None
    return kernel


def _chunked(student, teacher, labels, valid, idx, eta, temperature, chunk_size, need_grad, dtype):
    """The torch path: Σ KL·T², Σ CE and the gradient / n, chunk by chunk (``idx``: the valid rows)."""
    n_rows, n = student.shape[0], idx.numel()
    zero = torch.zeros((), dtype=dtype, device=student.device)
    # Chunks are plain slices (views, no copies) unless many rows are ignored: then only the valid ones
    # are gathered. A causal LM ignores 1 row of every sequence — computing it costs less than the two
    # gathered copies of the logits and the scattered copy of the gradient it saves.
    contiguous = (n_rows - n) * 8 <= n_rows
    valid_all = None if n == n_rows else valid
    grad = None
    if need_grad:
        grad = torch.empty_like(student) if contiguous else torch.zeros_like(student)
    kd_sum, ce_sum = zero.clone(), zero.clone()
    total = n_rows if contiguous else n
    step = chunk_size or total
    for start in range(0, total, step):
        v = None
        if contiguous:
            sel = slice(start, start + step)
            s, y = student[sel], labels[sel]
            t = teacher[sel] if teacher is not None else None
            if valid_all is not None:
                v = valid_all[sel]
                y = torch.where(v, y, 0)  # ignored labels may be any value; never read
        else:
            sel = idx[start : start + step]
            s, y = student.index_select(0, sel), labels.index_select(0, sel)
            t = teacher.index_select(0, sel) if teacher is not None else None
        kl_c, ce_c, g = _chunk_terms(s, t, y.long(), eta, temperature, need_grad, dtype, v)
        kd_sum += kl_c
        ce_sum += ce_c
        if g is not None:
            if contiguous:  # scale by 1/n and round to the logits' dtype in one pass, into place
                torch.mul(g, 1.0 / n, out=grad[sel])
            else:
                grad.index_copy_(0, sel, g.div_(n).to(grad.dtype))
        del s, t, g
    return kd_sum, ce_sum, grad


def _check(student_logits, teacher_logits, labels, eta, temperature, chunk_size) -> None:
    if not isinstance(student_logits, torch.Tensor) or not student_logits.is_floating_point():
        raise TypeError("student_logits must be a floating-point tensor")
    if student_logits.dim() < 2:
        raise ValueError(
            f"student_logits must be (..., vocab), e.g. (batch, seq, vocab); got {tuple(student_logits.shape)}"
        )
    if tuple(labels.shape) != tuple(student_logits.shape[:-1]):
        raise ValueError(
            f"labels {tuple(labels.shape)} must have the logits' shape without the vocab dim: logits "
            f"{tuple(student_logits.shape)} need labels {tuple(student_logits.shape[:-1])}"
        )
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if teacher_logits is not None:
        if tuple(teacher_logits.shape) != tuple(student_logits.shape):
            raise ValueError(
                f"teacher logits {tuple(teacher_logits.shape)} and student logits "
                f"{tuple(student_logits.shape)} must have the same shape (same tokens, same vocabulary)"
            )
        if not teacher_logits.is_floating_point():
            raise TypeError("teacher_logits must be a floating-point tensor")
        if teacher_logits.device != student_logits.device:
            raise ValueError(
                f"teacher logits are on {teacher_logits.device}, student logits on {student_logits.device}"
            )
    elif eta != 0:
        raise ValueError(f"teacher_logits is None but eta={eta}; without a teacher only eta=0 (pure CE) works")
    if labels.device != student_logits.device:
        raise ValueError(f"labels are on {labels.device}, logits on {student_logits.device}")
    if not (isinstance(eta, (int, float)) and 0.0 <= eta <= 1.0):
        raise ValueError(f"eta (the KD weight of Eq. 13) must be in [0, 1], got {eta!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive number of tokens or None (no chunking), got {chunk_size!r}")


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    eta: float = 2 / 3,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
    ignore_index: int = -100,
) -> KDLoss:
    """Eq. 13: ``η · T² · KL(P_t^T ‖ P_s^T) + (1 − η) · CE``, each averaged over non-ignored tokens.

    Args:
        student_logits: ``(..., V)``, e.g. ``(B, T, V)``; any float dtype (math in float32).
        teacher_logits: same shape; never receives a gradient. May be None only when ``eta == 0``.
        labels: ``(...)`` integer targets **aligned with the logits** (already shifted for a causal LM;
            see :func:`causal_kd_loss`); ``ignore_index`` marks tokens excluded from both terms.
        eta: weight of the KD term (paper: 2/3 for GPT-2/OPT, 1/3 for LLaMA).
        temperature: softmax temperature of the KD term (the KL is multiplied by T²).
        chunk_size: tokens per chunk (memory ~3 × chunk_size × V × 4 bytes of work space); None = one chunk.
        ignore_index: label value of ignored tokens.

    Returns:
        :class:`KDLoss` ``(loss, kd, ce)`` of float32 scalars (float64 for float64 logits); all zeros if
        every token is ignored.
    """
    _check(student_logits, teacher_logits, labels, eta, temperature, chunk_size)
    vocab = student_logits.shape[-1]
    student = student_logits.reshape(-1, vocab)  # a view for contiguous logits
    teacher = teacher_logits.detach().reshape(-1, vocab) if teacher_logits is not None else None
    # grad mode is off inside Function.forward and needs_input_grad ignores torch.no_grad(), so decide here
    # whether to build the gradient buffer (not in evaluation)
    need_grad = torch.is_grad_enabled() and student.requires_grad
    loss, kd, ce = _ChunkedKD.apply(
        student, teacher, labels.reshape(-1), float(eta), float(temperature), chunk_size, ignore_index, need_grad
    )
    return KDLoss(loss, kd, ce)


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``(B, T)`` labels in the HF convention -> labels aligned with the logits: ``out[:, i] = labels[:, i + 1]``
    and the last position ignored (it has no next token)."""
    shifted = torch.full_like(labels, ignore_index)
    shifted[..., :-1] = labels[..., 1:]
    return shifted


def causal_kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    eta: float = 2 / 3,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
    ignore_index: int = -100,
) -> KDLoss:
    """:func:`kd_loss` for a causal LM: ``labels`` (or ``input_ids``) as given to a HF model, ``(B, T)``.

    The logits at position ``i`` predict token ``i + 1``. Instead of slicing ``logits[:, :-1]`` (which,
    for B > 1, forces a copy of the whole logits tensor when flattened), the labels are shifted left and
    the last position of each sequence is ignored.
    """
    return kd_loss(
        student_logits,
        teacher_logits,
        shift_labels(labels, ignore_index),
        eta=eta,
        temperature=temperature,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
    )
