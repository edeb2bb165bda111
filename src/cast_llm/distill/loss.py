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

The torch path above is the reference of the checked kernel path ``kd.loss`` (:mod:`cast_llm.kernels`); its
candidates compute the same sums and the same gradient buffer: on CUDA (and on CPU tensors under
``TRITON_INTERPRET=1``, for tests) ONE fused Triton kernel (:mod:`cast_llm.distill.triton_kd`: per token row an online
log-sum-exp over the vocabulary, then the KL terms and the gradient row — two reads of the (bf16) logits, one
write of the gradient, no float32 copy of any logits; ``chunk_size`` plays no role there), and on CPU and CUDA
the same chunks compiled by ``torch.compile`` (:mod:`cast_llm.distill.paths`). Each is probed against the reference
on first use; float64 logits always take the reference.

No host synchronisation on any path: the count of valid labels stays on the device (the loss divides by
it there), invalid labels are caught by ``torch._assert_async`` (a device-side assert on CUDA; a ValueError
naming examples on CPU), and ignored rows are masked rather than gathered.

Consequences: only the student receives a gradient (the teacher is treated as a constant), ``kd`` and
``ce`` in the result are detached diagnostics (only ``loss`` is differentiable), and the graph can be
backpropagated once (the buffer is handed over, not copied).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from cast_llm import kernels
from cast_llm.distill import paths as kd_paths
from cast_llm.kernels.switch import compiled_runs_on, triton_runs_on

__all__ = ["KDLoss", "kd_loss", "causal_kd_loss", "shift_labels", "kd_path", "check_labels", "KD_LOSS"]


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

    ``s`` / ``t``: (c, V) student / teacher logits of any float dtype; ``y``: (c,) int64 labels in ``[0, V)``,
    all valid unless ``valid`` (c,) bool marks the rows that count: the others are computed (they may hold
    anything, NaN included) but masked out of both sums and get a zero gradient row — masked, not gathered,
    so no host synchronisation. Works in ``dtype`` (float32; float64 for float64 inputs) and reuses buffers in
    place so that at most ~3 (c, V) such tensors are alive.
    """
    T = temperature
    col = y.unsqueeze(1)  # (c, 1): the label's column
    kl = s.new_zeros((), dtype=dtype)

    def rows_sum(x: torch.Tensor) -> torch.Tensor:  # Σ over the rows that count
        return x.sum() if valid is None else torch.where(valid, x, 0.0).sum()

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
        kl = (terms.sum() if valid is None else rows_sum(terms.sum(dim=1))) * (T * T)
        del lt
    ls1 = ls if T == 1.0 else F.log_softmax(s, dim=-1, dtype=dtype)  # CE at temperature 1
    ce = -rows_sum(ls1.gather(1, col).squeeze(1))
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
        grad.scatter_add_(1, col, torch.full(col.shape, -(1.0 - eta), dtype=grad.dtype, device=grad.device))
    if valid is not None:
        grad.masked_fill_(~valid.unsqueeze(1), 0.0)  # the few ignored rows (e.g. the last token of each sequence)
    return kl, ce, grad


class _ChunkedKD(torch.autograd.Function):
    """Eq. 13 over (N, V) logits; the gradient is formed in the forward (see module docstring)."""

    @staticmethod
    def forward(ctx, student, teacher, labels, eta, temperature, chunk_size, ignore_index, need_grad):
        vocab = student.shape[1]
        valid = labels != ignore_index
        check_labels(labels, valid, vocab, ignore_index)
        # float32 math (float64 inputs stay float64, for reference tests)
        dtype = torch.float64 if student.dtype == torch.float64 else torch.float32
        # the number of rows that count stays on the device: every sum is divided by it there (none: 0 / 1 = 0)
        n = valid.sum().clamp_min(1).to(torch.float64)
        inv_n = (1.0 / n).to(dtype)
        ctx.grad = None
        ctx.backward_done = False
        path = kd_path(student, teacher, temperature, need_grad)
        if path == kernels.REFERENCE:
            kd_sum, ce_sum, grad = _chunked(student, teacher, labels, valid, inv_n, eta, temperature, chunk_size,
                                            need_grad, dtype)
        else:
            kd_sum, ce_sum, grad = kernels.implementation("kd.loss", path)(
                student, teacher, labels, ignore_index=ignore_index, inv_n=inv_n, eta=eta, temperature=temperature,
                need_grad=need_grad, chunk_size=chunk_size)
        kd, ce = kd_sum / n.to(kd_sum.dtype), ce_sum / n.to(ce_sum.dtype)
        # a term with weight 0 must not leak a NaN/Inf into the loss
        loss = torch.zeros((), dtype=dtype, device=student.device)
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


def check_labels(labels: torch.Tensor, valid: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every label is in ``[0, vocab)`` or ``ignore_index``: checked on the device without waiting for it
    (``torch._assert_async``: on CUDA a failed check is a device-side assert); on CPU a ValueError with
    examples."""
    bad = valid & ((labels < 0) | (labels >= vocab))
    message = f"labels must be in [0, {vocab}) or ignore_index={ignore_index}"
    if labels.device.type != "cpu":
        torch._assert_async(~bad.any(), message)
        return
    try:
        torch._assert_async(~bad.any(), message)
    except RuntimeError:
        examples = labels[bad][:5].tolist()
        raise ValueError(f"{message}; got e.g. {examples}") from None


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kd_path(student: torch.Tensor, teacher: torch.Tensor | None, temperature: float, need_grad: bool) -> str:
    """Which implementation computes Eq. 13 on these (N, V) logits: a candidate of the checked path
    ``kd.loss`` (``triton``, ``compiled``) or ``REFERENCE`` (the torch path: float64 logits, a device no
    candidate runs on, or candidates that failed their check)."""
    if student.dtype not in _KERNEL_DTYPES or (teacher is not None and teacher.dtype not in _KERNEL_DTYPES):
        return kernels.REFERENCE
    if student.stride(-1) != 1 or (teacher is not None and teacher.stride(-1) != 1) or student.numel() == 0:
        return kernels.REFERENCE
    variant = (student.dtype, "no teacher" if teacher is None else teacher.dtype,
               "T = 1" if temperature == 1.0 else "T != 1", "gradient" if need_grad else "no gradient")
    return kernels.choose("kd.loss", student.device, variant)


