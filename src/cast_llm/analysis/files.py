"""The analysis files a training run writes next to ``metrics.jsonl`` — their names, writers and readers.

==================  ================================================================================
``layers.jsonl``    one record per log step: ``{"step", "flip_rate": {fqn: r}, "initial_flip_rate":
                    {fqn: i}, "sparse_weight_ratio": {fqn: S}}`` (per-layer §7 statistics)
``ratio_hist.npz``  ρ histograms at the chosen steps: ``steps``, ``progress``, ``lin_edges``,
                    ``lin_counts`` (K, bins), ``lin_overflow``, ``log10_edges``, ``log_counts``,
                    ``log_underflow``, ``log_overflow``, ``groups``, ``mean``
``dynamics.json``   final values: ``"weight_tracking"`` (Table 2) and ``"ratio_histograms"`` (summaries)
==================  ================================================================================

Writers replace files atomically (:mod:`cast_llm.io`), so a run killed mid-write never leaves a torn file;
``layers.jsonl`` is appended to and truncated with :mod:`cast_llm.io`'s JSON-lines helpers. See
docs/analysis.md for what every quantity means.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from cast_llm.analysis.ratios import LIN_BINS, LIN_MAX, LOG_BINS, LOG_MAX, LOG_MIN
from cast_llm.io import RunDir, atomic_write, atomic_write_text, read_json, read_jsonl

LAYERS_FILE = RunDir.LAYERS
RATIO_FILE = RunDir.RATIO_HIST
DYNAMICS_FILE = RunDir.DYNAMICS
LAYER_METRICS = ("flip_rate", "initial_flip_rate", "sparse_weight_ratio")


def set_json_key(path: Path, key: str, value: Any | None) -> None:
    """Set (or, with None, remove) one top-level key of a JSON object file; other keys are kept, so
    several observers can share ``dynamics.json`` without knowing about each other."""
    data = read_json(path)
    if value is None:
        if key not in data:
            return
        data.pop(key)
    else:
        data[key] = value
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def read_layers(path: Path) -> dict[str, Any] | None:
    """``layers.jsonl`` as arrays: ``{"steps": (T,), "names": [L], metric: (T, L) float array}``, or None."""
    path = Path(path)
    if not path.is_file():
        return None
    # a torn last line (a killed run) is skipped, and so is a record of another shape (hand-edited)
    recs = [r for r in read_jsonl(path) if isinstance(r.get("step"), (int, float)) and isinstance(r.get("flip_rate"), dict)
            and all(isinstance(r.get(k, {}), dict) for k in LAYER_METRICS)]
    if not recs:
        return None
    names = list(recs[-1]["flip_rate"])
    out: dict[str, Any] = {"steps": np.array([r["step"] for r in recs]), "names": names}
    for key in LAYER_METRICS:
        out[key] = np.array([[r[key].get(n, np.nan) for n in names] for r in recs], dtype=float)
    return out


def save_ratio_histograms(path: Path, hists: list) -> None:
    """Write :class:`~cast_llm.analysis.ratios.RatioHistogram` objects as one ``.npz`` (module table)."""
    arrays = {
        "steps": np.array([h.step for h in hists], dtype=np.int64),
        "progress": np.array([h.progress for h in hists], dtype=float),
        "lin_edges": np.linspace(0.0, LIN_MAX, LIN_BINS + 1),
        "lin_counts": np.array([h.lin_counts.numpy() for h in hists], dtype=np.int64).reshape(-1, LIN_BINS),
        "lin_overflow": np.array([h.lin_overflow for h in hists], dtype=np.int64),
        "log10_edges": np.linspace(LOG_MIN, LOG_MAX, LOG_BINS + 1),
        "log_counts": np.array([h.log_counts.numpy() for h in hists], dtype=np.int64).reshape(-1, LOG_BINS),
        "log_underflow": np.array([h.log_underflow for h in hists], dtype=np.int64),
        "log_overflow": np.array([h.log_overflow for h in hists], dtype=np.int64),
        "groups": np.array([h.groups for h in hists], dtype=np.int64),
        "mean": np.array([np.nan if h.mean is None else h.mean for h in hists], dtype=float),
    }
    atomic_write(path, lambda f: np.savez(f, **arrays))


def load_ratio_histograms(path: Path) -> dict[str, np.ndarray] | None:
    path = Path(path)
    if not path.is_file():
        return None
    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    return data if data["steps"].size else None
