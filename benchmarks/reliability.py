"""Faults injected into real `cast-llm train` runs, and what each run kept and lost.

Every scenario trains a tiny random LLaMA (built locally, CPU, seconds) next to an uninterrupted reference
run with the same settings, injects one fault, recovers the way a user would (``--resume`` / ``--resume
auto``), and compares: the step the kept checkpoint holds, how many optimizer steps were lost (to be redone
after the resume), and whether the resumed run's final weights and metrics are bitwise those of the
reference; then the folder faults of issue 49 (an output onto its input, a marker naming files outside its
folder, a planted link, folders naming code, hostile GGUF / compressed-tensors headers), each with what was
kept. Writes ``docs/results/reliability.md``::

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
    # (checkpoints write their tensors through state_io.write_safetensors, not safetensors' save_file)
    code = ("import sys, errno; from cast_llm.train import state_io, trainer; real = state_io.write_safetensors\n"
            "def full(t, f, *a, **k):\n"
            "    if 'step-00000006' in str(f): raise OSError(errno.ENOSPC, 'No space left on device', str(f))\n"
            "    return real(t, f, *a, **k)\n"
            "state_io.write_safetensors = full\n"
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
        "(simulated ENOSPC in the checkpoint's writer) cast-llm train ... --save-every 3; cast-llm train --output-dir RUN --resume")

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
    rows += folder_scenarios(w, ref)
    return rows


MEASURED = ("import resource, sys, time; from cast_llm.cli import main; t = time.perf_counter(); rc = main(sys.argv[1:]); "
            "print(f'MEASURED {time.perf_counter() - t:.2f} s {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}',"
            " file=sys.stderr); sys.exit(rc)")


def measured(args: list[str]) -> tuple[subprocess.CompletedProcess, str, float, float]:
    """The command run in a fresh process; (result, its error line, seconds in main, peak RSS in GiB)."""
    r = subprocess.run([sys.executable, "-c", MEASURED, *args], env=ENV, capture_output=True, text=True, timeout=600,
                       stdin=subprocess.DEVNULL)
    lines = r.stderr.strip().splitlines()
    m = [ln for ln in lines if ln.startswith("MEASURED ")]
    seconds, rss = (float(m[-1].split()[1]), int(m[-1].split()[3]) / 2**20) if m else (float("nan"), float("nan"))
    errors = [ln for ln in lines if ln.startswith("cast-llm")]
    return r, (errors[-1].replace("|", "/") if errors else "(no message)"), seconds, rss


def _one_line(r: subprocess.CompletedProcess) -> bool:
    return r.returncode == 2 and "Traceback" not in r.stderr and \
        len([ln for ln in r.stderr.splitlines() if ln.startswith("cast-llm")]) == 1


def folder_scenarios(w: Work, ref: Path) -> list[dict]:
    """Issue 49: what the tool deletes (only what it wrote), which links it follows (none), which hostile
    files it reads (none past a one-line refusal)."""
    import struct

    rows = []

    def row(fault, how, kept, recovered, note, cmd):
        rows.append({"fault": fault, "how": how, "kept": kept, "lost": "—", "recovered": recovered, "note": note,
                     "command": cmd})
        print(f"{fault}: kept {kept}, recovered: {recovered} — {note}", flush=True)

    # a sparse model to export (the reference run's), and a copy of it as "a downloaded model"
    model = w.root / "sparse"
    shutil.copytree(ref, model, ignore=shutil.ignore_patterns("checkpoints", "tensorboard", "*.jsonl", "cast_run.json"))
    before = checksums(model)
    r, line, _, _ = measured(["export", str(model), "--format", "compressed", "--output-dir", str(model), "--overwrite"])
    row("export onto its own model with --overwrite", "`export ./m --output-dir ./m --overwrite`",
        "every file of the model (checksums equal)", _one_line(r) and checksums(model) == before, line,
        "cast-llm export ./m --format compressed --output-dir ./m --overwrite")

    downloaded = w.root / "Llama-downloaded"
    tiny.save_model(downloaded, "llama")
    before = checksums(downloaded)
    r, line, _, _ = measured(["export", str(model), "--output-dir", str(downloaded), "--overwrite", "--no-verify"])
    row("export --overwrite onto a model folder cast-llm did not write", "`--output-dir ~/models/Llama --overwrite`",
        "every file of that folder (checksums equal)", _one_line(r) and checksums(downloaded) == before, line,
        "cast-llm export RUN --output-dir ~/models/Llama-3.1-8B --overwrite")

    out = w.root / "export-c"
    w.run(["export", str(model), "--format", "compressed", "--output-dir", str(out)])
    before = checksums(out)
    code = ("import sys, errno, safetensors.torch as st; real = st.save_file\n"
            "def full(t, f, *a, **k): raise OSError(errno.ENOSPC, 'No space left on device', str(f))\n"
            "st.save_file = full\n"
            "from cast_llm.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "export", str(model), "--format", "compressed", "--output-dir",
                        str(out), "--overwrite"], env=ENV, capture_output=True, text=True, timeout=600)
    row("disk full during an --overwrite export", "ENOSPC while the new export is written",
        "the previous export (checksums equal)", r.returncode != 0 and checksums(out) == before,
        f"exit {r.returncode}: {_last_line(r.stderr)}", "(simulated ENOSPC) cast-llm export RUN --output-dir OLD-EXPORT --overwrite")

    before = checksums(ref)
    r = w.run(w.args(ref, "--resume", "auto"))
    said = [ln for ln in r.stdout.splitlines() if ln.startswith("already finished")]
    row("`--resume auto` on a finished run", "the same job submitted again after it finished",
        "the finished run (checksums equal)", r.returncode == 0 and bool(said) and checksums(ref) == before,
        f"exit 0: {said[0][:160] if said else '(nothing said)'}…", "cast-llm train ... --output-dir RUN --resume auto")

    out = w.root / "replaced"
    shutil.copytree(ref, out)
    RunDir(out).lock.unlink(missing_ok=True)
    before = checksums(out)
    code = ("import sys; from cast_llm.train import trainer; rb = trainer.PretrainJob.batch\n"
            "def crash(self, step, micro):\n"
            "    if step == 3: raise SystemExit(99)\n"
            "    return rb(self, step, micro)\n"
            "trainer.PretrainJob.batch = crash\n"
            "from cast_llm.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *w.args(out, "--overwrite")], env=ENV, capture_output=True,
                       text=True, timeout=600)
    kept = checksums(out / ".cast-llm-previous") if (out / ".cast-llm-previous").is_dir() else {}
    r2 = w.run(w.args(out, "--overwrite"))
    row("`train --overwrite` of a finished run, the new run crashing", "a crash in step 4 of the replacement",
        "the replaced run, whole, in `.cast-llm-previous/` (checksums equal)",
        r.returncode == 99 and kept == before and r2.returncode == 0 and not (out / ".cast-llm-previous").exists(),
        "its files are moved aside, not deleted, and deleted only once a replacement has finished (the next "
        "`--overwrite` did)", "cast-llm train ... --output-dir RUN --overwrite")

    out = w.root / "marker"
    shutil.copytree(ref, out)
    victim = w.root / "victim-data"
    victim.mkdir(exist_ok=True)
    (victim / "precious.txt").write_text("precious")
    marker = json.loads(RunDir(out).marker.read_text())
    marker["written"] = [*marker.get("written", []), "../victim-data"]
    RunDir(out).marker.write_text(json.dumps(marker))
    before = checksums(out)
    r = w.run(w.args(out, "--overwrite"))
    row("a run marker that lists `../victim-data`", "`cast_run.json` edited to list a folder outside the run",
        "the folder outside and the run (checksums equal)", _one_line(r) and (victim / "precious.txt").exists()
        and checksums(out) == before, _last_line(r.stderr), "cast-llm train ... --output-dir RUN --overwrite")

    out = w.root / "received"
    shutil.copytree(ref, out)
    bashrc = w.root / "bashrc"
    bashrc.write_text("precious\n")
    RunDir(out).lock.unlink(missing_ok=True)  # (the copy took the reference run's own lock file)
    RunDir(out).lock.symlink_to(bashrc)
    r = w.run(w.args(out, "--resume", "auto", "--overwrite"))
    rep = w.run(["report", str(out)])
    row("a run folder whose lock is a link to `~/.bashrc`", "`.cast-llm.lock -> ~/.bashrc`; train, then report",
        "the link's target (unchanged)", _one_line(r) and rep.returncode == 0 and bashrc.read_text() == "precious\n",
        f"train: {_last_line(r.stderr)}; report: exit {rep.returncode}, the target untouched",
        "cast-llm train --output-dir RUN --resume auto --overwrite; cast-llm report RUN")

    payload = "import pathlib; pathlib.Path(__file__).with_name('PAYLOAD-RAN').write_text('ran')\nclass Attr: pass\n"
    for name, edit in (("auto_map", lambda c: c.update(auto_map={"AutoModelForCausalLM": "evil.Attr"})),
                       ("compressed-tensors format", lambda c: c.update(quantization_config={
                           "quant_method": "compressed-tensors", "sparsity_config": {"format": "evil.py:Attr"}}))):
        folder = w.root / f"code-{name.split()[0]}"
        shutil.copytree(model, folder)
        (folder / "evil.py").write_text(payload)
        cfg = json.loads((folder / "config.json").read_text())
        edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
        r, line, secs, _ = measured(["export", str(folder), "--output-dir", str(w.root / "o-code")])
        row(f"a model folder naming code ({name})", "`auto_map` → evil.Attr" if name == "auto_map" else
            "`sparsity_config.format: evil.py:Attr` (compressed-tensors 0.14 would run it)",
            "the folder; the payload never ran", _one_line(r) and not (folder / "PAYLOAD-RAN").exists(),
            f"{secs:.1f} s, no prompt: {line}", "cast-llm export FOLDER --output-dir OUT")

    gguf = w.root / "hostile.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
                     + struct.pack("<IIQ", 9, 4, 1 << 40))
    r, line, secs, rss = measured(["eval", "ppl", "--model", str(gguf)])
    row("a 49-byte GGUF whose array claims 2^40 items", f"{gguf.stat().st_size} bytes",
        f"{secs:.2f} s in the command, peak {rss:.2f} GiB", _one_line(r) and secs < 10 and rss < 1,
        line, "cast-llm eval ppl --model hostile.gguf")

    ct = w.root / "ct"
    w.run(["export", str(model), "--format", "compressed-tensors", "--output-dir", str(ct), "--no-verify"])
    from safetensors.torch import save_file
    tensors = load_file(ct / "model.safetensors")
    key = sorted(k for k in tensors if k.endswith(".shape"))[0]
    tensors[key] = torch.tensor([150000, 150000], dtype=torch.int64).view(2, 1)
    save_file(tensors, ct / "model.safetensors", metadata={"format": "pt"})
    r, line, secs, rss = measured(["export", str(ct), "--output-dir", str(w.root / "o-ct")])
    row("a compressed-tensors `.shape` of 150000 × 150000", "one target's shape tensor edited (45 GB if zero-filled)",
        f"{secs:.2f} s in the command, peak {rss:.2f} GiB", _one_line(r) and secs < 10 and rss < 1,
        line, "cast-llm export CT-FOLDER --output-dir OUT")
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
        "2-process DDP run with SIGTERM, and fine-tuning runs). The rows from \"export onto its own model\" on are "
        "the folder faults of issue 49 — what the tool deletes (only what it wrote, once the new result is "
        "complete), which planted links it follows (none), which hostile files it reads (none past a one-line "
        "refusal, exit 2; the time and peak memory are those of the whole command, imports included); they are "
        "tests in `tests/test_no_data_loss.py`.",
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
