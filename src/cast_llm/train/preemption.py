"""Preemption: SIGTERM / SIGINT end a job cleanly at the next step boundary, with a checkpoint.

Cluster schedulers preempt a job with SIGTERM and kill it seconds later (SLURM: ``--signal=TERM@120``
sends it 120 s before the time limit); a user stops one with Ctrl-C (SIGINT). While a job runs,
:class:`StopRequest` catches the first such signal: the optimizer step in flight finishes, every rank
agrees on the step (a MAX all-reduce of the flag after every step), the loop writes an atomic checkpoint,
prints where it is and the command that resumes it, and exits with :data:`EXIT_PREEMPTED`. A second signal
exits at once (the last complete checkpoint is never touched: checkpoints are written into ``*.tmp`` and
renamed when complete).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["EXIT_PREEMPTED", "EXIT_INTERRUPTED", "StopRequest", "Preempted"]

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later" — the job stopped with a checkpoint and can resume
EXIT_INTERRUPTED = 130  # a second signal: stopped at once (128 + SIGINT, the shell's convention)


class Preempted(SystemExit):
    """Raised by the loop after the preemption checkpoint is written; its code is :data:`EXIT_PREEMPTED`."""

    def __init__(self, message: str):
        super().__init__(EXIT_PREEMPTED)
        self.message = message


class StopRequest:
    """Install handlers for SIGTERM and SIGINT for the duration of a ``with`` block.

    ``requested`` turns true at the first signal; a second one calls ``os._exit`` with
    :data:`EXIT_INTERRUPTED` (no Python cleanup runs that could touch files). Outside the main thread (where
    Python cannot install signal handlers) it does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, say=None):
        self.requested = False
        self.signal_name: str | None = None
        self._say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            self._say(f"{name} again: stopping now, without a new checkpoint (the last complete one is intact)")
            os._exit(EXIT_INTERRUPTED)
        self.requested = True
        self.signal_name = name
        self._say(f"{name} received: finishing the current step, then writing a checkpoint "
                  "(send it again to stop at once)")

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
