"""The KD loss of Eq. 13 and its gradient as ONE Triton kernel over the logits, for CUDA.

:func:`cast_llm.distill.kd_loss` on CUDA logits runs this instead of its chunked torch path. One program
per token row reads the student and teacher logits (bf16 under autocast) twice and writes the gradient
once, in the logits' dtype::

    pass 1  m, d = online max and Σ exp of z_s/T, z_t/T (and of z_s at T = 1 when T ≠ 1)
    pass 2  log P^T = z/T − (m + log d);  KL_row = Σ_v P_t^T (log P_t^T − log P_s^T)
            ∂/∂z_s = (η T (P_s^T − P_t^T) + (1 − η)(P_s − onehot(y))) / n

so no float32 copy of the logits ever exists: at SmolLM2's 49,152-entry vocabulary and 8,192 tokens the
torch path moves ~15 fp32 passes over 8 chunks (~25 GB), this kernel ~4 GB (and the second pass mostly
hits L2: one row pair is ~200 KB). All arithmetic is float32; rows whose label is ``ignore_index`` (which
may hold anything, NaN included) are computed but contribute 0 and get a zero gradient row.

``CE_row = log Σ exp(z_s) − z_s[y]`` (T = 1). ``KL_row`` is summed termwise like the torch path, then both
are reduced over rows by torch (float32). Differences from the torch path: summation order, and Triton's
exp/log (a few ulps) — float32 rounding.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from cast_llm.kernels.switch import triton_runs_on
from cast_llm.triton_support import FP_FUSION, tl, triton

__all__ = ["fused_kd", "unsupported_reason"]

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 4096  # vocabulary entries per iteration: 16 per thread at 8 warps
_NUM_WARPS = 8


def unsupported_reason(student: Tensor, teacher: Tensor | None) -> str | None:
    """None if :func:`fused_kd` takes these (N, V) logits, else why not (the caller uses the torch path)."""
    reason = triton_runs_on(student.device)
    if reason is not None:
        return reason
    for name, x in (("student", student), ("teacher", teacher)):
        if x is None:
            continue
        if x.dtype not in _FLOAT:
            return f"{name} logits are {x.dtype} (the kernel takes float32, bfloat16, float16)"
        if x.dim() != 2 or x.stride(1) != 1:
            return f"{name} logits are not (rows, vocab) with a contiguous vocabulary"
    if student.numel() == 0:
        return "no rows"
    return None


if triton is not None:

    @triton.jit
    def _kd_kernel(
        s_ptr, t_ptr, y_ptr, g_ptr, kl_ptr, ce_ptr, inv_n_ptr,
        V, s_stride, t_stride, g_stride, y_stride, ignore_index,
        eta, temperature, inv_t,
        HAS_T: tl.constexpr, UNIT_T: tl.constexpr, NEED_GRAD: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        y = tl.load(y_ptr + row * y_stride)  # the labels' own stride: a view of them is read in place
        valid = y != ignore_index
        y = tl.where(valid, y, 0)  # an ignored row's label is never read
        s_row = s_ptr + row * s_stride
        t_row = t_ptr + row * t_stride
        neg_inf = float("-inf")

        # pass 1: online max / Σ exp of z_s/T, z_t/T, and of z_s itself when T != 1 (the CE is at T = 1)
        m_s = tl.full((), neg_inf, tl.float32)
        d_s = tl.zeros((), tl.float32)
        m_t = tl.full((), neg_inf, tl.float32)
        d_t = tl.zeros((), tl.float32)
        m_1 = tl.full((), neg_inf, tl.float32)
        d_1 = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            inb = offs < V
            s = tl.load(s_row + offs, mask=inb, other=0.0).to(tl.float32)
            zs = tl.where(inb, s * inv_t, neg_inf)
            m_new = tl.maximum(m_s, tl.max(zs, 0))
            d_s = d_s * tl.exp(m_s - m_new) + tl.sum(tl.exp(zs - m_new), 0)
            m_s = m_new
            if HAS_T:
                t = tl.load(t_row + offs, mask=inb, other=0.0).to(tl.float32)
                zt = tl.where(inb, t * inv_t, neg_inf)
                m_new = tl.maximum(m_t, tl.max(zt, 0))
                d_t = d_t * tl.exp(m_t - m_new) + tl.sum(tl.exp(zt - m_new), 0)
                m_t = m_new
            if not UNIT_T:
                z1 = tl.where(inb, s, neg_inf)
                m_new = tl.maximum(m_1, tl.max(z1, 0))
                d_1 = d_1 * tl.exp(m_1 - m_new) + tl.sum(tl.exp(z1 - m_new), 0)
                m_1 = m_new
        lse_s = m_s + tl.log(d_s)
        lse_t = lse_s  # (read only with a teacher)
        if HAS_T:
            lse_t = m_t + tl.log(d_t)
        lse_1 = lse_s
        if not UNIT_T:
            lse_1 = m_1 + tl.log(d_1)
        ce = lse_1 - tl.load(s_row + y).to(tl.float32)

        # pass 2: the KL terms and the gradient row, scaled by 1/n (n, the rows that count, is on the device)
        grad_scale = tl.load(inv_n_ptr)
        kl = tl.zeros((BLOCK,), tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            inb = offs < V
            s = tl.load(s_row + offs, mask=inb, other=0.0).to(tl.float32)
            ls = s * inv_t - lse_s  # log P_s^T
            ps = tl.exp(ls)
            if HAS_T:
                t = tl.load(t_row + offs, mask=inb, other=0.0).to(tl.float32)
                lt = t * inv_t - lse_t  # log P_t^T
                pt = tl.exp(lt)
                kl += tl.where(inb, pt * (lt - ls), 0.0)
            if NEED_GRAD:
                if HAS_T:
                    if UNIT_T:
                        gr = ps - eta * pt
                    else:
                        gr = (eta * temperature) * (ps - pt) + (1.0 - eta) * tl.exp(s - lse_1)
                elif UNIT_T:
                    gr = ps
                else:
                    gr = tl.exp(s - lse_1)
                gr = tl.where(offs == y, gr - (1.0 - eta), gr)
                gr = tl.where(valid, gr * grad_scale, 0.0)
                tl.store(g_ptr + row * g_stride + offs, gr.to(g_ptr.dtype.element_ty), mask=inb)
        kl_row = tl.sum(kl, 0) * (temperature * temperature)
        tl.store(kl_ptr + row, tl.where(valid, kl_row, 0.0))
        tl.store(ce_ptr + row, tl.where(valid, ce, 0.0))


def fused_kd(student: Tensor, teacher: Tensor | None, labels: Tensor, *, ignore_index: int, inv_n: Tensor,
             eta: float, temperature: float, need_grad: bool, chunk_size: int | None = None
             ) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(Σ_rows KL·T², Σ_rows CE, ∂(η·KL·T² + (1−η)·CE)/∂z_s · inv_n)`` over (N, V) logits in one kernel.

    ``labels`` (N,) are valid (in ``[0, V)``) or ``ignore_index``; ``inv_n`` is 1 / (the number of valid
    ones), a float32 scalar on the logits' device (read there: no host synchronisation). Sums are float32
    scalars on the logits' device; the gradient has the student logits' shape and dtype (None unless
    ``need_grad``). ``teacher`` may be None only with ``eta == 0``. ``chunk_size`` is the torch path's and
    plays no role here.
    """
    reason = unsupported_reason(student, teacher)
    if reason is not None:
        raise RuntimeError(f"fused KD kernel cannot run: {reason}")
    rows, vocab = student.shape
    has_t = teacher is not None
    t = teacher if has_t else student  # a placeholder pointer, never read
    labels = labels if labels.dtype == torch.int64 else labels.long()
    grad = torch.empty_like(student, memory_format=torch.contiguous_format) if need_grad else student
    kl = torch.empty(rows, dtype=torch.float32, device=student.device)
    ce = torch.empty(rows, dtype=torch.float32, device=student.device)
    inv_n = inv_n.to(device=student.device, dtype=torch.float32)
    temperature = float(temperature)
    with _on(student.device):
        _kd_kernel[(rows,)](
            student, t, labels, grad, kl, ce, inv_n,
            vocab, student.stride(0), t.stride(0), grad.stride(0), labels.stride(0), ignore_index,
            float(eta), temperature, 1.0 / temperature,
            HAS_T=has_t, UNIT_T=temperature == 1.0, NEED_GRAD=need_grad, BLOCK=_BLOCK, num_warps=_NUM_WARPS,
            enable_fp_fusion=FP_FUSION,
        )  # fmt: skip
    return kl.sum(), ce.sum(), grad if need_grad else None


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it ``device`` when it is not (multi-GPU processes)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
