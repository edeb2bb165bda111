"""``--threads 0``: how many intra-op threads torch gets on a CPU — the cores nobody else is using now.

On a shared machine torch's threads spin against the other jobs' (a 2-core box measured 19.7 GFLOP/s with 1
thread against 13.7 with 2 while another job ran), so the cores other processes keep busy are left to them.
"Busy" is measured, not guessed: the CPU time the whole machine spent outside idle during a short sample of
``/proc/stat`` (half a second, while this process waits). The one-minute load average used before still
counted a test suite that had just finished, and gave ``make run`` after ``make test`` one thread of two
on an idle machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["busy_cores", "choose_threads", "setup_threads"]

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


def setup_threads(cfg, *, busy: Callable[[int], float | None] | None = None) -> str | None:
    """Set torch's intra-op threads from ``cfg.threads`` (0 = automatic: :func:`choose_threads`); returns a
    line saying what was chosen when fewer than all cores (None when the user or a launcher chose)."""
    import torch

    n = getattr(cfg, "threads", 0) or 0
    if n > 0:
        torch.set_num_threads(n)
        return None
    if os.environ.get("OMP_NUM_THREADS"):
        return None  # the user (or a launcher) chose already
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
