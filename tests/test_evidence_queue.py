"""benchmarks/evidence_queue.py: the committed rows follow the queue's runs when a seed is set aside."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _queue(monkeypatch, repo: Path):
    spec = importlib.util.spec_from_file_location("evidence_queue_t", BENCHMARKS / "evidence_queue.py")
    q = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(q)
    monkeypatch.setattr(q, "REPO", repo)
    monkeypatch.setattr(q, "ROWS", repo / "docs" / "results" / "compare-rows")
    return q


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def _committed(monkeypatch, tmp_path, repo: Path, message: str = "rows"):
    """``repo`` made a git repository with everything in it committed (the queue's checkout; commits by "t"), and
    the queue module bound to it."""
    _git(tmp_path, "init", "-q", str(repo))
    for k, v in (("NAME", "t"), ("EMAIL", "t@t")):
        monkeypatch.setenv(f"GIT_AUTHOR_{k}", v)
        monkeypatch.setenv(f"GIT_COMMITTER_{k}", v)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _queue(monkeypatch, repo)


def test_a_seed_set_aside_by_a_new_tuning_leaves_the_committed_rows(monkeypatch, tmp_path):
    repo, runs, state = tmp_path / "repo", tmp_path / "runs", tmp_path / "state"
    state.mkdir()
    row = repo / "docs" / "results" / "compare-rows" / "b48k" / "row"
    (row / "seed-1").mkdir(parents=True)
    old = json.dumps({"seed": 1, "wall_s": 1.0, "hyperparameters": {"lr": 2e-4}}) + "\n"
    (row / "seed-1" / "compare_row.json").write_text(old)
    (row / "seed-2").mkdir()
    (row / "seed-2" / "compare_row.json").write_text(old.replace('"seed": 1', '"seed": 2'))
    q = _committed(monkeypatch, tmp_path, repo)
    # the queue's runs: seed 1 set aside (its new run still under way, no row yet), seed 2 untouched
    (runs / "b48k" / "row" / "seed-1.superseded-lr-0.0002").mkdir(parents=True)
    (runs / "b48k" / "row" / "seed-1.superseded-lr-0.0002" / "compare_row.json").write_text(old)
    (runs / "b48k" / "row" / "seed-1" / "model").mkdir(parents=True)
    (runs / "b48k" / "row" / "seed-2").mkdir(parents=True)
    (runs / "b48k" / "row" / "seed-2" / "compare_row.json").write_text(
        (row / "seed-2" / "compare_row.json").read_text())
    q.sync(state, runs)
    assert (row / "seed-1.superseded-lr-0.0002" / "compare_row.json").read_text() == old
    assert not (row / "seed-1").exists() and (row / "seed-2" / "compare_row.json").is_file()
    tracked = _git(repo, "ls-files").split()
    assert "docs/results/compare-rows/b48k/row/seed-1/compare_row.json" not in tracked
    assert "docs/results/compare-rows/b48k/row/seed-1.superseded-lr-0.0002/compare_row.json" in tracked
    assert _git(repo, "status", "--porcelain") == ""
    # the new run lands: committed where the old one was
    new = old.replace("0.0002", "0.0004")
    (runs / "b48k" / "row" / "seed-1" / "compare_row.json").write_text(new)
    q.sync(state, runs)
    assert (row / "seed-1" / "compare_row.json").read_text() == new


def test_a_row_replaced_in_its_folder_takes_the_old_runs_other_records_with_it(monkeypatch, tmp_path):
    """A seed set aside and run again can land its new row before a sync sees the folder empty: the committed
    folder then held the old run's first_windows.json beside the new row (192k paper-exact seed 0 showed λ 1e-4's
    figure beside λ 2.6e-3's run). The records the run folder no longer has go with the replaced row."""
    repo, runs, state = tmp_path / "repo", tmp_path / "runs", tmp_path / "state"
    state.mkdir()
    row = repo / "docs" / "results" / "compare-rows" / "b192k" / "cast" / "seed-0"
    row.mkdir(parents=True)
    old = json.dumps({"seed": 0, "wall_s": 1.0, "hyperparameters": {"l1_decay": 1e-4}}) + "\n"
    (row / "compare_row.json").write_text(old)
    (row / "first_windows.json").write_text('{"windows": 64, "wikitext2_ppl": 384.17}\n')
    (row / "queue.json").write_text('{"paused_s": 1}\n')
    (row / "wikitext_rescored.json").write_text('{"row_test_ppl": 98.61}\n')
    q = _committed(monkeypatch, tmp_path, repo)
    run = runs / "b192k" / "cast" / "seed-0"
    run.mkdir(parents=True)
    new = old.replace("0.0001", "0.0026")
    (run / "compare_row.json").write_text(new)
    (run / "wikitext_rescored.json").write_text('{"row_test_ppl": 43.33}\n')  # the new run has its own
    q.sync(state, runs)
    assert (row / "compare_row.json").read_text() == new
    assert not (row / "first_windows.json").exists() and not (row / "queue.json").exists()
    assert (row / "wikitext_rescored.json").read_text() == '{"row_test_ppl": 43.33}\n'
    tracked = _git(repo, "ls-files").split()
    assert "docs/results/compare-rows/b192k/cast/seed-0/first_windows.json" not in tracked
    assert _git(repo, "status", "--porcelain") == ""
    assert "first_windows.json, queue.json removed" in _git(repo, "log", "-2", "--format=%s")
    # the same run's row written again (a field added) keeps the records beside it, the pause record included
    (row / "queue.json").write_text('{"paused_s": 2}\n')
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "pause record")
    (run / "compare_row.json").write_text(new.rstrip("\n")[:-1] + ', "x": 1}\n')
    q.sync(state, runs)
    assert (row / "queue.json").is_file() and (row / "compare_row.json").read_text() != new


