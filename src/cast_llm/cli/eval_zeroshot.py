"""``cast-llm eval zeroshot``: zero-/few-shot accuracy with lm-eval (method.md §7).

Writes ``zeroshot.json`` and ``zeroshot.md`` to ``--output-dir`` and prints the table (or the JSON with
``--json``). Tasks are built before the model is loaded, so a task whose dataset cannot be downloaded fails
at once, in one line naming the task, with exit code 2.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from cast_llm.cli.options import add_config_command, resolve_options, summary
from cast_llm.config import (
    DeviceSettings,
    JsonSettings,
    KernelSettings,
    ModelSettings,
    OutputDirSettings,
    SeedSettings,
    dtype_option,
    option,
)
from cast_llm.errors import CastError

# kept here (not imported from cast_llm.eval.zeroshot) so that `cast-llm --help` does not import lm-eval
DEFAULT_TASKS = "hellaswag,race,piqa,winogrande,arc_easy,arc_challenge,openbookqa"
DTYPES = ("fp32", "bf16", "fp16")


def _parse_limit(value) -> int | float:
    v = float(value)
    if v <= 0:
        raise ValueError(f"expected a positive number of items (or a fraction < 1), got {value!r}")
    return int(v) if v >= 1 and v.is_integer() else v


def _parse_batch_size(value) -> int | str:
    s = str(value).strip().lower()
    if s == "auto" or s.startswith("auto:"):
        return s
    n = int(s)
    if n < 1:
        raise ValueError(f"expected a batch size ≥ 1 or 'auto', got {value!r}")
    return n


MODEL, TASKS, OUTPUT = "model", "tasks", "output"


@dataclass
class ZeroShotOptions(OutputDirSettings, DeviceSettings, JsonSettings, SeedSettings, KernelSettings, ModelSettings):
    OPTION_TEXT = {"model": "the model to score: a local folder, a .gguf file, a hub id or an alias "
                            "(smollm2-135m: the embedded model)",
                   "device": "cpu, cuda, cuda:1, ... or auto (cuda when available)",
                   "seed": "seed of python/numpy/torch and of the few-shot sampler",
                   "json": "print the result as JSON instead of a table"}
    OPTION_SECTIONS = {"model": MODEL, "kernels": MODEL, "device": MODEL, "seed": TASKS, "json": OUTPUT}

    tasks: str = option(
        DEFAULT_TASKS, "comma-separated lm-eval task names (default: the paper's zero-shot suite)", section=TASKS
    )
    num_fewshot: int | None = option(
        None, "few-shot examples per item (default: each task's own, 0 in the suite)", section=TASKS
    )
    limit: float | None = option(
        None, "score only the first N items per task (< 1: a fraction); smoke tests only (default: every item)",
        parse=_parse_limit, section=TASKS,
    )
    batch_size: str = option("8", "items per forward pass, or 'auto'", parse=_parse_batch_size, section=TASKS)
    dtype: str = dtype_option("fp32", "dtype the model is loaded in", choices=DTYPES, section=MODEL)
    max_length: int | None = option(None, "longest context in tokens (default: the model's maximum)", section=MODEL)
    include_path: str | None = option(None, "a folder of extra lm-eval task YAML files (local tasks)", section=TASKS)
    # the current folder by default (the command writes two report files, no run folder)
    output_dir: str = option(".", "folder where zeroshot.json and zeroshot.md are written", section=OUTPUT)
    verbose: bool = option(False, "show lm-eval's own log", section=OUTPUT)

    def validate(self) -> None:
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise CastError(f"--num-fewshot must be ≥ 0, got {self.num_fewshot}")


def register(eval_subparsers) -> None:
    add_config_command(eval_subparsers, "zeroshot", ZeroShotOptions, func=run,
                       help="zero-/few-shot accuracy with lm-evaluation-harness", description=summary(__doc__))


def pick_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CastError(f"--device {name}: CUDA is not available here (use --device cpu or auto)")
    return name


def run(args) -> int:
    from cast_llm import kernels
    from cast_llm.deploy.checkpoint import DTYPES as TORCH_DTYPES
    from cast_llm.eval.zeroshot import evaluate_zeroshot, load_tasks
    from cast_llm.models import load_model, load_tokenizer

    cfg = resolve_options(ZeroShotOptions, args)
    kernels.apply_flag(cfg.kernels)
    device = pick_device(cfg.device)
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise CastError(f"--output-dir {out} exists and is not a folder")
    log = sys.stderr if cfg.json else sys.stdout  # keep stdout pure JSON with --json
    tasks = load_tasks(cfg.tasks, cfg.include_path, verbose=cfg.verbose)  # before the (slow) model load
    model = load_model(cfg.model, dtype=TORCH_DTYPES[cfg.dtype], device=device)
    tokenizer = load_tokenizer(cfg.model)
    result = evaluate_zeroshot(
        model,
        tokenizer,
        tasks,
        num_fewshot=cfg.num_fewshot,
        limit=cfg.limit,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        max_length=cfg.max_length,
        verbose=cfg.verbose,
        model_name=cfg.model,
    )
    out.mkdir(parents=True, exist_ok=True)
    paths = [result.write_json(out / "zeroshot.json"), result.write_markdown(out / "zeroshot.md")]
    if cfg.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.to_markdown())
    print("wrote " + ", ".join(map(str, paths)), file=log)
    return 0
