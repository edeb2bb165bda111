"""``cast-llm finetune MODEL --mode lora|sparse|dense --task causal-lm|classification``."""

from __future__ import annotations

import argparse

from cast_llm.config import add_arguments, cli_layer, load_yaml, resolve, run_config_layer


def build_config(args: argparse.Namespace):
    """defaults < (with --resume: the run's config.yaml) < --config YAML < flags (and MODEL) typed."""
    from cast_llm.finetune.config import FinetuneConfig

    cli = cli_layer(args, FinetuneConfig)
    layers = run_config_layer(cli)
    if args.config:
        layers.append((args.config, load_yaml(args.config)))
    layers.append(("command line", cli))
    return resolve(FinetuneConfig, *layers)


def run(args: argparse.Namespace) -> int:
    from cast_llm.finetune.job import finetune

    finetune(build_config(args))
    return 0


def register(sub) -> None:
    from cast_llm.finetune.config import FinetuneConfig

    p = sub.add_parser(
        "finetune",
        help="fine-tune an N:M model and keep it N:M (LoRA with a sparse merge, sparse or dense full FT)",
        description="Fine-tune a (sparse) causal LM on a downstream task. --mode lora trains LoRA adapters and "
        "merges them as W + M*(BA), so the model stays exactly N:M; --mode sparse trains every weight while "
        "pruned weights stay exactly 0; --mode dense is ordinary fine-tuning (the model becomes dense). "
        "Multi-GPU: `accelerate launch -m cast_llm.cli finetune ...`.",
    )
    p.add_argument("model", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                   help="the model to fine-tune: an HF folder (e.g. a cast-llm train/prune output), a hub id, "
                   "a .gguf file or the alias smollm2-135m")
    p.add_argument("--config", default=None, help="YAML file of options (keys as in config.yaml of a run)")
    add_arguments(p, FinetuneConfig, skip=("model",))
    p.set_defaults(func=run)
