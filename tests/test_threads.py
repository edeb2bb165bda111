"""--threads 0 (cast_llm/train/threads.py): the cores others use NOW (a /proc/stat sample), not the
one-minute load average — `make run` right after `make test` on an idle 2-core machine gets both cores."""

from __future__ import annotations

import types

import torch

from cast_llm.train import threads


def _stat(samples):
    """A fake /proc/stat reader giving (busy, total) jiffies in turn."""
    it = iter(samples)
    return lambda: next(it)


def test_busy_cores_from_a_sample_of_proc_stat():
    slept = []
    # 2 cores over the sample: 100 jiffies in all, 50 of them busy -> one core busy
    assert threads.busy_cores(2, read=_stat([(1000, 5000), (1050, 5100)]), sleep=slept.append) == 1.0
    assert slept == [threads.SAMPLE_S]
    assert threads.busy_cores(2, read=_stat([(1000, 5000), (1001, 5100)]), sleep=lambda s: None) == 0.02
    assert threads.busy_cores(2, read=lambda: None, sleep=lambda s: None) is None  # no /proc/stat
    assert threads.busy_cores(2, read=_stat([(1, 5), (1, 5)]), sleep=lambda s: None) is None  # no time passed


def test_choose_threads_leaves_the_cores_others_use():
    assert threads.choose_threads(2, 0.02) == 2  # idle machine (a finished test suite leaves no trace here)
    assert threads.choose_threads(2, 0.5) == 2  # half a core used elsewhere: still both
    assert threads.choose_threads(2, 1.0) == 1  # another job on one core
    assert threads.choose_threads(2, 2.0) == 1  # at least one
    assert threads.choose_threads(8, 3.2) == 5
    assert threads.choose_threads(4, None) == 4  # nothing measurable: all cores


def test_setup_threads_uses_the_measurement_and_respects_the_user(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
        note = threads.setup_threads(types.SimpleNamespace(threads=0), busy=lambda n: 0.05)
        assert torch.get_num_threads() == 2 and note == "threads: 2 of 2 cores"
        note = threads.setup_threads(types.SimpleNamespace(threads=0), busy=lambda n: 1.0)
        assert torch.get_num_threads() == 1 and "1 of 2 cores" in note and "used 1.0 cores" in note
        assert threads.setup_threads(types.SimpleNamespace(threads=3)) is None and torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a launcher chose: left alone
        torch.set_num_threads(2)
        assert threads.setup_threads(types.SimpleNamespace(threads=0), busy=lambda n: 0.0) is None
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_real_sample_reads_this_machine():
    b = threads.busy_cores(2, sample_s=0.05)
    assert b is None or 0.0 <= b <= 2.0 + 1e-9


def test_a_resume_takes_the_recorded_choice_and_a_different_explicit_one_says_so(monkeypatch):
    """--threads 0 on a resume: the threads the run chose before (recorded with its checkpoint), not a new
    measurement of a machine that may have got busier; --threads N (or OMP_NUM_THREADS) still wins, with a
    line saying that it differs from the recorded choice."""
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})

        def busy(n):
            raise AssertionError("a resume does not measure the machine again")

        note = threads.setup_threads(types.SimpleNamespace(threads=0), busy=busy, recorded=2)
        assert torch.get_num_threads() == 2 and note.startswith("threads: 2, as the run chose")
        note = threads.setup_threads(types.SimpleNamespace(threads=1), recorded=2)
        assert torch.get_num_threads() == 1 and "not the 2 the run computed with" in note and "--threads 1" in note
        assert threads.setup_threads(types.SimpleNamespace(threads=2), recorded=2) is None  # the same: nothing
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        assert "OMP_NUM_THREADS" in threads.setup_threads(types.SimpleNamespace(threads=0), recorded=2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_summary_says_when_a_resume_computed_with_other_threads():
    from cast_llm.train.summary import summary_table

    ppl = {"dense": 20.0, "sparse": 30.0}
    results = {"perplexity": {"heldout": dict(ppl), "wikitext2": dict(ppl)}, "pattern": "2:4", "method": "cast",
               "output_dir": "out", "tokens_trained": 1000,
               "threads_resumed": [{"recorded": 2, "used": 1, "step": 40}]}
    assert ("threads: resumed at step 40 with 1 CPU threads, not the 2 the run computed with before: not bitwise "
            "the uninterrupted run") in summary_table(results)
