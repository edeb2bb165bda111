"""The points a scaling law is fitted to: CSV files of ``tokens,ppl`` and finished run folders."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from cast_llm.config import parse_count
from cast_llm.errors import CastError
from cast_llm.io import RunDir, atomic_write_text

__all__ = ["METRICS", "Point", "read_points_csv", "load_results", "read_runs", "collect", "write_points_csv"]

METRICS = ("wikitext2", "heldout")  # the perplexities of a run folder's results.json that can be fitted


@dataclass(frozen=True)
class Point:
    """One measured point: training tokens (billions), perplexity, and where it was read."""

    tokens_billions: float
    ppl: float
    source: str


def read_points_csv(path: Path) -> list[Point]:
    """Points of a CSV file: a ``ppl`` (or ``perplexity``) column and ``tokens`` (raw counts, ``20M``
    allowed) or ``tokens_billions``; other columns are ignored."""
    try:
        rows = list(csv.DictReader(path.read_text(encoding="utf-8").splitlines()))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise CastError(f"cannot read {path}: {e}") from None
    if not rows:
        raise CastError(
            f"{path} holds no points (expected a header such as 'tokens,ppl' and one row per run)"
        )
    header = {k.strip().lower(): k for k in rows[0] if k}
    ppl_col = header.get("ppl") or header.get("perplexity")
    tok_col, in_billions = (
        (header["tokens_billions"], True) if "tokens_billions" in header else (header.get("tokens"), False)
    )
    if ppl_col is None or tok_col is None:
        raise CastError(
            f"{path}: needs a 'ppl' column and a 'tokens' (raw counts, 20M allowed) or "
            f"'tokens_billions' column; found {', '.join(header) or 'none'}"
        )
    points = []
    for i, row in enumerate(rows, start=2):  # line 1 is the header
        t, p = (row.get(tok_col) or "").strip(), (row.get(ppl_col) or "").strip()
        if not t and not p:
            continue
        try:
            d = float(t) if in_billions else parse_count(t) / 1e9
            ppl = float(p)
        except ValueError as e:
            raise CastError(f"{path}, line {i}: {e}") from None
        points.append(Point(d, ppl, f"{path}:{i}"))
    return points


def _ppl(results: dict, metric: str, model: str = "sparse") -> float | None:
    """``results["perplexity"][metric][model]`` as a float, None when absent (e.g. no WikiText-2 file)."""
    v = (results.get("perplexity") or {}).get(metric) or {}
    v = v.get(model) if isinstance(v, dict) else None
    if isinstance(v, dict):  # tolerate a full PplResult dict
        v = v.get("perplexity")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def load_results(run_dir: Path) -> dict | None:
    """``results.json`` of a *finished* run (tokens_trained and a sparse ppl present), else None."""
    f = RunDir(run_dir).results
    if not f.is_file():
        return None
    try:
        results = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    finished = (
        isinstance(results, dict)
        and isinstance(results.get("tokens_trained"), int)
        and any(_ppl(results, m) is not None for m in METRICS)
    )
    return results if finished else None


def read_runs(
    run_dirs: list[Path], metric: str, metric_given: bool, note=print
) -> tuple[list[Point], float | None]:
    """Points and the dense ppl (median over runs; None if absent) of finished run folders, one metric
    for all of them."""
    results = []
    for r in run_dirs:
        res = load_results(r)
        if res is None:
            why = "holds no results.json" if not RunDir(r).results.is_file() else "has not finished"
            raise CastError(f"run folder {r} {why}: finish it (or `cast-llm train --resume`) before fitting")
        results.append((r, res))
    missing = [r for r, res in results if _ppl(res, metric) is None]
    if (
        missing
        and not metric_given
        and metric == "wikitext2"
        and all(_ppl(res, "heldout") is not None for _, res in results)
    ):
        note(
            f"note: {len(missing)} run(s) have no WikiText-2 perplexity (e.g. {missing[0]}); "
            "fitting the held-out perplexity of every run instead (a --dense-ppl must then be held-out too)"
        )
        metric, missing = "heldout", []
    if missing:
        raise CastError(
            f"run folder {missing[0]} has no '{metric}' sparse perplexity in results.json; "
            f"choose the metric all runs have with --metric ({', '.join(METRICS)})"
        )
    points = [Point(res["tokens_trained"] / 1e9, _ppl(res, metric), str(r)) for r, res in results]
    # every run measures the same dense model before training: take the median in case evaluations differ
    dense = sorted(v for _, res in results if (v := _ppl(res, metric, "dense")) is not None)
    return points, (dense[len(dense) // 2] if dense else None)


def collect(
    inputs: list[str], metric: str, metric_given: bool, note=print
) -> tuple[list[Point], float | None]:
    """Points (and the dense ppl of the run folders) of every input: CSV files and finished run folders."""
    points, runs = [], []
    for s in inputs:
        p = Path(s)
        if p.is_dir():
            runs.append(p)
        elif p.is_file():
            points += read_points_csv(p)
        else:
            raise CastError(f"{p} does not exist (pass CSV files of tokens,ppl or training run folders)")
    dense = None
    if runs:
        run_points, dense = read_runs(runs, metric, metric_given, note)
        points += run_points
    return points, dense


def write_points_csv(points: list[Point], path: Path) -> Path:
    """The points as ``tokens,ppl,run`` rows (what :func:`read_points_csv` reads back)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["tokens", "ppl", "run"])
    for p in points:
        w.writerow([round(p.tokens_billions * 1e9), repr(p.ppl), p.source])
    return atomic_write_text(path, buf.getvalue())
