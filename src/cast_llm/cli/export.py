"""``cast-llm export``: write a sparse model as hf, compressed or compressed-tensors (method.md §7).

* ``hf`` — standard safetensors with exact zeros and a ``sparsity`` config entry (what training writes);
* ``compressed`` — our compact N:M format (:mod:`cast_llm.deploy.compressed`): kept values + 2-bit
  positions, 0.5625 × dense for fp16 2:4 targets; loads back bit-identically, or to semi-structured
  sparse weights on a CUDA GPU;
* ``compressed-tensors`` — the legacy ``sparse-24-bitmask`` layout served by vLLM < 0.19.1 (current vLLM and
  transformers refuse it: one line says so when it is written).

Every folder gets a model card (``README.md``: :mod:`cast_llm.deploy.model_card`) from what the model's
origin recorded — never over a README.md cast-llm did not write.

Every format refuses a model that is not exactly N:M (naming the layers), and by default the written folder
is read back and compared with the model bit for bit. The settings: :class:`cast_llm.deploy.config.ExportConfig`;
the job: :func:`cast_llm.jobs.export.export_job`.
"""

from __future__ import annotations

import argparse

from cast_llm.cli.options import add_config_command, resolve_options, summary
from cast_llm.deploy.config import FORMATS, ExportConfig

__all__ = ["FORMATS", "register", "run"]


def register(subparsers) -> None:
    add_config_command(subparsers, "export", ExportConfig, func=run,
                       model="the sparse model: a local HF folder, a hub id or an alias",
                       help="write a sparse model as hf / compressed / compressed-tensors", description=summary(__doc__))


def run(args: argparse.Namespace) -> int:
    cfg = resolve_options(ExportConfig, args)
    from cast_llm.jobs.export import export_job  # here, not above: `cast-llm --help` imports no torch

    export_job(cfg)
    return 0
