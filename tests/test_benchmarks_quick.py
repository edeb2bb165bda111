"""Every benchmark of benchmarks/ runs in its --quick mode (tiny shapes / a tiny random LLaMA), so that the
recorded commands of docs/results keep working. The scripts run as subprocesses, all at once: most of their
time is interpreter start-up and imports, which overlap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# script -> a line its report must contain
EXPECTED = {
    "optimizer_step.py": "AdamS packed masks",
    "mask_update.py": "amortised over T1 = 10",
    "train_step.py": "ratios: CAST w/o KD / plain",
    "peak_memory.py": "the teacher adds",
    "adams_noise.py": "AdamS moves noise-driven weights",
}


@pytest.fixture(scope="module")
def runs():
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    procs = {name: subprocess.Popen([sys.executable, str(BENCHMARKS / name), "--quick"], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in EXPECTED}
    return {name: (p, *p.communicate(timeout=600)) for name, p in procs.items()}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_benchmark_quick_mode_runs(runs, name):
    proc, out, err = runs[name]
    assert proc.returncode == 0, f"{name} --quick failed:\n{err[-3000:]}"
    assert EXPECTED[name] in out and "machine:" in out, out
