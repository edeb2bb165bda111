"""The experiment queue: `compare_methods.py` invocations run one at a time in the background, each finished
row's JSON committed to the repository at once (``runs/`` does not survive a new machine; the commits do).

    python benchmarks/evidence_queue.py start QUEUE_FILE      # clone HEAD, restore the committed rows, run
    python benchmarks/evidence_queue.py pause | resume         # stop / continue it (kill -STOP / -CONT)
    python benchmarks/evidence_queue.py quiet CMD ...          # run CMD with the queue stopped, pauses recorded
    python benchmarks/evidence_queue.py status [QUEUE_FILE]    # running or not, lines done, each run's progress

(``--state DIR`` goes before the action.)

QUEUE_FILE holds one `compare_methods.py` argument line per row group (``#`` comments); a line starting with
``mask_swap.py`` runs that benchmark instead (its runs under ``<state>/mask-swap``, its rows and learned masks
committed under ``docs/results/mask-swap-rows``). The queue runs from its
own clone of the committed HEAD (``<state>/clone``), moved to this checkout's HEAD between lines only, so edits in
this checkout never change a row under way and every row's ``code`` is a commit in the history. Its runs folder starts from the committed rows
(``docs/results/compare-rows``: a finished grid point or seed is not run again). Every 30 s, a record
(``RECORDS``: a row, its tuning, its decay forecast, its model scored again) that is new or changed is copied under
``docs/results/compare-rows/<budget>/`` and committed alone (``git commit --only``: nothing else of this
checkout's index goes with it); a row that was paused gets a ``queue.json`` listing the pauses (its wall time
includes them). State (pid, log, pauses) lives in ``--state`` (default ``/work/runs/queue``).

A line is done when its invocation exits 0. Any other exit stops the queue with that line not done: a run stopped
by a signal or failed (exit 3: ``start`` again resumes it), or a line the code cannot read (exit 2: an option not
committed yet — lines are read from this checkout, the code is its last commit).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = REPO / "docs" / "results" / "compare-rows"
MASK_ROWS = REPO / "docs" / "results" / "mask-swap-rows"  # benchmarks/mask_swap.py's rows and learned masks
RECORDS = ("compare_row.json", "tuning.json", "forecast.json", "first_windows.json", "wikitext_rescored.json",
           "masks/learned-*.safetensors")
# a queue line starting with one of these runs that benchmark (its own runs folder under the state, its rows
# committed under its own folder); any other line is compare_methods.py's arguments
SCRIPTS = {"mask_swap.py": ("mask-swap", MASK_ROWS)}


def _git(*args: str, cwd: Path | None = None, check: bool = True) -> str:
    for attempt in range(20):  # another git process of this checkout may hold the index lock for a moment
        r = subprocess.run(["git", *args], cwd=cwd or REPO, capture_output=True, text=True)
        if r.returncode == 0 or "index.lock" not in r.stderr:
            break
        time.sleep(1 + attempt)
    if check and r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def _pauses(state: Path) -> list[dict]:
    f = state / "pauses.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []


def _describe(rel: Path, row: dict) -> str:
    """The commit message of one finished row: what ran, what it scored, its final prune and wall time."""
    bits = [f"{rel.parts[0].removeprefix('smollm2-135m-')} {'/'.join(rel.parts[1:-1])}:"]
    if row.get("test") is not None:
        bits.append(f"test {row['test']:.2f} / WikiText-2 {row['wikitext2']:.2f}, validation "
                    f"{row.get('validation') or float('nan'):.2f};")
    if row.get("prune_validation_before") is not None:
        bits.append(f"final prune (validation) {row['prune_validation_before']:.2f} → "
                    f"{row['prune_validation_after']:.2f};")
    if row.get("sparse_weight_ratio") is not None:
        bits.append(f"S_T {row['sparse_weight_ratio']:.3f};")
    hp = row.get("hyperparameters") or {}
    if hp:
        bits.append(", ".join(f"{k} {v:g}" for k, v in hp.items() if isinstance(v, (int, float))) + ";")
    bits.append(f"{row.get('wall_s', 0):.0f} s at {row.get('threads') or '?'} thread(s), code {row.get('code')}")
    return " ".join(bits)


def _other_run(old: dict, new: dict) -> bool:
    """Whether row ``new`` comes from another run than the ``old`` row it replaces (another setting, seed or
    result), not the same run's row written again."""
    return any(old.get(k) != new.get(k) for k in ("seed", "hyperparameters", "test", "code"))


