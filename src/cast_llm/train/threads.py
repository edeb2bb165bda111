"""``--threads 0``: how many intra-op threads torch gets on a CPU — the cores nobody else is using now.

On a shared machine torch's threads spin against the other jobs' (a 2-core box measured 19.7 GFLOP/s with 1
thread against 13.7 with 2 while another job ran), so the cores other processes keep busy are left to them.
"Busy" is measured, not guessed: the CPU time the whole machine spent outside idle during a short sample of
``/proc/stat`` (half a second, while this process waits). The one-minute load average used before still
counted a test suite that had just finished, and gave ``make run`` after ``make test`` one thread of two
on an idle machine.

The choice is made once per run: it is recorded with the run's checkpoints and a resume takes it again
(``setup_threads(recorded=...)``), so that a run resumed on a busier machine continues exactly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["busy_cores", "choose_threads", "setup_threads", "differs_from_recorded"]

SAMPLE_S = 0.5


def _read_stat() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from the first line of /proc/stat; None where it is missing."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    total = sum(values)
    return total - idle, total


def busy_cores(cores_online: int, *, read: Callable[[], tuple[int, int] | None] = _read_stat,
               sleep: Callable[[float], None] = time.sleep, sample_s: float = SAMPLE_S) -> float | None:
    """Cores the machine keeps busy now: the busy share of CPU time over ``sample_s`` × the online cores."""
    a = read()
    if a is None:
        return None
    sleep(sample_s)
    b = read()
    if b is None or b[1] <= a[1]:
        return None
    return cores_online * (b[0] - a[0]) / (b[1] - a[1])


def choose_threads(cores: int, busy: float | None) -> int:
    """The cores this process may use (its affinity) less those busy elsewhere, at least 1. A core counts
    as busy from 60% use: a job using half a core leaves the rest of it to us."""
    if busy is None:
        return cores
    return max(1, cores - int(busy + 0.4))


def setup_threads(cfg, *, busy: Callable[[int], float | None] | None = None,
                  recorded: int | None = None) -> str | None:
    """Set torch's intra-op threads from ``cfg.threads`` (0 = automatic: :func:`choose_threads`) and return a
    line saying what was chosen when fewer than all cores (None when the user or a launcher chose).

    ``recorded``: on a resume, the threads the run computed with before (its checkpoint's). The automatic
    choice then takes them again instead of measuring the machine anew — a CPU's float sums depend on the
    thread count, so a resume on a machine that got busier would otherwise not continue the run exactly. A
    choice of the user's (``--threads N``, ``OMP_NUM_THREADS``) still wins; the line then says that it
    differs from the recorded one."""
    import torch

    n = cfg.threads or 0
    if n > 0:
        torch.set_num_threads(n)
        return differs_from_recorded(n, recorded, f"--threads {n}")
    if os.environ.get("OMP_NUM_THREADS"):
        # the user (or a launcher) chose already
        return differs_from_recorded(torch.get_num_threads(), recorded, "OMP_NUM_THREADS")
    if recorded:
        torch.set_num_threads(recorded)
        return (f"threads: {recorded}, as the run chose when it started (recorded with its checkpoint: the resumed "
                "steps compute as the first ones did; --threads N to choose)")
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    online = os.cpu_count() or cores
    used = (busy or busy_cores)(online)
    threads = choose_threads(cores, used)
    torch.set_num_threads(threads)
    if threads < cores:
        return (f"threads: {threads} of {cores} cores (other processes used {used:.1f} cores over the last "
                f"{SAMPLE_S:g} s; timings assume an idle machine; --threads N to choose)")
    return f"threads: {threads} of {cores} cores"


def differs_from_recorded(threads: int, recorded: int | None, how: str) -> str | None:
    """The line for a resume whose threads (chosen by ``how``) differ from the ``recorded`` ones; else None."""
    if not recorded or recorded == threads:
        return None
    return (f"threads: {threads} ({how}), not the {recorded} the run computed with before this resume: the "
            "resumed steps may differ from an uninterrupted run's in the last bits (--threads 0 reuses the "
            "run's choice)")
