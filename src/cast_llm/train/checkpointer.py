"""When and how the loop writes its checkpoints, and which one is the last good one.

:class:`Checkpointer` writes the atomic checkpoints of :mod:`cast_llm.train.checkpoint` (through the
distribution: rank 0's whole state, or every rank's shards) with everything a resume needs — model,
optimizer, schedule, RNG, observers, the method's own state and the log window in progress — and, in its
``meta.json``, the config fingerprint, the wall time so far and the CPU threads the run computes with
(``--threads 0`` chooses them once; a resume reuses the choice). It writes them at the one-shot start
(when that was slow), every ``--save-every`` steps or by the clock, at the last step, and when a signal
stops the run (:meth:`Checkpointer.preempt`). A failed periodic write is a warning and the run goes on;
a failed required one is an error naming the last good checkpoint. A finished run's checkpoints are
removed (:meth:`Checkpointer.drop`) unless asked to keep them.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from cast_llm.errors import CastError
from cast_llm.io import RunDir
from cast_llm.train.checkpoint import (
    CheckpointWriteError,
    checkpoint_dir,
    checkpoint_root,
    list_checkpoints,
    remove_stale_partials,
    rng_state,
)
from cast_llm.train.preemption import Preempted
from cast_llm.train.rundir import record_written, write_results

__all__ = ["Checkpointer"]


class Checkpointer:
    """The checkpoints of one run segment (see the module docstring).

    ``training``: the loop's live objects (``method``, ``raw``, ``raw_opt``, ``scheduler``, ``observers``,
    ``guard``); ``log``: the :class:`~cast_llm.train.metrics_log.MetricsLog` whose window is saved;
    ``results``: the run's results, written to ``results.json`` with every checkpoint (the first one's cost
    recorded in them); ``last_good``: the checkpoint the segment resumed from (None: a fresh start);
    ``auto_save_s``: without ``--save-every``, the wall time between checkpoints."""

    def __init__(self, ctx, training, log, *, fingerprint: dict[str, Any], marker_kind: str,
                 tokens_per_step: int | None, results: dict[str, Any], last_good: Path | None, auto_save_s: float):
        self.ctx, self.t, self.log = ctx, training, log
        self.out, self.is_main, self.distribution = ctx.out, ctx.is_main, ctx.distribution
        self.fingerprint, self.marker_kind, self.tokens_per_step = fingerprint, marker_kind, tokens_per_step
        self.results = results
        self.save_every, self.keep_last = ctx.cfg.save_every, ctx.cfg.keep_last
        self.auto_save_s = auto_save_s
        self.last_good = last_good
        self.saves = 0
        self.last_save = time.perf_counter()
        self.step_s: float | None = None  # the last step's wall time (what a SIGTERM's grace must cover too)

    # ---- when
    def due_by_clock(self) -> bool:
        """Without ``--save-every``: whether rank 0's clock says a checkpoint is due (agreed by the loop)."""
        return self.save_every is None and self.is_main and time.perf_counter() - self.last_save >= self.auto_save_s

    def after_step(self, done: int, total: int, due: bool) -> None:
        """The periodic checkpoint after step ``done``, if due (the last step's is :meth:`at_end`'s)."""
        if (due or (self.save_every and done % self.save_every == 0)) and done != total:
            self.save(done, required=False)

    def at_start(self, start_s: float, threshold_s: float) -> None:
        """A one-shot start slower than ``threshold_s`` is saved with the run at once (a step-0 checkpoint):
        a resume never computes it again."""
        if self.save_every != 0 and start_s >= threshold_s:
            self.save(0, required=False)

    def at_end(self, total: int) -> None:
        """With checkpoints on, the last step is saved before the export: a failure there costs no training."""
        if self.save_every or (self.save_every is None and self.saves):
            self.save(total, required=False)

    def preempt(self, done: int, total: int, signal_name: str | None, resume_command: str) -> Preempted:
        """The checkpoint of a run stopped by a signal (required: an error if it cannot be written); returns
        the :class:`Preempted` to raise, after saying where it is and how to resume."""
        path = self.save(done, required=True)
        msg = (f"stopped at step {done} of {total} ({signal_name or 'signal on another rank'}); "
               f"checkpoint {path}. Resume with: {resume_command}")
        self.ctx.say(msg)
        return Preempted(msg)

    # ---- how
    def save(self, step: int, *, required: bool) -> Path | None:
        """Write checkpoint ``step``. A failed periodic checkpoint is a warning (the run goes on, the previous
        one stays); a failed required one (preemption) is an error naming the last good one. The first one
        of a segment says what it cost: what a SIGTERM's grace period must cover."""
        t, distribution = self.t, self.distribution
        t.guard.check(self.last_good)  # never a checkpoint of a run that went non-finite
        t0 = time.perf_counter()
        t.method.verify(t.raw)
        states = {"model": distribution.model_state(t.method, t.raw),
                  "optimizer": distribution.optimizer_state(t.raw_opt),
                  "scheduler": t.scheduler.state_dict(), "rng": rng_state(),
                  "observers": {ob.name: ob.state_dict() for ob in t.observers}}
        extra = t.method.extra_state()
        if extra is not None:
            states["method"] = extra
        # the log window in progress: a run stopped between two log steps logs exactly what an uninterrupted one does
        states["loop"] = {"window": self.log.host_window()}
        meta = {"fingerprint": self.fingerprint, "tokens": step * (self.tokens_per_step or 0),
                "kind": self.marker_kind, "elapsed_s": self.ctx.elapsed(), "threads": torch.get_num_threads()}
        err = None
        try:
            distribution.save(self.out, step, states, meta, self.keep_last)
            ok = True
        except CheckpointWriteError as e:
            ok, err = False, e
        ok = distribution.all(ok)
        if not ok:
            where = f"the last complete checkpoint is {self.last_good}" if self.last_good else \
                "no checkpoint was written yet"
            msg = f"{err if self.is_main and err is not None else 'a checkpoint write failed'}; {where}"
            if required:
                raise CastError(msg)
            self.ctx.say(f"warning: {msg}; training goes on")
            return None
        seconds = time.perf_counter() - t0
        self.last_save = time.perf_counter()
        if self.saves == 0:
            self.results["checkpoint"] = self._cost(checkpoint_dir(self.out, step), seconds)
        self.saves += 1
        if self.is_main:
            record_written(self.out, [RunDir.CHECKPOINTS])
            write_results(self.out, self.results)
        distribution.barrier()
        self.last_good = list_checkpoints(self.out)[-1] if self.is_main else checkpoint_dir(self.out, step)
        return self.last_good

    def _cost(self, folder: Path, seconds: float) -> dict[str, Any]:
        """The first checkpoint of a segment: what it cost (the slowest rank), which is what a SIGTERM's grace
        period must cover after the step in flight; for results.json (``checkpoint``) and the log."""
        ctx, step_s = self.ctx, self.step_s
        mine = 0
        if folder.is_dir():
            sharded = any(folder.glob("*-rank00000.*"))  # FSDP2: every rank's own files; else rank 0 wrote it all
            files = folder.glob(f"*-rank{ctx.rank:05d}.*") if sharded else (folder.iterdir() if ctx.is_main else [])
            mine = sum(f.stat().st_size for f in files if f.is_file())
        every = self.distribution.gather((seconds, mine))
        slowest = max(s for s, _ in every)
        largest = max(b for _, b in every)
        need = slowest + (step_s or 0.0)
        step = f" + one step ({step_s:.1f} s)" if step_s is not None else ""
        ctx.say(f"checkpoint: {largest / 2**30:.2f} GiB per process written in {slowest:.1f} s; a SIGTERM needs "
                f"{need:.0f} s{step} of grace (SLURM --signal=TERM@…, torchrun --shutdown-timeout; docs/training.md)")
        return {"seconds": round(slowest, 2), "bytes_per_rank": largest,
                "step_seconds": None if step_s is None else round(step_s, 2),
                "sigterm_grace_needed_s": round(need, 2)}

    # ---- the end
    def drop(self, *, keep: bool) -> None:
        """A finished run needs no checkpoint to resume: remove them (ours only: complete checkpoints and
        partial ones with our marker; anything else in the folder stays), unless asked to keep them."""
        out, say = self.out, self.ctx.say
        found = list_checkpoints(out)
        if not found:
            return
        if keep:
            say(f"kept {len(found)} checkpoint(s) in {checkpoint_root(out)}")
            return
        size = sum(f.stat().st_size for c in found for f in c.iterdir() if f.is_file())
        for c in found:
            shutil.rmtree(c, ignore_errors=True)
        remove_stale_partials(out)
        with contextlib.suppress(OSError):  # (left in place when something else is in it)
            checkpoint_root(out).rmdir()
        say(f"removed the run's {len(found)} checkpoint(s) ({size / 2**30:.1f} GiB): the run is complete "
            "(--keep-checkpoints-after keeps them)")
