"""benchmarks/cpu24_models_summary.py: the ratios the README quotes are computed from the run files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu24_models_summary.py"


def _run(tokens_dense, tokens_sparse, gen_len=128):
    path = lambda t: {"decode_tokens_per_s": t, "prefill_tokens_per_s": 2 * t, "target_weight_bytes": 100 * t}  # noqa: E731
    return {"model": "m", "device": "cpu", "config": {"prompt_len": 128, "gen_len": gen_len, "dense_copy": True},
            "dense": path(tokens_dense), "sparse": path(tokens_sparse), "logits_rel_err": 0.0,
            "logits_noise_floor": 0.02, "logits_within_noise": True}


def test_ratios_ranges_and_medians_come_from_the_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("cpu24_models_summary", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "x-decode.json").write_text(json.dumps(_run(5.0, 10.0)))
    (tmp_path / "x-decode-run2.json").write_text(json.dumps(_run(5.0, 8.0)))
    (tmp_path / "x-decode-interleaved-run1.json").write_text(json.dumps(_run(4.0, 9.0)))
    (tmp_path / "x-decode-paired-run1.json").write_text(json.dumps({**_run(4.0, 10.0), "timing": "paired: ..."}))
    (tmp_path / "x-short.json").write_text(json.dumps(_run(4.0, 2.0, gen_len=8)))
    (tmp_path / "skipped.json").write_text(json.dumps({"dense": {}, "sparse": None}))
    out = mod.summarise(tmp_path)
    assert out["runs"]["x-decode.json"]["decode_ratio"] == 2.0
    assert out["runs"]["x-short.json"]["decode_ratio"] == 0.5 and "skipped.json" not in out["runs"]
    m = out["models"]["x-decode (sequential)"]
    assert (m["runs"], m["decode_ratio_min"], m["decode_ratio_max"], m["decode_ratio_median"]) == (3, 1.6, 2.25, 2.0)
    assert out["models"]["x-decode (paired)"]["decode_ratio_median"] == 2.5  # not pooled with the sequential runs
    assert not any(k.startswith("x-short") for k in out["models"])  # 8 decode steps are not pooled with the long runs
