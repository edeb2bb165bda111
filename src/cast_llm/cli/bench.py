"""``cast-llm bench-inference``: dense vs 2:4 prefill / decode throughput and weight memory (method.md §7).

Runs both paths side by side in one process (:mod:`cast_llm.deploy.bench`): the 2:4 path is the model's
targets swapped to :mod:`cast_llm.deploy.sparse24` layers, each running a 2:4 kernel only for the token
counts where that measured faster than dense on this GPU. On a machine without a CUDA GPU of compute
capability ≥ 8.0 only the dense path is measured and the sparse path is reported as skipped, with the reason. ``MODEL`` may also be ``random:llama-2-7b`` / ``random:llama-2-13b``: a
randomly initialised model of that shape built directly on the device (speed does not depend on values).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from cast_llm.cli.options import add_config_command, resolve_options, summary
from cast_llm.config import kernels_option, option
from cast_llm.errors import CastError

# LLaMA shapes (hidden, intermediate, layers, heads, key/value heads, vocabulary, tied head) for random-weight
# speed runs, from the models' published configs
RANDOM_SHAPES = {
    "llama-2-7b": (4096, 11008, 32, 32, 32, 32000, False),
    "llama-2-13b": (5120, 13824, 40, 40, 40, 32000, False),
    "tinyllama-1.1b": (2048, 5632, 22, 32, 4, 32000, False),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, True),
}


MODEL, WORKLOAD, TIMING, OUTPUT = "model and kernels", "workload", "timing", "output"


@dataclass
class BenchInferenceConfig:
    model: str = option("", "model folder, hub id, alias (smollm2-135m) or random:llama-2-7b / random:llama-2-13b")
    batch_size: int = option(1, "sequences per batch", section=WORKLOAD)
    batch_sizes: str = option("", "several batch sizes, one run each on the same model (e.g. 1,4,16; overrides "
                                  "--batch-size): the tables one after another, --json a list", section=WORKLOAD)
    prompt_len: int = option(128, "prompt tokens per sequence (prefill)", section=WORKLOAD)
    gen_len: int = option(64, "tokens generated per sequence (decode, greedy, KV cache)", section=WORKLOAD)
    dtype: str = option("fp16", "weights and activations dtype (semi-structured kernels: fp16 or bf16)",
                        choices=("fp16", "bf16", "fp32"), section=MODEL)
    device: str = option("auto", "auto (cuda if available), cpu, cuda, cuda:N", section=MODEL)
    backend: str = option("auto", "2:4 kernels: auto (every one that runs here; the dispatch picks per shape), "
                          "cusparselt, cutlass (Ampere only)", choices=("auto", "cusparselt", "cutlass"), section=MODEL)
    dispatch_cache: str | None = option(None, "JSON file of measured dense/2:4 choices to reuse and extend "
                                        "(created if missing; a file it did not write is refused)", section=MODEL)
    dense_copy: bool = option(True, "let a 2:4 layer keep its dense weight for the token counts where dense "
                                    "measures faster (--no-dense-copy: compressed weights only, the least memory; "
                                    "on the CPU large token counts then rebuild the dense weight into a scratch "
                                    "buffer)", section=MODEL)
    kernels: str = kernels_option(section=MODEL)
    warmup: int = option(1, "untimed runs before measuring", section=TIMING)
    repeats: int = option(3, "timed generation runs; the median is reported", section=TIMING)
    linear_repeats: int = option(20, "timed runs of each per-linear F.linear measurement (median)", section=TIMING)
    seed: int = option(0, "seed of the random prompt (and of random: models)", section=TIMING)
    json: bool = option(False, "print the report as one JSON object instead of a table", section=OUTPUT)
    json_out: str | None = option(None, "also write the report as JSON to this file", section=OUTPUT)
    plot: str | None = option(None, "also draw the report (tokens/s dense vs 2:4, per-linear speed-ups) into this "
                                    "PNG file", section=OUTPUT)

    def validate(self) -> None:
        if not self.model:
            raise CastError("MODEL is required")
        if min(self.batch_size, self.prompt_len, self.repeats, self.linear_repeats) < 1 or self.gen_len < 0 or self.warmup < 0:
            raise CastError("--batch-size, --prompt-len, --repeats and --linear-repeats must be ≥ 1; "
                            "--gen-len and --warmup ≥ 0")


def register(subparsers) -> None:
    add_config_command(subparsers, "bench-inference", BenchInferenceConfig, func=run,
                       model="model folder, hub id, alias or random:llama-2-7b",
                       help="dense vs 2:4 inference speed and weight memory", description=summary(__doc__))


def random_model(spec: str, dtype, device, seed: int = 0):
    """A LLaMA of a named shape with random weights, built directly on ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if spec not in RANDOM_SHAPES:
        raise CastError(f"unknown random model 'random:{spec}'; use one of "
                        + ", ".join(f"random:{k}" for k in RANDOM_SHAPES))
    hidden, inter, layers, heads, kv_heads, vocab, tied = RANDOM_SHAPES[spec]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=4096, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def run(args: argparse.Namespace) -> int:
    cfg = resolve_options(BenchInferenceConfig, args)
    from cast_llm import kernels
    from cast_llm.deploy.bench import BenchConfig, format_report, run_bench

    kernels.apply_flag(cfg.kernels)
    from cast_llm.deploy.checkpoint import parse_dtype
    from cast_llm.models import load_model, resolve_device

    device = resolve_device(cfg.device)
    dtype = parse_dtype(cfg.dtype)
    if cfg.model.startswith("random:"):
        model = random_model(cfg.model.split(":", 1)[1], dtype, device, cfg.seed)
    else:
        model = load_model(cfg.model, dtype=dtype, device=device)
    try:
        sizes = [int(b) for b in cfg.batch_sizes.split(",")] if cfg.batch_sizes else [cfg.batch_size]
    except ValueError:
        raise CastError(f"--batch-sizes {cfg.batch_sizes!r}: give whole numbers separated by commas, e.g. 1,4,16") from None
    if min(sizes) < 1:
        raise CastError("--batch-sizes: every batch size must be at least 1")
    from cast_llm.deploy.sparse24 import from_sparse24_
    from cast_llm.deploy.sparse24.dense_cpu import restore_head_

    docs = []
    for size in sizes:
        bench = BenchConfig(batch_size=size, prompt_len=cfg.prompt_len, gen_len=cfg.gen_len,
                            warmup=cfg.warmup, repeats=cfg.repeats, backend=cfg.backend,
                            linear_repeats=cfg.linear_repeats, dispatch_cache=cfg.dispatch_cache,
                            dense_copy=cfg.dense_copy)
        report = run_bench(model, name=cfg.model, cfg=bench, seed=cfg.seed)
        from_sparse24_(model)  # the next batch size starts from the dense model again
        restore_head_(model)
        docs.append({**report.to_dict(), "kernels": kernels.taken()})  # which 2:4 kernels passed their checks
        if not cfg.json:
            print(format_report(report))
        if cfg.plot:
            from cast_llm.deploy.bench import plot_report

            stem = Path(cfg.plot)
            plot_report(report, str(stem if len(sizes) == 1 else stem.with_name(f"{stem.stem}-b{size}{stem.suffix}")))
    doc = docs[0] if len(docs) == 1 else docs
    if cfg.json:
        print(json.dumps(doc))
    if cfg.json_out:
        from cast_llm.io import atomic_write_text

        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cfg.json_out, json.dumps(doc, indent=2))
    return 0
