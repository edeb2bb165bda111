"""``cast-llm export``: write a sparse model as hf, compressed or compressed-tensors (method.md §7).

* ``hf`` — standard safetensors with exact zeros and a ``sparsity`` config entry (what training writes);
* ``compressed`` — our compact N:M format (:mod:`cast_llm.deploy.compressed`): kept values + 2-bit
  positions, 0.5625 × dense for fp16 2:4 targets; loads back bit-identically, or to semi-structured
  sparse weights on a CUDA GPU;
* ``compressed-tensors`` — the legacy ``sparse-24-bitmask`` layout served by vLLM < 0.19.1 (current vLLM and
  transformers refuse it: one line says so when it is written).

Every folder gets a model card (``README.md``: :mod:`cast_llm.deploy.model_card`) from what the model's
origin recorded — never over a README.md cast-llm did not write.

Every format refuses a model that is not exactly N:M (naming the layers), and by default the written folder
is read back and compared with the model bit for bit.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from cast_llm.cli.options import add_config_command, resolve_options, summary
from cast_llm.config import option
from cast_llm.errors import CastError

FORMATS = ("hf", "compressed", "compressed-tensors")


@dataclass
class ExportConfig:
    model: str = option("", "the sparse model: a local HF folder, a hub id or an alias")
    format: str = option("hf", "hf (safetensors with exact zeros), compressed (kept values + 2-bit positions), "
                         "compressed-tensors (vLLM's legacy sparse-24-bitmask)", choices=FORMATS)
    output_dir: str | None = option(None, "folder to write (required)")
    overwrite: bool = option(False, "replace the cast-llm output at --output-dir (only the files its marker lists, "
                             "once the new one is complete)")
    dtype: str = option("auto", "dtype of the written weights: auto (as stored in MODEL), fp32, fp16, bf16",
                        choices=("auto", "fp32", "fp16", "bf16"))
    n: int = option(2, "N of the N:M pattern the model must have (compressed-tensors: 2:4 only)")
    m: int = option(4, "M of the N:M pattern")
    encoding: str = option("auto", "compressed: how kept positions are stored: index (ceil(log2 m) bits per kept "
                           "value), bitmask (1 bit per weight), auto (the smaller)",
                           choices=("auto", "index", "bitmask"))
    verify: bool = option(True, "read the written checkpoint back and check it equals the model bit for bit")

    def validate(self) -> None:
        if not self.model:
            raise CastError("MODEL is required")
        if self.output_dir is None:
            raise CastError("--output-dir is required")
        if not 0 < self.n < self.m:
            raise CastError(f"an N:M pattern needs 0 < n < m, got --n {self.n} --m {self.m}")
        if self.format == "compressed-tensors" and (self.n, self.m) != (2, 4):
            raise CastError("--format compressed-tensors stores 2:4 only (sparse-24-bitmask)")


def register(subparsers) -> None:
    add_config_command(subparsers, "export", ExportConfig, func=run,
                       model="the sparse model: a local HF folder, a hub id or an alias",
                       help="write a sparse model as hf / compressed / compressed-tensors", description=summary(__doc__))


def _load_dtype(name: str):
    from cast_llm.deploy.checkpoint import parse_dtype

    return "auto" if name == "auto" else parse_dtype(name)


def _state_equal(a, b) -> list[str]:
    """Names of tensors that differ (value, dtype or shape) between two state dicts."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    bad = [k for k in sa if k not in sb or sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k].to(sa[k].device))]
    return bad + [k for k in sb if k not in sa]


def export_model(model, tokenizer, cfg: ExportConfig, out: Path) -> Path:
    from cast_llm.deploy.export import read_sparsity_metadata, save_sparse_checkpoint
    from cast_llm.deploy.model_card import source_facts

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
        from cast_llm.deploy.compressed import save_compressed

        return save_compressed(model, tokenizer, out, n=cfg.n, m=cfg.m, encoding=cfg.encoding,
                               metadata={"sparsity_method": method}, card=card)
    from cast_llm.deploy.compressed_tensors import save_compressed_tensors

    return save_compressed_tensors(model, tokenizer, out, metadata={"sparsity_method": method}, card=card)


def reload(cfg: ExportConfig, out: Path, dtype):
    if cfg.format == "hf":
        from cast_llm.models import load_model

        return load_model(str(out), dtype=dtype)
    if cfg.format == "compressed":
        from cast_llm.deploy.compressed import load_compressed

        return load_compressed(out, dtype=dtype)
    from cast_llm.deploy.compressed_tensors import load_compressed_tensors

    return load_compressed_tensors(out, dtype=dtype)


def run(args: argparse.Namespace) -> int:
    cfg = resolve_options(ExportConfig, args)
    from cast_llm.deploy.checkpoint import prepare_output_dir
    from cast_llm.deploy.compressed import on_disk_bytes
    from cast_llm.deploy.model_card import COMPRESSED_TENSORS_LEGACY, keep_users_readme
    from cast_llm.models import load_model, load_tokenizer

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
        print(f"wrote {cfg.format} checkpoint to {out}: {sizes['total'] / 2**20:,.2f} MiB of weights "
              f"({sizes['total'] / dense:.4f} x the {dense / 2**20:,.2f} MiB of dense "
              f"{str(dtype).removeprefix('torch.')} parameters)")
        if cfg.verify:
            bad = _state_equal(model, reload(cfg, staged, dtype))
            if bad:
                raise CastError(f"verification failed: {len(bad)} tensor(s) differ after reading the export back, "
                                f"e.g. {bad[:3]}; {out} was left as it was")
            print("verified: the written checkpoint loads back identical to the model (every tensor torch.equal)")
    if cfg.format == "compressed-tensors":
        print(f"note: {COMPRESSED_TENSORS_LEGACY}")
    return 0
