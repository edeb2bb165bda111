"""Stage correctness: every CUDA-marked test (``pytest -m cuda``), the Triton AdamS kernel against its float64
reference, a short bf16 training run on SmolLM2-135M, and the exact 2:4 export of that run."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from gpukit.common import read_json_mark
from gpukit.executor import Ctx, Step

_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")


def parse_pytest(text: str, ctx: Ctx) -> dict:
    tail = "\n".join(text.strip().splitlines()[-3:])
    counts: dict[str, int] = {}
    for n, what in _PYTEST_COUNT.findall(tail):
        counts["error" if what.startswith("error") else what] = int(n)
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", tail)
    if m:
        counts["collected"] = int(m.group(1))
    skipped = re.findall(r"^SKIPPED \[\d+\] (.+)$", text, flags=re.M)
    ok = counts.get("failed", 0) == 0 and counts.get("error", 0) == 0 and bool(counts)
    return {"ok": ok, "counts": counts, "skipped_reasons": skipped[:20], "summary": tail.splitlines()[-1] if tail else ""}


def _run_dir_report(run: Path) -> dict:
    """What a `cast-llm train` run folder says: steps, tokens, tok/s, final loss, S_t, perplexities."""
    out: dict = {}
    res_f, met_f = run / "results.json", run / "metrics.jsonl"
    recs = [json.loads(x) for x in met_f.read_text().splitlines() if x.strip()] if met_f.is_file() else []
    if recs:
        tps = [r["tokens_per_s"] for r in recs[1:] if isinstance(r.get("tokens_per_s"), (int, float))]
        tps = tps or [r["tokens_per_s"] for r in recs if isinstance(r.get("tokens_per_s"), (int, float))]
        out.update(last_step=recs[-1].get("step"), loss=recs[-1].get("loss"),
                   tokens_per_s=round(statistics.median(tps), 1) if tps else None,
                   sparse_weight_ratio=recs[-1].get("sparse_weight_ratio"),
                   finite=all(isinstance(r.get("loss"), (int, float)) and r["loss"] == r["loss"] for r in recs))
    if res_f.is_file():
        res = json.loads(res_f.read_text())
        fp = (res.get("decay") or {}).get("final_prune") or {}
        if isinstance(fp, dict) and fp.get("sparse_weight_ratio") is not None:
            out["sparse_weight_ratio"] = fp["sparse_weight_ratio"]
        out.update(steps=res.get("steps"), tokens=res.get("tokens_trained"), wall_s=res.get("wall_time_s"),
                   perplexity={k: v for k, v in (res.get("perplexity") or {}).items()})
    return out


def train_argv(ctx: Ctx, out: Path) -> list[str]:
    base = ["-m", "cast_llm.cli", "train", "--model", ctx.model, "--data", ctx.data, "--output-dir", str(out),
            "--overwrite", "--no-progress", "--method", "cast"]
    if ctx.dry:
        return base + ["--device", "cpu", "--precision", "fp32", "--max-steps", "4", "--batch-size", "2",
                       "--seq-len", "32", "--log-every", "2", "--mask-interval", "2", "--save-every", "2",
                       "--val-sequences", "1", "--wikitext-windows", "1", "--eval-seq-len", "32", "--lr", "1e-3",
                       "--no-baseline-eval", "--calib-samples", "2"]
    return base + ["--device", "cuda", "--precision", "bf16", "--max-steps", "30", "--batch-size", "4",
                   "--seq-len", "1024", "--log-every", "5", "--mask-interval", "5", "--save-every", "10",
                   "--val-sequences", "8", "--wikitext-windows", "4", "--eval-seq-len", "1024", "--lr", "1e-4",
                   "--l1-decay", "2e-5"]


def parse_train(text: str, ctx: Ctx) -> dict:
    run = ctx.kit / "runs" / "correctness-train"
    rep = _run_dir_report(run)
    ok = bool(rep.get("finite")) and (run / "config.json").is_file()
    if ok:
        ctx.set_ready("train", str(run))
    return {"ok": ok, **rep, "checkpoints_written": any((run / "checkpoints").glob("step-*"))}


def parse_kit_json(text: str, ctx: Ctx) -> dict:
    return read_json_mark(text) or {"ok": False, "error": "no report"}


def steps(ctx: Ctx) -> list[Step]:
    run = ctx.kit / "runs" / "correctness-train"
    pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
    if ctx.dry:  # collection only: the marker selection and the imports of the CUDA tests
        cuda = pytest + ["--co", "-m", "cuda", "tests/test_triton_adams.py"]
        triton = pytest + ["--co", "tests/test_triton_adams.py"]
    else:
        cuda = pytest + ["-m", "cuda", "tests"]
        triton = pytest + ["tests/test_triton_adams.py"]
    return [
        Step("cuda-tests", argv=cuda, timeout_s=300, min_s=90, parse=parse_pytest),
        Step("triton-tests", argv=triton, timeout_s=240, min_s=60, parse=parse_pytest),
        Step("train-bf16", argv=train_argv(ctx, run), timeout_s=300, min_s=120, needs=("model", "corpus"),
             parse=parse_train),
        Step("export-check", argv=["benchmarks/gpu/kit.py", "check-export", str(run), "--device", ctx.device],
             timeout_s=120, min_s=30, needs=("train",), parse=parse_kit_json),
    ]
