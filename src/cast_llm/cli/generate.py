"""``cast-llm generate``: text from a model folder on the CPU, through its 2:4 layers, with the tokens/s it ran at.

A ``--format compressed`` export loads straight into 2:4 layers (no dense copy of a target weight); a dense
Hugging Face folder or alias whose targets are exactly 2:4 is compressed into them at load. Each layer runs
the CPU 2:4 kernel or, where the dispatcher measured it faster on this CPU (long prompts), its dense weight
rebuilt into a shared scratch buffer (docs/deployment.md, "On the CPU"). ``--dense`` runs the same model
dense, for comparison. Generation is ``transformers``' ``generate`` with the KV cache, greedy or sampled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from cast_llm.cli.options import add_config_command, resolve_options, summary
from cast_llm.config import (
    JsonSettings,
    KernelSettings,
    ModelSettings,
    SeedSettings,
    ThreadSettings,
    dtype_option,
    option,
)
from cast_llm.errors import CastError

MODEL, TEXT, OUTPUT = "model", "text", "output"


@dataclass
class GenerateConfig(JsonSettings, SeedSettings, KernelSettings, ThreadSettings, ModelSettings):
    OPTION_TEXT = {"model": "model folder (cast-llm export, any format but compressed-tensors; a Hugging Face "
                            "folder) or alias (smollm2-135m: the embedded model)",
                   "seed": "seed of the sampling",
                   "json": "print one JSON object (text, tokens, timings) instead of text"}
    OPTION_SECTIONS = {"model": MODEL, "kernels": MODEL, "seed": TEXT, "json": OUTPUT, "threads": MODEL}

    prompt: str = option("", "the text to continue", section=TEXT)
    max_new_tokens: int = option(64, "tokens to generate", min=1, section=TEXT)
    sample: bool = option(False, "sample (with --temperature / --top-p) instead of greedy decoding", section=TEXT)
    temperature: float = option(1.0, "sampling temperature (with --sample)", min=0.0, min_exclusive=True,
                                section=TEXT)
    top_p: float = option(1.0, "nucleus sampling mass (with --sample)", min=0.0, max=1.0, min_exclusive=True,
                          section=TEXT)
    dense: bool = option(False, "run every layer dense (torch F.linear) instead of the 2:4 layers", section=MODEL)
    dtype: str = dtype_option("auto", "weights and activations dtype: auto (bf16; a compressed fp32 export stays "
                                      "fp32, an fp16 one loads as fp32), bf16 or fp32", choices=("auto", "bf16", "fp32"),
                              section=MODEL)

    def validate(self) -> None:
        if not self.prompt:
            raise CastError("--prompt is required: the text to continue")


def register(subparsers) -> None:
    add_config_command(subparsers, "generate", GenerateConfig, func=run,
                       help="generate text on the CPU through the 2:4 layers, with tokens/s",
                       description=summary(__doc__))


def run(args: argparse.Namespace) -> int:
    cfg = resolve_options(GenerateConfig, args)
    import torch

    from cast_llm import kernels
    from cast_llm.inference import generate, load_for_inference, plan
    from cast_llm.train.threads import setup_threads

    kernels.apply_flag(cfg.kernels)
    info = sys.stderr if cfg.json else sys.stdout
    # the cores less those other processes are using: two threads on a core shared with another job wait on
    # each other at every layer (measured here: 1.3 tokens/s instead of 21 with one thread)
    said = setup_threads(cfg)
    if said and "of" in said and torch.get_num_threads() < (os.cpu_count() or 1):
        print(said, file=info)
    dtype = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
    model, tokenizer, how = load_for_inference(cfg.model, sparse24=not cfg.dense, dtype=dtype)
    ids = tokenizer(cfg.prompt, return_tensors="pt").input_ids
    plan(model, ids.shape[-1])  # measured once per shape on this CPU, then read from the dispatch cache
    g = generate(model, tokenizer, ids, max_new_tokens=cfg.max_new_tokens, sample=cfg.sample,
                 temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
    param = next(p for p in model.parameters() if p.is_floating_point())
    stats = (f"{g.new_tokens} new tokens after {g.prompt_tokens}: prefill {g.prefill_s * 1e3:.0f} ms, decode "
             f"{g.decode_tokens_per_s:.1f} tokens/s ({str(param.dtype).removeprefix('torch.')}, "
             f"{torch.get_num_threads()} threads; {how})")
    if cfg.json:
        print(json.dumps({**g.to_dict(), "model": cfg.model, "how": how, "threads": torch.get_num_threads(),
                          "dtype": str(param.dtype).removeprefix("torch.")}))
        print(stats, file=info)
    else:
        print(cfg.prompt + g.text)
        print(f"-- {stats}", file=info)
    return 0
