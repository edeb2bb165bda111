"""Start-up cost of a run's data, for a source 3× and 30× the embedded corpus at the same small budget:
peak host memory and wall time of preparing the data (tokenizer load included), in a fresh process each —
the code before the token cache (every document read and tokenised, int64 in memory) beside today's
(read only as far as the budget, a binary cache memory-mapped), cold (no cache) and warm (cache built).

    python benchmarks/data_startup.py [--copies 3,30] [--old-rev 211d34b] [--json out.json]

The numbers in docs/results/data-startup.md came from this command; it prints what else kept the machine busy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

CHILD = r"""
import json, sys, time, importlib.util
t0 = time.perf_counter()
from cast_llm.models import load_tokenizer
tok = load_tokenizer("smollm2-135m")
mode, src, cache = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "old":
    spec = importlib.util.spec_from_file_location("old_data", sys.argv[4])
    old = importlib.util.module_from_spec(spec); sys.modules["old_data"] = old; spec.loader.exec_module(old)
    d = old.prepare(src, tok, 128, seed=0, min_train_sequences=4)
    n = d.train.shape[0]
else:
    from cast_llm.data import prepare
    d = prepare(src, tok, 128, train_sequences=32, val_sequences=16, test_sequences=16, calib_samples=128,
                cache_root=cache)
    n = d.train.shape[0]
import resource
print(json.dumps({"seconds": time.perf_counter() - t0, "train_sequences": n,
                  "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def run_child(args: list[str]) -> dict:
    """One fresh process: its wall time, and the peak RSS and data-ready time it reports itself."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"child failed: {p.stderr[-2000:]}")
    return {"wall_s": round(wall, 2), **json.loads(p.stdout.strip().splitlines()[-1])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", default="3,30", help="sizes of the .jsonl as copies of the embedded corpus")
    ap.add_argument("--old-rev", default="211d34b", help="the commit whose data.py is 'before'")
    ap.add_argument("--json", help="write the measurements here")
    opts = ap.parse_args(argv)
    from compare_methods import MachineLoad

    from cast_llm.data import load_documents

    docs = load_documents("wiki-summaries")
    work = Path(tempfile.mkdtemp(prefix="data-startup-"))
    old = work / "old_data.py"
    old.write_text(subprocess.run(["git", "show", f"{opts.old_rev}:src/cast_llm/data.py"], cwd=REPO,
                                  capture_output=True, text=True, check=True).stdout)
    rows = []
    machine = MachineLoad()
    for k in [int(x) for x in opts.copies.split(",")]:
        src = work / f"corpus-x{k}.jsonl"
        with src.open("w") as f:
            for _ in range(k):
                for d in docs:
                    f.write(json.dumps({"text": d}) + "\n")
        size = src.stat().st_size
        cache = work / f"cache-x{k}"
        for mode, label in (("old", "before (read all, int64)"), ("new", "cache cold"), ("new", "cache warm")):
            r = run_child([mode, str(src), str(cache), str(old)])
            rows.append({"copies": k, "bytes": size, "code": label, "wall_s": r["wall_s"],
                         "data_ready_s": round(r["seconds"], 2), "peak_rss_mib": round(r["peak_rss_kib"] / 1024, 1),
                         "train_sequences": r["train_sequences"]})
            print(f"x{k:<3} {size / 2**20:7.1f} MiB  {label:<26} {r['wall_s']:7.2f} s  "
                  f"peak RSS {rows[-1]['peak_rss_mib']:8.1f} MiB", flush=True)
    load = machine.finish()
    print(f"machine: {load} (other_cores: what else kept the machine busy meanwhile)")
    by = {(r["copies"], r["code"]): r for r in rows}
    ks = [int(x) for x in opts.copies.split(",")]
    if len(ks) == 2:
        a, b = ks
        for label in ("before (read all, int64)", "cache cold", "cache warm"):
            x, y = by[(a, label)], by[(b, label)]
            print(f"{label:<26} x{b} / x{a}: wall {y['wall_s'] / x['wall_s']:.2f}×, peak RSS "
                  f"{y['peak_rss_mib'] - x['peak_rss_mib']:+.1f} MiB")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"rows": rows, "machine": load, "command": " ".join(sys.argv)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
