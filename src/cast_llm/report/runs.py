"""Reading a training run folder (as ``cast-llm train`` writes it) for the report.

Everything is optional except being a run: a folder qualifies when it holds ``cast_run.json``,
``metrics.jsonl`` or ``results.json``. A run still in progress (no ``results.json`` yet), a run from before
the analysis observers (no ``layers.jsonl`` / ``dynamics.json`` / ``ratio_hist.npz``) and a run without
``zeroshot.json`` all load; the report says what is missing instead of drawing empty axes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cast_llm.analysis.files import load_ratio_histograms, read_layers
from cast_llm.errors import CastError
from cast_llm.io import RunDir, read_json_object

RUN_MARKERS = (RunDir.MARKER, RunDir.METRICS, RunDir.RESULTS)


@dataclass
class Run:
    path: Path
    label: str
    method: str
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    dynamics: dict[str, Any] = field(default_factory=dict)
    layers: dict[str, Any] | None = None
    ratio: dict[str, np.ndarray] | None = None
    zeroshot: dict[str, Any] | None = None

    def series(self, key: str, x: str = "tokens") -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of ``key`` over the log records that have a finite value for it."""
        pts = [(r.get(x, r["step"]), r[key]) for r in self.metrics if _finite(r.get(key))]
        if not pts:
            return np.empty(0), np.empty(0)
        xs, ys = zip(*pts)
        return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)

    def has(self, key: str) -> bool:
        return any(_finite(r.get(key)) for r in self.metrics)

    @property
    def tokens_per_step(self) -> float | None:
        for r in self.metrics:
            if r.get("tokens") and r.get("step"):
                return r["tokens"] / r["step"]
        steps, tokens = self.results.get("steps"), self.results.get("tokens_trained")
        return tokens / steps if steps and tokens else None

    @property
    def total_tokens(self) -> float | None:
        if self.results.get("tokens_trained"):
            return float(self.results["tokens_trained"])
        return float(self.metrics[-1]["tokens"]) if self.metrics and "tokens" in self.metrics[-1] else None


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of a killed run: skip it, keep the rest
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def load_run(path: str | Path) -> Run:
    """Load one run folder, or raise a one-line :class:`CastError` saying why it is not one."""
    p = Path(path)
    if not p.exists():
        raise CastError(f"{p} does not exist (pass the --output-dir of a `cast-llm train` run)")
    if not p.is_dir():
        raise CastError(f"{p} is a file, not a run folder (pass the --output-dir of a `cast-llm train` run)")
    if not any((p / name).is_file() for name in RUN_MARKERS):
        raise CastError(f"{p} is not a cast-llm run folder (none of {', '.join(RUN_MARKERS)} in it)")
    run = RunDir(p)
    fix = "restore or remove the file (was it edited by hand?)"

    def obj(f: Path, what: str) -> dict[str, Any]:  # a file that is there must be what cast-llm writes
        return read_json_object(f, what, fix=fix) if f.is_file() else {}

    marker = obj(run.marker, "the run's marker")
    results = obj(run.results, "the run's results")
    config = marker.get("config") or {}
    if not config and run.config.is_file():
        import yaml

        try:
            config = yaml.safe_load(run.config.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise CastError(f"{run.config} (the run's config) is not valid YAML ({type(e).__name__}); {fix}") from None
    if not isinstance(config, dict):
        raise CastError(f"the run's config in {run.config if not marker.get('config') else run.marker} is a "
                        f"{type(config).__name__}, not a mapping; {fix}")
    method = marker.get("method") or results.get("method") or config.get("method") or "?"
    zeroshot = obj(p / "zeroshot.json", "the run's zero-shot results") or None
    return Run(path=p, label=p.name or str(p), method=str(method), config=config,
               metrics=_read_jsonl(run.metrics), results=results, dynamics=obj(run.dynamics, "the run's dynamics"),
               layers=read_layers(run.layers), ratio=load_ratio_histograms(run.ratio_hist),
               zeroshot=zeroshot)


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Load several runs with distinct labels: the folder name and the method, widened with parent folders
    when two runs share a name (``a/run``, ``b/run``)."""
    if not paths:
        raise CastError("give at least one run folder")
    runs = [load_run(p) for p in paths]
    resolved = [r.path.resolve() for r in runs]
    if len(set(resolved)) != len(resolved):
        dup = next(str(r.path) for r, q in zip(runs, resolved) if resolved.count(q) > 1)
        raise CastError(f"{dup} is given twice")
    depth = 1
    while True:
        names = ["/".join(q.parts[-depth:]) for q in resolved]
        if len(set(names)) == len(names) or depth > max(len(q.parts) for q in resolved):
            break
        depth += 1
    for r, name in zip(runs, names):
        r.label = f"{name} ({r.method})"
    return runs
