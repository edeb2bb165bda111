"""Faults injected into real `cast-llm train` runs, and what each run kept and lost.

Every scenario trains a tiny random LLaMA (built locally, CPU, seconds) next to an uninterrupted reference
run with the same settings, injects one fault, recovers the way a user would (``--resume`` / ``--resume
auto``), and compares: the step the kept checkpoint holds, how many optimizer steps were lost (to be redone
after the resume), and whether the resumed run's final weights and metrics are bitwise those of the
reference. Writes ``docs/results/reliability.md``::

    python benchmarks/reliability.py [--out docs/results/reliability.md] [--work /tmp/cast-reliability]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pickle
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import tiny  # noqa: E402

from cast_llm.io import RunDir  # noqa: E402

STEPS = 12


def _last_line(stderr: str) -> str:
    """The error a user saw (its last line), whole: the table quotes it."""
    lines = stderr.strip().splitlines()
    return lines[-1].replace("|", "/") if lines else "(no message)"
TRAIN = ["--batch-size", "2", "--seq-len", "32", "--log-every", "1", "--val-sequences", "2", "--no-progress",
         "--lr", "1e-3", "--l1-decay", "1e-4", "--mask-interval", "2", "--no-baseline-eval", "--device", "cpu",
         "--max-steps", str(STEPS)]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from cast_llm.cli import main; sys.exit(main(sys.argv[1:]))", *args]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Work:
    def __init__(self, root: Path):
        self.root = root
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        tiny.save_model(root / "llama", "llama")
        tiny.write_corpus(root / "corpus.jsonl")
        (root / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))

    def args(self, out: Path, *extra: str) -> list[str]:
        return ["train", "--model", str(self.root / "llama"), "--data", str(self.root / "corpus.jsonl"),
                "--wikitext-file", str(self.root / "eval.txt"), "--output-dir", str(out), *TRAIN, *extra]

    def run(self, args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cli(*args), env=ENV, capture_output=True, text=True, timeout=600)

    def start(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(cli(*args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_step(out: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while not (RunDir(out).metrics.is_file() and len(RunDir(out).metrics.read_text().splitlines()) >= step):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError("the run ended before the fault")
        time.sleep(0.01)


def steps_done(out: Path) -> int:
    m = RunDir(out).metrics
    return len(m.read_text().splitlines()) if m.is_file() else 0


def kept_step(out: Path) -> int | None:
    done = [c for c in (out / "checkpoints").glob("step-*") if (c / "meta.json").is_file()] \
        if (out / "checkpoints").is_dir() else []
    return max(json.loads((c / "meta.json").read_text())["step"] for c in done) if done else None


def same_run(ref: Path, cut: Path) -> bool:
    if not (cut / "model.safetensors").is_file():
        return False
    a, b = load_file(ref / "model.safetensors"), load_file(cut / "model.safetensors")
    if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
        return False
    strip = lambda p: [{k: v for k, v in json.loads(x).items() if k != "tokens_per_s"}  # noqa: E731
                       for x in RunDir(p).metrics.read_text().splitlines()]
    return strip(ref) == strip(cut)


def checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def scenarios(w: Work) -> list[dict]:
    ref = w.root / "ref"
    r = w.run(w.args(ref))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = []

    def row(fault, how, kept, lost, recovered, note, cmd):
        rows.append({"fault": fault, "how": how, "kept": kept, "lost": lost, "recovered": recovered,
                     "note": note, "command": cmd})
        print(f"{fault}: kept {kept}, lost {lost}, recovered: {recovered} — {note}", flush=True)

    # 1-2. a signal, no --save-every
    for sig in (signal.SIGTERM, signal.SIGINT):
        out = w.root / f"sig-{sig.name}"
        p = w.start(w.args(out))
        wait_step(out, 5, p)
        at = steps_done(out)
        p.send_signal(sig)
        _, err = p.communicate(timeout=300)
        k = kept_step(out)
        r = w.run(["train", "--output-dir", str(out), "--resume", "auto"])
        row(f"{sig.name} (preemption / Ctrl-C)", f"{sig.name} after step {at}, no --save-every",
            f"checkpoint at step {k} (exit {p.returncode})", f"{max(0, at - k) if k else 'all'} steps (the step "
            "in flight finished)", r.returncode == 0 and same_run(ref, out),
            "resumed with `--resume auto` alone (settings from the run's config.yaml)",
            f"cast-llm train ... ; kill -{sig.name[3:]} PID; cast-llm train --output-dir RUN --resume auto")

    # 3. a second signal while the job is stopping
    out = w.root / "double"
    p = w.start(w.args(out, "--save-every", "3"))
    wait_step(out, 7, p)
    at = steps_done(out)
    p.send_signal(signal.SIGTERM)
    for line in p.stdout:  # the job says it is stopping: now the second one
        if "received" in line:
            p.send_signal(signal.SIGTERM)
            break
    p.communicate(timeout=300)
    k = kept_step(out)
    r = w.run(["train", "--output-dir", str(out), "--resume"])
    row("SIGTERM twice", f"SIGTERM after step {at}, a second one once the job said it was stopping; "
        "--save-every 3", f"checkpoint at step {k} (exit {p.returncode})",
        f"{max(0, at - (k or 0))} steps (since the last complete checkpoint)", r.returncode == 0 and same_run(ref, out),
        "exit 130: stopped at once, the last complete checkpoint intact; exit 75: the stop had finished first",
        "kill -TERM PID; kill -TERM PID; cast-llm train --output-dir RUN --resume")

    # 4. kill -9
    out = w.root / "kill9"
    p = w.start(w.args(out, "--save-every", "4"))
    wait_step(out, 6, p)
    at = steps_done(out)
    p.kill()
    p.communicate()
    k = kept_step(out)
    r = w.run(["train", "--output-dir", str(out), "--resume"])
    row("kill -9 (node lost)", f"SIGKILL after step {at}, --save-every 4", f"checkpoint at step {k}",
        f"{max(0, at - (k or 0))} steps (since the last checkpoint)", r.returncode == 0 and same_run(ref, out),
        "nothing can be saved on SIGKILL: --save-every bounds the loss", "kill -9 PID; cast-llm train --output-dir RUN --resume")

    # 5. disk full while writing a checkpoint, then a crash
    out = w.root / "enospc"
    code = ("import sys, errno, safetensors.torch as st; from cast_llm.train import trainer; real = st.save_file\n"
            "def full(t, f, *a, **k):\n"
            "    if 'step-00000006' in str(f): raise OSError(errno.ENOSPC, 'No space left on device', str(f))\n"
            "    return real(t, f, *a, **k)\n"
            "st.save_file = full\n"
            "rb = trainer.PretrainJob.batch\n"
            "def crash(self, step, micro):\n"
            "    if step == 8: raise SystemExit(99)\n"
            "    return rb(self, step, micro)\n"
            "trainer.PretrainJob.batch = crash\n"
            "from cast_llm.cli import main; sys.exit(main(sys.argv[1:]))")
    r0 = subprocess.run([sys.executable, "-c", code, *w.args(out, "--save-every", "3")], env=ENV,
                        capture_output=True, text=True, timeout=600)
    k = kept_step(out)
    torn = [c.name for c in (out / "checkpoints").iterdir() if not (c / "meta.json").is_file()]
    r = w.run(["train", "--output-dir", str(out), "--resume"])
    row("disk full (ENOSPC) during a checkpoint, then a crash", "ENOSPC while writing step 6, crash in step 9",
        f"checkpoint at step {k}; no torn folder ({len(torn)})", f"{8 - (k or 0)} steps",
        r.returncode == 0 and same_run(ref, out) and "No space left" in r0.stdout + r0.stderr,
        "the failed write is a warning naming the path and the reason; the run went on",
        "(simulated ENOSPC in safetensors' writer) cast-llm train ... --save-every 3; cast-llm train --output-dir RUN --resume")

    # 6. a pickle planted in a checkpoint
    out = w.root / "pickle"
    r = w.run(w.args(out, "--save-every", "4", "--keep-checkpoints-after"))
    ck = sorted((out / "checkpoints").iterdir())[-1]
    marker = w.root / "PAYLOAD-RAN"
    (ck / "model.pt").write_bytes(pickle.dumps(Payload(str(marker))))
    r = w.run(["train", "--output-dir", str(out), "--resume"])
    row("a crafted pickle in a checkpoint folder", "model.pt whose unpickling would run `touch`", "the model is "
        "untouched", "—", r.returncode == 2 and not marker.exists(),
        f"refused: {_last_line(r.stderr)}; the payload never ran", "cast-llm train --output-dir RUN --resume")

    # 7. a second job on the same folder
    out = w.root / "busy"
    p = w.start(w.args(out, "--max-steps", "200"))
    wait_step(out, 2, p)
    r = w.run(w.args(out, "--overwrite"))
    p.kill()
    p.communicate()
    row("a second job on a folder in use", "`cast-llm train` twice on one --output-dir", "the first run's files",
        "—", r.returncode == 2, _last_line(r.stderr), "cast-llm train --output-dir RUN ... (twice)")

    # 8. --overwrite onto the model's own folder
    model = w.root / "tiny-copy"
    tiny.save_model(model, "llama")
    before = checksums(model)
    r = w.run(["train", "--model", str(model), "--data", str(w.root / "corpus.jsonl"), "--output-dir", str(model),
               "--overwrite", *TRAIN])
    row("--overwrite onto the model's own folder", "`--model tiny-copy --output-dir tiny-copy --overwrite`",
        "every file of the model (checksums equal)", "—", r.returncode == 2 and checksums(model) == before,
        _last_line(r.stderr), "cast-llm train --model tiny-copy --output-dir tiny-copy --overwrite")
    return rows


def write(rows: list[dict], out: Path, seconds: float) -> None:
    lines = [
        "# Reliability: faults injected into training runs, and what was kept",
        "",
        f"Generated {datetime.date.today().isoformat()} by `python benchmarks/reliability.py` ({seconds:.0f} s) on "
        f"{platform.machine()} / {platform.system()}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"CPU. Each fault hits a `cast-llm train` run of a tiny random LLaMA ({STEPS} steps, 1 process) next to an "
        "uninterrupted reference run; \"recovered\" means the recovery shown ended with final weights and metrics "
        "**bitwise** equal to the reference (or, for the refusals, that the refusal happened and nothing was "
        "touched). The same faults are tests in `tests/test_reliability.py` (which also stops one rank of a "
        "2-process DDP run with SIGTERM, and fine-tuning runs).",
        "",
        "| fault | injected | kept | lost | recovered | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['fault']} | {r['how']} | {r['kept']} | {r['lost']} | {'yes' if r['recovered'] else '**no**'} "
                     f"| {r['note'].replace('|', '/')} |")
    lines += ["", "Commands (RUN = the run folder):", ""] + [f"- {r['fault']}: `{r['command']}`" for r in rows]
    out.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "reliability.md"))
    p.add_argument("--work", default="/tmp/cast-reliability")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = scenarios(Work(Path(a.work)))
    write(rows, Path(a.out), time.perf_counter() - t0)
    print(f"wrote {a.out}")
    return 0 if all(r["recovered"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
