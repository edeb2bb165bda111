"""Helpers shared by the tests that start, signal or kill training processes (test_reliability.py, test_train.py,
test_train_memory_options.py, test_fsdp_precision.py): a free port for a launcher, the command line in a warm
child, wait for a run to reach a step, find the workers a launcher started."""

from __future__ import annotations

import socket
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port nobody listens on now (for a launcher's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli(warm_cli, args: list[str], unbuffered: bool = False):
    """``cast-llm ARGS`` in a process of its own, forked from conftest's ``warm_cli`` (Popen-like)."""
    code = f"import sys; from cast_llm.cli import main; sys.argv = ['-c', *{list(args)!r}]; sys.exit(main(sys.argv[1:]))"
    return warm_cli.start(code, unbuffered=unbuffered)


def wait_for_step(out: Path, step: int, proc, timeout: float = 240) -> None:
    """Return once the run writing ``out`` has logged ``step`` lines of metrics (one per step at --log-every 1);
    fail if ``proc`` ended first or ``timeout`` seconds passed."""
    deadline = time.time() + timeout
    metrics = out / "metrics.jsonl"
    while True:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step:
            return
        assert proc.poll() is None, "the run ended before the signal"
        assert time.time() < deadline, "timed out waiting for the run"
        time.sleep(0.02)


def children_running(needle: str, parent: int) -> list[int]:
    """PIDs of the processes below ``parent`` whose command line contains ``needle`` (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat[3]) == parent and needle in cmd:
            out.append(int(d.name))
    return sorted(out)
