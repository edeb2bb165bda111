"""``cast-llm bench-inference``: dense vs 2:4 prefill / decode throughput and weight memory (method.md §7).

Runs both paths side by side in one process (:mod:`cast_llm.deploy.bench`): the 2:4 path is the model's
targets swapped to :mod:`cast_llm.deploy.sparse24` layers, each running a 2:4 kernel only for the token
counts where that measured faster than dense on this GPU. On a machine without a CUDA GPU of compute
capability ≥ 8.0 only the dense path is measured and the sparse path is reported as skipped, with the reason. ``MODEL`` may also be ``random:llama-2-7b`` / ``random:llama-2-13b``: a
randomly initialised model of that shape built directly on the device (speed does not depend on values).

The settings: :class:`cast_llm.deploy.config.BenchInferenceConfig`; the job: :func:`cast_llm.jobs.bench.bench_job`.
"""

from __future__ import annotations

import argparse

from cast_llm.cli.options import add_config_command, resolve_options, summary
from cast_llm.deploy.config import BENCH_SECTIONS, BenchInferenceConfig

__all__ = ["register", "run"]


def register(subparsers) -> None:
    add_config_command(subparsers, "bench-inference", BenchInferenceConfig, func=run, sections=BENCH_SECTIONS,
                       model="model folder, hub id, alias or random:llama-2-7b",
                       help="dense vs 2:4 inference speed and weight memory", description=summary(__doc__))


def run(args: argparse.Namespace) -> int:
    cfg = resolve_options(BenchInferenceConfig, args)
    from cast_llm.jobs.bench import bench_job  # here, not above: `cast-llm --help` imports no torch

    bench_job(cfg)
    return 0
