"""cuSPARSELt plans (deploy/sparse24/plans.py): one algorithm search per (shape, token bucket), an LRU that
destroys what it evicts and keeps what a CUDA graph captured, nothing built during a capture; and the layer's
fallback when a capture finds no plan — all on fakes (the real binding: tests/test_sparse24_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cast_llm.deploy.sparse24 import Dispatcher, Sparse24Linear
from cast_llm.deploy.sparse24 import cusparselt_direct as direct
from cast_llm.deploy.sparse24 import linear as L
from cast_llm.deploy.sparse24.plans import PlanCache, PlanNotReady
from cast_llm.sparsity.mask import nm_mask

SHAPE = (0, torch.bfloat16, 576, 1536)  # (device index, dtype, out, in)


class FakePlan:
    def __init__(self, n, config, log):
        self.n, self.config, self.log = n, config, log
        self.destroyed = False

    def destroy(self):
        self.destroyed = True
        self.log.append(("destroy", self.n))


def cache(capacity=4):
    log = []

    def build(shape, n, config):
        log.append(("build", n))
        return FakePlan(n, config, log)

    def search(shape, n, inputs):
        log.append(("search", n))
        return {"alg_id": n}  # the row count it was searched on

    return PlanCache(build, search, capacity=capacity), log


def test_one_search_per_bucket_serves_every_row_count_in_it():
    plans, log = cache(capacity=16)
    for n in (24, 17, 32, 24, 40, 64, 8):  # buckets 32, 32, 32, 32, 64, 64, 8
        plan = plans.get(SHAPE, n, capturing=False)
        assert plan.n == n
    assert [e for e in log if e[0] == "search"] == [("search", 24), ("search", 40), ("search", 8)]
    assert plans.get(SHAPE, 30, capturing=False).config == {"alg_id": 24}  # bucket 32's algorithm
    assert plans.searches == 3 and plans.builds == 7  # 24 was built once, found again
    assert plans.config(SHAPE, 20) == {"alg_id": 24} and plans.config(SHAPE, 200) is None


def test_the_lru_destroys_what_it_evicts_but_never_a_captured_plan():
    plans, log = cache(capacity=2)
    a = plans.get(SHAPE, 8, capturing=False)
    plans.get(SHAPE, 8, capturing=True)  # a graph captured a: pinned
    b = plans.get(SHAPE, 16, capturing=False)
    c = plans.get(SHAPE, 24, capturing=False)  # over capacity: b (the oldest unpinned) goes
    assert b.destroyed and not a.destroyed and not c.destroyed and ("destroy", 16) in log
    d = plans.get(SHAPE, 40, capturing=False)  # over again: c is the least recent unpinned one
    assert c.destroyed and not d.destroyed and not a.destroyed and len(plans.plans) == 2
    plans.clear()
    assert not a.destroyed and list(plans.plans) == [(*SHAPE, 8)]


def test_nothing_is_built_or_searched_during_a_capture():
    plans, log = cache()
    with pytest.raises(PlanNotReady, match="run one eager forward with this token count before capturing"):
        plans.get(SHAPE, 8, capturing=True)
    assert log == []
    plans.get(SHAPE, 8, capturing=False)
    assert plans.get(SHAPE, 8, capturing=True).pinned


def test_mm_builds_plans_through_the_cache_with_the_device_current(monkeypatch):
    seen = []
    monkeypatch.setattr(direct, "_library", lambda: (object(), None))
    monkeypatch.setattr(direct, "capturing", lambda: False)
    monkeypatch.setattr(direct, "_on", lambda device: seen.append(device) or _Null())

    class Plan:
        pinned = False

        def run(self, packed, x2d, out):
            out.fill_(1.0)

    plans = PlanCache(lambda shape, n, config: Plan(), lambda shape, n, inputs: {"alg_id": 0})
    monkeypatch.setattr(direct, "PLANS", plans)
    y = direct.mm(torch.zeros(4), torch.zeros(16, 32), 8)
    assert y.shape == (16, 8) and bool((y == 1).all()) and seen == [torch.device("cpu")]
    assert direct.has_plan(torch.float32, 8, 32, 16, 0) and not direct.has_plan(torch.float32, 8, 32, 24, 0)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_capture_without_a_plan_runs_the_eager_choice_and_says_so_once(monkeypatch, capsys):
    lin = nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.masked_fill_(~nm_mask(lin.weight), 0)
    timer = lambda kernel, *a: (1.0 if kernel == "dense" else 0.5, None)  # noqa: E731 - the 2:4 kernel wins
    layer = Sparse24Linear.from_linear(lin, kernels=("emulated",), dispatcher=Dispatcher(measure=timer, gpu="f",
                                                                                      versions="v"), name="q")
    layer.kernels = ["cusparselt-direct", "emulated"]  # as on a GPU: the direct kernel first
    layer.states["cusparselt"] = layer.states["emulated"]
    layer._choices = {(8, "graph"): "cusparselt-direct", (8, "eager"): "emulated"}
    monkeypatch.setattr(L, "capturing", lambda: True)
    monkeypatch.setattr(direct, "has_plan", lambda *a: False)
    x = torch.randn(8, 64)
    for _ in range(2):
        torch.testing.assert_close(layer(x), lin(x))  # the emulated (eager) choice, not the direct kernel
    err = capsys.readouterr().err
    assert err.count("no cuSPARSELt plan for 8 tokens was built before this CUDA-graph capture") == 1
    assert "the layer runs emulated in the graph" in err
