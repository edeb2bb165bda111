"""The KD loss's fast paths beside its torch reference (:mod:`cast_llm.distill`): the ``compiled`` candidate, and
how every candidate of the checked path ``kd.loss`` is probed and timed (:mod:`cast_llm.kernels`).

Every candidate has the contract of :func:`cast_llm.distill.triton_kd.fused_kd`: ``(Σ KL·T², Σ CE, gradient × 1/n)``
over ``(N, V)`` logits, ``1/n`` a device scalar (no host read), ignored rows masked (any value, NaN included).

* ``compiled``: the torch path's chunk — both log-softmaxes, the KL and CE terms and the gradient row —
  written as one function of the chunk and compiled by ``torch.compile`` (dynamic rows, one compile per
  (η, T, teacher or not, gradient or not) in a process): inductor fuses the passes over each row that the
  eager chunk makes one by one (vectorised C++ on a CPU, Triton on CUDA).
* The probe: 9 rows × 5,000 vocabulary entries (two of the Triton kernel's 4,096-wide blocks), two ignored
  rows, one of them holding a NaN, η and T of the variant; against the torch path in float64 on the same
  rounded logits. Measure: the worse of the sums' relative error (tolerance 1e-5: float32 rounding) and the
  gradient's ``max |Δ| / max |ref|`` (1e-5 for float32 logits; the gradient is stored in the logits' dtype:
  4e-3 for bf16 — half an ulp is 2e-3 — 8e-3 under Triton's interpreter, which truncates; 1e-3 for fp16);
  an ignored row whose gradient is not exactly 0 fails.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from cast_llm.kernels import Check, seconds_per_call
from cast_llm.kernels.switch import interpreting

__all__ = ["compiled_kd", "kd_probe", "kd_timer", "kd_variants"]

_GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 1e-3}


def _kd_chunk(s: Tensor, t: Tensor | None, y: Tensor, row_weight: Tensor, *, eta: float, temperature: float,
              need_grad: bool):
    # s, t: (c, V) logits in their dtype; y: (c,) int64 labels (ignored rows: 0); row_weight: (c,) float32, 1/n
    # for the rows that count and 0 for the others. Selections are made on float comparisons: inductor's C++
    # vectorises those, where a select on a bool tensor is ~30x slower.
    T = temperature
    counts = row_weight > 0
    zs = s.float()
    ls = F.log_softmax(zs if T == 1.0 else zs / T, dim=-1)  # log P_s^T
    kl = torch.zeros((), dtype=torch.float32, device=s.device)
    pt = None
    if t is not None:
        zt = t.float()
        lt = F.log_softmax(zt if T == 1.0 else zt / T, dim=-1)  # log P_t^T
        pt = lt.exp()
        kl = torch.where(counts, ((lt - ls) * pt).sum(dim=1), 0.0).sum() * (T * T)
    ls1 = ls if T == 1.0 else F.log_softmax(zs, dim=-1)  # the CE at temperature 1
    ce = -torch.where(counts, ls1.gather(1, y.unsqueeze(1)).squeeze(1), 0.0).sum()
    if not need_grad:
        return kl, ce, None
    if T == 1.0:
        grad = ls.exp() - eta * pt if pt is not None and eta > 0 else ls.exp()
    elif eta > 0:
        grad = (ls.exp() - pt) * (eta * T) + (1.0 - eta) * ls1.exp()
    else:
        grad = ls1.exp()
    if eta < 1:  # − (1 − η) at the label's column (float column indices: exact below 2^24 entries)
        cols = torch.arange(s.shape[1], device=s.device, dtype=torch.float32).unsqueeze(0)
        grad = torch.where(cols == y.to(torch.float32).unsqueeze(1), grad - (1.0 - eta), grad)
    weight = row_weight.unsqueeze(1)
    return kl, ce, torch.where(weight > 0, grad * weight, 0.0).to(s.dtype)


@functools.cache
def _compiled(**flags):
    return torch.compile(functools.partial(_kd_chunk, **flags), dynamic=True, fullgraph=True)


def compiled_kd(student: Tensor, teacher: Tensor | None, labels: Tensor, *, ignore_index: int, inv_n: Tensor,
                eta: float, temperature: float, need_grad: bool, chunk_size: int | None = 1024
                ) -> tuple[Tensor, Tensor, Tensor | None]:
    """The contract of :func:`cast_llm.distill.triton_kd.fused_kd`, chunk by chunk of rows through the compiled chunk."""
    fn = _compiled(eta=float(eta), temperature=float(temperature), need_grad=bool(need_grad))
    rows = student.shape[0]
    grad = torch.empty_like(student) if need_grad else None
    kl_sum = torch.zeros((), dtype=torch.float32, device=student.device)
    ce_sum = kl_sum.clone()
    step = chunk_size or max(rows, 1)
    inv_n = inv_n.to(device=student.device, dtype=torch.float32)
    for start in range(0, rows, step):
        sel = slice(start, start + step)
        y = labels[sel]
        valid = y != ignore_index
        kl, ce, g = fn(student[sel], None if teacher is None else teacher[sel], torch.where(valid, y, 0).long(),
                       valid.to(torch.float32) * inv_n)
        kl_sum += kl
        ce_sum += ce
        if g is not None:
            grad[sel] = g
    return kl_sum, ce_sum, grad


# ------------------------------------------------------------------------------------------- probe, timer
def _case(variant: tuple) -> tuple[float, float]:
    _, teacher, temp, _ = variant
    if teacher == "no teacher":
        return 0.0, 1.0 if temp == "T = 1" else 2.0
    return (0.5, 1.0) if temp == "T = 1" else (1 / 3, 2.0)


def kd_probe(impl, device: torch.device, variant: tuple, *, reference) -> Check:
    """``reference(student, teacher, labels, valid, inv_n, eta, T, chunk, need_grad, dtype)``: the torch path."""
    dtype, teacher_dtype, _, grads = variant
    eta, temperature = _case(variant)
    need_grad = grads == "gradient"
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 9, 5000
    s = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    t = None if teacher_dtype == "no teacher" else (3 * torch.randn(rows, vocab, generator=gen)).to(teacher_dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[[3, 8]] = -100
    s[3, 17] = float("nan")  # an ignored row may hold anything
    valid = labels != -100
    n = int(valid.sum())
    kl, ce, grad = impl(s.to(device), None if t is None else t.to(device), labels.to(device), ignore_index=-100,
                        inv_n=torch.tensor(1.0 / n, device=device), eta=eta, temperature=temperature,
                        need_grad=need_grad, chunk_size=4)
    r_kl, r_ce, r_grad = reference(s.double(), None if t is None else t.double(), labels, valid,
                                   torch.tensor(1.0 / n, dtype=torch.float64), eta, temperature, 4, need_grad,
                                   torch.float64)
    err = max(abs(float(a) - float(b)) / max(abs(float(b)), 1e-3) for a, b in ((kl, r_kl), (ce, r_ce)))
    worst = Check(err, 1e-5)
    if need_grad:
        g = grad.detach().cpu()
        if g.shape != s.shape or g.dtype != s.dtype or not bool((g[~valid] == 0).all()):
            return Check(float("inf"), 0.0)  # the shape, dtype or the ignored rows' zeros are wrong
        tol = 2 * _GRAD_TOL[dtype] if interpreting() and dtype != torch.float32 else _GRAD_TOL[dtype]
        gerr = float((g[valid].double() - r_grad[valid]).abs().max() / r_grad[valid].abs().max())
        if not gerr / tol <= err / 1e-5:
            worst = Check(gerr, tol)
    return worst


def kd_timer(impl, device: torch.device, variant: tuple, *, reference) -> float:
    """Eq. 13 with its gradient over 1,024 × 49,152 logits on CUDA (SmolLM2's vocabulary), 256 × 32,000 on CPU."""
    dtype, teacher_dtype, _, grads = variant
    eta, temperature = _case(variant)
    rows, vocab = (1024, 49152) if device.type == "cuda" else (256, 32000)
    s = torch.randn(rows, vocab, device=device).to(dtype)
    t = None if teacher_dtype == "no teacher" else torch.randn(rows, vocab, device=device).to(teacher_dtype)
    labels = torch.randint(0, vocab, (rows,), device=device)
    valid = labels >= 0
    inv_n = torch.tensor(1.0 / rows, device=device)
    need_grad = grads == "gradient"
    if impl is None:
        return seconds_per_call(lambda: reference(s, t, labels, valid, inv_n, eta, temperature, 1024, need_grad,
                                                  torch.float32), device)
    return seconds_per_call(lambda: impl(s, t, labels, ignore_index=-100, inv_n=inv_n, eta=eta,
                                         temperature=temperature, need_grad=need_grad, chunk_size=1024), device)


def kd_variants(device: torch.device) -> list[tuple]:
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    return [(low, low, "T = 1", "gradient"), (low, "no teacher", "T = 1", "gradient")]
