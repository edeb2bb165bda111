"""What a call leaves: the files under ``$OUT`` (at most 8 come back), and ``record`` — merging a call's files
into ``docs/results/gpu/`` with what earlier calls and sessions recorded.

Under ``$OUT``, rewritten after every step (so a hard stop keeps what finished): ``versions.json``,
``results.json`` (this machine's steps, ``targets`` and ``checks``), ``summary.md`` (the same for a person, each
target's prediction from ``notes.md`` beside it), this call's log, the comparison's ``compare.md`` and
``compare.png``, and ``perf-profile.txt`` (the profiler tables of the perf stage).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from gpukit.common import (
    DEFAULT_FLOW,
    GPU_DIR,
    KIT_VERSION,
    MAX_OUT_FILES,
    REPO,
    RUN_SH,
    STAGES,
    fmt,
    now,
)
from gpukit.executor import Ctx
from gpukit.image import IMAGE_DATE, IMAGE_VERSIONS
from gpukit.notes import fill_measured, load_predictions
from gpukit.stages import perf
from gpukit.targets import CHECKS, TARGETS, evaluate, gpu_and_versions


def machine_info() -> dict:
    info = {"hostname": platform.node(), "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "cpus": os.cpu_count()}
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/meminfo") as f:
            kb = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            info["memory_gib"] = round(kb / 2**20, 1)
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            info["gpus"] = [line.strip() for line in r.stdout.strip().splitlines()]
            info["gpu"] = [dict(zip(("name", "memory", "driver"), (x.strip() for x in line.split(","))))
                           for line in info["gpus"]]
    return info


# ------------------------------------------------------------------------------------------ results.json
def results_of(ctx: Ctx) -> dict:
    """This machine's results: every step's state, the targets and checks judged from them, and the call."""
    st = ctx.state
    return {"kit": KIT_VERSION, "updated": now(), "dry_run": ctx.dry,
            "call": {"number": st.get("call"), "command": st.get("command"), "started": st.get("call_started")},
            "machine": st.get("machine", {}), "software": {k: (st.get("software") or {}).get(k)
                                                           for k in ("packages", "cuda", "python")},
            "source": st.get("source", {}), **evaluate(st), "steps": st.get("steps", {}), "quality": st.get("quality", {}),
            "ready": st.get("ready", {})}


def source_of(ctx: Ctx) -> dict:
    """The code that ran: the working tree's commit when it came with its .git, else the preparation's."""
    if shutil.which("git"):
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
        if r.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True).stdout.strip()
            return {"commit": r.stdout.strip(), "dirty": bool(dirty), "from": "git"}
    src = ctx.manifest().get("source") or {}
    return {**src, "from": "the preparation's manifest (the tree may have changed since)"} if src else {}


def _merge_entry(old: dict | None, new: dict) -> dict:
    """A newer measurement replaces an older one (which goes to ``history``); an entry with no measurement never
    replaces a measured one (it is noted as the last attempt). The same entry twice changes nothing."""
    if not old:
        return {**new, "history": []}
    if new.get("measured") is None:
        if old.get("measured") is None:
            return {**new, "history": old.get("history", [])}
        if new.get("when") and new.get("when") != old.get("when"):
            return {**old, "last_attempt": {k: new.get(k) for k in ("when", "status", "note", "call_command")}}
        return old
    if old.get("measured") is None or old.get("when") == new.get("when"):
        return {**new, "history": old.get("history", [])}
    past = {k: old.get(k) for k in ("measured", "pass", "when", "gpu", "command", "call_command")}
    return {**new, "history": [*old.get("history", []), past][-20:]}


def _issue16_checks(old: dict) -> dict:
    """Issue 16's measurements of the two checks it shares with this kit (same definition and bound), as entries."""
    out = {}
    steps = old.get("steps") or {}
    for t in old.get("targets_issue16", []):
        key = t.get("key")
        if key not in CHECKS or not isinstance(t.get("measured"), (int, float)):
            continue
        step = {"linear24_max_rel_err": "speed/linear-2to4", "cast_sparse_weight_ratio": "quality/rows"}[key]
        c = CHECKS[key]
        out[key] = {"label": c.label, "measured": t["measured"], "target": c.goal, "direction": c.op,
                    "bound": c.bound, "pass": c.judge(t["measured"]), "status": "ok",
                    "note": "issue 16's session (targets_issue16)", "step": step,
                    "when": (steps.get(step) or {}).get("when"), "command": (steps.get(step) or {}).get("command"),
                    "history": []}
    return out


