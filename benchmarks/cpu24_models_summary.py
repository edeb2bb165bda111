"""Summarise a folder of `cast-llm bench-inference --json-out` files (one CPU host) into its `summary.json`:
per run the decode and prefill ratios (2:4 ÷ dense tokens/s), the target-weight ratio and the logits verdict,
and per model the range and median of the decode ratio over its runs. The README quotes these.

    python benchmarks/cpu24_models_summary.py docs/results/cpu24-models/epyc-b
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def summarise(folder: Path) -> dict:
    runs, by_model = {}, {}
    for f in sorted(folder.glob("*.json")):
        if f.name == "summary.json":
            continue
        r = json.loads(f.read_text())
        if not isinstance(r, dict) or "dense" not in r or not r.get("sparse"):
            continue
        d, s = r["dense"], r["sparse"]
        row = {"model": r["model"], "device": r["device"],
               "prompt_len": r["config"]["prompt_len"], "gen_len": r["config"]["gen_len"],
               "dense_copy": r["config"]["dense_copy"],
               "decode_ratio": round(s["decode_tokens_per_s"] / d["decode_tokens_per_s"], 4),
               "prefill_ratio": round(s["prefill_tokens_per_s"] / d["prefill_tokens_per_s"], 4),
               "target_weight_ratio": round(s["target_weight_bytes"] / d["target_weight_bytes"], 4),
               "logits_rel_err": r.get("logits_rel_err"), "logits_noise_floor": r.get("logits_noise_floor"),
               "logits_within_noise": r.get("logits_within_noise")}
        runs[f.name] = row
        paired = str(r.get("timing", "")).startswith("paired")
        key = re.sub(r"-(interleaved-|paired-alternating-|paired-)?run\d+$", "", f.stem)
        key += " (paired)" if paired else " (sequential)"
        row["timing"] = "paired" if paired else "sequential"
        if row["gen_len"] >= 64:  # decode ratios over short generations are not pooled with the long ones
            by_model.setdefault(key, []).append(row["decode_ratio"])
    models = {k: {"runs": len(v), "decode_ratio_min": min(v), "decode_ratio_max": max(v),
                  "decode_ratio_median": statistics.median(v)} for k, v in by_model.items()}
    return {"written_by": "benchmarks/cpu24_models_summary.py", "folder": str(folder), "runs": runs,
            "models": models}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    a = p.parse_args()
    out = summarise(a.folder)
    (a.folder / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, row in out["runs"].items():
        print(f"{name:<52} decode {row['decode_ratio']:.2f}x prefill {row['prefill_ratio']:.2f}x "
              f"targets {row['target_weight_ratio']:.2f}x within noise {row['logits_within_noise']}")
    for name, m in out["models"].items():
        print(f"{name:<52} decode {m['decode_ratio_min']:.2f}-{m['decode_ratio_max']:.2f}x over {m['runs']} runs, "
              f"median {m['decode_ratio_median']:.2f}x")


if __name__ == "__main__":
    main()
