"""Quantizing a model's N:M targets in place (RTN or AWQ) and checking that every zero stays exactly zero.

:func:`quantize_model_` is the entry point (re-exported as :func:`cast_llm.quant.quantize_model_`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cast_llm.errors import CastError
from cast_llm.quant.calibration import awq_quantize_
from cast_llm.quant.rtn import QuantizedWeight, rtn_quantize_
from cast_llm.sparsity.mask import pack_mask, unpack_mask
from cast_llm.targets import find_targets

METHODS = ("rtn", "awq")  # the order of cast_llm.quant.config.METHODS is --help's (a test keeps the sets equal)


def default_group_size(model) -> int:
    """128, or 64 for GPT-2 widths (method.md §7)."""
    return 64 if getattr(model.config, "model_type", "") == "gpt2" else 128


@dataclass
class QuantResult:
    method: str
    bits: int
    group_size: int
    weights: dict[str, QuantizedWeight]  # by target fqn, (out, in) orientation
    transposed: dict[str, bool]
    awq_report: list[dict] = field(default_factory=list)
    zeros_checked: int = 0  # weights that were zero before and were verified exactly zero after


def _zero_bitmaps(targets) -> dict[str, torch.Tensor]:
    """1 bit per weight: where each target is zero now (kept packed: 1/32 of an fp32 model)."""
    return {t.fqn: pack_mask(t.weight.detach() == 0) for t in targets}


def verify_zeros(targets, bitmaps: dict[str, torch.Tensor]) -> int:
    """Raise CastError unless every entry zero in ``bitmaps`` is exactly zero in the targets now."""
    checked = 0
    for t in targets:
        was_zero = unpack_mask(bitmaps[t.fqn], t.weight.shape)
        moved = int((t.weight.detach()[was_zero] != 0).sum())
        if moved:
            raise CastError(f"quantization broke sparsity: {moved} weight(s) of {t.fqn} that were zero are not "
                            "zero any more; nothing was written")
        checked += int(was_zero.sum())
    return checked


def quantize_model_(model, *, method: str, bits: int, group_size: int | None = None,
                    calib_ids: torch.Tensor | None = None, n: int = 2, m: int = 4, grid: int = 20,
                    search_tokens: int = 4096, batch_size: int = 1, seed: int = 0, progress: bool = False
                    ) -> QuantResult:
    """Quantize the targets of ``model`` in place to fake-quant values (method ``rtn`` or ``awq``).

    AWQ needs ``calib_ids`` (samples, seq_len) and also rescales the producers it folds into (norms,
    v_proj / up_proj rows). The model should be in fp32 (the search and the folding run in its dtype).
    """
    if method not in METHODS:
        raise CastError(f"unknown quantization method {method!r}; use one of {', '.join(METHODS)}")
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise CastError(f"--bits must be an integer from 2 to 8, got {bits!r}")
    group_size = group_size or default_group_size(model)
    if group_size < 1:
        raise CastError(f"--group-size must be positive, got {group_size}")
    targets = find_targets(model, n=n, m=m, skip_incompatible=True)
    bitmaps = _zero_bitmaps(targets)
    report: list[dict] = []
    if method == "rtn":
        weights = rtn_quantize_(targets, bits=bits, group_size=group_size)
    else:
        if calib_ids is None:
            raise CastError("AWQ needs calibration data: pass --data (and --calib-samples, --seq-len)")
        weights, report = awq_quantize_(model, targets, calib_ids, bits=bits, group_size=group_size, grid=grid,
                                        search_tokens=search_tokens, batch_size=batch_size, seed=seed,
                                        progress=progress)
    checked = verify_zeros(targets, bitmaps)
    return QuantResult(method, bits, group_size, weights, {t.fqn: t.transposed for t in targets}, report, checked)
