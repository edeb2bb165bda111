"""The one-shot pruning job (``cast-llm prune``): a dense model in, a verified N:M checkpoint out.

Loads the model, optionally measures its perplexity on a text file, prunes every target once (magnitude,
Wanda or SparseGPT: :func:`cast_llm.prune.oneshot.prune_model`), measures again, and writes a verified N:M
Hugging Face checkpoint whose ``sparsity`` metadata names the method and its calibration settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from cast_llm.config import to_dict
from cast_llm.data import calibration_samples, prepare
from cast_llm.deploy.checkpoint import prepare_output_dir
from cast_llm.deploy.export import format_sparsity_report, save_sparse_checkpoint, sparsity_report
from cast_llm.deploy.model_card import keep_users_readme
from cast_llm.errors import CastError
from cast_llm.eval.ppl import perplexity, tokenize_text
from cast_llm.models import check_seq_len, load_model, load_tokenizer, resolve_device
from cast_llm.prune.config import PruneConfig
from cast_llm.prune.oneshot import prune_model
from cast_llm.targets import find_targets


def _perplexity(model, ids, seq_len, device, max_windows, desc):
    home = next(model.parameters()).device
    model.to(device)
    try:
        return perplexity(model, ids, seq_len, max_windows=max_windows, progress=True, desc=desc)
    finally:
        model.to(home)


def prune_job(cfg: PruneConfig, *, say: Callable[[str], None] = print) -> Path:
    """Run ``cfg`` (validated: :func:`cast_llm.config.resolve` builds it) and return the folder written."""
    target = prepare_output_dir(cfg.output_dir, cfg.overwrite, inputs={
        "--model": cfg.model, "--data": cfg.data if cfg.method != "magnitude" else None,
        "--eval-text-file": cfg.eval_text_file})
    out = target.path

    device = resolve_device(cfg.device)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model)  # fp32 on the CPU; blocks visit `device` one at a time
    targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
    for t in targets.skipped:
        say(f"leaving {t.fqn} dense: {t.in_features} input features is not a multiple of m={cfg.m}")

    calib = None
    if cfg.method != "magnitude":
        check_seq_len(model, cfg.seq_len, cfg.model)
        data = prepare(cfg.data, tokenizer, cfg.seq_len, train_sequences=cfg.calib_samples,
                       calib_samples=cfg.calib_samples, min_train_sequences=cfg.calib_samples, progress=True, say=say,
                       too_small="(--calib-samples); add text or lower --calib-samples / --seq-len")
        calib = calibration_samples(data, cfg.calib_samples, seed=cfg.seed)

    eval_ids, eval_len, ppl = None, cfg.eval_window, {}
    if cfg.eval_text_file:
        f = Path(cfg.eval_text_file)
        if not f.is_file():
            raise CastError(f"--eval-text-file {f} not found")
        check_seq_len(model, eval_len, cfg.model)
        eval_ids = tokenize_text(f.read_text(encoding="utf-8"), tokenizer)
        ppl["dense"] = _perplexity(model, eval_ids, eval_len, device, cfg.eval_max_windows, "ppl dense")
        say(f"dense:  {ppl['dense']}")

    result = prune_model(model, cfg.method, calib, n=cfg.n, m=cfg.m, damp=cfg.damp, blocksize=cfg.blocksize,
                         batch_size=cfg.calib_batch_size, device=device, targets=targets, keep_masks=False,
                         progress=True)
    say(f"{cfg.method} {cfg.n}:{cfg.m}: pruned {len(result.layers)} layers in {result.seconds:.1f} s")
    for r in result.retried:
        say(f"  note: Cholesky of {r.fqn} failed at --damp {cfg.damp:g}; used damping {r.damp:g}")
    if eval_ids is not None:
        ppl["sparse"] = _perplexity(model, eval_ids, eval_len, device, cfg.eval_max_windows, "ppl sparse")
        say(f"sparse: {ppl['sparse']}")

    meta = {"source_model": cfg.model, **result.metadata(), "config": to_dict(cfg)}
    if calib is not None:
        meta["oneshot"]["calibration"].update(data=cfg.data, seed=cfg.seed)
    if ppl:
        meta["oneshot"]["perplexity"] = {k: v.to_dict() for k, v in ppl.items()}
        meta["oneshot"]["perplexity"]["text_file"] = str(cfg.eval_text_file)
    with target.staged() as staged:  # the old --output-dir is replaced only once the new one is complete
        save_sparse_checkpoint(model, tokenizer, staged, n=cfg.n, m=cfg.m, method=cfg.method, targets=targets,
                               metadata=meta)
        keep_users_readme(staged, target)  # a README.md cast-llm did not write stays; no model card then
    say(format_sparsity_report(sparsity_report(model, n=cfg.n, m=cfg.m, targets=targets), n=cfg.n, m=cfg.m))
    say(f"wrote {out} ({time.perf_counter() - t0:.1f} s in all)")
    return out
