"""cast_llm.io: the one set of helpers every writer of the package goes through."""

from __future__ import annotations

import json
import os
import stat

import pytest

from cast_llm.io import (
    append_jsonl,
    atomic_dir,
    atomic_write,
    atomic_write_text,
    move_into,
    publish_dir,
    read_json,
    read_jsonl,
    staging_dir,
    truncate_jsonl,
)


def test_atomic_write_leaves_the_old_file_when_the_writer_fails(tmp_path):
    f = tmp_path / "a.json"
    atomic_write_text(f, "old")

    def failing(fh):
        fh.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(f, failing)
    assert f.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]
    assert stat.S_IMODE(f.stat().st_mode) == 0o644


def test_jsonl_truncate_keeps_through_a_step_and_skips_a_torn_line(tmp_path):
    f = tmp_path / "m.jsonl"
    for step in (1, 2, 3, 4):
        append_jsonl(f, {"step": step, "loss": step / 10})
    with f.open("a") as fh:
        fh.write('{"step": 5, "lo')  # a writer killed mid-line
    assert [r["step"] for r in read_jsonl(f)] == [1, 2, 3, 4]
    truncate_jsonl(f, keep_through=2)
    assert f.read_text() == "".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in (1, 2))
    truncate_jsonl(tmp_path / "missing.jsonl", 3)  # nothing to do
    assert read_json(tmp_path / "missing.json") == {} and read_json(tmp_path / "missing.json", []) == []


def test_atomic_dir_and_publish_dir(tmp_path):
    final = tmp_path / "ck"
    with atomic_dir(final) as tmp:
        (tmp / "a").write_text("1")
    assert (final / "a").read_text() == "1" and not (tmp_path / "ck.tmp").exists()
    with pytest.raises(FileExistsError), atomic_dir(final) as tmp:
        (tmp / "a").write_text("2")
    assert (final / "a").read_text() == "1" and not (tmp_path / "ck.tmp").exists()
    with atomic_dir(final, replace=True) as tmp:
        (tmp / "b").write_text("3")
    assert sorted(p.name for p in final.iterdir()) == ["b"] and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(FileExistsError):
        publish_dir(other, final)
    assert other.is_dir() and (final / "b").is_file()


