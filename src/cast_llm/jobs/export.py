"""The export job (``cast-llm export``): a sparse model written as hf, compressed or compressed-tensors.

Every format refuses a model that is not exactly N:M (naming the layers); by default the written folder is read
back and compared with the model bit for bit, and the old ``--output-dir`` is replaced only once the new one is
written and verified. Every folder gets a model card from what the model's origin recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from cast_llm.deploy.checkpoint import parse_dtype, prepare_output_dir
from cast_llm.deploy.compressed import load_compressed, on_disk_bytes, save_compressed
from cast_llm.deploy.compressed_tensors import load_compressed_tensors, save_compressed_tensors
from cast_llm.deploy.config import ExportConfig
from cast_llm.deploy.export import read_sparsity_metadata, save_sparse_checkpoint
from cast_llm.deploy.model_card import COMPRESSED_TENSORS_LEGACY, keep_users_readme, source_facts
from cast_llm.errors import CastError
from cast_llm.models import load_model, load_tokenizer


def _load_dtype(name: str):
    return "auto" if name == "auto" else parse_dtype(name)


def _state_equal(a, b) -> list[str]:
    """Names of tensors that differ (value, dtype or shape) between two state dicts."""
    sa, sb = a.state_dict(), b.state_dict()
    bad = [k for k in sa if k not in sb or sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k].to(sa[k].device))]
    return bad + [k for k in sb if k not in sa]


def export_model(model, tokenizer, cfg: ExportConfig, out: Path) -> Path:
    """Write ``model`` in ``cfg.format`` into the folder ``out``."""
    card = {**source_facts(cfg.model), "made_by": f"cast-llm export --format {cfg.format}"}
    meta = {}
    if Path(cfg.model).is_dir():
        meta = read_sparsity_metadata(cfg.model) or {}
    method = meta.get("method", "unknown")
    if cfg.format == "hf":
        extra = {k: v for k, v in meta.items() if k not in ("pattern", "n", "m", "method", "targets",
                                                               "target_sparsity", "cast_llm_version")}
        return save_sparse_checkpoint(model, tokenizer, out, n=cfg.n, m=cfg.m, method=method, metadata=extra,
                                      card=card)
    if cfg.format == "compressed":
        return save_compressed(model, tokenizer, out, n=cfg.n, m=cfg.m, encoding=cfg.encoding,
                               metadata={"sparsity_method": method}, card=card)
    return save_compressed_tensors(model, tokenizer, out, metadata={"sparsity_method": method}, card=card)


def reload(cfg: ExportConfig, out: Path, dtype):
    """The model written into ``out`` in ``cfg.format``, loaded back in ``dtype``."""
    if cfg.format == "hf":
        return load_model(str(out), dtype=dtype)
    if cfg.format == "compressed":
        return load_compressed(out, dtype=dtype)
    return load_compressed_tensors(out, dtype=dtype)


def export_job(cfg: ExportConfig, *, say: Callable[[str], None] = print) -> Path:
    """Run ``cfg`` (validated: :func:`cast_llm.config.resolve` builds it) and return the folder written."""
    target = prepare_output_dir(cfg.output_dir, cfg.overwrite, inputs={"MODEL": cfg.model})
    out = target.path
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, dtype=_load_dtype(cfg.dtype))
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with target.staged() as staged:  # the old --output-dir is replaced only once this one is written and verified
        export_model(model, tokenizer, cfg, staged)
        keep_users_readme(staged, target)  # a README.md cast-llm did not write stays; no card then
        sizes = on_disk_bytes(staged)
        dense = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        say(f"wrote {cfg.format} checkpoint to {out}: {sizes['total'] / 2**20:,.2f} MiB of weights "
            f"({sizes['total'] / dense:.4f} x the {dense / 2**20:,.2f} MiB of dense "
            f"{str(dtype).removeprefix('torch.')} parameters)")
        if cfg.verify:
            bad = _state_equal(model, reload(cfg, staged, dtype))
            if bad:
                raise CastError(f"verification failed: {len(bad)} tensor(s) differ after reading the export back, "
                                f"e.g. {bad[:3]}; {out} was left as it was")
            say("verified: the written checkpoint loads back identical to the model (every tensor torch.equal)")
    if cfg.format == "compressed-tensors":
        say(f"note: {COMPRESSED_TENSORS_LEGACY}")
    return out
