"""``cast-llm doctor``: the environment and every checked kernel path's verdict, on this machine (a CPU here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import cast_llm
from cast_llm import kernels
from cast_llm.cli import main
from cast_llm.deploy.sparse24 import cpu as cpu24


def test_doctor_json_lists_every_kernel_path_then_the_table_reads_the_verdict_file(capsys):
    """One probe of every path (``--json``, ~10 s here), then the table from the verdicts it wrote."""
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    env = report["environment"]
    assert env["torch"] == torch.__version__ and "triton" in env and "gpus" in env and "driver" in env
    assert {"nccl", "cusparselt", "cuda_runtime", "verdict_file"} <= set(env)
    rows = report["rows"]
    assert {r["path"] for r in rows} == set(kernels.REGISTRY) >= {
        "adams.update", "adams.masks", "kd.loss", "scaled_weight.layer", "scaled_weight.block", "teacher.cuda_graph",
        "sparse24.gemm", "sparse24.decode_graph"}
    assert all(r["verdict"] in ("pass", "fail", "not here", "CUDA-only") for r in rows)
    if not torch.cuda.is_available():
        cpu_ok = [r for r in rows if r["verdict"] == "pass"]
        cpu24_ok = [r for r in cpu_ok if r["path"].startswith("sparse24.cpu_gemm.")]
        assert [(r["path"], r["candidate"]) for r in cpu_ok if r not in cpu24_ok] == [("adams.update", "blockwise")]
        assert cpu_ok[0]["runs"] and cpu_ok[0]["seconds"] > 0 and cpu_ok[0]["reference_seconds"] > 0
        if cpu24.extension_reason() is None:  # the CPU 2:4 kernels: listed with their time against dense
            bf16 = {r["candidate"]: r for r in cpu24_ok if r["path"] == "sparse24.cpu_gemm.bfloat16"}
            assert "cpu-avx512-bf16" in bf16 or "cpu-avx2" in bf16
            assert all(r["seconds"] > 0 and r["reference_seconds"] > 0 for r in bf16.values())
        cuda_only = {r["path"] for r in rows if r["verdict"] == "CUDA-only"}
        assert cuda_only >= {"adams.masks", "scaled_weight.layer", "teacher.cuda_graph", "sparse24.gemm"}
        assert all(r["verdict"] != "fail" for r in rows)
    kernels.reset()  # a second run: the verdicts come from the file (no probe)
    probes = []
    path = kernels.REGISTRY["adams.update"]
    real = path.probe
    kernels.REGISTRY["adams.update"] = type(path)(**{**path.__dict__, "probe": lambda *a, **k: probes.append(1) or
                                                     real(*a, **k)})
    try:
        assert main(["doctor"]) == 0
    finally:
        kernels.REGISTRY["adams.update"] = path
    table = capsys.readouterr().out
    assert not probes
    assert "environment" in table and "adams.update" in table and "CUDA-only" in table and "docs/gpu.md" in table
    # where the CPU 2:4 layers' compressed tensors lie, and why not on huge pages where they are not
    why = cpu24.huge_pages_reason()
    assert env["cpu_huge_pages"] == why
    assert ("CPU 2:4 weights: on huge pages" if why is None else f"CPU 2:4 weights: on 4 KB pages ({why})") in table
    # the cache the cold timings overflow (the suite sets CAST_LLM_L3_BYTES: given, so as reported)
    assert env["cpu_cold_bytes"] == env["cpu_l3_bytes"] and f"CPU cache: {env['cpu_l3_bytes'] >> 20} MiB" in table


def _every_module() -> list[str]:
    src = Path(cast_llm.__file__).parent
    names = []
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] != "__main__":  # importing one runs the command line
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_doctor_in_a_fresh_process_lists_every_path_any_module_registers():
    """No hand list: ``doctor`` in a process that imported nothing else lists every checked path — the ones
    that importing every module of the package, one by one, registers afterwards (a path declared in a new
    module that ``doctor`` does not find fails here). The checked kernels are switched off in that process
    (``CAST_LLM_KERNELS=reference``): the rows are listed, nothing is probed (that is the test above's work)."""
    code = ("import importlib, json, sys\n"
            "from cast_llm.doctor import doctor\n"
            "listed = sorted({r['path'] for r in doctor()['rows']})\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "from cast_llm import kernels\n"
            "print(json.dumps({'listed': listed, 'registered': sorted(kernels.REGISTRY)}))\n")
    proc = subprocess.run([sys.executable, "-c", code, *_every_module()], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "CAST_LLM_KERNELS": "reference"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    missing = sorted(set(found["registered"]) - set(found["listed"]))
    assert not missing, f"checked paths missing from cast-llm doctor: {missing}"
    assert len(found["listed"]) >= 10 and "sparse24.decode_graph" in found["listed"]  # the check sees paths


def test_doctor_takes_the_cores_other_processes_leave(monkeypatch, capsys):
    """On a machine another job keeps busy, doctor's probes run on the cores left (two threads spin at every
    barrier on a shared core), says so, and the report names the thread count its times were taken at."""
    import cast_llm.doctor
    from cast_llm.kernels.environment import environment
    from cast_llm.train import threads

    # the probes themselves are the first test's: here only what the command sets up before them
    monkeypatch.setattr(cast_llm.doctor, "doctor", lambda recheck=False: {"environment": environment(), "rows": []})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda cores, **k: cores - 0.9)  # all but one core busy
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["doctor", "--json"]) == 0
        out = capsys.readouterr()
        assert torch.get_num_threads() == 1 and "other processes" in out.err
        assert json.loads(out.out)["environment"]["cpu_threads"] == 1
    finally:
        torch.set_num_threads(before)
