"""``cast-llm doctor``: the machine, and every checked kernel path's verdict on it, timed against its reference.

Every fast path of cast-llm is a checked kernel path (:mod:`cast_llm.kernels`); :func:`doctor` first imports
every module that declares one (:func:`cast_llm.kernels.load_all`, which finds them in the package's source:
no hand list), so the registry is complete, then for each path, device (the CPU and every visible GPU) and
representative variant lists each candidate: whether it can run here (and why not), its verdict —
taken from the user's verdict file when there is one (``--recheck`` probes again), else probed now, exactly
as a run would on first use — and, where it passed, its time per call beside the reference's at the path's
timing size. On a machine without a GPU the CUDA-only candidates are listed as such and not run.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from cast_llm import kernels
from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24 import cusparselt_direct
from cast_llm.deploy.sparse24.cycles import cold_bytes, l3_bytes, l3_given
from cast_llm.kernels.environment import environment

__all__ = ["doctor", "format_doctor"]


def _devices() -> list[torch.device]:
    return [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def doctor(*, recheck: bool = False) -> dict[str, Any]:
    """The environment and one row per (path, device, variant, candidate); see the module docstring."""
    kernels.load_all()  # every checked path registers itself when its module is imported
    env = environment()
    if env["cuda_available"]:
        env["cusparselt_direct"] = cusparselt_direct.library_version()
    env["cpu_huge_pages"] = cpu24.huge_pages_reason()  # None: CPU 2:4 layers' compressed tensors on huge pages
    env["cpu_l3_bytes"], env["cpu_cold_bytes"] = l3_bytes(), cold_bytes()  # the cache as reported, and as timed past
    rows = []
    started = time.perf_counter()
    for name in sorted(kernels.REGISTRY):
        path = kernels.REGISTRY[name]
        for device in _devices():
            if device.type == "cpu" and path.cuda_only:
                rows += [{"path": name, "device": "cpu", "variant": "-", "candidate": c.name, "verdict": "CUDA-only",
                          "why": c.runs_on(device)} for c in path.candidates]
                continue
            for variant in path.variants(device):
                found = kernels.examine(name, device, variant, recheck=recheck)
                runs = kernels.choose(name, device, variant)
                for row in found:
                    if row["verdict"] == "not here" and device.type == "cpu" and not row["why"].startswith("off"):
                        row["verdict"] = "CUDA-only"
                    row["runs"] = row["candidate"] == runs
                rows += found
    return {"environment": env, "mode": kernels.mode(), "rows": rows,
            "seconds": round(time.perf_counter() - started, 2),
            "paths": {name: kernels.REGISTRY[name].what for name in sorted(kernels.REGISTRY)}}


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3g} ms"


def format_doctor(report: dict[str, Any]) -> str:
    env = report["environment"]
    gpus = "; ".join(f"cuda:{g['index']} {g['name']} (sm {g['compute_capability']}, {g['memory_gib']} GiB)"
                     for g in env["gpus"]) or "none visible: the CUDA-only checks are listed, not run"
    triton = env["triton"]
    lines = [
        "environment",
        f"  cast-llm {env['cast_llm']}, Python {env['python']}, torch {env['torch']} (CUDA {env['cuda_runtime']}), "
        f"transformers {env['transformers']}",
        f"  Triton {triton['version']}" + ("" if triton["importable"] else f" — not importable: {triton.get('why')}"),
        f"  GPU: {gpus}",
        f"  driver {env['driver']}, cuSPARSELt {env['cusparselt']}"
        + (f" (direct binding: {env.get('cusparselt_direct')})" if env["cuda_available"] else "")
        + f", NCCL {env['nccl']}",
        f"  CPU: {env['cpu']}, {env['cpu_threads']} thread(s) for the probes",
        "  CPU 2:4 weights: " + ("on huge pages (transparent, madvise; CAST_LLM_HUGE_PAGES=0 turns it off)"
                                 if env.get("cpu_huge_pages") is None else f"on 4 KB pages ({env['cpu_huge_pages']})"),
        f"  CPU cache: {env['cpu_l3_bytes'] >> 20} MiB last-level"
        + (" (CAST_LLM_L3_BYTES)" if l3_given() else " (sysfs)")
        + (f"; cold timings cycle copies past {env['cpu_cold_bytes'] >> 20} MiB (from there on this process reads at"
           " DRAM speed, measured; CAST_LLM_L3_BYTES sets it)" if env["cpu_cold_bytes"] != env["cpu_l3_bytes"] else ""),
        f"  kernels: {env['kernels_mode']}; torch.compile candidates {env['compile_candidates']}; verdicts in "
        f"{env['verdict_file']}",
        "",
    ]
    header = ("path", "device", "variant", "candidate", "verdict", "error / tolerance", "time", "reference", "ratio")
    table = [header]
    for r in report["rows"]:
        err = r.get("error") or ""
        if r["verdict"] == "pass" and r.get("max_error") is not None:
            err = f"{r['max_error']:.2g} <= {r['tolerance']:.2g}"
        elif r["verdict"] in ("not here", "CUDA-only"):
            err = r.get("why") or ""
        ratio = ""
        if r.get("seconds") and r.get("reference_seconds"):
            ratio = f"{r['seconds'] / r['reference_seconds']:.2f}x"
        verdict = r["verdict"] + (" (runs)" if r.get("runs") else "")
        table.append((r["path"], r["device"], r["variant"], r["candidate"], verdict, err[:70], _ms(r.get("seconds")),
                      _ms(r.get("reference_seconds")), ratio))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    lines += ["", "verdicts: pass / fail (the candidate's check against its reference on this machine; a failed one "
              "never runs here), not here (cannot run on this device), CUDA-only (listed on a machine without a "
              "GPU). '(runs)': the candidate a run takes; ratio: its time / the reference's. docs/gpu.md explains "
              "how to read this."]
    return "\n".join(lines)
