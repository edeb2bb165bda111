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
