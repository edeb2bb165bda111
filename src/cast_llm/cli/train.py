"""``cast-llm train``: CAST (and baseline) training on any Hugging Face causal LM."""

from __future__ import annotations

import argparse

from cast_llm.config import add_arguments, cli_layer, load_yaml, resolve, run_config_layer


def build_config(args: argparse.Namespace):
    """defaults < (with --resume: the run's config.yaml) < --preset < --config YAML < flags typed."""
    from cast_llm.errors import CastError
    from cast_llm.train.config import PRESETS, TrainConfig

    cli = cli_layer(args, TrainConfig)
    layers = run_config_layer(cli)
    if args.preset:
        if args.preset not in PRESETS:
            raise CastError(f"unknown --preset '{args.preset}' (choose from {', '.join(PRESETS)})")
        layers.append((f"preset {args.preset}", PRESETS[args.preset]))
    if args.config:
        layers.append((args.config, load_yaml(args.config)))
    # a budget typed on the command line replaces the preset's/file's budget of the other kind
    if "tokens" in cli or "max_steps" in cli:
        layers = [(src, {k: v for k, v in d.items() if k.replace("-", "_") not in ("tokens", "max_steps")})
                  for src, d in layers]
    layers.append(("command line", cli))
    return resolve(TrainConfig, *layers)


def run(args: argparse.Namespace) -> int:
    from cast_llm.train.trainer import train

    train(build_config(args))
    return 0


def register(sub) -> None:
    from cast_llm.train.config import PRESETS, TrainConfig

    p = sub.add_parser(
        "train",
        help="sparsity-aware training to an N:M model (CAST)",
        description="Train a dense causal LM into an N:M (default 2:4) sparse model with CAST: AdamS, "
        "learnable weight scaling and distillation from the dense model. Multi-GPU: "
        "`accelerate launch [--multi_gpu] -m cast_llm.cli train ...` or `accelerate launch $(which cast-llm) train ...`.",
    )
    p.add_argument("--preset", default=None, help=f"paper / CPU hyperparameters: {', '.join(PRESETS)}")
    p.add_argument("--config", default=None, help="YAML file of options (keys as in config.yaml of a run)")
    add_arguments(p, TrainConfig)
    p.set_defaults(func=run)