def _chunked(student, teacher, labels, valid, inv_n, eta, temperature, chunk_size, need_grad, dtype):
    """The torch path: Σ KL·T², Σ CE and the gradient × ``inv_n``, chunk by chunk of rows (plain slices: views,
    no copies; ignored rows are computed and masked: a causal LM ignores 1 row of every sequence)."""
    n_rows = student.shape[0]
    grad = torch.empty_like(student) if need_grad else None
    kd_sum = torch.zeros((), dtype=dtype, device=student.device)
    ce_sum = kd_sum.clone()
    step = chunk_size or max(n_rows, 1)
    for start in range(0, n_rows, step):
        sel = slice(start, start + step)
        s, v = student[sel], valid[sel]
        t = teacher[sel] if teacher is not None else None
        y = torch.where(v, labels[sel], 0)  # ignored labels may be any value; never read
        kl_c, ce_c, g = _chunk_terms(s, t, y.long(), eta, temperature, need_grad, dtype, v)
        kd_sum += kl_c
        ce_sum += ce_c
        if g is not None:  # scale by 1/n and round to the logits' dtype in one pass, into place
            torch.mul(g, inv_n, out=grad[sel])
        del s, t, g
    return kd_sum, ce_sum, grad


def _triton_kd(*args, **kwargs):
    from cast_llm.distill import triton_kd  # in-function: imports Triton (optional, ~1 s)


    return triton_kd.fused_kd(*args, **kwargs)


def _compiled_kd(*args, **kwargs):
    return kd_paths.compiled_kd(*args, **kwargs)


KD_LOSS = kernels.register(kernels.CheckedPath(
    name="kd.loss",
    what="KD loss and its gradient, Eq. 13 (distill/loss.py)",
    reference="the chunked torch path in float64",
    measure="relative error of the sums, or max |Δ| / max |ref| of the gradient",
    candidates=(kernels.Candidate("triton", lambda: _triton_kd, triton_runs_on),
                kernels.Candidate("compiled", lambda: _compiled_kd, compiled_runs_on, compiles=True)),
    probe=functools.partial(kd_paths.kd_probe, reference=_chunked),
    timer=functools.partial(kd_paths.kd_timer, reference=_chunked),
    variants=kd_paths.kd_variants, cuda_only=False,
))


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
