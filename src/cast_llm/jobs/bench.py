"""The inference benchmark job (``cast-llm bench-inference``): dense vs 2:4 prefill / decode on one model.

Loads the model (or builds a random one of a named LLaMA shape on the device: speed does not depend on
values), runs :func:`cast_llm.deploy.bench.run_bench` once per batch size, from the dense model each time,
and reports each as a table, JSON and a plot.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from cast_llm import kernels
from cast_llm.deploy.bench import format_report, plot_report, run_bench
from cast_llm.deploy.checkpoint import parse_dtype
from cast_llm.deploy.config import BenchConfig, BenchInferenceConfig
from cast_llm.deploy.sparse24 import from_sparse24_
from cast_llm.deploy.sparse24.dense_cpu import restore_head_
from cast_llm.errors import CastError
from cast_llm.io import atomic_write_text
from cast_llm.models import load_model, resolve_device

# LLaMA shapes (hidden, intermediate, layers, heads, key/value heads, vocabulary, tied head) for random-weight
# speed runs, from the models' published configs
RANDOM_SHAPES = {
    "llama-2-7b": (4096, 11008, 32, 32, 32, 32000, False),
    "llama-2-13b": (5120, 13824, 40, 40, 40, 32000, False),
    "tinyllama-1.1b": (2048, 5632, 22, 32, 4, 32000, False),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, True),
}


def random_model(spec: str, dtype, device, seed: int = 0):
    """A LLaMA of a named shape with random weights, built directly on ``device`` in ``dtype``."""
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


def bench_job(cfg: BenchInferenceConfig, *, say: Callable[[str], None] = print) -> dict | list[dict]:
    """Run ``cfg`` (validated: :func:`cast_llm.config.resolve` builds it); return the report (a list of them for
    several batch sizes), as ``--json`` prints it."""
    kernels.apply_flag(cfg.kernels)
    device = resolve_device(cfg.device)
    dtype = parse_dtype(cfg.dtype)
    if cfg.model.startswith("random:"):
        model = random_model(cfg.model.split(":", 1)[1], dtype, device, cfg.seed)
    else:
        model = load_model(cfg.model, dtype=dtype, device=device)
    sizes = cfg.batch_size_list()
    measured = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(BenchConfig)}  # what run_bench reads
    docs = []
    for size in sizes:
        report = run_bench(model, name=cfg.model, cfg=BenchConfig(**{**measured, "batch_size": size}), seed=cfg.seed)
        from_sparse24_(model)  # the next batch size starts from the dense model again
        restore_head_(model)
        docs.append({**report.to_dict(), "kernels": kernels.taken()})  # which 2:4 kernels passed their checks
        if not cfg.json:
            say(format_report(report))
        if cfg.plot:
            stem = Path(cfg.plot)
            plot_report(report, str(stem if len(sizes) == 1 else stem.with_name(f"{stem.stem}-b{size}{stem.suffix}")))
    doc = docs[0] if len(docs) == 1 else docs
    if cfg.json:
        say(json.dumps(doc))
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cfg.json_out, json.dumps(doc, indent=2))
    return doc