def sync(state: Path, runs: Path, rows: Path | None = None) -> None:
    """Copy each new or changed record of the queue's runs folder into ``rows`` (default
    ``docs/results/compare-rows``) and commit it alone; a row whose run overlapped a pause gets ``queue.json``
    beside it."""
    rows = rows or ROWS
    pauses = _pauses(state)
    for src in sorted({p for name in RECORDS for p in runs.glob(f"*/**/{name}")}):
        rel = src.relative_to(runs)
        if rel.parts[1:2] in (("_eval",),) or "model" in rel.parts:
            continue
        dst = rows / rel
        data = src.read_bytes()
        before = dst.read_bytes() if dst.is_file() else None
        if before == data:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        text = data.decode() if src.suffix == ".json" else ""
        paths = [dst]
        msg = f"{'/'.join(rel.parts[:-1])}: {rel.name} updated"
        if src.name == "compare_row.json":
            row = json.loads(text)
            end = src.stat().st_mtime
            start = end - float(row.get("wall_s") or 0)
            hit = [p for p in pauses if p["from"] < end and p.get("to", time.time()) > start]
            if hit:
                q = {"paused_s": round(sum(min(p.get("to", end), end) - max(p["from"], start) for p in hit), 1),
                     "pauses": hit, "note": "the queue was stopped (kill -STOP) during this row: its wall_s and "
                                            "train_wall_s include the pause"}
                (dst.parent / "queue.json").write_text(json.dumps(q, indent=2) + "\n")
                paths.append(dst.parent / "queue.json")
            msg = _describe(rel, row) + (f"; paused {q['paused_s']:.0f} s during it (wall time includes it, "
                                         "queue.json)" if hit else "")
        gone = []
        if src.name == "compare_row.json" and before is not None and _other_run(json.loads(before), row):
            # another run's row stood here (a seed set aside and run again at a new setting, the new row landing
            # before a sync saw the folder empty): its other records (first-windows figure, rescoring, pause
            # record) are not the new row's, and a restart would copy them back beside it. Removed with it
            gone = [x for x in _git("ls-files", "--", str(dst.parent.relative_to(REPO))).splitlines()
                    if x and (REPO / x).parent == dst.parent and (REPO / x) not in paths
                    and not (src.parent / Path(x).name).is_file()]
            if gone:
                _git("rm", "-q", "--", *gone)
                msg += f"; the replaced run's {', '.join(Path(x).name for x in gone)} removed"
        rels = [str(p.relative_to(REPO)) for p in paths]
        _git("add", "--", *rels)
        _git("commit", "-q", "--only", "-m", msg, "--", *rels, *gone)
        print(f"[queue] committed {msg}", flush=True)
    if rows == ROWS:
        drop_set_aside(runs)


def drop_set_aside(runs: Path) -> None:
    """A seed that compare_methods set aside in the queue's runs (``seed-N`` renamed ``seed-N.superseded-*`` when a
    later tuning chose another setting) leaves its committed ``seed-N`` behind, which a table made from the committed
    rows would count beside the new seeds (one row at two settings). Once the set-aside copy is committed with the
    same content, the committed ``seed-N`` (the queue's own copy of that run) is removed, until the new run lands."""
    for old in sorted(ROWS.glob("*/**/seed-*/compare_row.json")):
        rel = old.relative_to(ROWS)
        seed_dir = rel.parent
        if not seed_dir.name.removeprefix("seed-").isdigit() or (runs / rel).is_file():
            continue
        text = old.read_text()
        kept = [p for p in (ROWS / seed_dir.parent).glob(f"{seed_dir.name}.superseded-*/compare_row.json")
                if p.read_text() == text and (runs / p.relative_to(ROWS)).is_file()]
        if not kept:
            continue
        tracked = [x for x in _git("ls-files", "--", str((ROWS / seed_dir).relative_to(REPO))).splitlines() if x]
        if not tracked:
            continue
        msg = f"{'/'.join(seed_dir.parts)}: set aside as {kept[0].parent.name} (committed), removed"
        _git("rm", "-q", "--", *tracked)
        _git("commit", "-q", "--only", "-m", msg, "--", *tracked)
        print(f"[queue] committed {msg}", flush=True)


