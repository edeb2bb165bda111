"""AWQ's lifecycle: block-by-block calibration through the decoder (method.md §7; math in :mod:`.awq`).

For each decoder block in order:

1. run the calibration inputs of the block through it once, with hooks on the first consumer of every
   scale group recording ``mean |x|`` per input channel over all tokens and a seeded random subset of at
   most ``search_tokens`` input rows for the error search; the block outputs become the next block's inputs
   (computed from the float block, as in the reference AWQ: scaling does not change the function);
2. search and fold the scale of every group (:func:`~cast_llm.quant.awq.search_scale`,
   :func:`~cast_llm.quant.awq.fold_scale_`);
3. check that folding preserved the block's function on one calibration batch (a wrong fold for an
   unsupported variant fails loudly here instead of silently degrading the model);
4. quantize every target of the block (mask-aware RTN on the scaled weights).

Memory: one block's calibration activations plus the search subsets; the block inputs are captured with
:func:`cast_llm.prune.blockwise.capture_block_inputs` (all calibration samples' hidden states).
"""

from __future__ import annotations

import logging

import torch

from cast_llm.errors import CastError
from cast_llm.prune.blockwise import (
    block_walk,
    capture_block_inputs,
    decoder_blocks,
    run_block,
    targets_by_block,
)
from cast_llm.quant.awq import (
    SUPPORTED_MODEL_TYPES,
    ScaleGroup,
    fold_scale_,
    oriented,
    scale_groups,
    search_scale,
)
from cast_llm.quant.rtn import QuantizedWeight, rtn_quantize_

logger = logging.getLogger(__name__)


class _InputRecorder:
    """Forward hook: running sum of |x| per channel and a random subset of input rows."""

    def __init__(self, per_batch: int, generator: torch.Generator):
        self.abs_sum: torch.Tensor | None = None
        self.tokens = 0
        self.rows: list[torch.Tensor] = []
        self.per_batch, self.generator = per_batch, generator

    def __call__(self, module, args, output):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # (..., C) -> (tokens, C)
        s = x.abs().sum(0)
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        self.tokens += x.shape[0]
        take = torch.randperm(x.shape[0], generator=self.generator)[: self.per_batch]
        self.rows.append(x[take.to(x.device)])

    def mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


@torch.no_grad()
def awq_quantize_(model, targets, calib_ids: torch.Tensor, *, bits: int, group_size: int, grid: int = 20,
                  search_tokens: int = 4096, batch_size: int = 1, seed: int = 0, progress: bool = False
                  ) -> tuple[dict[str, QuantizedWeight], list[dict]]:
    """AWQ-quantize ``targets`` of ``model`` in place (fake-quant weights; scales folded into producers).

    Returns ``(quantized weights by fqn, one report row per scale group: block, group, alpha, error ratio)``.
    """
    model_type = getattr(model.config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        logger.warning("AWQ scale folding is not defined for model type %r (supported: %s): plain RTN is "
                       "used for every layer", model_type, ", ".join(SUPPORTED_MODEL_TYPES))
    if calib_ids.ndim != 2 or calib_ids.shape[0] == 0:
        raise CastError(f"AWQ needs calibration ids of shape (samples, seq_len), got {tuple(calib_ids.shape)}")
    prefix, blocks = decoder_blocks(model, [t.fqn for t in targets])
    device = next(model.parameters()).device
    by_block = targets_by_block(prefix, targets)
    quantized: dict[str, QuantizedWeight] = {}
    report: list[dict] = []
    with block_walk(model, blocks, desc=f"awq w{bits}", progress=progress) as tick:
        inputs = capture_block_inputs(model, blocks, calib_ids, batch_size=batch_size, device=device)
        per_batch = max(1, -(-search_tokens // len(inputs)))  # ceil: rows kept per calibration batch
        gen = torch.Generator().manual_seed(seed)
        for index, block in enumerate(blocks):
            groups = scale_groups(block, model_type) if model_type in SUPPORTED_MODEL_TYPES else []
            recorders = [_InputRecorder(per_batch, gen) for _ in groups]
            handles = [g.consumers[0][1].register_forward_hook(r) for g, r in zip(groups, recorders)]
            try:
                outputs = [run_block(block, inp) for inp in inputs]
            finally:
                for h in handles:
                    h.remove()
            for g, r in zip(groups, recorders):
                _search_and_fold(g, r, bits=bits, group_size=group_size, grid=grid)
                report.append({"block": index, "group": g.name, "alpha": g.alpha, "error_ratio": g.error_ratio})
            del recorders
            if groups:
                _check_function_preserved(block, inputs[0], outputs[0], index)
            quantized.update(rtn_quantize_(by_block.get(index, []), bits=bits, group_size=group_size))
            inputs = [type(inp)(out, inp.args, inp.kwargs) for inp, out in zip(inputs, outputs)]
            tick()
    return quantized, report


def _search_and_fold(group: ScaleGroup, rec: _InputRecorder, *, bits: int, group_size: int, grid: int) -> None:
    weights = [oriented(c) for _, c in group.consumers]
    s, alpha, errors = search_scale(rec.sample(), rec.mean(), weights, bits=bits, group_size=group_size, grid=grid)
    group.alpha, group.errors = alpha, errors
    group.error_ratio = min(errors) / errors[0] if errors[0] > 0 else 1.0
    fold_scale_(group, s)


def _check_function_preserved(block, inp, expected: torch.Tensor, index: int) -> None:
    got = run_block(block, inp)
    tol = 1e-3 if expected.dtype == torch.float32 else 3e-2  # fold rounding only; a wrong fold is O(1)
    rel = float((got.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-12))
    if not rel < tol:
        raise RuntimeError(f"AWQ scale folding changed the output of block {index} (relative error {rel:.2e}); "
                           "this architecture variant is not supported — use --method rtn")