def test_a_mask_swap_line_commits_its_rows_and_learned_masks_under_its_own_folder(monkeypatch, tmp_path):
    """A queue line ``mask_swap.py ...`` keeps its runs apart and commits its rows and the learned masks (binary
    files, byte for byte) under ``docs/results/mask-swap-rows``; a one-shot mask (rebuilt from its command) and
    a model folder are not committed."""
    repo, state = tmp_path / "repo", tmp_path / "state"
    (repo / "docs" / "results" / "compare-rows").mkdir(parents=True)
    (repo / "README").write_text("x\n")
    q = _committed(monkeypatch, tmp_path, repo, "init")
    dest = repo / "docs" / "results" / "mask-swap-rows"
    monkeypatch.setattr(q, "SCRIPTS", {"mask_swap.py": ("mask-swap", dest)})
    runs = state / "mask-swap" / "m-48k"
    (runs / "masks" / "magnitude-model").mkdir(parents=True)
    blob = bytes(range(256)) * 3
    (runs / "masks" / "learned-x-seed-0.safetensors").write_bytes(blob)
    (runs / "masks" / "magnitude.safetensors").write_bytes(blob)
    (runs / "learners" / "cast" / "seed-0" / "model").mkdir(parents=True)
    (runs / "learners" / "cast" / "seed-0" / "model" / "compare_row.json").write_text("{}")
    (runs / "learners" / "cast" / "seed-0" / "compare_row.json").write_text(json.dumps({"test": 9.0, "wikitext2": 9.5}))
    q.sync(state, state / "mask-swap", dest)
    assert (dest / "m-48k" / "masks" / "learned-x-seed-0.safetensors").read_bytes() == blob
    assert not (dest / "m-48k" / "masks" / "magnitude.safetensors").exists()
    assert json.loads((dest / "m-48k" / "learners" / "cast" / "seed-0" / "compare_row.json").read_text())["test"] == 9
    assert not (dest / "m-48k" / "learners" / "cast" / "seed-0" / "model").exists()
    assert _git(repo, "status", "--porcelain") == ""
    assert len(_git(repo, "log", "--oneline").splitlines()) == 3


def test_the_clone_follows_the_checkouts_code_between_lines_only(monkeypatch, tmp_path):
    """A line runs on the last commit of this checkout's code (a line that uses an option committed after the
    queue started no longer fails in the older clone); the queue's own row commits, which change no code, leave
    the clone where it is."""
    repo, state = tmp_path / "repo", tmp_path / "state"
    script = repo / "benchmarks" / "compare_methods.py"
    script.parent.mkdir(parents=True)
    (repo / "docs" / "results" / "compare-rows").mkdir(parents=True)
    (repo / "docs" / "results" / "compare-rows" / ".keep").write_text("")
    body = ("import sys, pathlib\nout = pathlib.Path(sys.argv[sys.argv.index('--runs-dir') + 1]).parent\n"
            "with open(out / 'ran.txt', 'a') as f:\n    f.write('{v} ' + sys.argv[1] + '\\n')\n")
    script.write_text(body.replace("{v}", "v1"))
    queue = repo / "benchmarks" / "evidence-queue.txt"
    queue.write_text("a\n")
    q = _committed(monkeypatch, tmp_path, repo, "v1")
    state.mkdir()
    _git(state, "clone", "-q", str(repo), str(state / "clone"))
    assert q.run(queue, state) == 0 and (state / "ran.txt").read_text() == "v1 a\n"
    (repo / "docs" / "results" / "compare-rows" / "row.json").write_text("{}")  # a row commit: no code
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "row")
    queue.write_text("a\nb\n")  # the queue file is read from the checkout, never the clone's code
    assert q.follow_head(state / "clone") is None
    script.write_text(body.replace("{v}", "v2"))
    _git(repo, "commit", "-q", "-am", "v2")
    queue.write_text("a\nb\nc\n")
    assert q.run(queue, state) == 0
    assert (state / "ran.txt").read_text() == "v1 a\nv2 b\nv2 c\n"
    assert q.follow_head(state / "clone") is None


