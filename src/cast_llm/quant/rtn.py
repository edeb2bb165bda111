"""Group-wise asymmetric integer quantization, round-to-nearest, that keeps every zero exactly zero
(method.md §7: "zeros must stay exactly zero").

Pure tensor math on a weight ``W`` of shape ``(R, C)`` (``nn.Linear`` layout; groups run along the input
dim, like the N:M groups). Each row is cut into ``ceil(C / g)`` groups of ``g`` columns (the last one
shorter when ``g`` does not divide ``C`` — SmolLM2's 576 = 4 × 128 + 64). Per group, with ``b`` bits and
``qmax = 2^b − 1``::

    lo = min(0, min kept w)     hi = max(0, max kept w)        (only the entries the mask keeps)
    s  = fp16((hi − lo) / qmax)                                 (stored fp16, like AWQ)
    z  = clamp(round(−lo / s), 0, qmax)                         (an integer zero-point)
    q  = clamp(round(w / s) + z, 0, qmax)    for kept entries;  q = z  for pruned entries
    ŵ  = (q − z) · s                                           (computed in fp32)

Why zeros survive *exactly*: ``z`` is an integer code, so a pruned entry's code ``z`` dequantizes to
``(z − z) · s = +0.0`` — whatever the range. Including 0 in ``[lo, hi]`` additionally puts ``z`` inside
``[0, qmax]`` without clipping, so 0 is a grid point and kept values are never clipped. The range comes
from the *kept* entries only (mask-aware): the pruned zeros of a 2:4 group must not widen it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP16_TINY = 2.0**-14  # smallest normal fp16: scales are stored fp16 and must not flush to zero
FP16_MAX = 65504.0


def num_groups(cols: int, group_size: int) -> int:
    return math.ceil(cols / group_size)


def _check(bits: int, group_size: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")


def _grouped(x: torch.Tensor, group_size: int, pad_value) -> torch.Tensor:
    """(R, C) -> (R, G, g), padding the last group with ``pad_value``."""
    rows, cols = x.shape
    groups = num_groups(cols, group_size)
    if groups * group_size != cols:
        pad = torch.full((rows, groups * group_size - cols), pad_value, dtype=x.dtype, device=x.device)
        x = torch.cat([x, pad], dim=1)
    return x.view(rows, groups, group_size)


def _per_column(x: torch.Tensor, group_size: int, cols: int) -> torch.Tensor:
    """(R, G) per-group values -> (R, C) per-column values."""
    return x.repeat_interleave(group_size, dim=1)[:, :cols]


def quant_params(weight: torch.Tensor, bits: int, group_size: int, mask: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(scale fp16 (R, G), zero uint8 (R, G))`` of ``weight`` (R, C) from its kept entries."""
    _check(bits, group_size)
    qmax = (1 << bits) - 1
    w = weight.float()
    keep = torch.ones_like(w, dtype=torch.bool) if mask is None else mask
    wg = _grouped(w, group_size, 0.0)  # (R, G, g)
    kg = _grouped(keep, group_size, False)
    lo = torch.where(kg, wg, torch.inf).amin(-1).clamp(max=0.0)  # a group with nothing kept -> lo = hi = 0
    hi = torch.where(kg, wg, -torch.inf).amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / qmax).clamp(FP16_TINY, FP16_MAX).to(torch.float16)
    zero = torch.round(-lo / scale.float()).clamp(0, qmax).to(torch.uint8)
    return scale, zero


def quantize_codes(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Integer codes (uint8, (R, C)) of ``weight`` on the given grid; pruned entries get their zero-point."""
    qmax = (1 << bits) - 1
    cols = weight.shape[1]
    s = _per_column(scale.float(), group_size, cols)
    z = _per_column(zero.float(), group_size, cols)
    q = torch.clamp(torch.round(weight.float() / s) + z, 0, qmax)
    if mask is not None:
        q = torch.where(mask, q, z)
    return q.to(torch.uint8)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q − z) · s`` in fp32, then cast once to ``dtype``: the one definition every loader uses."""
    cols = codes.shape[1]
    s = _per_column(scale.float(), group_size, cols)
    z = _per_column(zero.float(), group_size, cols)
    return ((codes.float() - z) * s).to(dtype)


@dataclass
class QuantizedWeight:
    """One group-wise quantized weight (R, C): integer codes, fp16 scales, integer zero-points."""

    codes: torch.Tensor  # (R, C) uint8, values in [0, 2^bits)
    scale: torch.Tensor  # (R, G) float16
    zero: torch.Tensor  # (R, G) uint8
    bits: int
    group_size: int

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int = 4, group_size: int = 128,
                   mask: torch.Tensor | None = None) -> QuantizedWeight:
        """Quantize ``weight`` (R, C). ``mask`` (bool, True = kept) defaults to ``weight != 0``, so every
        zero of a sparse weight stays exactly zero and the quantization range ignores them."""
        if weight.dim() != 2:
            raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
        mask = weight != 0 if mask is None else mask
        scale, zero = quant_params(weight, bits, group_size, mask)
        codes = quantize_codes(weight, scale, zero, bits, group_size, mask)
        return cls(codes, scale, zero, bits, group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_codes(self.codes, self.scale, self.zero, self.group_size, dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)


def fake_quantize(weight: torch.Tensor, bits: int, group_size: int, mask: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``dequantize(quantize(weight))`` in fp32 (the AWQ scale search calls this on every grid point)."""
    return QuantizedWeight.from_float(weight, bits, group_size, mask).dequantize(torch.float32)


@torch.no_grad()
def rtn_quantize_(targets, *, bits: int, group_size: int) -> dict[str, QuantizedWeight]:
    """Round-to-nearest: quantize every target weight in place (fake-quant values, same dtype).

    ``targets`` are :class:`cast_llm.targets.Target` objects; GPT-2 ``Conv1D`` weights are quantized in
    ``(out, in)`` orientation so that the groups run along the input dim. Returns the quantized weights by fqn.
    """
    out = {}
    for t in targets:
        w = t.weight.t() if t.transposed else t.weight  # (out, in)
        qw = QuantizedWeight.from_float(w.float(), bits, group_size)
        deq = qw.dequantize(t.weight.dtype)
        t.weight.copy_(deq.t() if t.transposed else deq)
        out[t.fqn] = qw
    return out
