"""How long each phase of a run took and how much memory it needed, on every process.

A phase (``with phases("load the model"): ...``) records its wall time and this process's peak memory over
it: the host's resident set when it begins and its peak (``VmHWM``, reset when the phase begins), and on CUDA
``torch.cuda.max_memory_allocated`` (reset too). Phases run outside the training steps, whose own peak
:class:`~cast_llm.train.memory.PeakMemory` measures; a phase nested in another records its own figures
and leaves the outer one's host peak as the larger of the two. :meth:`Phases.gathered` collects every
process's records on rank 0 for ``results.json`` (``phases``): the start-up and the end beside the plan's
estimates (:mod:`cast_llm.plan.startup`), per rank.
"""

from __future__ import annotations

import contextlib
import time

import torch

from cast_llm.train.memory import peak_rss, reset_rss_peak

__all__ = ["Phases"]


class Phases:
    def __init__(self, device: torch.device):
        self.device = device
        self.records: dict[str, dict[str, float | int | None]] = {}
        self._open: list[dict[str, int]] = []  # the phases in progress, outermost first

    def _peaks(self) -> dict[str, int]:
        cuda = self.device.type == "cuda"
        return {"host": peak_rss() or 0, "device": int(torch.cuda.max_memory_allocated(self.device)) if cuda else 0}

    @contextlib.contextmanager
    def __call__(self, name: str):
        cuda = self.device.type == "cuda"
        if self._open:  # the peaks so far of the phases around this one, before this one resets them
            now = self._peaks()
            for frame in self._open:
                frame.update({k: max(frame[k], v) for k, v in now.items()})
        frame = {"host": 0, "device": 0}
        self._open.append(frame)
        reset_rss_peak()
        start = peak_rss()  # = the resident set now: what the phase starts from
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
            now = self._peaks()
            self._open.pop()
            self.records[name] = {"seconds": round(time.perf_counter() - t0, 3), "host_start": start,
                                  "host_peak": max(now["host"], frame["host"]),
                                  "device_peak": max(now["device"], frame["device"]) if cuda else None}

    def gathered(self, distribution) -> dict[str, dict[str, list]]:
        """``{phase: {"seconds": [per rank], "host_start": [...], "host_peak": [...], "device_peak": [...]}}``
        (collective)."""
        every = distribution.gather(self.records)
        names = list(dict.fromkeys(n for r in every for n in r))
        return {n: {k: [r.get(n, {}).get(k) for r in every]
                    for k in ("seconds", "host_start", "host_peak", "device_peak")} for n in names}
