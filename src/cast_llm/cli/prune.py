"""``cast-llm prune``: one-shot N:M pruning with magnitude, Wanda or SparseGPT (method.md §6).

Loads a dense model, optionally measures its perplexity on a text file, prunes every target once, measures
again, and writes a verified N:M Hugging Face checkpoint whose ``sparsity`` metadata names the method and
its calibration settings.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from cast_llm.cli.options import add_config_command, resolve_options
from cast_llm.config import option, to_dict
from cast_llm.errors import CastError

METHODS = ("magnitude", "wanda", "sparsegpt")  # = cast_llm.prune.METHODS, kept here so --help stays fast


RUN, CALIB, PATTERN, SPARSEGPT, EVAL = "model and output", "calibration", "N:M pattern", "SparseGPT", "evaluation"


@dataclass
class PruneConfig:
    method: str | None = option(
        None, "one-shot method (required): magnitude (Eq. 6), wanda (|W|·‖X‖), sparsegpt (OBS reconstruction)",
        choices=METHODS, section=RUN)
    model: str = option("smollm2-135m", "dense model: a local HF folder, a .gguf file, a hub id or the alias "
                                        "smollm2-135m", section=RUN)
    data: str = option("wiki-summaries",
                       "calibration text: wiki-summaries, a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG]",
                       section=CALIB)
    calib_samples: int = option(128, "calibration sequences (wanda, sparsegpt); the paper uses 128", section=CALIB)
    # 512 rather than the paper's 2048: a CPU calibrates 128 × 512 tokens in minutes, and the statistics
    # (column norms, X Xᵀ) are averages over tokens that change little with the window length
    seq_len: int = option(512, "tokens per calibration sequence (at most the model's maximum)", section=CALIB)
    calib_batch_size: int = option(1, "calibration sequences per forward through a block", section=CALIB)
    n: int = option(2, "N of the N:M pattern: weights kept in every group", section=PATTERN)
    m: int = option(4, "M of the N:M pattern: group size along the input dimension", section=PATTERN)
    damp: float = option(0.01, "diagonal damping as a fraction of mean(diag H); ×10 retries if Cholesky fails",
                         section=SPARSEGPT)
    blocksize: int = option(128, "columns per lazy-update block (a multiple of m)", section=SPARSEGPT)
    seed: int = option(0, "seed for the split of the data and the choice of calibration sequences", section=CALIB)
    device: str = option("auto", "where the blocks run: auto (cuda if available), cpu, cuda, cuda:N", section=RUN)
    output_dir: str | None = option(None, "folder for the pruned checkpoint (required)", section=RUN)
    overwrite: bool = option(False, "replace the cast-llm output in --output-dir (only the files it lists), or "
                             "write beside the files of another non-empty folder (none of them is replaced)",
                             section=RUN)
    skip_incompatible: bool = option(False, "leave layers whose input width is not a multiple of m dense",
                                     section=PATTERN)
    eval_text_file: str | None = option(None, "also report perplexity before and after pruning on this text file",
                                        section=EVAL)
    eval_seq_len: int | None = option(None, "perplexity window length (default: --seq-len)", section=EVAL)
    eval_max_windows: int | None = option(None, "score only the first this many windows (default: all)",
                                          section=EVAL)

    def validate(self) -> None:
        if self.method is None:
            raise CastError(f"--method is required ({'|'.join(METHODS)})")
        if self.output_dir is None:
            raise CastError("--output-dir is required (where the pruned checkpoint is written)")
        if not 0 < self.n < self.m:
            raise CastError(f"an N:M pattern needs 0 < n < m, got --n {self.n} --m {self.m}")
        if self.calib_samples < 1 or self.calib_batch_size < 1:
            raise CastError("--calib-samples and --calib-batch-size must be at least 1")
        if self.damp < 0:
            raise CastError(f"--damp must be ≥ 0, got {self.damp}")
        if self.blocksize <= 0 or self.blocksize % self.m:
            raise CastError(f"--blocksize must be a positive multiple of --m {self.m}, got {self.blocksize}")
        if self.eval_max_windows is not None and self.eval_max_windows < 1:
            raise CastError("--eval-max-windows must be at least 1")


def register(subparsers) -> None:
    add_config_command(subparsers, "prune", PruneConfig, func=run, config_file=True,
                       help="one-shot N:M pruning (magnitude, Wanda, SparseGPT)",
                       description="Prune a dense model to N:M in one shot and write a verified sparse checkpoint.")


def _perplexity(model, ids, seq_len, device, max_windows, desc):
    from cast_llm.eval.ppl import perplexity

    home = next(model.parameters()).device
    model.to(device)
    try:
        return perplexity(model, ids, seq_len, max_windows=max_windows, progress=True, desc=desc)
    finally:
        model.to(home)


def run(args: argparse.Namespace) -> int:
    cfg = resolve_options(PruneConfig, args)
    from cast_llm.deploy.checkpoint import prepare_output_dir

    target = prepare_output_dir(cfg.output_dir, cfg.overwrite, inputs={
        "--model": cfg.model, "--data": cfg.data if cfg.method != "magnitude" else None,
        "--eval-text-file": cfg.eval_text_file})
    out = target.path

    from cast_llm.deploy.export import format_sparsity_report, save_sparse_checkpoint, sparsity_report
    from cast_llm.models import check_seq_len, load_model, load_tokenizer, resolve_device
    from cast_llm.prune import prune_model
    from cast_llm.targets import find_targets

    device = resolve_device(cfg.device)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model)  # fp32 on the CPU; blocks visit `device` one at a time
    targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
    for t in getattr(targets, "skipped", []):
        print(f"leaving {t.fqn} dense: {t.in_features} input features is not a multiple of m={cfg.m}")

    calib = None
    if cfg.method != "magnitude":
        from cast_llm.data import calibration_samples, prepare

        check_seq_len(model, cfg.seq_len, cfg.model)
        data = prepare(cfg.data, tokenizer, cfg.seq_len, train_sequences=cfg.calib_samples,
                       calib_samples=cfg.calib_samples, min_train_sequences=cfg.calib_samples, progress=True, say=print,
                       too_small="(--calib-samples); add text or lower --calib-samples / --seq-len")
        calib = calibration_samples(data, cfg.calib_samples, seed=cfg.seed)

    eval_ids, eval_len, ppl = None, cfg.eval_seq_len or cfg.seq_len, {}
    if cfg.eval_text_file:
        from cast_llm.eval.ppl import tokenize_text

        f = Path(cfg.eval_text_file)
        if not f.is_file():
            raise CastError(f"--eval-text-file {f} not found")
        check_seq_len(model, eval_len, cfg.model)
        eval_ids = tokenize_text(f.read_text(encoding="utf-8"), tokenizer)
        ppl["dense"] = _perplexity(model, eval_ids, eval_len, device, cfg.eval_max_windows, "ppl dense")
        print(f"dense:  {ppl['dense']}")

    result = prune_model(model, cfg.method, calib, n=cfg.n, m=cfg.m, damp=cfg.damp, blocksize=cfg.blocksize,
                         batch_size=cfg.calib_batch_size, device=device, targets=targets, keep_masks=False,
                         progress=True)
    print(f"{cfg.method} {cfg.n}:{cfg.m}: pruned {len(result.layers)} layers in {result.seconds:.1f} s")
    for r in result.retried:
        print(f"  note: Cholesky of {r.fqn} failed at --damp {cfg.damp:g}; used damping {r.damp:g}")
    if eval_ids is not None:
        ppl["sparse"] = _perplexity(model, eval_ids, eval_len, device, cfg.eval_max_windows, "ppl sparse")
        print(f"sparse: {ppl['sparse']}")

    meta = {"source_model": cfg.model, **result.metadata(), "config": to_dict(cfg)}
    if calib is not None:
        meta["oneshot"]["calibration"].update(data=cfg.data, seed=cfg.seed)
    if ppl:
        meta["oneshot"]["perplexity"] = {k: v.to_dict() for k, v in ppl.items()}
        meta["oneshot"]["perplexity"]["text_file"] = str(cfg.eval_text_file)
    with target.staged() as staged:  # the old --output-dir is replaced only once the new one is complete
        save_sparse_checkpoint(model, tokenizer, staged, n=cfg.n, m=cfg.m, method=cfg.method, targets=targets,
                               metadata=meta)
        from cast_llm.deploy.model_card import keep_users_readme

        keep_users_readme(staged, target)  # a README.md cast-llm did not write stays; no model card then
    print(format_sparsity_report(sparsity_report(model, n=cfg.n, m=cfg.m, targets=targets), n=cfg.n, m=cfg.m))
    print(f"wrote {out} ({time.perf_counter() - t0:.1f} s in all)")
    return 0
