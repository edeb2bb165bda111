"""Per-shape dispatch (cast_llm.deploy.sparse24.dispatch) with a fake timer: the rule, the token buckets, the
in-memory and on-disk caches, and the refusal to touch a file the tool did not write."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cast_llm.deploy.sparse24.dispatch import (
    CACHE_MARKER,
    MAX_BUCKET,
    Dispatcher,
    choose_kernel,
    token_bucket,
    wins_needed,
)
from cast_llm.errors import CastError

BF16 = torch.bfloat16
CANDIDATES = ["dense", "cusparselt-direct", "cusparselt"]


@pytest.mark.parametrize("tokens,bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (2048, 2048),
                                           (2049, 4096), (10**6, MAX_BUCKET)])
def test_token_bucket(tokens, bucket):
    assert token_bucket(tokens) == bucket


def test_rule_runs_dense_unless_a_sparse_kernel_is_clearly_faster():
    t = {"dense": 10.0, "cusparselt-direct": 9.95, "cusparselt": 12.0}
    assert choose_kernel(t, CANDIDATES, min_speedup=1.02) == "dense"  # 0.5 % faster is noise
    t["cusparselt-direct"] = 7.0
    assert choose_kernel(t, CANDIDATES) == "cusparselt-direct"
    t["cusparselt"] = 7.0
    assert choose_kernel(t, ["dense", "cusparselt", "cusparselt-direct"]) == "cusparselt"  # tie: first listed
    failed = {"dense": 1.0, "cusparselt-direct": math.inf, "cusparselt": math.inf}
    assert choose_kernel(failed, CANDIDATES) == "dense"
    # no dense fallback held: the fastest sparse kernel even if slower than dense would be
    assert choose_kernel({"cusparselt": 2.0, "cusparselt-direct": 3.0}, ["cusparselt-direct", "cusparselt"]) == "cusparselt"


class FakeTimer:
    """Sparse wins from 64 tokens on, dense below; graph mode removes a fixed per-call host cost."""

    def __init__(self):
        self.calls = []

    def __call__(self, kernel, out_f, in_f, dtype, tokens, mode):
        self.calls.append((kernel, out_f, in_f, dtype, tokens, mode))
        work = out_f * in_f * tokens * 1e-15  # ~1 PFLOP/s-ish
        if kernel == "dense":
            return work + 5e-6, None
        if kernel == "cusparselt":  # torch's op: plan per call
            return work / 2 + (5e-6 if mode == "graph" else 500e-6), None
        return work / 2 + (3e-5 if tokens < 64 else 5e-6), None


def make(tmp_path=None, **kw):
    timer = FakeTimer()
    d = Dispatcher(measure=timer, gpu="NVIDIA H100 80GB HBM3", versions="torch 2.11, cuSPARSELt 800",
                   cache_path=None if tmp_path is None else tmp_path / "dispatch.json", **kw)
    return d, timer


def test_decisions_depend_on_token_bucket_and_mode():
    d, _ = make()
    assert d.decide(4096, 4096, BF16, 1, "eager", CANDIDATES).kernel == "dense"
    assert d.decide(4096, 4096, BF16, 4096, "eager", CANDIDATES).kernel == "cusparselt-direct"
    g = d.decide(4096, 4096, BF16, 4096, "graph", ["dense", "cusparselt"])
    assert g.kernel == "cusparselt" and g.seconds["cusparselt"] < g.seconds["dense"]
    assert d.decide(4096, 4096, BF16, 4096, "eager", ["dense", "cusparselt"]).kernel == "dense"  # host-bound op


def test_each_key_is_measured_once_and_a_bucket_is_shared():
    d, timer = make()
    d.decide(576, 576, BF16, 1000, "eager", CANDIDATES)
    assert len(timer.calls) == 3 and {c[4] for c in timer.calls} == {1024}  # measured at the bucket
    d.decide(576, 576, BF16, 600, "eager", CANDIDATES)  # same bucket (512, 1024]
    assert len(timer.calls) == 3
    d.decide(576, 576, BF16, 1025, "eager", CANDIDATES)
    d.decide(576, 576, torch.float16, 1000, "eager", CANDIDATES)
    d.decide(192, 576, BF16, 1000, "eager", CANDIDATES)
    d.decide(576, 576, BF16, 1000, "graph", CANDIDATES)
    assert len(timer.calls) == 15
    # a candidate that became available later is the only one measured
    d.decide(576, 576, BF16, 1000, "eager", CANDIDATES + ["cutlass"])
    assert len(timer.calls) == 16 and timer.calls[-1][0] == "cutlass"


def test_keys_name_gpu_versions_mode_dtype_shape_and_bucket():
    d, _ = make()
    key = d.key(192, 576, BF16, 16, "graph")
    for part in ("NVIDIA H100 80GB HBM3", "cuSPARSELt 800", "graph", "bfloat16", "192x576", "tokens<=16"):
        assert part in key


def test_cache_file_round_trip_and_merge(tmp_path):
    d, timer = make(tmp_path)
    d.decide(4096, 11008, BF16, 2048, "eager", CANDIDATES)
    d.decide(4096, 11008, BF16, 1, "eager", ["dense", "cusparselt"])
    path = d.save()
    data = json.loads(path.read_text())
    assert data["written_by"] == CACHE_MARKER and data["format"] == 1 and len(data["entries"]) == 2
    # another process: everything comes from the file, nothing is measured again
    d2, timer2 = make(tmp_path)
    assert d2.decide(4096, 11008, BF16, 2048, "eager", CANDIDATES).kernel == "cusparselt-direct"
    assert timer2.calls == []
    d2.decide(576, 576, BF16, 8, "graph", CANDIDATES)
    d2.save()
    assert len(json.loads(path.read_text())["entries"]) == 3  # merged, not replaced
    assert d2.save() is None  # nothing new: no write


def test_failed_candidates_are_stored_as_null_and_come_back_as_inf(tmp_path):
    d = Dispatcher(measure=lambda k, *a: (math.inf, "RuntimeError: boom") if k == "cusparselt" else (1.0, None),
                   gpu="g", versions="v", cache_path=tmp_path / "c.json")
    dec = d.decide(64, 64, BF16, 8, "graph", ["dense", "cusparselt"])
    assert dec.kernel == "dense" and dec.notes["cusparselt"].startswith("RuntimeError")
    d.save()
    entry = next(iter(json.loads((tmp_path / "c.json").read_text())["entries"].values()))
    assert entry["seconds"]["cusparselt"] is None
    back = Dispatcher(measure=None, gpu="g", versions="v", cache_path=tmp_path / "c.json")
    assert math.isinf(back.decide(64, 64, BF16, 8, "graph", ["dense", "cusparselt"]).seconds["cusparselt"])


@pytest.mark.parametrize("content", ['{"entries": {}}', "not json at all", '[1, 2]'])
def test_a_file_the_tool_did_not_write_is_never_read_or_overwritten(tmp_path, content):
    path = tmp_path / "mine.json"
    path.write_text(content)
    with pytest.raises(CastError, match="not written by cast-llm's 2:4 dispatch"):
        Dispatcher(measure=FakeTimer(), gpu="g", versions="v", cache_path=path)
    assert path.read_text() == content


def test_a_cache_of_another_format_is_refused(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"written_by": CACHE_MARKER, "format": 99, "entries": {}}))
    with pytest.raises(CastError, match="format 99"):
        Dispatcher(measure=FakeTimer(), gpu="g", versions="v", cache_path=path)


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_speedup"):
        Dispatcher(measure=FakeTimer(), gpu="g", versions="v", min_speedup=0.9)
    d, _ = make()
    with pytest.raises(ValueError, match="mode"):
        d.decide(64, 64, BF16, 8, "lazy", CANDIDATES)


def test_the_real_measurement_times_and_rejects_a_wrong_kernel(monkeypatch):
    from cast_llm.deploy.sparse24.kernels import KERNELS
    from cast_llm.deploy.sparse24.timing import measure_gemm

    cpu = torch.device("cpu")
    seconds, note = measure_gemm("emulated", 64, 128, torch.float32, 8, "eager", cpu)
    assert 0 < seconds < 1 and note is None
    assert measure_gemm("dense", 64, 128, torch.float32, 8, "eager", cpu)[0] > 0
    seconds, note = measure_gemm("emulated", 64, 128, torch.float32, 8, "graph", cpu)
    assert math.isinf(seconds) and "CUDA" in note
    monkeypatch.setattr(KERNELS["emulated"], "mm", lambda x2d, state, bias, out_f: x2d.new_zeros(x2d.shape[0], out_f))
    seconds, note = measure_gemm("emulated", 64, 128, torch.float32, 8, "eager", cpu)
    assert math.isinf(seconds) and note.startswith("RuntimeError: wrong results")


# ------------------------------------------------------------------ the paired sign rule (CPU timings)
def test_wins_needed_allows_one_lost_round_in_five():
    assert [wins_needed(n) for n in (1, 3, 4, 5, 8, 10, 20)] == [1, 3, 4, 4, 7, 8, 16]


def test_paired_rule_needs_the_margin_and_a_win_in_nearly_every_round():
    dense = [10.0, 10.0, 10.0, 10.0, 10.0]
    lucky = [7.0, 7.0, 8.0, 11.0, 11.0]  # median ratio 1.25, but slower than dense in 2 of 5 rounds
    steady = [8.6, 8.7, 8.8, 8.9, 8.5]  # median ratio 1.14, faster in every round
    close = [9.4, 9.3, 9.5, 9.2, 9.4]  # faster in every round, by less than the margin
    outlier = [7.0, 7.5, 8.0, 8.2, 11.5]  # median ratio 1.25, one round lost (the VM's outlier): taken
    med = {"dense": 10.0, "a": 8.0, "b": 8.7, "c": 9.4, "d": 8.0}
    assert choose_kernel(med, ["dense", "a"], 1.10) == "a"  # medians alone: the lucky one passes
    assert choose_kernel(med, ["dense", "a"], 1.10, {"dense": dense, "a": lucky}) == "dense"
    assert choose_kernel(med, ["dense", "b"], 1.10, {"dense": dense, "b": steady}) == "b"
    assert choose_kernel(med, ["dense", "c"], 1.10, {"dense": dense, "c": close}) == "dense"
    assert choose_kernel(med, ["dense", "d"], 1.10, {"dense": dense, "d": outlier}) == "d"
    # of the candidates that pass, the fastest by median; one that fails the sign test does not hide one that passes
    both = {"dense": dense, "a": lucky, "b": steady}
    assert choose_kernel(med, ["dense", "a", "b"], 1.10, both) == "b"
    # rounds of another length (timed apart) are not a pairing: the medians decide
    assert choose_kernel(med, ["dense", "a"], 1.10, {"dense": dense, "a": lucky[:4]}) == "a"


def test_a_paired_timer_s_rounds_decide_and_round_trip_through_the_cache(tmp_path):
    rounds = {"dense": [10.0, 10.0, 10.0, 10.0, 10.0], "cpu-a": [7.0, 7.0, 8.0, 11.0, 11.0],
              "cpu-b": [8.6, 8.7, 8.8, 8.9, 8.5]}
    calls = []

    def timer(kernel, *a):
        calls.append(kernel)
        return sorted(rounds[kernel])[2], None, rounds[kernel]

    d = Dispatcher(measure=timer, device="cpu", gpu="cpu", versions="v", cache_path=tmp_path / "d.json")
    dec = d.decide(64, 64, BF16, 16, "eager", ["dense", "cpu-a"])
    assert dec.kernel == "dense" and dec.rounds["cpu-a"] == rounds["cpu-a"]
    d.save()
    back = Dispatcher(measure=timer, device="cpu", gpu="cpu", versions="v", cache_path=tmp_path / "d.json")
    assert back.decide(64, 64, BF16, 16, "eager", ["dense", "cpu-a"]).rounds == dec.rounds
    assert calls == ["dense", "cpu-a"]  # read back, not measured again
    # a candidate that appears later: every candidate timed again, so that its rounds pair with dense's
    again = back.decide(64, 64, BF16, 16, "eager", ["dense", "cpu-a", "cpu-b"])
    # ... and the kernel ahead of dense among three timed against dense alone, where it wins too
    assert calls == ["dense", "cpu-a", "dense", "cpu-a", "cpu-b", "dense", "cpu-b"]
    assert again.kernel == "cpu-b" and set(again.head_to_head) == {"cpu-b"}


def test_a_kernel_ahead_among_many_must_beat_dense_head_to_head(tmp_path):
    """Among many candidates dense reads slower than beside one (cpu24-notes.md §53): the winner there is timed
    against dense alone, the next winner tried where it loses, dense where all do; the pair's rounds are cached."""
    dense_many, dense_alone = [10.0] * 5, [8.0] * 5
    fast = {"cpu-a": [8.0, 8.1, 8.2, 8.0, 8.1], "cpu-b": [6.5, 6.6, 6.4, 6.5, 6.6], "cpu-c": [9.9] * 5}
    calls = []

    def timer(kernel, *a):
        calls.append(kernel)
        r = (dense_many if calls.count("dense") == 1 else dense_alone) if kernel == "dense" else fast[kernel]
        return sorted(r)[2], None, r

    d = Dispatcher(measure=timer, device="cpu", gpu="cpu", versions="v", cache_path=tmp_path / "d.json")
    dec = d.decide(64, 64, BF16, 128, "eager", ["dense", "cpu-a", "cpu-b", "cpu-c"])
    # cpu-a and cpu-b beat dense among four (1.23x, 1.54x); head to head cpu-b still wins (1.23x), cpu-a is not tried
    assert dec.kernel == "cpu-b" and calls == ["dense", "cpu-a", "cpu-b", "cpu-c", "dense", "cpu-b"]
    fast["cpu-b"] = [7.6, 7.7, 7.5, 7.6, 7.8]  # 1.32x among four, 1.05x against dense alone: the next winner, then dense
    calls.clear()
    dec = d.decide(64, 64, BF16, 256, "eager", ["dense", "cpu-a", "cpu-b", "cpu-c"])
    assert calls == ["dense", "cpu-a", "cpu-b", "cpu-c", "dense", "cpu-b", "dense", "cpu-a"]
    assert dec.kernel == "dense" and set(dec.head_to_head) == {"cpu-a", "cpu-b"}
    d.save()
    calls.clear()
    back = Dispatcher(measure=timer, device="cpu", gpu="cpu", versions="v", cache_path=tmp_path / "d.json")
    assert back.decide(64, 64, BF16, 256, "eager", ["dense", "cpu-a", "cpu-b", "cpu-c"]).kernel == "dense"
    assert back.decide(64, 64, BF16, 128, "eager", ["dense", "cpu-a", "cpu-b", "cpu-c"]).kernel == "cpu-b"
    assert calls == []  # the head-to-head rounds came from the cache


