"""Every benchmark of benchmarks/ runs in its --quick mode (tiny shapes / a tiny random LLaMA), so that the
recorded commands of docs/results keep working. The scripts run as subprocesses, all at once: most of their
time is interpreter start-up and imports, which overlap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
def json_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("benchmarks")


@pytest.fixture(scope="module")
def runs(json_dir):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    extra = {"optimizer_step.py": ["--json", str(json_dir / "optimizer_step.json")],
             "train_step.py": ["--json", str(json_dir / "train_step.json")]}  # what the GPU kit reads
    procs = {name: subprocess.Popen([sys.executable, str(BENCHMARKS / name), "--quick", *extra.get(name, [])],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in EXPECTED}
    return {name: (p, *p.communicate(timeout=600)) for name, p in procs.items()}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_benchmark_quick_mode_runs(runs, name):
    proc, out, err = runs[name]
    assert proc.returncode == 0, f"{name} --quick failed:\n{err[-3000:]}"
    assert EXPECTED[name] in out and "machine:" in out, out


def test_optimizer_step_json_has_the_targets(runs, json_dir):
    """The GPU kit reads these keys; on CPU the GPU targets are null and the rows hold the CPU timings."""
    import json

    assert runs["optimizer_step.py"][0].returncode == 0
    result = json.loads((json_dir / "optimizer_step.json").read_text())
    for key in ("adams_over_fused", "adams_over_fused_smollm2", "adams_copy_fraction"):
        assert key in result and result[key] is None
    assert {"rows", "device", "versions"} <= set(result) and result["versions"]["torch"] == torch.__version__
    shapes = {(r["shapes"], r["optimizer"]) for r in result["rows"]}
    for model in ("tiny", "tiny-7b"):
        assert {(model, "AdamW(fused=True)"), (model, "AdamS bool masks"), (model, "AdamS packed masks")} <= shapes
    assert all(r["median_ms"] > 0 and r["over_fused"] > 0 for r in result["rows"])


def test_train_step_json_has_the_issue_keys_and_a_profile_per_variant(runs, json_dir):
    """train_step.py --tiny --json: the four target ratios at the top level (SmolLM2's row and the 1B row,
    here their tiny stand-ins), one row per configuration and variant, and a profiler table for each."""
    import json

    proc, out, err = runs["train_step.py"]
    assert proc.returncode == 0, err[-3000:]
    doc = json.loads((json_dir / "train_step.json").read_text())
    keys = ("cast_nokd_over_plain", "cast_kd_over_plain", "cast_nokd_over_plain_1b", "cast_kd_over_plain_1b")
    assert all(isinstance(doc[k], float) and doc[k] > 0 for k in keys), doc
    assert set(doc) == {*keys, "rows", "device", "versions", "settings"}
    assert doc["versions"]["torch"] and doc["device"].startswith("cpu")
    rows = {(r["config"], r["variant"]): r for r in doc["rows"]}
    assert set(rows) == {(c, v) for c in ("smollm2", "1b") for v in ("plain", "cast_nokd", "cast_kd")}
    assert rows[("1b", "cast_kd")]["over_plain"] == doc["cast_kd_over_plain_1b"]
    assert rows[("smollm2", "cast_nokd")]["mask_update_steps"] >= 1  # a mask update was timed and amortised
    for r in rows.values():
        table = Path(r["profile_file"]).read_text()
        assert "Self CPU" in table and r["top_ops"], r