def follow_head(clone: Path) -> str | None:
    """Move the queue's clone to this checkout's HEAD, between lines (nothing under way), where the code differs
    (``src``, ``benchmarks`` but the queue file, ``pyproject.toml``): a line edited to use an option committed since
    the queue started, or a fix, runs on that commit; each row records the commit it ran. The queue's own row
    commits move HEAD without a code change: the clone stays. The new HEAD where it moved, else None."""
    head = _git("rev-parse", "HEAD").strip()
    at = _git("rev-parse", "HEAD", cwd=clone).strip()
    if at == head or not _git("diff", "--name-only", at, head, "--", "src", "benchmarks", "pyproject.toml",
                              ":(exclude)benchmarks/evidence-queue.txt").strip():
        return None
    _git("fetch", "-q", str(REPO), "HEAD", cwd=clone)
    _git("checkout", "-q", "--detach", head, cwd=clone)
    return head


def queue_lines(queue_file: Path) -> list[str]:
    """The queue file's lines to run, in order (``#`` comments and blank lines left out)."""
    return [x.strip() for x in queue_file.read_text().splitlines() if x.strip() and not x.lstrip().startswith("#")]


def lines_done(state: Path) -> list[str]:
    """The lines this queue state has finished (``done.json``)."""
    f = state / "done.json"
    return json.loads(f.read_text()) if f.is_file() else []


def run(queue_file: Path, state: Path) -> int:
    clone, runs = state / "clone", state / "runs"
    done_file = state / "done.json"
    done = lines_done(state)
    while True:  # the file is read again after each line: lines may be added or edited while the queue runs
        lines = queue_lines(queue_file)
        line = next((x for x in lines if x not in done), None)
        if line is None:
            return 0
        if moved := follow_head(clone):
            print(f"[queue] {time.strftime('%H:%M:%S')} clone moved to {moved[:12]} (this checkout's HEAD)", flush=True)
        args = shlex.split(line)
        script, line_runs, rows = "compare_methods.py", runs, None
        if args[0] in SCRIPTS:
            script = args.pop(0)
            folder, rows = SCRIPTS[script]
            line_runs = state / folder
        proc = subprocess.Popen([sys.executable, str(clone / "benchmarks" / script), *args,
                                 "--runs-dir", str(line_runs), "--docs-dir", str(state / "docs")], cwd=clone,
                                env={**os.environ, "PYTHONPATH": str(clone / "src")})
        print(f"[queue] {time.strftime('%H:%M:%S')} started: {line}", flush=True)
        while True:  # every 30 s, and once the line ends: its new records committed
            try:
                proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                sync(state, line_runs, rows)
        sync(state, line_runs, rows)
        print(f"[queue] {time.strftime('%H:%M:%S')} ended rc {proc.returncode}: {line}", flush=True)
        if proc.returncode != 0:
            return proc.returncode
        done.append(line)
        done_file.write_text(json.dumps(done, indent=2))