def merge_results(old: dict | None, new: dict) -> dict:
    """``new`` (one call's results.json) merged into ``old`` (what docs/results/gpu holds): targets and checks
    per key (``_merge_entry``), steps per key (the later run wins), the call appended to ``calls``; issue 16's
    list of targets, if the old file has it, is kept as ``targets_issue16``. Merging the same file twice changes
    nothing."""
    out = dict(old or {})
    if isinstance(out.get("targets"), list):
        out["targets_issue16"] = out.pop("targets")
        out["checks"] = {**_issue16_checks(out), **(out.get("checks") or {})}
    for section in ("targets", "checks"):
        merged = dict(out.get(section) or {})
        for key, entry in (new.get(section) or {}).items():
            merged[key] = _merge_entry(merged.get(key), entry)
        out[section] = merged
    steps = dict(out.get("steps") or {})
    for key, st in (new.get("steps") or {}).items():
        if key not in steps or (st.get("when") or "") >= (steps[key].get("when") or ""):
            steps[key] = st
    out["steps"] = steps
    for section in ("quality", "ready"):
        out[section] = {**(out.get(section) or {}), **(new.get(section) or {})}
    for key in ("kit", "updated", "dry_run", "call", "machine", "software", "source"):
        if key in new:
            out[key] = new[key]
    calls = list(out.get("calls") or [])
    this = {**(new.get("call") or {}), "updated": new.get("updated"), "gpu": gpu_and_versions(new)[0]}
    if not any(c.get("started") == this.get("started") and c.get("command") == this.get("command") for c in calls):
        calls.append(this)
    else:
        calls = [this if c.get("started") == this.get("started") and c.get("command") == this.get("command") else c
                 for c in calls]
    out["calls"] = calls
    return out


# ------------------------------------------------------------------------------------------- summary.md
def _status(e: dict) -> str:
    s = e.get("status") or "not run"
    note = e.get("note")
    return f"{s}: {note}" if note and e.get("measured") is None else s


def _cell(text) -> str:
    return str(text).replace("|", "\\|")


def targets_table(results: dict, preds: dict[str, dict], *, labels: bool = True) -> list[str]:
    head = ("| target | key |" if labels else "| key |") + " measured | goal | pass | predicted (notes.md) | status |"
    lines = [head, ("|---|---|" if labels else "|---|") + "---:|---:|---|---:|---|"]
    for key, t in TARGETS.items():
        e = (results.get("targets") or {}).get(key) or {}
        verdict = {True: "PASS", False: "**FAIL**"}.get(e.get("pass"), "n/a")
        pred = preds.get(key, {}).get("predicted") or "—"
        lines.append((f"| {_cell(t.label)} " if labels else "") + f"| `{key}` | {fmt(e.get('measured'))} | {t.goal} | "
                     f"{verdict} | {pred} | {_cell(_status(e))} |")
    return lines


