"""A call's context and the step runner: every stage is a list of ``Step``s; the runner skips what finished in
an earlier call, leaves waiting what needs something not carried yet, defers what would not end inside this
call's budget (keeping the time a stage reserves for its later steps), runs the rest with a time limit each —
in a process group of its own, or in this interpreter for the dry run — and keeps the state on the kit's disk,
so the next call carries on."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import runpy
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from gpukit.common import NOTES_FILE, REPO, now


@dataclass
class Step:
    """One unit of a stage: a command run with the kit's interpreter (``argv`` after it), or ``fn(ctx)``."""

    name: str
    argv: list[str] | None = None
    fn: object = None
    timeout_s: int = 300
    min_s: int = 30  # not started with less time left in the call than this
    needs: tuple[str, ...] = ()  # "model", "corpus", "gguf", "train" (another step's output)
    parse: object = None  # (text, ctx) -> dict; "ok": False in it fails the step
    always: bool = False  # run at every call (cheap bookkeeping), never "done"
    reserve_for: tuple[int, ...] = ()  # the minima of the stage's later steps due in this call, in their order
    before: object = None  # fn(ctx) just before the run (e.g. remove the output a parser will read)


@dataclass
class Ctx:
    kit: Path
    out: Path
    device: str
    calls_root: Path
    budget_s: float
    inprocess: bool = False
    model: str = "smollm2-135m"
    data: str = "wiki-summaries"
    session_left_s: float | None = None
    tokens: int | None = None
    rows: list[str] | None = None
    cast_best: list[str] | None = None  # None: compare_methods.CAST_BEST
    redo: bool = False
    retry_failed: bool = False
    only: set[str] | None = None
    redo_stages: set[str] | None = None  # --redo STAGE,…: only these stages' finished steps run again
    bench_dir: Path | None = None  # where the perf stage's benchmark scripts are (None: benchmarks/)
    notes: Path = NOTES_FILE  # the predictions the summary prints beside the figures
    argv: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    state: dict = field(default_factory=dict)
    log_path: Path | None = None
    stages: list[str] = field(default_factory=list)

    @property
    def dry(self) -> bool:
        return self.device == "cpu"

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.0f} s] {msg}"
        print(line, flush=True)
        if self.log_path is not None:
            with self.log_path.open("a") as f:
                f.write(line + "\n")

    # where things live on the kit's disk
    @property
    def site(self) -> Path:
        return self.kit / "site"

    @property
    def pkgs(self) -> Path:
        return self.kit / "pkgs"

    def wikitext(self) -> Path | None:
        for f in self.manifest().get("files", []):
            if f["role"] == "wikitext" and (self.kit / f["dest"]).is_file():
                return self.kit / f["dest"]
        return None

    def manifest(self) -> dict:
        p = self.kit / "manifest.json"
        return json.loads(p.read_text()) if p.is_file() else {}

    def env(self) -> dict[str, str]:
        """The variables every step runs with (added to the inherited environment)."""
        paths = [str(REPO / "src"), str(self.site), str(self.pkgs)]
        env = {"PYTHONPATH": os.pathsep.join(paths), "CAST_LLM_CACHE": str(self.kit / "cache"),
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
        wiki = self.wikitext()
        if wiki is not None:
            env["CAST_WIKITEXT2"] = str(wiki)
        return env

    def ready(self, need: str) -> bool:
        return bool(self.state.get("ready", {}).get(need))

    def set_ready(self, need: str, value) -> None:
        self.state.setdefault("ready", {})[need] = value

    def step_state(self, stage: str, name: str) -> dict:
        return self.state.setdefault("steps", {}).setdefault(f"{stage}/{name}", {})

    def selected(self, step: Step) -> bool:
        """Whether ``--steps`` leaves this step in (the bookkeeping steps always run)."""
        return self.only is None or step.name in self.only or step.always

    def redoes(self, stage: str) -> bool:
        return self.redo and (self.redo_stages is None or stage in self.redo_stages)

    def settled(self, stage: str, step: Step) -> bool:
        """Finished in an earlier call (ok, or failed unless --retry-failed) and not to be run again."""
        final = ("ok",) if self.retry_failed else ("ok", "failed")
        st = self.state.get("steps", {}).get(f"{stage}/{step.name}", {})
        return st.get("status") in final and not step.always and not self.redoes(stage)

    def result(self, stage: str, name: str) -> dict:
        return self.state.get("steps", {}).get(f"{stage}/{name}", {}).get("result", {}) or {}

    def save_state(self) -> None:
        self.kit.mkdir(parents=True, exist_ok=True)
        tmp = self.kit / "state.json.tmp"
        tmp.write_text(json.dumps(self.state, indent=2, default=str))
        os.replace(tmp, self.kit / "state.json")


def _restore_env(saved: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(saved)


def run_inprocess(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """A step's command in this interpreter (the dry run: no interpreter start per step)."""
    saved_env, saved_argv, saved_path = dict(os.environ), sys.argv[:], sys.path[:]
    os.environ.update(env)
    sys.path[0:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    importlib.invalidate_caches()
    buf = io.StringIO()
    rc = 0
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                if argv[0] == "-m":
                    sys.argv = [argv[1], *argv[2:]]
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                elif argv[0] == "-c":
                    sys.argv = ["-c", *argv[2:]]
                    exec(compile(argv[1], "<kit -c>", "exec"), {"__name__": "__main__"})
                else:
                    script = (REPO / argv[0]).resolve()
                    sys.path.insert(0, str(script.parent))
                    sys.argv = [str(script), *argv[1:]]
                    runpy.run_path(str(script), run_name="__main__")
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc()
                rc = 1
    finally:
        _restore_env(saved_env)
        sys.argv, sys.path[:] = saved_argv, saved_path
        importlib.invalidate_caches()
    return rc, buf.getvalue()


_CHILDREN: set[int] = set()  # process groups of the running steps (ended with the kit, see cmd_run)


def _end_children(signum=None, frame=None) -> None:
    """Kill every running step's process group; as a signal handler (run.sh's hard stop), exit too."""
    for pgid in list(_CHILDREN):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    if signum is not None:
        print(f"\nstopped by signal {signum} (run.sh's hard stop): the step running was ended; the files under "
              "$OUT hold every step that finished, and the next call runs the rest", flush=True)
        raise SystemExit(128 + signum)


def run_subprocess(argv: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int, str, bool]:
    """``(returncode, output, timed_out)``. The step runs in a process group of its own (not a new session:
    the device ends whatever a call leaves behind); on timeout the group gets SIGTERM, then SIGKILL."""
    full = dict(os.environ)
    full.update(env)
    if os.environ.get("PYTHONPATH") and "PYTHONPATH" in env:
        full["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + os.environ["PYTHONPATH"]
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=full, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=os.setpgrp)
        _CHILDREN.add(proc.pid)
        timed_out = False
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = 124
        finally:
            _CHILDREN.discard(proc.pid)
    return rc, log.read_text(errors="replace"), timed_out


class _Tee(io.StringIO):
    """What a kit function prints, kept for the log and written through to a file as it comes (a hard stop
    of the call still leaves it on the kit's disk)."""

    def __init__(self, path: Path):
        super().__init__()
        self.file = path.open("w")

    def write(self, s: str) -> int:
        self.file.write(s)
        self.file.flush()
        return super().write(s)


def reserve(spare: float, later: tuple[int, ...]) -> float:
    """Seconds to keep for the later steps out of ``spare`` (what is left beyond this step's minimum): each
    later step's minimum, in order, as long as it fits — earlier steps come first, and a step that could not
    fit anyway keeps nothing from the ones before it."""
    keep = 0.0
    for m in later:
        if keep + m <= spare:
            keep += m
    return keep


def run_step(ctx: Ctx, stage: str, step: Step) -> bool:
    """Run one step if it is due; returns whether it ran. Its status, result, command and time go into the
    state (saved at once: a hard stop of the call later keeps it)."""
    if not ctx.selected(step) or ctx.settled(stage, step):
        return False
    st = ctx.step_state(stage, step.name)
    missing = [n for n in step.needs if not ctx.ready(n)]
    if missing:
        st.update(status="waiting", note=f"waits for {', '.join(missing)}")
        ctx.say(f"{stage}/{step.name}: waits for {', '.join(missing)}")
        return False
    left = ctx.left()
    if left < step.min_s:
        st.update(status="deferred", note=f"would not fit: {left:.0f} s left in this call, needs ≥ {step.min_s} s")
        ctx.say(f"{stage}/{step.name}: deferred to the next call ({st['note']})")
        return False
    keep = reserve(left - step.min_s, step.reserve_for)
    timeout = max(1.0, min(step.timeout_s, left - keep - 5))
    if step.before is not None:
        step.before(ctx)
    importlib.invalidate_caches()  # earlier steps may have installed or unpacked packages
    ctx.say(f"{stage}/{step.name}: start, limit {timeout:.0f} s" + (f" ({shlex.join(step.argv)})" if step.argv else ""))
    t = time.monotonic()
    timed_out = False
    logs = ctx.kit / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        if step.fn is not None:
            buf = _Tee(ctx.kit / "logs" / f"{stage}-{step.name}.txt")
            try:
                with contextlib.redirect_stdout(buf):
                    res = step.fn(ctx) or {}
            finally:
                buf.file.close()
            rc, text = (0 if res.get("ok", True) is not False else 1), buf.getvalue()
        else:
            if ctx.inprocess:
                rc, text = run_inprocess(step.argv, ctx.env())
            else:
                rc, text, timed_out = run_subprocess(step.argv, ctx.env(), timeout,
                                                     logs / f"{stage}-{step.name}.txt")
            res = step.parse(text, ctx) if step.parse is not None else {}
    except Exception as e:  # a parser or a kit function failed: the step failed, the call goes on
        rc, text, res = 1, traceback.format_exc(), {"ok": False, "error": f"{type(e).__name__}: {e}"}
    seconds = round(time.monotonic() - t, 1)
    if ctx.log_path is not None:
        with ctx.log_path.open("a") as f:
            f.write(f"\n===== {stage}/{step.name} (rc {rc}, {seconds} s)"
                    + (f": {shlex.join(step.argv)}" if step.argv else "") + "\n" + text.rstrip() + "\n=====\n")
    ok = rc == 0 and res.get("ok", True) is not False
    pending = bool(res.get("pending"))
    st.pop("note", None)
    if timed_out and timeout < step.timeout_s:
        status = "deferred"  # cut by this call's end (or the later steps' share), not by its own limit
        st["note"] = f"cut at {timeout:.0f} s, short of its limit of {step.timeout_s} s, to leave the call's " \
                     "end or the later steps their time: runs again next call"
    elif pending:
        status = "pending"
    elif timed_out:
        status = "failed"
        st["note"] = f"ran past its own limit of {step.timeout_s} s"
    else:
        status = "ok" if ok else "failed"
    st.update(status=status, rc=rc, seconds=seconds, when=now(), result=res, call=ctx.state.get("call"),
              call_command=ctx.state.get("command"))
    if step.argv:
        st["command"] = shlex.join([Path(sys.executable).name, *step.argv])
    tail = "" if ok else " — " + (res.get("error") or (text.strip().splitlines() or ["(no output)"])[-1])[-300:]
    ctx.say(f"{stage}/{step.name}: {st['status']} in {seconds} s{tail}")
    ctx.save_state()
    return True
