"""``cast-llm quantize``: sparsity-preserving AWQ / RTN weight quantization (method.md §7).

Group-wise asymmetric integer quantization (integer zero-points, fp16 scales) of every linear in the
decoder blocks, at 4 or 3 bits, group 128 (64 for GPT-2); AWQ first searches per-input-channel scales on
calibration text (``--data``) block by block and folds them exactly into the preceding norm / linear.
Every weight that was zero stays exactly zero (checked before anything is written).

Writes ``--output-dir``: the packed integer checkpoint (``quantized.safetensors`` + ``quant_index.json``,
loadable with :func:`cast_llm.quant.pack.load_quantized`) and ``fake-quant/``, a plain Hugging Face
checkpoint of the dequantized weights for evaluation with any tool.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from cast_llm.cli.options import add_config_command, resolve_options, summary
from cast_llm.config import option
from cast_llm.errors import CastError

METHODS = ("awq", "rtn")  # = cast_llm.quant.METHODS (in another order), kept here so --help stays fast
QUANT, CALIB, OUTPUT, EVAL = "quantization", "AWQ calibration", "output", "evaluation"


@dataclass
class QuantizeConfig:
    model: str = option("", "the model to quantize (dense or N:M sparse): HF folder, hub id or alias")
    method: str = option("awq", "awq (activation-aware scale search, then group-wise quantization) or rtn "
                         "(round-to-nearest)", choices=METHODS, section=QUANT)
    bits: int = option(4, "bits per weight (the paper: 4 and 3)", choices=(2, 3, 4, 8), section=QUANT)
    group_size: int | None = option(None, "weights per quantization group along the input dim "
                                    "(default: 128; 64 for GPT-2, method.md §7)", section=QUANT)
    data: str = option("wiki-summaries", "AWQ calibration text: wiki-summaries, a .txt/.jsonl/.parquet file or "
                       "folder, or hf:NAME[:CONFIG]", section=CALIB)
    calib_samples: int = option(128, "AWQ calibration sequences (the AWQ paper: 128)", section=CALIB)
    seq_len: int = option(512, "tokens per calibration sequence (the AWQ paper: 512)", section=CALIB)
    calib_batch_size: int = option(1, "calibration sequences per forward through a block", section=CALIB)
    grid: int = option(20, "AWQ: alpha grid points on [0, 1] beyond 0 (alpha = i / grid)", section=CALIB)
    search_tokens: int = option(4096, "AWQ: calibration tokens (a seeded random subset) on which the output "
                                "error of each alpha is measured; mean |x| uses all tokens", section=CALIB)
    n: int = option(2, "N of the N:M pattern (selects targets; a sparse model's packed codes use it)", section=QUANT)
    m: int = option(4, "M of the N:M pattern", section=QUANT)
    dtype: str = option("fp16", "dtype of the non-quantized tensors and of fake-quant/ (the search runs in fp32)",
                        choices=("fp16", "bf16", "fp32"), section=OUTPUT)
    device: str = option("auto", "where calibration runs: auto (cuda if available), cpu, cuda, cuda:N",
                         section=CALIB)
    seed: int = option(0, "seed of the data split, the calibration samples and the search subset", section=CALIB)
    output_dir: str | None = option(None, "folder to write (required): packed weights + fake-quant/", section=OUTPUT)
    overwrite: bool = option(False, "replace the cast-llm output at --output-dir (only the files its marker "
                             "lists, once the new one is complete)", section=OUTPUT)
    eval_windows: int = option(0, "if > 0: WikiText-2 perplexity before and after, on the first this many windows",
                               section=EVAL)
    eval_seq_len: int = option(512, "perplexity window length for --eval-windows", section=EVAL)

    def validate(self) -> None:
        if not self.model:
            raise CastError("MODEL is required")
        if self.output_dir is None:
            raise CastError("--output-dir is required")
        if self.group_size is not None and self.group_size < 1:
            raise CastError(f"--group-size must be positive, got {self.group_size}")
        if self.calib_samples < 1 or self.calib_batch_size < 1 or self.seq_len < 2:
            raise CastError("--calib-samples and --calib-batch-size must be ≥ 1 and --seq-len ≥ 2")
        if self.grid < 1 or self.search_tokens < 1:
            raise CastError("--grid and --search-tokens must be ≥ 1")
        if not 0 < self.n < self.m:
            raise CastError(f"an N:M pattern needs 0 < n < m, got --n {self.n} --m {self.m}")


def register(subparsers) -> None:
    add_config_command(subparsers, "quantize", QuantizeConfig, func=run,
                       model="the model to quantize: HF folder, hub id or alias",
                       help="sparsity-preserving AWQ / RTN quantization (4/3-bit)", description=summary(__doc__))


def _wikitext_ppl(model, tokenizer, cfg: QuantizeConfig, ids=None):
    from cast_llm.eval.ppl import perplexity, tokenize_text, wikitext2_text

    ids = ids if ids is not None else tokenize_text(wikitext2_text(), tokenizer)
    return ids, perplexity(model, ids, cfg.eval_seq_len, max_windows=cfg.eval_windows)


def run(args: argparse.Namespace) -> int:
    cfg = resolve_options(QuantizeConfig, args)
    import torch

    from cast_llm.deploy.checkpoint import parse_dtype, prepare_output_dir
    from cast_llm.deploy.export import read_sparsity_metadata
    from cast_llm.models import check_seq_len, load_model, load_tokenizer, resolve_device
    from cast_llm.quant import quantize_model_
    from cast_llm.quant.pack import save_quantized

    target = prepare_output_dir(cfg.output_dir, cfg.overwrite,
                                inputs={"MODEL": cfg.model, "--data": cfg.data if cfg.method == "awq" else None})
    out = target.path
    device = resolve_device(cfg.device)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, dtype=torch.float32, device=device)
    ppl_before = ids = None
    if cfg.eval_windows:
        ids, ppl_before = _wikitext_ppl(model, tokenizer, cfg)
        print(f"before: WikiText-2 {ppl_before}")
    calib = None
    if cfg.method == "awq":
        from cast_llm.data import calibration_samples, prepare

        check_seq_len(model, cfg.seq_len, cfg.model)
        data = prepare(cfg.data, tokenizer, cfg.seq_len, train_sequences=cfg.calib_samples,
                       calib_samples=cfg.calib_samples, min_train_sequences=cfg.calib_samples, progress=True, say=print,
                       too_small="(--calib-samples); add text or lower --calib-samples / --seq-len")
        calib = calibration_samples(data, cfg.calib_samples, seed=cfg.seed)
    result = quantize_model_(model, method=cfg.method, bits=cfg.bits, group_size=cfg.group_size, calib_ids=calib,
                             n=cfg.n, m=cfg.m, grid=cfg.grid, search_tokens=cfg.search_tokens,
                             batch_size=cfg.calib_batch_size, seed=cfg.seed, progress=True)
    print(f"{cfg.method} w{cfg.bits} g{result.group_size}: {len(result.weights)} layers quantized; "
          f"{result.zeros_checked:,} zero weights verified exactly zero")
    ppl_after = None
    if cfg.eval_windows:
        _, ppl_after = _wikitext_ppl(model, tokenizer, cfg, ids)
        print(f"after:  WikiText-2 {ppl_after}")
    sparse_meta = read_sparsity_metadata(cfg.model) if Path(cfg.model).is_dir() else None
    metadata = {"source_model": cfg.model, "sparsity_method": (sparse_meta or {}).get("method", "unknown"),
                "calibration": {"data": cfg.data, "samples": cfg.calib_samples, "seq_len": cfg.seq_len,
                                "seed": cfg.seed} if cfg.method == "awq" else None}
    if ppl_after is not None:
        metadata["wikitext2"] = {"before": ppl_before.to_dict(), "after": ppl_after.to_dict()}
    model.to("cpu").to(parse_dtype(cfg.dtype))
    with target.staged() as staged:  # the old --output-dir is replaced only once the new one is complete
        save_quantized(model, result, tokenizer, staged, n=cfg.n, m=cfg.m, metadata=metadata)
        from cast_llm.deploy.model_card import keep_users_readme

        keep_users_readme(staged, target)  # a README.md cast-llm did not write stays; no model card then
    index = json.loads((out / "quant_index.json").read_text())
    print(f"wrote {out} (packed targets: {index['bytes']['targets_packed'] / 2**20:,.2f} MiB) and "
          f"{out / 'fake-quant'} in {time.perf_counter() - t0:,.0f} s")
    return 0
