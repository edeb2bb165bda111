"""Eq. 13 through the LM head, a chunk of tokens at a time: the (tokens × vocabulary) logits never exist.

:mod:`cast_llm.distill` bounds the loss's *work* space to a chunk of tokens, but it takes the logits of
student and teacher whole, and a logits-sized gradient comes out of it: three ``N × V`` tensors, 25 GiB in
bf16 for 32k tokens of LLaMA-3's 128k vocabulary, more than the model's weights on a GPU of an 8-GPU run.
Here the model returns the LM head's *input* (hidden states ``N × h``: :func:`head_inputs`), and
:func:`fused_head_loss` forms the logits of one chunk of tokens for student and teacher, computes Eq. 13 and
its gradient on them with :func:`cast_llm.distill.kd_loss`, and turns that gradient at once into the
gradients of the hidden states (``N × h``) and of the head's weight (``V × h``, summed in fp32 across the
chunks, in place: no ``V × h`` temporary per chunk), which it keeps for backward. Memory: one chunk of
logits of each kind instead of all of them, plus the head's gradient, which the backward of an ordinary head
allocates anyway (measured at a 128k vocabulary: docs/results/fused-head-memory.md). FLOPs: the same matmuls
as the ordinary head. Nothing is read on the host (no synchronisation per chunk).

The loss is the token-mean of Eq. 13 as :func:`cast_llm.distill.causal_kd_loss` computes it (the chunks
are weighted by their valid tokens); it equals that function on full logits up to float summation order.
Chunking along the vocabulary is not needed for memory: in fp32 a chunk holds 5 ``chunk × V`` rows with KD on
the eager path (student and teacher logits, the logits' gradient, 2 of the loss's work space; 4 on the compiled
chunk) and 3 with CE alone (measured warm: ``benchmarks/dev/fused_head_rows.py``; 2.4 GiB at 1024 × 128k with KD;
``--kd-chunk-size`` lowers it), whatever the number of tokens.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from cast_llm.distill import KDLoss, kd_loss, shift_labels
from cast_llm.errors import CastError

__all__ = ["fused_head_loss", "head_inputs", "check_fusable"]

# config attributes of architectures that change the logits after the LM head (soft-capping, scaling): the
# fused loss would skip that step, so such models are refused
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _raw(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP's wrapper holds the model in .module


def check_fusable(model: nn.Module) -> nn.Linear:
    """The model's LM head, if the fused loss computes exactly what its forward would; else a CastError."""
    raw = _raw(model)
    head = raw.get_output_embeddings() if hasattr(raw, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise CastError(f"--fused-head needs an LM head that is a bias-free nn.Linear; {type(raw).__name__} has "
                        f"{type(head).__name__}")
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(raw.config, attr, None)
        if value not in (None, 1, 1.0):
            raise CastError(f"--fused-head: {type(raw).__name__} transforms its logits after the head "
                            f"({attr}={value}); train it without --fused-head")
    return head


def _identity(x):
    return x


@contextlib.contextmanager
def head_inputs(*models: nn.Module | None):
    """Inside, each model's forward returns its LM head's input (the final hidden states) as ``.logits``:
    the head's ``forward`` is the identity (module, parameters and state dict stay as they are)."""
    heads = [check_fusable(m) for m in models if m is not None]
    for h in heads:
        h.forward = _identity
    try:
        yield
    finally:
        for h in heads:
            h.__dict__.pop("forward", None)


class _FusedHead(torch.autograd.Function):
    """Eq. 13 of ``hidden @ weightᵀ`` chunk by chunk; both gradients formed in the forward.

    Nothing is read on the host: the count of valid labels and each chunk's share of it stay on the device (a
    chunk with no valid label is computed and weighs 0). The weight's gradient is summed in float32 (float64
    for float64 references) without a ``V × h`` temporary: each chunk adds ``gᵀ h`` into the accumulator in
    place (:func:`_add_outer_`)."""

    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, labels, eta, temperature, chunk, ignore_index, dtype):
        # hidden: (N, h) student's head input; weight: (V, h); t_*: the teacher's (or None); labels: (N,)
        device = hidden.device
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32  # float64 for references
        valid = labels != ignore_index
        n = valid.sum().clamp_min(1).to(acc)  # on the device: every chunk is weighted by valid_c / n there
        zero = torch.zeros((), dtype=acc, device=device)
        loss, kd, ce = zero.clone(), zero.clone(), zero.clone()
        need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        with torch.autocast(device.type, enabled=False):  # the dtypes below are chosen, not autocast's
            w = weight.to(dtype)  # the matmul copy, once (the ordinary head's autocast cast)
            tw = None if t_weight is None else t_weight.to(dtype if t_weight.dtype == torch.float32 else t_weight.dtype)
            for lo in range(0, hidden.shape[0], chunk):
                y = labels[lo:lo + chunk]
                share = valid[lo:lo + chunk].sum().to(acc) / n  # this chunk's weight in the token mean
                h = hidden[lo:lo + chunk].to(dtype)
                logits = (h @ w.t()).requires_grad_(need)  # (c, V)
                t_logits = None
                if tw is not None:
                    t_logits = t_hidden[lo:lo + chunk].to(tw.dtype) @ tw.t()
                with torch.enable_grad():
                    out: KDLoss = kd_loss(logits, t_logits, y, eta=eta, temperature=temperature, chunk_size=None,
                                          ignore_index=ignore_index)
                    part = out.loss * share.to(out.loss.dtype)
                    if need:
                        part.backward()
                loss += part.detach().to(acc)
                kd += out.kd.to(acc) * share
                ce += out.ce.to(acc) * share
                if need:
                    g = logits.grad  # (c, V), the logits' dtype
                    if grad_h is not None:
                        grad_h[lo:lo + chunk] = g @ w
                    if grad_w is not None:
                        _add_outer_(grad_w, g, h)
                # every chunk-sized tensor of this chunk let go before the next chunk forms its logits (its gradient
                # ``g`` and the loss's outputs too: kept until their names were rebound, they held two more chunk × V
                # tensors through the next chunk, measured 5 of them at 4 chunks where the plan counts 3)
                del logits, t_logits, out, part
                if need:
                    del g
        ctx.grads = (grad_h, grad_w if grad_w is None else grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(kd, ce)
        return loss, kd, ce

    @staticmethod
    def backward(ctx, grad_loss, _kd, _ce):
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss.to(grad_w.dtype))
        return grad_h, grad_w, None, None, None, None, None, None, None, None


