"""cuSPARSELt matmul plans kept per token bucket: one algorithm search per (shape, bucket), an LRU of plans that
destroys what it evicts, and nothing created while a CUDA graph is being captured.

A cuSPARSELt plan describes one problem exactly — its dense descriptor holds the row count ``n`` — so every
distinct (padded) token count needs its own plan; building one is cheap (descriptor and plan init, a few
µs). Choosing its **algorithm** is not: ``cusparseLtMatmulSearch`` times every algorithm and waits for the
device (milliseconds per layer shape). So the search runs once per (device, dtype, out, in, token bucket) —
the bucket of :func:`~cast_llm.deploy.sparse24.dispatch.token_bucket`, the one the dispatch decides per — and
its configuration (algorithm, split-K) serves every ``n`` in the bucket: a new prompt length costs a plan
init, not a search.

Plans live in a least-recently-used cache of ``capacity`` entries; an evicted plan is destroyed (plan and
descriptors, its workspace freed) — except a plan that ran inside a CUDA-graph capture: the graph replays its
kernels on that workspace, so it is pinned for the process's life. While a capture is running nothing is
created (a handle, a descriptor or a plan allocates and may synchronise): :class:`PlanNotReady` says so, and
the caller runs another kernel (:class:`~cast_llm.deploy.sparse24.linear.Sparse24Linear` falls back to its
eager choice, saying so once). The cuSPARSELt calls themselves are injected (``build``, ``search``), so all of
this is tested on CPU with fakes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from cast_llm.deploy.sparse24.buckets import token_bucket

__all__ = ["PlanCache", "PlanNotReady"]


class PlanNotReady(RuntimeError):
    """No plan for this row count exists and a CUDA graph is being captured: none can be built now."""


class PlanCache:
    """``get(shape, n, capturing, inputs)`` → the plan for ``n`` rows of ``shape`` = (device index, dtype, out,
    in). ``search(shape, n, inputs) -> config`` runs once per (shape, bucket); ``build(shape, n, config) ->
    plan`` once per (shape, n) while cached; a plan has ``destroy()`` and a ``pinned`` flag."""

    def __init__(self, build: Callable[[tuple, int, dict], Any], search: Callable[[tuple, int, Any], dict], *,
                 capacity: int = 128):
        if capacity < 1:
            raise ValueError(f"a plan cache holds at least one plan, got capacity={capacity}")
        self.build, self.search, self.capacity = build, search, capacity
        self.configs: dict[tuple, dict] = {}  # (shape..., bucket) -> algorithm configuration
        self.plans: OrderedDict[tuple, Any] = OrderedDict()  # (shape..., n) -> plan, least recent first
        self.searches = self.builds = self.destroyed = 0

    def get(self, shape: tuple, n: int, *, capturing: bool, inputs: Any = None) -> Any:
        key = (*shape, n)
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            if capturing:
                plan.pinned = True  # a captured graph replays on its workspace from now on
            return plan
        if capturing:
            raise PlanNotReady(f"no cuSPARSELt plan for {n} rows of {shape[2]}x{shape[3]} yet, and none can be "
                               "built during a CUDA-graph capture; run one eager forward with this token count "
                               "before capturing")
        bucket = (*shape, token_bucket(n))
        config = self.configs.get(bucket)
        if config is None:
            config = self.configs[bucket] = self.search(shape, n, inputs)
            self.searches += 1
        plan = self.plans[key] = self.build(shape, n, config)
        plan.pinned = False
        self.builds += 1
        self._evict()
        return plan

    def config(self, shape: tuple, n: int) -> dict | None:
        """The configuration that serves ``n`` rows of ``shape`` (None before its bucket was searched)."""
        return self.configs.get((*shape, token_bucket(n)))

    def _evict(self) -> None:
        while len(self.plans) > self.capacity:
            victim = next((k for k, p in self.plans.items() if not p.pinned), None)
            if victim is None:
                return  # every plan is pinned by a graph: keep them all
            self.plans.pop(victim).destroy()
            self.destroyed += 1

    def clear(self) -> None:
        """Destroy every plan no graph needs (searched configurations are kept)."""
        for key in [k for k, p in self.plans.items() if not p.pinned]:
            self.plans.pop(key).destroy()
            self.destroyed += 1