def test_a_kernel_that_fails_against_dense_alone_is_not_chosen(tmp_path):
    """A kernel ahead among many that fails when timed again (its check, a crash) is never run: the next one that
    beat dense, else dense; the failure is cached as null, not as a number."""
    fails = {"n": 0}

    def timer(kernel, *a):
        if kernel == "cpu-b":
            fails["n"] += 1
            if fails["n"] > 1:
                return math.inf, "RuntimeError: wrong results", None
            return 6.5, None, [6.5] * 5
        return {"dense": (10.0, None, [10.0] * 5), "cpu-a": (8.0, None, [8.0] * 5),
                "cpu-c": (20.0, None, [20.0] * 5)}[kernel]

    d = Dispatcher(measure=timer, device="cpu", gpu="cpu", versions="v", cache_path=tmp_path / "d.json")
    dec = d.decide(64, 64, BF16, 128, "eager", ["dense", "cpu-a", "cpu-b", "cpu-c"])
    assert dec.kernel == "cpu-a" and "wrong results" in dec.notes["cpu-b"]
    d.save()
    text = (tmp_path / "d.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    back = Dispatcher(measure=timer, device="cpu", gpu="cpu", versions="v", cache_path=tmp_path / "d.json")
    assert back.decide(64, 64, BF16, 128, "eager", ["dense", "cpu-a", "cpu-b", "cpu-c"]).kernel == "cpu-a"


def test_cpu_decisions_are_keyed_by_the_paired_rule():
    """Decisions cached before the rule kept no rounds: a CPU's key names the rule, so they are measured again."""
    from cast_llm.deploy.sparse24.dispatch import CPU_RULE

    assert CPU_RULE in Dispatcher(measure=FakeTimer(), device="cpu").versions