def start(queue_file: Path, state: Path) -> None:
    state.mkdir(parents=True, exist_ok=True)
    clone = state / "clone"
    head = _git("rev-parse", "HEAD").strip()
    if not clone.is_dir():
        _git("clone", "-q", "--no-hardlinks", str(REPO), str(clone), cwd=state)
    _git("fetch", "-q", str(REPO), "HEAD", cwd=clone)
    _git("checkout", "-q", "--detach", head, cwd=clone)
    runs = state / "runs"
    for budget in ROWS.iterdir():  # the committed rows: what finished is not run again
        shutil.copytree(budget, runs / budget.name, dirs_exist_ok=True)
    for folder, rows in SCRIPTS.values():  # and the other benchmarks' rows (and learned masks)
        for budget in rows.iterdir() if rows.is_dir() else ():
            shutil.copytree(budget, state / folder / budget.name, dirs_exist_ok=True)
    log = open(state / "queue.log", "a")
    p = subprocess.Popen([sys.executable, __file__, "--state", str(state), "_run", str(queue_file.resolve())],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (state / "queue.pgid").write_text(str(p.pid))
    print(f"queue started at {head[:12]} (pgid {p.pid}); log {state / 'queue.log'}")


def _signal(state: Path, sig: int) -> None:
    try:
        os.killpg(int((state / "queue.pgid").read_text()), sig)
    except (FileNotFoundError, ProcessLookupError):
        print("no queue running", file=sys.stderr)


def pause(state: Path) -> None:
    _signal(state, signal.SIGSTOP)
    with (state / "pauses.jsonl").open("a") as f:
        t = time.time()
        f.write(json.dumps({"from": t, "from_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))}) + "\n")


def resume(state: Path) -> None:
    f = state / "pauses.jsonl"
    rows = _pauses(state)
    if rows and "to" not in rows[-1]:
        t = time.time()
        rows[-1].update(to=t, paused_s=round(t - rows[-1]["from"], 1),
                        to_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)))
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _signal(state, signal.SIGCONT)


def _alive(state: Path) -> bool:
    try:
        os.killpg(int((state / "queue.pgid").read_text()), 0)
        return True
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return False


def _holder_alive(run: Path) -> bool:
    """Whether the job that locked ``<run>/model`` (its ``.cast-llm.lock`` names the pid) is still that job: the
    pid is alive and its command line names the folder (read only: taking the lock, even for a moment, could
    refuse a job starting on it)."""
    try:
        pid = int(json.loads((run / "model" / ".cast-llm.lock").read_text())["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
        return False
    try:
        return str(run / "model") in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return True  # no /proc: the pid alone


def run_progress(run: Path) -> str | None:
    """One line on a training run under way (``<run>/log.txt`` and ``<run>/model/metrics.jsonl``): its step of
    the total, its tokens/s and when its training ends at that rate, or that it is in its final evaluation (which
    writes nothing for many minutes); None where the run has finished (its ``compare_row.json``) or its job is
    gone (stopped)."""
    metrics, log = run / "model" / "metrics.jsonl", run / "log.txt"
    if (run / "compare_row.json").is_file() or not _holder_alive(run):
        return None
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    last = json.loads(lines[-1]) if lines else {}
    found = re.search(r"(\d+) steps × (\d+) tokens", log.read_text(errors="replace")) if log.is_file() else None
    step, rate = last.get("step"), last.get("tokens_per_s")
    if step is None or found is None:
        return "starting"
    total, per_step = int(found.group(1)), int(found.group(2))
    if step >= total:
        return f"step {step} / {total}: its final evaluation"
    left = (total - step) * per_step / rate / 60 if rate else None
    return (f"step {step} / {total} ({100 * step / total:.0f} %), {rate:.0f} tokens/s"
            + (f": training ends in ~{left:.0f} min, then its final evaluation" if left is not None else ""))


def status(queue_file: Path, state: Path) -> str:
    """Where the queue stands: running or not (paused), the lines done of the file's, the line under way with each
    of its training runs' progress, and the lines after it."""
    done, lines = lines_done(state), queue_lines(queue_file)
    todo = [x for x in lines if x not in done]
    pauses = _pauses(state)
    how = ("paused" if pauses and "to" not in pauses[-1] else "running") if _alive(state) else "not running"
    out = [f"queue: {how}; {len(lines) - len(todo)} of {len(lines)} lines done ({queue_file})"]
    if todo:
        out.append(f"{'now' if how != 'not running' else 'next'}: {todo[0]}")
        runs = sorted({p.parent.parent for p in (state / "runs").glob("**/model/.cast-llm.lock")})  # every job's
        for run in runs:
            if (line := run_progress(run)) is not None:
                out.append(f"  {run.relative_to(state / 'runs')}: {line}")
        out += [f"then: {x}" for x in todo[1:]]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["start", "pause", "resume", "quiet", "status", "_run"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.add_argument("--state", type=Path, default=Path("/work/runs/queue"))
    opts = p.parse_args(argv)
    if opts.action == "start":
        start(Path(opts.rest[0]), opts.state)
    elif opts.action == "_run":
        return run(Path(opts.rest[0]), opts.state)
    elif opts.action == "status":
        print(status(Path(opts.rest[0]) if opts.rest else REPO / "benchmarks" / "evidence-queue.txt", opts.state))
    elif opts.action == "pause":
        pause(opts.state)
    elif opts.action == "resume":
        resume(opts.state)
    else:
        cmd = opts.rest[1:] if opts.rest[:1] == ["--"] else opts.rest
        pause(opts.state)
        try:
            return subprocess.call(cmd)
        finally:
            resume(opts.state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