def _compare_methods():
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(BENCHMARKS))
    return compare_methods


def _queue_lines() -> list[list[str]]:
    """The committed queue's lines as the queue reads them (its ``queue_lines``), each split into arguments."""
    import shlex

    spec = importlib.util.spec_from_file_location("evidence_queue_lines", BENCHMARKS / "evidence_queue.py")
    q = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(q)
    return [shlex.split(x) for x in q.queue_lines(BENCHMARKS / "evidence-queue.txt")]


def test_every_line_of_the_committed_queue_is_a_valid_invocation(tmp_path):
    """A line the queue reaches hours from now fails then, stopping the queue (a mistyped row key, a tier setting
    that does not exist, a malformed grid): each compare_methods line is built into its Comparison here."""
    cm = _compare_methods()
    lines = [a for a in _queue_lines() if a[0] != "mask_swap.py"]
    assert lines
    for args in lines:
        cm.Comparison(cm.parse_args([*args, "--runs-dir", str(tmp_path / "runs"), "--docs-dir",
                                     str(tmp_path / "docs")]))
    for bad in (["--only", "cast-best-norepair"], ["--set", "wikitext_window=0"]):  # the check itself refuses
        with pytest.raises(SystemExit):
            cm.Comparison(cm.parse_args([*lines[-1], *bad, "--runs-dir", str(tmp_path / "runs"), "--docs-dir",
                                         str(tmp_path / "docs")]))


def test_status_says_what_runs_how_far_each_run_is_and_what_follows(monkeypatch, tmp_path):
    """``evidence_queue.py status``: the queue's lines done, the line under way with each training run's step of
    its total and when its training ends at its rate (or its final evaluation, which writes nothing for many
    minutes), and the lines after it; a finished run, and one whose job is gone, are not listed as under way."""
    import sys
    import time

    q = _queue(monkeypatch, tmp_path)
    state = tmp_path / "state"
    queue = tmp_path / "queue.txt"
    queue.write_text("# a comment\n--tokens 48k --only a\n--tokens 192k --only b\n--tokens 384k --only c\n")
    (state / "runs").mkdir(parents=True)
    (state / "done.json").write_text(json.dumps(["--tokens 48k --only a"]))

    jobs = []

    def run(name, step, finished=False, alive=True):
        d = state / "runs" / "smollm2-135m-192k" / name / "seed-0"
        (d / "model").mkdir(parents=True)
        # the job holding the folder: a process whose command line names it, as `cast-llm train --output-dir` does
        job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(d / "model")])
        jobs.append(job)
        cmdline = Path(f"/proc/{job.pid}/cmdline")
        for _ in range(500):  # until it has exec'd (between fork and exec it shows this process's command line)
            if str(d / "model").encode() in cmdline.read_bytes():
                break
            time.sleep(0.01)
        if not alive:
            job.kill()
            job.wait()
        (d / "model" / ".cast-llm.lock").write_text(json.dumps({"pid": job.pid, "host": "vm"}))
        (d / "log.txt").write_text("model smollm2-135m: ...; 282 steps × 512 tokens on 1 process(es), cpu\n")
        (d / "model" / "metrics.jsonl").write_text(json.dumps({"step": step - 10, "tokens_per_s": 60.0}) + "\n"
                                                   + json.dumps({"step": step, "tokens_per_s": 64.0}) + "\n")
        if finished:
            (d / "compare_row.json").write_text("{}")
        return d

    run("b", 180)
    run("done", 282, finished=True)
    run("stopped", 90, alive=False)
    run("evaluating", 282)
    starting = run("starting", 0)  # a job still in its start-up (a one-shot warm start): no metrics yet
    (starting / "model" / "metrics.jsonl").unlink()
    (state / "runs" / "other" / "seed-0" / "model").mkdir(parents=True)  # a lock naming another folder's job
    (state / "runs" / "other" / "seed-0" / "model" / ".cast-llm.lock").write_text(json.dumps({"pid": jobs[0].pid}))
    (state / "runs" / "other" / "seed-0" / "model" / "metrics.jsonl").write_text("{}\n")
    try:
        out = q.status(queue, state).splitlines()
    finally:
        for job in jobs:
            job.kill()
            job.wait()
    assert out[0].startswith("queue: not running; 1 of 3 lines done")
    assert out[1] == "next: --tokens 192k --only b"
    assert out[2:4] == ["  smollm2-135m-192k/b/seed-0: step 180 / 282 (64 %), 64 tokens/s: training ends in ~14 min, "
                        "then its final evaluation",
                        "  smollm2-135m-192k/evaluating/seed-0: step 282 / 282: its final evaluation"], out
    assert out[4:] == ["  smollm2-135m-192k/starting/seed-0: starting", "then: --tokens 384k --only c"], out
