"""Stage quality: the GPU tier of ``benchmarks/compare_methods.py`` (SmolLM2-135M, the embedded corpus, bf16),
its budget chosen by a probe for the session's remaining device time; training rows checkpoint about once a
minute and resume from there when a call ends before they do."""

from __future__ import annotations

import json
import shutil
import sys
import time

from gpukit.common import REPO
from gpukit.executor import Ctx, Step, run_subprocess
from gpukit.stages.correctness import _run_dir_report

# The GPU tier's "cast-best" row takes compare_methods.CAST_BEST (the configuration the CPU-tier comparison chose;
# docs/results/compare-smollm2-135m-cpu-notes.md); `run quality --cast-best "FLAGS"` overrides it (kept in the
# state once chosen). compare_methods is imported lazily: it imports cast_llm, which setup makes importable.
# The GPU tier's rows, in the order they run (the training rows first: they are the answer; the cheap
# references after them). The table keeps compare_methods' order.
QUALITY_ROWS = ["dense", "naive", "naive-sgpt", "srste", "cast", "cast-best", "sparsegpt", "magnitude"]


def _compare_module():
    bench = str(REPO / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import compare_methods

    return compare_methods


def choose_budget(tok_s_kd: float, overhead_s: float, seconds: float, train_rows: int, tokens_per_step: int,
                  cap: int) -> int:
    """The largest training-token budget (of runs without KD; KD runs get 3/4, equal compute) such that
    ``train_rows`` runs fit ``seconds``: each run costs ``overhead_s`` plus its tokens at the KD rate
    (equal compute makes every training row take about as long as a KD row with 3/4 of the tokens).
    Rounded down to two significant digits (a readable name: 12M), at least 10 steps, at most ``cap``."""
    per_row = seconds / max(1, train_rows) - overhead_s
    budget = max(0.0, per_row) * tok_s_kd / 0.75
    if budget >= cap:
        return int(cap)
    budget = int(budget)
    if budget >= 100:
        unit = 10 ** (len(str(budget)) - 2)
        budget = budget // unit * unit
    return int(min(cap, max(budget, 10 * tokens_per_step)))


def _tier(ctx: Ctx) -> str:
    return "quick" if ctx.dry else "gpu"


def make_comparison(ctx: Ctx, budget: int, save_every: int):
    """compare_methods' Comparison for the kit: its rows (CAST paper-exact and best configuration included),
    each training run checkpointed every ``save_every`` steps and resumed from there by the next call
    (compare_methods passes ``--resume auto``), and stopped at the call's deadline."""
    import dataclasses

    cm = _compare_module()
    opts = cm.parse_args(["--tier", _tier(ctx), "--tokens", str(budget), "--runs-dir", str(ctx.kit / "quality" / "runs"),
                          "--docs-dir", str(ctx.kit / "quality" / "docs"), "--save-every", str(save_every)])
    entries = {e.key: e for e in cm.ALL_ENTRIES}
    best = ctx.state.get("quality", {}).get("cast_best")
    if best:  # an override of the configuration compare_methods calls best
        entries["cast-best"] = dataclasses.replace(entries["cast-best"], args=["--method", "cast", *best])

    class KitComparison(cm.Comparison):
        last_rc = 0

        def _run_cli(self, argv, log, cpu=None):
            if self.inprocess:
                self.last_rc = super()._run_cli(argv, log, cpu)
                return self.last_rc
            # run_subprocess reports no CPU time: the row's machine load is then taken the script's way
            rc, _, timed_out = run_subprocess(["-m", "cast_llm.cli", *argv], ctx.env(), ctx.left() - 10, log)
            self.last_rc = 124 if timed_out else rc
            return self.last_rc

    comp = KitComparison(opts)
    comp.inprocess = ctx.inprocess  # the quick tier too runs each row as its own process unless in-process
    comp.entries = [entries[k] for k in QUALITY_ROWS if k in entries]
    return cm, comp, entries


def quality_probe(ctx: Ctx) -> dict:
    """Measure training tokens/s (CAST with KD, the slowest row) and the fixed cost of a run, then choose the
    budget for the time that is left; kept in the state so every later call uses the same budget."""
    q = ctx.state.setdefault("quality", {})
    if ctx.cast_best:
        q.setdefault("cast_best", list(ctx.cast_best))
    if q.get("budget") and not ctx.redoes("quality"):
        ctx.set_ready("budget", True)
        return {"budget": q["budget"], "note": "chosen by an earlier call"}
    cm = _compare_module()
    tier = dict(cm.TIERS[_tier(ctx)])
    tokens_per_step = tier["batch_size"] * tier["grad_accum"] * tier["seq_len"]
    if ctx.tokens:
        q.update(budget=int(ctx.tokens), chosen="--tokens", tokens_per_step=tokens_per_step)
        q["save_every"] = q.get("save_every") or 50
        ctx.set_ready("budget", True)
        return {"budget": q["budget"], "chosen": "--tokens"}
    _, comp, entries = make_comparison(ctx, tier["tokens"], 0)
    probe = ctx.kit / "quality" / "probe"
    steps = 4 if ctx.dry else 30
    argv = comp.train_argv(tier["tokens"], entries["cast"].args, probe)
    i = argv.index("--tokens")
    argv = argv[:i] + argv[i + 2:] + ["--max-steps", str(steps), "--log-every", str(max(1, steps // 6)),
                                      "--val-sequences", "1", "--wikitext-windows", "1", "--overwrite"]
    if "--resume" in argv:  # the probe always starts afresh
        j = argv.index("--resume")
        argv = argv[:j] + argv[j + 2:]
    t = time.monotonic()
    rc = comp._run_cli(argv, ctx.kit / "quality" / "probe.log")
    wall = time.monotonic() - t
    rep = _run_dir_report(probe)
    if rc != 0 or not rep.get("tokens_per_s"):
        log = ctx.kit / "quality" / "probe.log"
        tail = log.read_text().strip().splitlines()[-1:] if log.is_file() else []
        return {"ok": False, "error": f"probe run failed (rc {rc}): {tail}"}
    tok_s = rep["tokens_per_s"]
    overhead = max(0.0, wall - steps * tokens_per_step / tok_s) + 30.0  # + the full end-of-run evaluation
    # what is left of the session, less this call's tail and the next calls' starts, the dense and one-shot rows
    seconds = max(60.0, ctx.session_left_s - 120 - 3 * overhead)
    train_rows = sum(1 for k in (ctx.rows or QUALITY_ROWS) if k in entries and entries[k].kind == "train")
    budget = choose_budget(tok_s, overhead, seconds, train_rows, tokens_per_step, int(tier["tokens"]))
    save_every = max(10, int(60 * tok_s / tokens_per_step))  # a checkpoint every ~minute of training
    q.update(budget=budget, tok_s_kd=tok_s, overhead_s=round(overhead, 1), seconds_for_rows=round(seconds),
             train_rows=train_rows, tokens_per_step=tokens_per_step, save_every=save_every, chosen="probe")
    ctx.set_ready("budget", True)
    print(f"probe: CAST (KD) trains {tok_s:,.0f} tokens/s, fixed cost ~{overhead:.0f} s per run; "
          f"{train_rows} training rows in ~{seconds:.0f} s -> budget {budget:,} tokens (KD rows 3/4 of it)")
    return {"budget": budget, "tok_s_kd": tok_s, "overhead_s": round(overhead, 1), "save_every": save_every}


def quality_rows(ctx: Ctx) -> dict:
    """The rows, resumable: finished ones are reused, a cut one resumes from its checkpoint next call."""
    q = ctx.state["quality"]
    cm, comp, entries = make_comparison(ctx, q["budget"], q.get("save_every", 0))
    order = [k for k in (ctx.rows or QUALITY_ROWS) if k in entries]
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    overhead = q.get("overhead_s", 30.0)
    for key in order:
        e = entries[key]
        row_dir = comp.runs / key / (f"seed-{comp.seeds[0]}" if e.seeded else "")
        done = row_dir / "compare_row.json"
        if done.is_file():
            results[key] = json.loads(done.read_text())
            continue
        if key in q.get("failed_rows", {}) and not ctx.redoes("quality"):  # failed earlier: not again
            results[key] = q["failed_rows"][key]
            continue
        need = overhead + 60 if e.kind == "train" else overhead
        if not comp.inprocess and ctx.left() < need:
            results[key] = {"key": key, "label": e.label, "status": "pending", "note": "not started: call ending"}
            continue
        print(f"row {key} ...", flush=True)
        row = comp.run_entry(e)
        if row.get("status") != "ok" and comp.last_rc == 124:
            row.update(status="pending", note="cut at the call's end: resumes from its checkpoint")
        if row.get("status") == "ok" and e.kind == "train":  # (compare_methods recorded S_T and tokens/s)
            shutil.rmtree(row_dir / "model" / "checkpoints", ignore_errors=True)
        if row.get("status") == "failed":
            q.setdefault("failed_rows", {})[key] = row
        results[key] = row
        print(f"  {key}: {row.get('status')} held-out {row.get('heldout')} WikiText-2 {row.get('wikitext2')} "
              f"S_t {row.get('sparse_weight_ratio')} tok/s {row.get('tokens_per_s')}", flush=True)
    table = [results[e.key] for e in comp.entries if e.key in results]
    finished = [r for r in table if r.get("status") == "ok"]
    md = png = None
    if finished:
        meta = {"tier": _tier(ctx), "model": comp.tier["model"], "data": comp.tier["data"], "budget": comp.budget,
                "settings": comp.tier, "total_wall_s": round(time.perf_counter() - t0, 1),
                "command": "python benchmarks/gpu/kit.py run quality (compare_methods.py --tier "
                           f"{_tier(ctx)} --tokens {comp.budget}, rows {','.join(order)})",
                "runs_dir": str(comp.runs)}
        docs = ctx.kit / "quality" / "docs"
        docs.mkdir(parents=True, exist_ok=True)
        stem = f"compare-{comp.model_name}-{cm.budget_name(comp.budget)}"
        png = cm.write_chart(finished, meta, docs / f"{stem}.png")
        md = cm.write_report(finished, meta, docs / f"{stem}.md", png)
        (comp.runs / "rows.json").write_text(json.dumps({"meta": meta, "rows": table}, indent=2))
    pending = [r["key"] for r in table if r.get("status") == "pending"]
    q["report"] = {"md": str(md) if md else None, "png": str(png) if png else None}
    failed = [r["key"] for r in table if r.get("status") == "failed"]
    return {"budget": comp.budget, "rows": table, "pending": bool(pending), "pending_rows": pending,
            "failed_rows": failed, "ok": not failed}


def steps(ctx: Ctx) -> list[Step]:
    return [Step("probe", fn=quality_probe, needs=("model", "corpus"), min_s=120 if not ctx.dry else 1),
            Step("rows", fn=quality_rows, needs=("model", "corpus", "budget"), min_s=90 if not ctx.dry else 1)]
