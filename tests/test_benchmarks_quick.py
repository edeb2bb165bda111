"""Every benchmark of benchmarks/ runs in its --quick mode (tiny shapes / a tiny random LLaMA), so that the
recorded commands of docs/results keep working. Most of a script's time in --quick is its imports (torch,
transformers, the package: ~4 s of CPU each here), so each runs in a process forked from one warm interpreter
that has imported them (tests/warm_interpreter.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from warm_interpreter import WarmInterpreter

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# script -> a line its report must contain
EXPECTED = {
    "optimizer_step.py": "AdamS packed masks",
    "mask_update.py": "amortised over T1 = 10",
    "train_step.py": "ratios: CAST w/o KD / plain",
    "peak_memory.py": "the teacher adds",
    "adams_noise.py": "AdamS moves noise-driven weights",
    "linear24.py": "linear24_prefill_speedup",
    "inference24.py": "model24_logits_rel_err",
}
# --json: what the GPU kit's perf stage reads
WRITES_JSON = ("linear24.py", "inference24.py", "optimizer_step.py", "train_step.py")
# what the scripts import (each imported once, in the warm interpreter, not once per script)
PRELOAD = ["torch", "torch.profiler", "transformers", "cast_llm.optim.adams", "cast_llm.deploy.sparse24",
           "cast_llm.deploy.sparse24.decode", "cast_llm.targets", "_common", "_sparse24"]


@pytest.fixture(scope="module")
def json_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-json")


@pytest.fixture(scope="module")
def runs(json_dir):
    """Each script as ``python <script> --quick`` runs it (``__main__``, its argv, its folder first on sys.path),
    in a child forked from one warm interpreter that has imported what the scripts import."""
    server = WarmInterpreter({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                             path=[BENCHMARKS], preload=PRELOAD)
    out = {}
    try:
        for name in EXPECTED:
            argv = [str(BENCHMARKS / name), "--quick",
                    *(["--json", str(json_dir / f"{name}.json")] if name in WRITES_JSON else [])]
            out[name] = server.run(f"import runpy, sys\nsys.argv = {argv!r}\nsys.path[0] = {str(BENCHMARKS)!r}\n"
                                   f"runpy.run_path({argv[0]!r}, run_name='__main__')\n")
    finally:
        server.close()
    return {name: (r, r.stdout, r.stderr) for name, r in out.items()}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_benchmark_quick_mode_runs(runs, name):
    proc, out, err = runs[name]
    assert proc.returncode == 0, f"{name} --quick failed:\n{err[-3000:]}"
    assert EXPECTED[name] in out and "machine:" in out, out


def _json(runs, json_dir, name):
    assert runs[name][0].returncode == 0, runs[name][2][-3000:]
    return json.loads((json_dir / f"{name}.json").read_text())


def test_linear24_tiny_reports_the_24_side_skipped_and_no_target(runs, json_dir):
    data = _json(runs, json_dir, "linear24.py")
    assert data["linear24_prefill_speedup"] is None  # never estimated
    assert data["rows"] and all(r["dense_us"] > 0 and r["kernels"] == {} for r in data["rows"])
    assert "CUDA" in data["skipped"]["cusparselt"] and "graph mode" in data["skipped"]


def test_inference24_tiny_reports_dense_rows_checks_and_null_targets(runs, json_dir):
    data = _json(runs, json_dir, "inference24.py")
    keys = ("model24_prefill_speedup", "model24_decode_speedup", "model24_min_speedup", "model24_logits_rel_err")
    assert all(k in data and data[k] is None for k in keys)
    assert {r["phase"] for r in data["rows"]} == {"prefill", "decode_eager"}
    assert all("ratio" not in r and ("note" in r or r["dense_tok_s"] > 0) for r in data["rows"])
    assert "CUDA" in data["models"][0]["sparse_skipped"]
    # the layer plumbing is still checked on CPU with the emulated kernel (fp32: exact up to summation order)
    checks = data["checks"]
    assert {c["phase"] for c in checks} == {"prefill", "decode"}
    assert all(c["rel_err"] < 1e-5 and not c["counts_for_target"] and "emulated" in c["kernel"] for c in checks)


def test_optimizer_step_json_has_the_targets(runs, json_dir):
    """The GPU kit reads these keys; on CPU the GPU targets are null and the rows hold the CPU timings."""
    result = _json(runs, json_dir, "optimizer_step.py")
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
    doc = _json(runs, json_dir, "train_step.py")
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


def test_benchmarks_import_only_public_names():
    """A benchmark uses the library's public API and its sibling scripts' public helpers: a private name
    (``_x``) imported from ``cast_llm`` or from another script is a helper that should be public (a package's
    own modules, like ``benchmarks/gpu/gpukit``, may share theirs)."""
    import ast

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    scripts = {p.stem for p in root.glob("*.py")}
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            top = node.module.split(".")[0]
            if top != "cast_llm" and top not in scripts:
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            private += [part for part in node.module.split(".") if part.startswith("_") and part not in scripts]
            if private:
                found.append(f"{path.relative_to(root)}:{node.lineno} imports {private} from {node.module}")
    assert not found, "\n".join(found)
