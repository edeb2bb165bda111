"""``cast-llm finetune MODEL --mode lora|sparse|dense --task causal-lm|classification``."""

from __future__ import annotations

import argparse

from cast_llm.cli.options import add_config_command, resolve_options


def build_config(args: argparse.Namespace):
    """defaults < (with --resume: the run's config.yaml) < --config YAML < flags (and MODEL) typed."""
    from cast_llm.finetune.config import FinetuneConfig

    return resolve_options(FinetuneConfig, args, run_folder=True)


def run(args: argparse.Namespace) -> int:
    from cast_llm.finetune.job import finetune
    from cast_llm.train.rundir import say_if_finished

    if say_if_finished(args):  # --resume on a finished run: nothing to do, nothing touched
        return 0
    finetune(build_config(args))
    return 0


def register(sub) -> None:
    from cast_llm.finetune.config import SECTIONS, FinetuneConfig

    add_config_command(
        sub, "finetune", FinetuneConfig, func=run, config_file=True, optional_model=True, sections=SECTIONS,
        model="the model to fine-tune: an HF folder (e.g. a cast-llm train/prune output), a hub id, a .gguf file "
        "or the alias smollm2-135m",
        help="fine-tune an N:M model and keep it N:M (LoRA with a sparse merge, sparse or dense full FT)",
        description="Fine-tune a (sparse) causal LM on a downstream task. --mode lora trains LoRA adapters and "
        "merges them as W + M*(BA), so the model stays exactly N:M; --mode sparse trains every weight while "
        "pruned weights stay exactly 0; --mode dense is ordinary fine-tuning (the model becomes dense). "
        "Multi-GPU: `accelerate launch -m cast_llm.cli finetune ...`.",
    )
