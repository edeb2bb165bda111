"""The kit's command line: ``prepare`` (here), ``run STAGE …`` (the GPU machine; ``--device cpu``: the dry run),
``record`` (here, after a call), and the subcommands the stages run as steps."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from gpukit import report, tools
from gpukit.common import (
    CALL_BUDGET_S,
    GPU_DIR,
    NOTES_FILE,
    REPO,
    RESULTS_DIR,
    SESSION_DEVICE_S,
    STAGE_ALIASES,
    STAGES,
    START_COST_S,
    now,
)
from gpukit.executor import Ctx, _end_children, _restore_env, run_step
from gpukit.image import cmd_imports
from gpukit.notes import load_predictions
from gpukit.payload import cmd_prepare
from gpukit.stages import correctness, perf, quality, setup, speed
from gpukit.stages.quality import QUALITY_ROWS

# stage name -> the function that lists its steps for this call (tests replace entries of this dict)
STEP_BUILDERS = {"setup": setup.steps, "perf": perf.steps, "correctness": correctness.steps,
                 "speed": speed.steps, "quality": quality.steps}


def stage_names(names: list[str]) -> set[str]:
    """The stages named (comma- or space-separated, issue 16's numbers and ``all`` allowed); ValueError for an
    unknown name."""
    found: set[str] = set()
    for s in names:
        for part in s.split(","):
            part = STAGE_ALIASES.get(part, part)
            if part == "all":
                found |= set(STAGES)
            elif part in STAGES:
                found.add(part)
            else:
                raise ValueError(f"unknown stage {part!r} (use {', '.join(STAGES)}, or all)")
    return found


def parse_stages(names: list[str]) -> list[str]:
    """The stages to run, in order of value, setup first (every call collects what it carried and checks the
    software: cheap)."""
    wanted = stage_names(names) | {"setup"}
    return [s for s in STAGES if s in wanted]


def run_stages(ctx: Ctx, stages: list[str]) -> None:
    """Every due step of the stages, in order; the files under ``ctx.out`` are rewritten after each step that
    ran, so what finished is there whatever happens next (a failure, a time-out, run.sh's hard stop)."""
    for stage in stages:
        for step in STEP_BUILDERS[stage](ctx):
            if run_step(ctx, stage, step):
                report.write_outputs(ctx)


def cmd_run(args) -> int:
    try:
        stages = parse_stages(args.stages)
        redo_stages = None if args.redo in (None, "all") else stage_names([args.redo])
    except ValueError as e:
        print(f"run: {e}", file=sys.stderr)
        return 2
    kit = Path(args.kit_dir).expanduser().resolve()
    out = Path(args.out).expanduser().resolve() if args.out else kit / "out"
    bench = args.benchmarks_dir or os.environ.get(perf.BENCH_DIR_ENV)
    ctx = Ctx(kit=kit, out=out, device=args.device, calls_root=Path(args.calls_root).resolve(),
              budget_s=args.budget_s, inprocess=args.inprocess, session_left_s=args.session_left_s,
              tokens=args.tokens, rows=args.rows.split(",") if args.rows else None, redo=args.redo is not None,
              redo_stages=redo_stages, retry_failed=args.retry_failed,
              only=set(args.steps.split(",")) if args.steps else None, argv=list(args.raw_argv), stages=stages,
              bench_dir=Path(bench).resolve() if bench else None, notes=Path(args.notes).resolve())
    if args.cast_best is not None:
        ctx.cast_best = shlex.split(args.cast_best)
    if ctx.dry:
        if not args.model:
            print("run --device cpu (the dry run) needs --model DIR (a tiny HF model folder)", file=sys.stderr)
            return 2
        ctx.model = str(Path(args.model).resolve())
    kit.mkdir(parents=True, exist_ok=True)
    state_f = kit / "state.json"
    ctx.state = json.loads(state_f.read_text()) if state_f.is_file() else {}
    ctx.state["call"] = int(ctx.state.get("call", 0)) + 1
    ctx.state["call_started"] = now()
    ctx.state.setdefault("first_call_time", time.time())
    if ctx.session_left_s is None:  # a 30-minute session that began shortly before this kit's first call
        ctx.session_left_s = SESSION_DEVICE_S - START_COST_S - (time.time() - ctx.state["first_call_time"])
    ctx.state["command"] = args.command or "python benchmarks/gpu/kit.py " + shlex.join(args.raw_argv)
    ctx.state["machine"] = report.machine_info()
    ctx.state["source"] = report.source_of(ctx)
    if args.cast_best is not None:
        ctx.state.setdefault("quality", {})["cast_best"] = ctx.cast_best
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.log_path = ctx.out / f"log-{ctx.state['call']:02d}-{'-'.join(stages)}.txt"
    # run.sh's hard stop (SIGTERM from `timeout`) ends the running step's processes too
    saved = {sig: signal.signal(sig, _end_children) for sig in (signal.SIGTERM, signal.SIGHUP)}
    # the kit's own work (the comparison's evaluations) runs with the steps' environment
    for d in (ctx.site, ctx.pkgs):
        d.mkdir(parents=True, exist_ok=True)
    saved_env, saved_path = dict(os.environ), sys.path[:]
    env = ctx.env()
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    os.environ.update(env)
    sys.path[0:0] = [p for p in env["PYTHONPATH"].split(os.pathsep) if p not in sys.path]
    importlib.invalidate_caches()
    ctx.say(f"GPU kit call {ctx.state['call']}: stages {', '.join(stages)} on {args.device}; kit {kit}; "
            f"{ctx.budget_s:.0f} s budget")
    try:
        run_stages(ctx, stages)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        _restore_env(saved_env)
        sys.path[:] = saved_path
    ctx.save_state()
    report.write_outputs(ctx)
    results = report.results_of(ctx)
    preds = load_predictions(ctx.notes)
    print("\n" + report.summary_md(results, preds, with_targets=False))  # the targets last: the reply shows the end
    print(report.targets_block(results, preds) + f"\n\nNext call: {report.next_call(ctx)}")
    failed = [k for k, v in ctx.state.get("steps", {}).items() if v.get("status") == "failed"]
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kit.py", description="The GPU kit: prepare here, then validate and measure "
                                 "everything GPU-only inside one lent session (docs/gpu.md).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="fill .gpu/ and print the device calls (this machine)")
    p.add_argument("--part-mib", type=int, help="largest part (default: what fits a call with the working tree)")
    p.add_argument("--no-download", action="store_true", help="use the wheels already in .gpu/wheels")
    p.add_argument("--json", action="store_true", help="also print the manifest as one JSON line")
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("run", help="run stages (the GPU machine; --device cpu: the dry run)")
    p.add_argument("stages", nargs="+", help=f"{', '.join(STAGES)} (comma- or space-separated), or all; run in "
                                             "this order, setup always first")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--kit-dir", default=os.environ.get("CAST_KIT_DIR", str(Path.home() / "cast-kit")))
    p.add_argument("--out", default=os.environ.get("OUT"), help="where the ≤ 8 result files go (default: $OUT)")
    p.add_argument("--calls-root", default=str(REPO / GPU_DIR), help="where the carried call folders are")
    p.add_argument("--budget-s", type=float, default=CALL_BUDGET_S, help="start no work after this many seconds")
    p.add_argument("--session-left-s", type=float, help="device seconds left to the session (sizes the comparison)")
    p.add_argument("--tokens", type=int, help="the comparison's budget instead of the probe's choice")
    p.add_argument("--rows", help=f"comparison rows, comma-separated (default {','.join(QUALITY_ROWS)})")
    p.add_argument("--cast-best", help="flags of the cast-best row (default: compare_methods.CAST_BEST, the "
                                       "configuration the CPU-tier comparison chose)")
    p.add_argument("--redo", nargs="?", const="all", metavar="STAGES",
                   help="run finished steps again: all of them, or only those of these stages (--redo perf: "
                        "measure again after a change)")
    p.add_argument("--retry-failed", action="store_true", help="run failed steps again")
    p.add_argument("--steps", help="only these steps (names as in summary.md, comma-separated)")
    p.add_argument("--benchmarks-dir", help=f"the perf stage's benchmark scripts from this folder instead of "
                                            f"benchmarks/ (also ${perf.BENCH_DIR_ENV})")
    p.add_argument("--notes", default=str(NOTES_FILE), help="the predictions file the summary reads")
    p.add_argument("--inprocess", action="store_true", help="dry run: run steps in this interpreter")
    p.add_argument("--model", help="dry run: a tiny HF model folder (the GPU machine uses smollm2-135m)")
    p.add_argument("--command", help="the command line to record (run.sh passes its own)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("record", help="merge a call's returned files into docs/results/gpu/ (this machine)")
    p.add_argument("dir", help="the folder holding the call's files (the device reply's files_at)")
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the results are kept")
    p.add_argument("--notes", help="the predictions file whose measured cells are filled (default: "
                                   "RESULTS_DIR/notes.md)")
    p.add_argument("--allow-dry", action="store_true", help="record a --device cpu dry run too (tests)")
    p.set_defaults(func=report.cmd_record)
    p = sub.add_parser("software", help="imports, versions, CUDA (JSON)")
    p.add_argument("--device", default="cuda")
    p.set_defaults(func=tools.cmd_software)
    p = sub.add_parser("doctor", help="cast-llm doctor: every custom kernel's verdict here (JSON)")
    p.set_defaults(func=tools.cmd_doctor)
    p = sub.add_parser("convert", help="convert the embedded GGUF into the cache")
    p.set_defaults(func=tools.cmd_convert)
    p = sub.add_parser("check-export", help="exact 2:4 export check of a run folder")
    p.add_argument("run_dir")
    p.add_argument("--device", default="cuda")
    p.set_defaults(func=tools.cmd_check_export)
    p = sub.add_parser("linear-check", help="2:4 F.linear vs dense: outputs and time")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--shapes", default="llama-7b",
                   help=f"comma-separated shape sets ({', '.join(sorted(tools.LINEAR_SHAPES))}); targets use the first")
    p.add_argument("--repeats", type=int, default=20)
    p.set_defaults(func=tools.cmd_linear_check)
    p = sub.add_parser("imports", help="third-party imports of the stages against the image")
    p.set_defaults(func=cmd_imports)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.raw_argv = argv
    return int(args.func(args) or 0)
