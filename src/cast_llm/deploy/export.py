"""Writing sparse models: verify N:M first, then write a standard Hugging Face checkpoint atomically.

The checkpoint is plain safetensors with exact zeros, loadable by ``transformers.from_pretrained`` without
cast_llm installed. ``config.json`` gains a ``sparsity`` entry (pattern, targets, method, tokens trained,
...) so tools and people can tell what they hold. Nothing is written unless every target is exactly N:M
along its input dimension and finite: a half-sparse model written silently is worse than no model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cast_llm import __version__
from cast_llm.deploy.model_card import writer_card
from cast_llm.errors import CastError
from cast_llm.io import RunDir, move_into, read_json_object, staging_dir
from cast_llm.sparsity.mask import is_nm
from cast_llm.targets import find_targets

__all__ = ["EXPORT_MARKER", "LayerSparsity", "sparsity_report", "format_sparsity_report", "verify_nm",
           "save_sparse_checkpoint", "save_hf_checkpoint", "read_sparsity_metadata"]

# the exported model's own marker (its kind, sparsity and files), written last: its presence means the export
# completed (a training run's folder has its own, RunDir.MARKER, beside it)
EXPORT_MARKER = RunDir.EXPORT_MARKER


@dataclass
class LayerSparsity:
    name: str
    shape: tuple[int, ...]
    zeros: int
    numel: int
    is_nm: bool

    @property
    def sparsity(self) -> float:
        return self.zeros / self.numel


def _nm_view(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weight with N:M groups along its last dim (Conv1D stores (in, out): transpose it)."""
    return weight.t() if transposed else weight


def sparsity_report(model, *, n: int = 2, m: int = 4, targets=None) -> list[LayerSparsity]:
    """Per-target zero counts and whether each is N:M (at most n non-zeros in every group of m)."""
    targets = targets if targets is not None else find_targets(model, n=n, m=m, skip_incompatible=True)
    rows = []
    for t in targets:
        w = _nm_view(t.weight.detach(), t.transposed)
        rows.append(LayerSparsity(t.fqn, tuple(w.shape), int((w == 0).sum()), w.numel(), bool(is_nm(w, n, m))))
    return rows


def format_sparsity_report(rows: list[LayerSparsity], *, n: int, m: int, per_layer: bool = False) -> str:
    zeros = sum(r.zeros for r in rows)
    numel = sum(r.numel for r in rows)
    bad = [r for r in rows if not r.is_nm]
    lines = []
    if per_layer:
        lines += [f"  {r.name:<48} {str(r.shape):>14} sparsity {r.sparsity:6.2%} {'ok' if r.is_nm else 'NOT N:M'}"
                  for r in rows]
    total = f"{len(rows)} targets, {numel:,} weights, {zeros / max(numel, 1):.2%} zero"
    lines.append(f"{n}:{m} check: {total}; " + ("all exactly N:M" if not bad else f"{len(bad)} NOT N:M"))
    return "\n".join(lines)


def verify_nm(model, *, n: int = 2, m: int = 4, targets=None) -> list[LayerSparsity]:
    """Raise CastError unless every target is N:M and every parameter is finite."""
    rows = sparsity_report(model, n=n, m=m, targets=targets)
    bad = [r for r in rows if not r.is_nm]
    if bad:
        names = ", ".join(f"{r.name} {r.shape} ({r.sparsity:.1%} zero)" for r in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise CastError(f"refusing to write: {len(bad)} target(s) are not {n}:{m} sparse: {names}{more}")
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise CastError(f"refusing to write: parameter {name} {tuple(p.shape)} holds NaN/Inf")
    return rows


def save_sparse_checkpoint(
    model,
    tokenizer,
    output_dir: str | Path,
    *,
    n: int = 2,
    m: int = 4,
    method: str,
    targets=None,
    metadata: dict[str, Any] | None = None,
    card: dict[str, Any] | None = None,
) -> Path:
    """Verify and write ``model`` as an HF checkpoint with a ``sparsity`` entry in its config.

    Nothing is written unless every target is N:M; then :func:`save_hf_checkpoint` writes atomically.
    ``card``: recorded facts of the model's origin for its model card (:mod:`cast_llm.deploy.model_card`).
    """
    targets = targets if targets is not None else find_targets(model, n=n, m=m, skip_incompatible=True)
    rows = verify_nm(model, n=n, m=m, targets=targets)
    info = {
        "pattern": f"{n}:{m}",
        "n": n,
        "m": m,
        "method": method,
        "targets": [r.name for r in rows],
        "target_sparsity": sum(r.zeros for r in rows) / max(sum(r.numel for r in rows), 1),
        "cast_llm_version": __version__,
        **(metadata or {}),
    }
    return save_hf_checkpoint(model, tokenizer, output_dir, info, kind="sparse-model", card=card, nm_rows=rows)


def save_hf_checkpoint(model, tokenizer, output_dir: str | Path, sparsity: dict[str, Any], *,
                       kind: str = "model", card: dict[str, Any] | None = None, nm_rows=None) -> Path:
    """Write ``model`` (+ tokenizer) as an HF checkpoint whose ``config.json`` carries ``sparsity``.

    No N:M check here (:func:`save_sparse_checkpoint` does that first); this is the atomic writing shared
    by sparse exports and by outputs that are knowingly dense (``cast-llm finetune --mode dense``, whose
    ``sparsity`` entry says ``pattern: none``). Written into a temporary folder beside ``output_dir``;
    files are moved in only once the whole checkpoint is on disk, and ``cast_llm.json`` (the completion
    marker, holding ``kind``) last. The folder gets a model card (``README.md``, never over one cast-llm
    did not write in ``output_dir``).
    """
    out = Path(output_dir)
    had = getattr(model.config, "sparsity", None)
    model.config.sparsity = sparsity
    try:
        with staging_dir(out, prefix=".export-") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)

            writer_card(tmp, model, fmt="hf", dest=out, sparsity=sparsity, card=card, nm_rows=nm_rows)
            names = sorted(p.name for p in tmp.iterdir()) + [EXPORT_MARKER]
            (tmp / EXPORT_MARKER).write_text(json.dumps({"kind": kind, "sparsity": sparsity, "files": names},
                                                            indent=2))
            move_into(tmp, out, last=EXPORT_MARKER)
    finally:
        if had is None:
            del model.config.sparsity
        else:
            model.config.sparsity = had
    return out


def read_sparsity_metadata(path: str | Path) -> dict[str, Any] | None:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    sparsity = read_json_object(cfg, "the model's config").get("sparsity")
    return sparsity if isinstance(sparsity, dict) else None  # (a hand-edited entry of another shape: none)
