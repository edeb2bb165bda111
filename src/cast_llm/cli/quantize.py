"""``cast-llm quantize``: sparsity-preserving AWQ / RTN weight quantization (method.md §7).

Group-wise asymmetric integer quantization (integer zero-points, fp16 scales) of every linear in the
decoder blocks, at 4 or 3 bits, group 128 (64 for GPT-2); AWQ first searches per-input-channel scales on
calibration text (``--data``) block by block and folds them exactly into the preceding norm / linear.
Every weight that was zero stays exactly zero (checked before anything is written).

Writes ``--output-dir``: the packed integer checkpoint (``quantized.safetensors`` + ``quant_index.json``,
loadable with :func:`cast_llm.quant.pack.load_quantized`) and ``fake-quant/``, a plain Hugging Face
checkpoint of the dequantized weights for evaluation with any tool. The settings:
:class:`cast_llm.quant.config.QuantizeConfig`; the job: :func:`cast_llm.jobs.quantize.quantize_job`.
"""

from __future__ import annotations

import argparse

from cast_llm.cli.options import add_config_command, resolve_options, summary
from cast_llm.quant.config import METHODS, SECTIONS, QuantizeConfig

__all__ = ["METHODS", "register", "run"]


def register(subparsers) -> None:
    add_config_command(subparsers, "quantize", QuantizeConfig, func=run, sections=SECTIONS,
                       model="the model to quantize: HF folder, hub id or alias",
                       help="sparsity-preserving AWQ / RTN quantization (4/3-bit)", description=summary(__doc__))


def run(args: argparse.Namespace) -> int:
    cfg = resolve_options(QuantizeConfig, args)
    from cast_llm.jobs.quantize import quantize_job  # here, not above: `cast-llm --help` imports no torch

    quantize_job(cfg)
    return 0