_OUT_DTYPE_ADDMM = [True]  # torch.addmm(..., out_dtype=float32): CUDA only (torch 2.9+); tried once


def _add_outer_(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``acc (V, h) += gᵀ h`` summed in ``acc``'s dtype, in place, without a ``(V, h)`` temporary: on CUDA the
    low-precision product accumulates in float32 inside the GEMM (``addmm(..., out_dtype=float32)``);
    elsewhere the chunk's ``g`` (c × V) and ``h`` (c × h) are widened first — chunk-sized, as the loss's own
    work space — and the product is float32 throughout."""
    if g.dtype == acc.dtype and h.dtype == acc.dtype:
        acc.addmm_(g.t(), h)
        return
    if acc.is_cuda and _OUT_DTYPE_ADDMM[0]:
        try:
            torch.addmm(acc, g.t(), h, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError):  # this torch or GPU has no such GEMM: widen the chunk instead
            _OUT_DTYPE_ADDMM[0] = False
    acc.addmm_(g.t().to(acc.dtype), h.to(acc.dtype))


def fused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, t_hidden: torch.Tensor | None,
                    t_weight: torch.Tensor | None, input_ids: torch.Tensor, *, eta: float, temperature: float = 1.0,
                    chunk_size: int = 1024, ignore_index: int = -100) -> KDLoss:
    """:func:`cast_llm.distill.causal_kd_loss` of ``hidden @ weightᵀ`` (student) and ``t_hidden @ t_weightᵀ``
    (teacher; None with ``eta == 0``) without forming either whole.

    ``hidden``: ``(B, T, h)``, the student's LM-head input; ``weight``: the head's ``(V, h)`` weight (tied
    or not: its gradient is accumulated as usual); ``input_ids``: ``(B, T)``, the labels in the HF
    convention (shifted here). The logits are formed in the autocast dtype when autocast is on (as the
    ordinary head computes them), else in the weight's dtype; the teacher's in its own dtype.
    """
    if t_hidden is None and eta != 0:
        raise ValueError(f"t_hidden is None but eta={eta}; without a teacher only eta=0 (pure CE) works")
    labels = shift_labels(input_ids, ignore_index).reshape(-1)
    h = hidden.reshape(-1, hidden.shape[-1])
    th = None if t_hidden is None else t_hidden.detach().reshape(-1, t_hidden.shape[-1])
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    tw = None if t_weight is None else t_weight.detach()
    loss, kd, ce = _FusedHead.apply(h, weight, th, tw, labels, float(eta), float(temperature), int(chunk_size),
                                    ignore_index, dtype)
    return KDLoss(loss, kd, ce)