def summary_md(results: dict, preds: dict[str, dict], *, next_call: str | None = None,
               title: str = "GPU kit results", with_targets: bool = True) -> str:
    sw = results.get("software") or {}
    pk = sw.get("packages") or {}
    mach = results.get("machine") or {}
    gpu, v = gpu_and_versions(results)
    call = results.get("call") or {}
    lines = [f"# {title}{' (dry run, --device cpu)' if results.get('dry_run') else ''}", "",
             f"Updated {results.get('updated')} by call {call.get('number')} (`{call.get('command')}`); machine: "
             f"{gpu or ', '.join(mach.get('gpus', [])) or 'no GPU'}; {mach.get('cpu', '?')}, {mach.get('cpus')} "
             f"CPUs; torch {v.get('torch') or '?'}, CUDA {v.get('cuda') or '—'}, cuSPARSELt "
             f"{v.get('cusparselt') or '—'}, triton {v.get('triton') or '?'}, driver {v.get('driver') or '—'}, "
             f"transformers {pk.get('transformers', '?')}; source {(results.get('source') or {}).get('commit', '?')}.",
             ""]
    if with_targets:
        lines += ["## Targets (issue 21)", "", *targets_table(results, preds), "",
                  "Predictions: `docs/results/gpu/notes.md` (written before measuring). Commands: `results.json`, "
                  "under `targets`.", ""]
    lines += ["## Other checks (issue 16)", "", "| check | measured | goal | pass | status |", "|---|---:|---:|---|---|"]
    for key, t in CHECKS.items():
        e = (results.get("checks") or {}).get(key) or {}
        verdict = {True: "PASS", False: "**FAIL**"}.get(e.get("pass"), "n/a")
        lines.append(f"| {_cell(t.label)} | {fmt(e.get('measured'))} | {t.goal} | {verdict} | {_cell(_status(e))} |")
    old = results.get("targets_issue16")
    if old:
        lines += ["", "## Issue 16's targets (earlier sessions, as recorded then)", "",
                  "| target | measured | goal | verdict |", "|---|---:|---:|---|"]
        lines += [f"| {_cell(t.get('target'))} | {fmt(t.get('measured'))} | {t.get('goal')} | {t.get('verdict')} |"
                  for t in old]
    lines += ["", "## Steps", "", "| stage/step | status | when | seconds | result |", "|---|---|---|---:|---|"]
    for key, st in (results.get("steps") or {}).items():
        res = st.get("result") or {}
        brief = dict((res.get("measured") or {}).items())
        brief.update({k: x for k, x in res.items() if not isinstance(x, (dict, list)) and k not in ("ok", "json")})
        text = ", ".join(f"{k} {fmt(x)}" for k, x in list(brief.items())[:6]) or st.get("note", "")
        lines.append(f"| {key} | {st.get('status')} | {(st.get('when') or '—')[:16]} | {fmt(st.get('seconds'))} | "
                     f"{text.replace('|', '/')} |")
    lin = ((results.get("steps") or {}).get("speed/linear-2to4") or {}).get("result") or {}
    if lin.get("shapes"):
        lines += ["", "## 2:4 semi-structured linear vs dense (speed/linear-2to4; prefill)", "",
                  "| set | shape (out × in) | tokens | dense µs | 2:4 F.linear µs | speedup | 2:4 W·Xᵀ µs | speedup "
                  "| max rel err |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in lin["shapes"]:
            err = max((r.get(k) for k in ("max_rel_err", "mm_rel_err") if r.get(k) is not None), default=None)
            lines.append(f"| {r.get('set', '—')} | {r['out']} × {r['in']} | {r['tokens']} | {fmt(r.get('dense_us'))} | "
                         f"{fmt(r.get('sparse_us'))} | {fmt(r.get('speedup'))} | {fmt(r.get('sparse_mm_us'))} | "
                         f"{fmt(r.get('mm_speedup'))} | {fmt(err)} |")
    rows = (((results.get("steps") or {}).get("quality/rows") or {}).get("result") or {}).get("rows", [])
    if rows:
        q = results.get("quality") or {}
        lines += ["", f"## GPU comparison tier (budget {q.get('budget', 0):,} tokens; KD rows 3/4 of it)", "",
                  "| row | status | tokens | held-out ppl | WikiText-2 ppl | S_t | wall s | tokens/s |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r.get('label', r.get('key'))} | {r.get('status')} | {fmt(r.get('tokens'))} | "
                         f"{fmt(r.get('heldout'))} | {fmt(r.get('wikitext2'))} | {fmt(r.get('sparse_weight_ratio'))} | "
                         f"{fmt(r.get('wall_s'))} | {fmt(r.get('tokens_per_s'))} |")
    if next_call:
        lines += ["", f"Next call: {next_call}"]
    return "\n".join(lines) + "\n"


def next_call(ctx: Ctx) -> str:
    steps = ctx.state.get("steps", {})
    collect = steps.get("setup/collect", {}).get("result", {})
    if collect.get("missing_calls"):
        calls = {c["call"]: c for c in ctx.manifest().get("calls", [])}
        k = collect["missing_calls"][0]
        c = calls.get(k, {"command": f"{RUN_SH} setup perf correctness", "carry": [f"{GPU_DIR}/call{k}"]})
        return f"run(command={c['command']!r}, carry={c['carry']!r}) — carries the parts still missing"
    open_ = []
    for stage in STAGES[1:]:
        mine = [v for k, v in steps.items() if k.startswith(stage + "/")]
        if (not mine and stage in DEFAULT_FLOW) or any(v.get("status") not in ("ok", "failed") for v in mine):
            open_.append(stage)
    if not open_:
        return "nothing: every stage is done (here: python benchmarks/gpu/kit.py record FILES_AT)"
    tail = " --session-left-s SECONDS_LEFT" if "quality" in open_ else ""
    return f"run(command={RUN_SH + ' ' + ' '.join(open_) + tail!r}, carry=[])"


# --------------------------------------------------------------------------------------------- the files
def write_outputs(ctx: Ctx) -> list[Path]:
    """versions.json, results.json, summary.md, perf-profile.txt (+ this call's log and the comparison's table
    and chart), under ``ctx.out``."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    sw = ctx.state.get("software", {})
    versions = {"command": ctx.state.get("command"), "kit_argv": ctx.argv, "call": ctx.state.get("call"),
                "time": now(), "machine": ctx.state.get("machine", {}), "python": platform.python_version(),
                "packages": sw.get("packages", {}), "cuda": sw.get("cuda", {}), "image_expected": IMAGE_VERSIONS,
                "image_date": IMAGE_DATE, "source": ctx.manifest().get("source", {}),
                "manifest": ctx.manifest().get("id"), "dry_run": ctx.dry}
    results = results_of(ctx)
    files = {"versions.json": json.dumps(versions, indent=2, default=str),
             "results.json": json.dumps(results, indent=2, default=str),
             "summary.md": summary_md(results, load_predictions(ctx.notes), next_call=next_call(ctx))}
    prof = perf.profile_text(ctx)
    if prof is not None:
        files["perf-profile.txt"] = prof
    for name, text in files.items():
        tmp = ctx.out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, ctx.out / name)  # whole files only, even if the call is stopped mid-write
    rep = ctx.state.get("quality", {}).get("report", {})
    for key, name in (("md", "compare.md"), ("png", "compare.png")):
        if rep.get(key) and Path(rep[key]).is_file():
            shutil.copyfile(rep[key], ctx.out / name)
    written = sorted(p for p in ctx.out.iterdir() if p.is_file())
    if len(written) > MAX_OUT_FILES:
        raise RuntimeError(f"{len(written)} files under {ctx.out}: at most {MAX_OUT_FILES} come back")
    return written


def targets_block(results: dict, preds: dict[str, dict]) -> str:
    """The targets alone: printed last, where the device's reply (its output's last 12,000 characters) shows it."""
    return "\n".join(["Targets (issue 21), this machine (labels and commands: summary.md, results.json):",
                      *targets_table(results, preds, labels=False)])


# ------------------------------------------------------------------------------------------------- record
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def cmd_record(args) -> int:
    """Merge a call's returned files (the device's ``files_at`` folder) into ``docs/results/gpu/``."""
    src, dest = Path(args.dir), Path(args.results_dir)
    notes = Path(args.notes) if args.notes else dest / "notes.md"
    f = src / "results.json"
    if not f.is_file():
        print(f"record: {f} not found: give the folder the device's reply names files_at", file=sys.stderr)
        return 2
    new = json.loads(f.read_text())
    if not isinstance(new.get("targets"), dict):
        print(f"record: {f} is not a kit-{KIT_VERSION} results.json (no `targets` object); copy it by hand",
              file=sys.stderr)
        return 2
    if new.get("dry_run") and not args.allow_dry:
        print("record: a dry run's results (--device cpu) are not recorded (--allow-dry to do it anyway)",
              file=sys.stderr)
        return 2
    dest.mkdir(parents=True, exist_ok=True)
    old_f = dest / "results.json"
    old = json.loads(old_f.read_text()) if old_f.is_file() else None
    merged = merge_results(old, new)
    old_f.write_text(json.dumps(merged, indent=2, default=str) + "\n")
    stamp = _SAFE.sub("", (new.get("updated") or now())[:16].replace(":", ""))
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name in ("results.json", "summary.md"):
            continue
        target = dest / p.name
        if target.is_file() and target.read_bytes() != p.read_bytes():
            target = dest / f"{p.stem}-{stamp}{p.suffix}"
        if not (target.is_file() and target.read_bytes() == p.read_bytes()):
            shutil.copyfile(p, target)
            copied.append(target.name)
    filled: list[str] = []
    if notes.is_file():
        figures = {k: (fmt(e["measured"]), e.get("call_command")) for k, e in (new.get("targets") or {}).items()
                   if e.get("measured") is not None}
        text, filled = fill_measured(notes.read_text(), figures)
        if filled:
            notes.write_text(text)
    (dest / "summary.md").write_text(summary_md(merged, load_predictions(notes), title="GPU results (merged by "
                                                "kit.py record)"))
    print(f"recorded {f} into {dest}/results.json and summary.md; copied {', '.join(copied) or 'nothing new'}"
          + (f"; notes.md: measured filled for {', '.join(filled)}" if filled else ""))
    for key in TARGETS:
        before = ((old or {}).get("targets") or {}) if isinstance((old or {}).get("targets"), dict) else {}
        a, b = (before.get(key) or {}).get("measured"), (merged["targets"].get(key) or {}).get("measured")
        if a != b:
            print(f"  {key}: {fmt(a)} -> {fmt(b)} ({merged['targets'][key].get('target')}, pass "
                  f"{merged['targets'][key].get('pass')})")
    return 0

