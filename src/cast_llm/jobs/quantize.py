"""The quantization job (``cast-llm quantize``): sparsity-preserving AWQ / RTN of a model into a packed checkpoint.

Writes ``cfg.output_dir``: the packed integer checkpoint (``quantized.safetensors`` + ``quant_index.json``,
loadable with :func:`cast_llm.quant.pack.load_quantized`) and ``fake-quant/``, a plain Hugging Face
checkpoint of the dequantized weights for evaluation with any tool.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cast_llm.data import calibration_samples, prepare
from cast_llm.deploy.checkpoint import parse_dtype, prepare_output_dir
from cast_llm.deploy.export import read_sparsity_metadata
from cast_llm.deploy.model_card import keep_users_readme
from cast_llm.eval.ppl import perplexity, tokenize_text, wikitext2_text
from cast_llm.models import check_seq_len, load_model, load_tokenizer, resolve_device
from cast_llm.quant.config import QuantizeConfig
from cast_llm.quant.pack import save_quantized
from cast_llm.quant.quantize import quantize_model_


def _wikitext_ppl(model, tokenizer, cfg: QuantizeConfig, ids=None):
    ids = ids if ids is not None else tokenize_text(wikitext2_text(), tokenizer)
    return ids, perplexity(model, ids, cfg.eval_window, max_windows=cfg.eval_windows)


def quantize_job(cfg: QuantizeConfig, *, say: Callable[[str], None] = print) -> Path:
    """Run ``cfg`` (validated: :func:`cast_llm.config.resolve` builds it) and return the folder written."""
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
        say(f"before: WikiText-2 {ppl_before}")
    calib = None
    if cfg.method == "awq":
        check_seq_len(model, cfg.seq_len, cfg.model)
        data = prepare(cfg.data, tokenizer, cfg.seq_len, train_sequences=cfg.calib_samples,
                       calib_samples=cfg.calib_samples, min_train_sequences=cfg.calib_samples, progress=True, say=say,
                       too_small="(--calib-samples); add text or lower --calib-samples / --seq-len")
        calib = calibration_samples(data, cfg.calib_samples, seed=cfg.seed)
    result = quantize_model_(model, method=cfg.method, bits=cfg.bits, group_size=cfg.group_size, calib_ids=calib,
                             n=cfg.n, m=cfg.m, grid=cfg.grid, search_tokens=cfg.search_tokens,
                             batch_size=cfg.calib_batch_size, seed=cfg.seed, progress=True)
    say(f"{cfg.method} w{cfg.bits} g{result.group_size}: {len(result.weights)} layers quantized; "
        f"{result.zeros_checked:,} zero weights verified exactly zero")
    ppl_after = None
    if cfg.eval_windows:
        _, ppl_after = _wikitext_ppl(model, tokenizer, cfg, ids)
        say(f"after:  WikiText-2 {ppl_after}")
    sparse_meta = read_sparsity_metadata(cfg.model) if Path(cfg.model).is_dir() else None
    metadata = {"source_model": cfg.model, "sparsity_method": (sparse_meta or {}).get("method", "unknown"),
                "calibration": {"data": cfg.data, "samples": cfg.calib_samples, "seq_len": cfg.seq_len,
                                "seed": cfg.seed} if cfg.method == "awq" else None}
    if ppl_after is not None:
        metadata["wikitext2"] = {"before": ppl_before.to_dict(), "after": ppl_after.to_dict()}
    model.to("cpu").to(parse_dtype(cfg.dtype))
    with target.staged() as staged:  # the old --output-dir is replaced only once the new one is complete
        save_quantized(model, result, tokenizer, staged, n=cfg.n, m=cfg.m, metadata=metadata)
        keep_users_readme(staged, target)  # a README.md cast-llm did not write stays; no model card then
    index = json.loads((out / "quant_index.json").read_text())
    say(f"wrote {out} (packed targets: {index['bytes']['targets_packed'] / 2**20:,.2f} MiB) and "
        f"{out / 'fake-quant'} in {time.perf_counter() - t0:,.0f} s")
    return out
