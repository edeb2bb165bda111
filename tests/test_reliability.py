"""Runs that survive the faults of real clusters (preemption, full disks, crashes, a second job on the same
folder), checkpoints that cannot run code, and a tool that never destroys what it did not write.
Tiny random models on the CPU; the multi-process tests start 2 gloo processes with torchrun."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tiny
import torch
from run_helpers import start_cli, wait_for_step
from safetensors.torch import load_file

from cast_llm.cli import main
from cast_llm.train.preemption import EXIT_PREEMPTED

COMMON = ["--batch-size", "2", "--seq-len", "32", "--log-every", "1", "--val-sequences", "2", "--no-progress",
          "--lr", "1e-3", "--l1-decay", "1e-4", "--mask-interval", "2", "--no-baseline-eval", "--device", "cpu",
          "--no-report"]  # the HTML report: tested in test_report.py


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("reliability")
    tiny.save_model(d / "llama", "llama")
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    return d


def _args(workdir, out, *extra):
    return ["train", "--model", str(workdir / "llama"), "--data", str(workdir / "corpus.jsonl"), "--wikitext-file",
            str(workdir / "eval.txt"), "--output-dir", str(out), *COMMON, *extra]


def _same_run(ref: Path, cut: Path) -> None:
    a, b = load_file(ref / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    strip = lambda p: [{k: v for k, v in json.loads(x).items() if k != "tokens_per_s"}  # noqa: E731
                       for x in (p / "metrics.jsonl").read_text().splitlines()]
    assert strip(ref) == strip(cut)


def _checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ preemption
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_checkpoints_and_resume_auto_alone_continues_bitwise(workdir, warm_cli, tmp_path, sig):
    """SIGINT/SIGTERM mid-run (random step; no --save-every) → a complete checkpoint, exit 75, the resume
    command printed; then `--output-dir X --resume auto` with NO other flag continues from the run's own
    config.yaml and ends bitwise equal to an uninterrupted run."""
    import random

    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert main(_args(workdir, ref, "--max-steps", "14")) == 0
    p = start_cli(warm_cli, _args(workdir, cut, "--max-steps", "14"), unbuffered=True)
    wait_for_step(cut, random.Random(sig).randint(2, 9), p)
    p.send_signal(sig)
    out, err = p.communicate(timeout=240)
    assert p.returncode == EXIT_PREEMPTED, err[-2000:]
    assert "Resume with: cast-llm train --output-dir" in out + err
    done = [c for c in (cut / "checkpoints").iterdir() if not c.name.endswith(".tmp")]
    assert len(done) == 1 and not (cut / "model.safetensors").exists()
    stopped_at = json.loads((done[0] / "meta.json").read_text())["step"]
    assert 2 <= stopped_at < 14
    assert main(["train", "--output-dir", str(cut), "--resume", "auto"]) == 0
    _same_run(ref, cut)
    assert not (cut / "checkpoints").exists()  # a complete run needs no checkpoint: removed


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals: main thread only")
def test_a_resume_on_a_busy_machine_computes_with_the_threads_the_run_chose(workdir, tmp_path, monkeypatch, capsys):
    """--threads 0 chooses the threads once per run. A run that chose both cores of an idle machine, stopped by
    SIGTERM and resumed on a machine whose two cores are busy elsewhere (the measurement says so: a fresh
    choice would be 1 thread), computes its remaining steps with 2 threads again (a CPU's float sums depend on
    the thread count) and ends bitwise equal to the uninterrupted run. (The measurement itself, of /proc/stat,
    is tested in test_threads.py; here it is set, so that the test does not take two cores from the suite.)"""
    from cast_llm.train import threads
    from cast_llm.train.trainer import PretrainJob

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # (conftest's: a launcher's choice is never overridden)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})  # two cores, whatever the machine
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    args = ("--max-steps", "4", "--threads", "0")
    real_batch = PretrainJob.batch

    def sigterm_in_step_2(self, step, micro):
        if step == 1 and micro == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_batch(self, step, micro)

    try:
        with monkeypatch.context() as m:
            m.setattr(threads, "busy_cores", lambda online, **kw: 0.0)  # the idle machine of the first segment
            assert main(_args(workdir, ref, *args)) == 0
            m.setattr(PretrainJob, "batch", sigterm_in_step_2)
            assert main(_args(workdir, cut, *args)) == EXIT_PREEMPTED
        (done,) = [c for c in (cut / "checkpoints").iterdir() if (c / "meta.json").is_file()]
        meta = json.loads((done / "meta.json").read_text())
        assert meta["step"] == 2 and meta["threads"] == 2  # what the run chose, recorded with its checkpoint
        assert threads.choose_threads(2, 2.0) == 1  # what a fresh choice on the busy machine would be
        monkeypatch.setattr(threads, "busy_cores", lambda online, **kw: 2.0)  # both cores busy elsewhere
        assert main(["train", "--output-dir", str(cut), "--resume", "auto"]) == 0
    finally:
        torch.set_num_threads(before)
    said = capsys.readouterr().out
    assert "threads: 2, as the run chose when it started" in said, said[-3000:]
    results = json.loads((cut / "results.json").read_text())
    assert results["threads"] == 2 and "threads_resumed" not in results
    _same_run(ref, cut)


def test_second_signal_stops_at_once_and_keeps_the_last_checkpoint(workdir, warm_cli, tmp_path):
    out = tmp_path / "run"
    p = start_cli(warm_cli, _args(workdir, out, "--max-steps", "80", "--save-every", "2"), unbuffered=True)
    deadline = time.time() + 240
    while not (out / "checkpoints").is_dir() or not any((out / "checkpoints").glob("step-*[0-9]")):
        assert p.poll() is None and time.time() < deadline
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    assert p.returncode in (EXIT_PREEMPTED, 130)
    complete = [c for c in (out / "checkpoints").iterdir() if (c / "meta.json").is_file()]
    assert complete, "the last complete checkpoint must survive"
    # the resume runs the rest of the 80 steps, with checkpoints and logs sparser than the signalled run's
    # (settings a resume may change): the test pays for the training alone
    assert main(["train", "--output-dir", str(out), "--resume", "--max-steps", "80", "--save-every", "1000",
                 "--log-every", "100"]) in (0,)


def test_finetune_sigterm_checkpoint_and_resume_is_bitwise(workdir, warm_cli, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    with (d / "instr.jsonl").open("w") as f:
        for i in range(48):
            f.write(json.dumps({"prompt": f"Item {i % 6}. Animal:", "completion": " fox"}) + "\n")
    model = tmp_path / "llama-24"
    from cast_llm.sparsity.mask import apply_mask_, nm_mask
    from cast_llm.targets import find_targets

    m = tiny.model("llama")
    for t in find_targets(m):
        apply_mask_(t.weight.data, nm_mask(t.weight.data))
    m.save_pretrained(model)
    tiny.tokenizer().save_pretrained(model)
    args = lambda out: ["finetune", str(model), "--data", str(d / "instr.jsonl"), "--output-dir", str(out),  # noqa: E731
                        "--mode", "sparse", "--max-steps", "12", "--seq-len", "48", "--log-every", "1",
                        "--no-progress", "--no-baseline-eval", "--lr", "1e-3", "--no-per-layer-report"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert main(args(ref)) == 0
    p = start_cli(warm_cli, args(cut), unbuffered=True)
    wait_for_step(cut, 5, p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=240)
    assert p.returncode == EXIT_PREEMPTED, err[-2000:]
    assert main(["finetune", "--output-dir", str(cut), "--resume", "auto"]) == 0
    _same_run(ref, cut)


# ------------------------------------------------------------------------------------------------ disk faults
def test_enospc_during_a_checkpoint_keeps_the_previous_one_which_resumes_bitwise(workdir, tmp_path, monkeypatch,
                                                                                capsys):
    """The step-4 checkpoint write fails with ENOSPC: a warning, the run goes on; it then crashes at step 5.
    The step-2 checkpoint is intact and resumes to the same model as an uninterrupted run."""
    from cast_llm.train import state_io, trainer

    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert main(_args(workdir, ref, "--max-steps", "8")) == 0
    real_save = state_io.write_safetensors  # (checkpoints write their tensors through it)
    writes = {"n": 0}

    def full_disk(tensors, filename):
        if "step-00000004" in str(filename):
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        writes["n"] += 1
        return real_save(tensors, filename)

    real_batch = trainer.PretrainJob.batch

    def crash(self, step, micro):
        if step == 5:
            raise RuntimeError("the node died")
        return real_batch(self, step, micro)

    monkeypatch.setattr(state_io, "write_safetensors", full_disk)
    monkeypatch.setattr(trainer.PretrainJob, "batch", crash)
    with pytest.raises(RuntimeError, match="node died"):
        main(_args(workdir, cut, "--max-steps", "8", "--save-every", "2"))
    err = capsys.readouterr()
    assert "warning: writing checkpoint" in err.out + err.err and "No space left" in err.out + err.err
    names = sorted(c.name for c in (cut / "checkpoints").iterdir())
    assert names == ["step-00000002"], names  # no torn step-4 folder
    monkeypatch.setattr(state_io, "write_safetensors", real_save)
    monkeypatch.setattr(trainer.PretrainJob, "batch", real_batch)
    assert main(["train", "--output-dir", str(cut), "--resume"]) == 0
    _same_run(ref, cut)


def test_keep_last_removes_old_checkpoints_only_after_a_new_one_is_complete(workdir, tmp_path, monkeypatch):
    from cast_llm.train import checkpoint as ck

    seen = []
    real = ck._rotate

    def spy(run_dir, keep):
        seen.append(sorted(p.name for p in ck.list_checkpoints(run_dir)))
        return real(run_dir, keep)

    monkeypatch.setattr(ck, "_rotate", spy)
    out = tmp_path / "run"
    assert main(_args(workdir, out, "--max-steps", "8", "--save-every", "2", "--keep-last", "1",
                      "--keep-checkpoints-after")) == 0
    assert seen[1] == ["step-00000002", "step-00000004"]  # the new one is complete before the old goes
    # steps 2, 4, 6, then the last step (saved before the export when checkpoints are on): only the newest stays
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000008"]


# ------------------------------------------------------------------------------------------------ safe loading
class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_in_a_checkpoint_is_refused_and_never_runs(workdir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(workdir, out, "--max-steps", "4", "--save-every", "2", "--keep-checkpoints-after")) == 0
    ck = sorted((out / "checkpoints").iterdir())[-1]
    marker = tmp_path / "PWNED"
    (ck / "model.pt").write_bytes(pickle.dumps(_Payload(str(marker))))
    assert main(["train", "--output-dir", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "model.pt" in err and "pickle" in err and "refusing" in err
    assert not marker.exists()
    # the same payload under the names our format uses: parsed as JSON / safetensors, refused as corrupt
    (ck / "model.pt").unlink()
    payload = pickle.dumps(_Payload(str(marker)))
    (ck / "model.safetensors").write_bytes(payload)
    meta = json.loads((ck / "meta.json").read_text())
    meta["files"]["model.safetensors"] = hashlib.sha256(payload).hexdigest()  # an attacker can fix checksums
    (ck / "meta.json").write_text(json.dumps(meta))
    assert main(["train", "--output-dir", str(out), "--resume"]) == 2
    assert "cannot be read as safetensors" in capsys.readouterr().err
    assert not marker.exists()


def test_state_io_round_trips_what_checkpoints_hold_without_pickle(tmp_path):
    import random

    import numpy as np

    from cast_llm.train.checkpoint import rng_state, set_rng_state
    from cast_llm.train.state_io import load_state, save_state

    w = torch.randn(4, 8)
    state = {"model": {"a.weight": w, "tied": w, "view": w[1:3]}, "optimizer": {
        "state": {0: {"step": torch.tensor(3.0), "mask": torch.rand(4, 8) > 0.5, "packed": torch.arange(5, dtype=torch.uint8)}},
        "param_groups": [{"betas": (0.9, 0.999), "lr": 1e-3, "params": [0], "nan": float("nan")}]},
        "rng": rng_state(), "none": None, "shape": torch.Size([2, 3]), "dtype": torch.bfloat16}
    save_state(tmp_path / "s", state)
    back = load_state(tmp_path / "s")
    assert torch.equal(back["model"]["a.weight"], w) and torch.equal(back["model"]["view"], w[1:3])
    st = back["optimizer"]["state"][0]
    assert st["mask"].dtype == torch.bool and st["packed"].dtype == torch.uint8 and float(st["step"]) == 3.0
    group = back["optimizer"]["param_groups"][0]
    assert group["betas"] == (0.9, 0.999) and group["nan"] != group["nan"]
    assert back["shape"] == (2, 3) and back["dtype"] == torch.bfloat16 and back["none"] is None
    x = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(back["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == x
    with pytest.raises(TypeError, match="cannot be stored"):
        save_state(tmp_path / "bad", {"f": lambda: 0})


def test_checkpoint_tensors_are_written_one_at_a_time_in_the_safetensors_format(tmp_path):
    """state_io writes safetensors itself, one tensor at a time (safetensors.torch.save_file would first copy
    every tensor into bytes: a second host copy of a whole checkpoint shard); safetensors reads it back
    exactly, every dtype a checkpoint holds, views of one storage and empty tensors included."""
    from safetensors.torch import load_file

    from cast_llm.train.state_io import write_safetensors

    base = torch.randn(6, 8)
    tensors = {"f32": base, "view": base[2:4], "col": base[:, 1], "bf16": torch.randn(3, 5).bfloat16(),
               "f16": torch.randn(2).half(), "i64": torch.arange(7), "u8": torch.arange(9, dtype=torch.uint8),
               "bool": torch.rand(4, 4) > 0.5, "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5)}
    write_safetensors(tensors, tmp_path / "x.safetensors")
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


# --------------------------------------------------------------------------------------- never destroy data
def test_overwrite_refuses_the_models_own_folder_and_foreign_weights(workdir, tmp_path, capsys):
    model = tmp_path / "tiny-copy"
    tiny.save_model(model, "llama")
    before = _checksums(model)
    argv = ["train", "--model", str(model), "--data", str(workdir / "corpus.jsonl"), *COMMON, "--max-steps", "1",
            "--overwrite"]
    assert main([*argv, "--output-dir", str(model)]) == 2
    assert "model's own folder" in capsys.readouterr().err
    assert main([*argv, "--output-dir", str(model / "sub")]) == 2
    assert _checksums(model) == before and not (model / "sub").exists()
    other = tmp_path / "someone-elses-model"
    tiny.save_model(other, "llama")
    (other / "notes.txt").write_text("mine")
    theirs = _checksums(other)
    assert main(["train", "--model", str(workdir / "llama"), "--data", str(workdir / "corpus.jsonl"), *COMMON,
                 "--max-steps", "1", "--overwrite", "--output-dir", str(other)]) == 2
    assert "not a cast-llm run and holds model files" in capsys.readouterr().err
    assert _checksums(other) == theirs


def test_overwrite_of_our_own_run_removes_only_what_it_wrote(workdir, tmp_path):
    out = tmp_path / "run"
    assert main(_args(workdir, out, "--max-steps", "2")) == 0
    (out / "my-notes.txt").write_text("keep me")
    assert main(_args(workdir, out, "--max-steps", "2", "--overwrite")) == 0
    assert (out / "my-notes.txt").read_text() == "keep me" and (out / "model.safetensors").is_file()


def test_a_filesystem_without_locks_is_not_taken_for_a_folder_in_use(tmp_path, monkeypatch):
    """flock failing for want of support (Lustre's noflock, NFSv3: ENOLCK / ENOSYS) is said as such and the job
    runs unlocked; only EWOULDBLOCK means another job holds the folder."""
    import fcntl

    from cast_llm.train.rundir import RunLock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = RunLock(tmp_path / "run").acquire()
    assert lock.unsupported and "No locks available" in lock.unsupported and lock.fd is None


def test_a_second_job_on_a_folder_in_use_is_refused_and_a_dead_holder_frees_it(workdir, tmp_path, capsys):
    from cast_llm.train.rundir import RunLock

    out = tmp_path / "run"
    lock = RunLock(out).acquire()
    try:
        assert main(_args(workdir, out, "--max-steps", "1")) == 2
        assert "in use by another cast-llm job" in capsys.readouterr().err
    finally:
        lock.release()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from cast_llm.train.rundir import RunLock; "
                               "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()  # a crashed job: the OS drops its flock
    holder.wait()
    assert main(_args(workdir, out, "--max-steps", "1", "--overwrite")) == 0


# --------------------------------------------------------------------------------------- every option checked
@pytest.mark.parametrize("flag, value, message", [
    ("--log-every", "0", "--log-every must be ≥ 1"),
    ("--wikitext-windows", "-1", "--wikitext-windows must be ≥ 0"),
    ("--save-every", "-5", "--save-every must be ≥ 0"),
    ("--val-sequences", "-1", "--val-sequences must be ≥ 0"),
    ("--keep-last", "0", "--keep-last must be ≥ 1"),
    ("--val-fraction", "1.5", "--val-fraction must be ≤ 0.5"),
    ("--lr", "0", "--lr must be > 0"),
    ("--eta", "2", "--eta must be ≤ 1"),
    ("--resume", "sometimes", "resume"),
])
def test_out_of_range_options_are_one_line_errors(workdir, tmp_path, capsys, flag, value, message):
    assert main(_args(workdir, tmp_path / "run", "--max-steps", "1", flag, value)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run" / "model.safetensors").exists()