def test_staging_dir_then_move_into_puts_the_marker_last_and_cleans_up(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("mine")
    (out / "done.json").write_text("stale")  # the marker of an earlier export
    moved = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (moved.append(os.path.basename(b)), real_replace(a, b)))
    with staging_dir(out, prefix=".export-") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".export-")
        for name in ("model.safetensors", "config.json", "done.json"):
            (tmp / name).write_text(name)
        os.chmod(tmp / "config.json", 0o600)
        names = move_into(tmp, out, last="done.json")
    assert names == ["config.json", "model.safetensors", "done.json"] and moved[-1] == "done.json"
    assert (out / "metrics.jsonl").read_text() == "mine" and (out / "done.json").read_text() == "done.json"
    assert stat.S_IMODE((out / "config.json").stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # the staging folder is gone
    with pytest.raises(RuntimeError), staging_dir(out, prefix=".export-"):
        raise RuntimeError("export failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_run_dir_names_the_files_the_trainer_writes(tmp_path):
    from pathlib import Path

    from cast_llm.io import RunDir
    from cast_llm.train.rundir import RUN_FILES, RUN_MARKER

    run = RunDir(tmp_path / "run")
    assert run.results == tmp_path / "run" / "results.json" and run.metrics.name == "metrics.jsonl"
    assert run.marker.name == RUN_MARKER and run.config.name == "config.yaml" and run / "x" == tmp_path / "run" / "x"
    assert set(RUN_FILES) == set(RunDir.OWN) and RunDir.MARKER not in RunDir.OWN  # the marker is never replaced
    assert Path(run) == tmp_path / "run"


# the one spelling of a run folder's file names outside io.RunDir that is not one: the HTML report's page inside its
# own folder (RUN/report/report.html), which shares RunDir.REPORT's name
NOT_RUN_FOLDER_PATHS = {("report/build.py", "report.html")}


def _path_literals(tree):
    """(line, name) of every ``PATH / "name"`` and ``f"{PATH}/name"`` in a module's syntax tree."""
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                and isinstance(node.right.value, str):
            yield node.lineno, node.right.value
        elif isinstance(node, ast.JoinedStr):
            for part in node.values:
                if isinstance(part, ast.Constant) and "/" in part.value:
                    yield node.lineno, part.value.rsplit("/", 1)[-1]


def test_run_folder_paths_are_spelled_only_by_run_dir_and_results_have_one_writer():
    """No module builds a path to a run-folder file from its name (``out / "results.json"``): they go through
    RunDir (cast_llm.io) or the checkpoint's own names; and results.json is written by rundir.write_results
    alone (a module calling a writer on ``….results`` / ``RunDir.RESULTS`` elsewhere fails)."""
    import ast
    from pathlib import Path

    from cast_llm.io import RunDir
    from cast_llm.train.checkpoint import SAVE_MARKER
    from cast_llm.train.rundir import PREVIOUS

    names = {v for k, v in vars(RunDir).items() if k.isupper() and isinstance(v, str)} | {SAVE_MARKER, PREVIOUS}
    src = Path(__file__).resolve().parents[1] / "src" / "cast_llm"
    spelled, writers = [], []
    for f in sorted(src.rglob("*.py")):
        rel = f.relative_to(src).as_posix()
        tree = ast.parse(f.read_text(encoding="utf-8"))
        spelled += [f"{rel}:{line} {name}" for line, name in _path_literals(tree)
                    if name in names and (rel, name) not in NOT_RUN_FOLDER_PATHS]
        for node in ast.walk(tree):
            if rel != "train/rundir.py" and isinstance(node, ast.Call) and node.args and isinstance(
                    node.func, ast.Name) and node.func.id.startswith(("atomic_write", "write_")) and any(
                    isinstance(n, ast.Attribute) and n.attr in ("results", "RESULTS") for n in ast.walk(node.args[0])):
                writers.append(f"{rel}:{node.lineno}")
    assert not spelled, f"run-folder file names spelled outside RunDir: {spelled}"
    assert not writers, f"results.json written outside train/rundir.py's write_results: {writers}"

def test_a_killed_process_s_staging_folder_is_removed_by_the_next_one(tmp_path):
    """staging_dir names its folder by host and pid; the next one made beside it removes only folders of
    this host whose process is gone."""
    import subprocess
    import sys

    from cast_llm.io import _host, staging_dir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f".export-{_host()}-{dead}-abc"
    live = tmp_path / f".export-{_host()}-{os.getppid()}-def"
    other_host = tmp_path / f".export-elsewhere-{dead}-ghi"
    other_prefix = tmp_path / f".stage-{_host()}-{dead}-jkl"
    for d in (stale, live, other_host, other_prefix):
        (d / "part").mkdir(parents=True)
    with staging_dir(tmp_path / "model", prefix=".export-") as tmp:
        assert tmp.name.startswith(f".export-{_host()}-{os.getpid()}-")
    assert not stale.exists() and live.exists() and other_host.exists() and other_prefix.exists()
    assert not tmp.exists()


def test_atomic_write_takes_its_mode_from_the_umask_and_follows_no_planted_link(tmp_path):
    import os

    from cast_llm.io import atomic_write_text

    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "results.json"
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # the temporary names the old code used
        (tmp_path / f".results.json.{pid}.tmp").symlink_to(victim)
    old = os.umask(0o077)
    try:
        atomic_write_text(target, "{}")
    finally:
        os.umask(old)
    assert victim.read_text() == "precious"
    assert target.read_text() == "{}" and (target.stat().st_mode & 0o777) == 0o600
    link = tmp_path / "linked.json"
    link.symlink_to(victim)  # a link at the target itself: replaced, its target untouched
    atomic_write_text(link, "new")
    assert victim.read_text() == "precious" and not link.is_symlink() and link.read_text() == "new"


@pytest.mark.parametrize("content, says", [(b"{", "not valid JSON"), (b"\xff\xfe{}", "not UTF-8"),
                                           (b"[]", "JSON list, not an object"), (b"", "not valid JSON")])
def test_read_json_object_says_what_is_wrong_in_one_line(tmp_path, content, says):
    from cast_llm.errors import CastError
    from cast_llm.io import read_json_object

    p = tmp_path / "config.json"
    p.write_bytes(content)
    with pytest.raises(CastError) as e:
        read_json_object(p, "the model's config")
    assert says in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_append_jsonl_never_writes_through_a_planted_link(tmp_path):
    from cast_llm.errors import CastError
    from cast_llm.io import append_jsonl

    victim = tmp_path / "victim"
    victim.write_text("precious")
    for target in (victim, tmp_path / "dangling"):
        link = tmp_path / f"metrics-{target.name}.jsonl"
        link.symlink_to(target)
        with pytest.raises(CastError, match="is a link"):
            append_jsonl(link, {"step": 1})
    assert victim.read_text() == "precious" and not (tmp_path / "dangling").exists()
    append_jsonl(tmp_path / "ok.jsonl", {"step": 1})
    append_jsonl(tmp_path / "ok.jsonl", {"step": 2})
    assert (tmp_path / "ok.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
