"""The CPU 2:4 tables, from the committed measurements: ``docs/results/cpu24-linear*.json`` (benchmarks/cpu24.py,
one file a CPU: ``LINEAR``) and ``docs/results/cpu24-models/*.json`` (``cast-llm bench-inference --device cpu --dtype bf16 ... --json-out``).

Writes ``docs/results/cpu24-summary.json`` (every ratio the tables print, rounded as printed, so that the README's
figures can be checked against a file) and ``docs/results/cpu24.md``. Nothing is measured here.

    python benchmarks/cpu24_report.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
MODELS = {  # file stem -> (model, workload)
    "smollm2-135m-decode": ("SmolLM2-135M (embedded, magnitude 2:4)", "128 prompt + 128 decode"),
    "smollm2-135m-decode-compressed-only": ("SmolLM2-135M, --no-dense-copy", "128 prompt + 128 decode"),
    "tinyllama-1.1b-decode": ("TinyLlama-1.1B shape (random 2:4)", "128 prompt + 128 decode"),
    "llama-3.2-1b-decode": ("Llama-3.2-1B shape (random 2:4)", "128 prompt + 128 decode"),
    "smollm2-135m-prefill512": ("SmolLM2-135M (embedded, magnitude 2:4)", "512 prompt + 8 decode"),
    "tinyllama-1.1b-prefill512": ("TinyLlama-1.1B shape (random 2:4)", "512 prompt + 8 decode"),
}
EXTRA = {"2:4 hwpf": "hwpf", "2:4 amx": "amx", "2:4 rows": "rows", "2:4 tok": "tokens"}  # benchmarks/cpu24.py's names of the other 2:4 paths -> column
BEST = {"2:4": "gather", "2:4 hwpf": "hwpf", "2:4 amx": "amx", "2:4 rows": "rows", "2:4 tok": "tokens"}
HEAD = re.compile(r"\(([\d.]+) ms a token against torch's ([\d.]+)\)")


def model_rows() -> list[dict]:
    rows = []
    for stem, (model, work) in MODELS.items():
        f = RESULTS / "cpu24-models" / f"{stem}.json"
        if not f.is_file():
            continue
        d = json.loads(f.read_text())
        dense, sparse = d["dense"], d["sparse"]
        head = next((n for n in d.get("notes", []) if n.startswith("LM head")), "")
        m = HEAD.search(head)
        dec_ms_d, dec_ms_s = 1e3 / dense["decode_tokens_per_s"], 1e3 / sparse["decode_tokens_per_s"]
        # the decode ratio with the head's gain taken out (its torch time put back): the 2:4 layers' share
        no_head = dec_ms_d / (dec_ms_s + float(m.group(2)) - float(m.group(1))) if m else None
        rows.append({
            "file": f"cpu24-models/{stem}.json", "model": model, "workload": work, "device": d["device"],
            "prefill_dense": round(dense["prefill_tokens_per_s"]), "prefill_24": round(sparse["prefill_tokens_per_s"]),
            "prefill_ratio": round(sparse["prefill_tokens_per_s"] / dense["prefill_tokens_per_s"], 2),
            "decode_dense": round(dense["decode_tokens_per_s"], 1), "decode_24": round(sparse["decode_tokens_per_s"], 1),
            "decode_ratio": round(sparse["decode_tokens_per_s"] / dense["decode_tokens_per_s"], 2),
            "decode_ratio_without_head": None if no_head is None else round(no_head, 2),
            "head": head,
            "target_mib_dense": round(dense["target_weight_bytes"] / 2**20, 1),
            "target_mib_24": round(sparse["target_weight_bytes"] / 2**20, 1),
            "target_bytes_ratio": round(sparse["target_weight_bytes"] / dense["target_weight_bytes"], 2),
            "logits_rel_err": d.get("logits_rel_err"), "plan": d.get("plan"),
        })
    return rows


LINEAR = {  # file -> the CPU it was measured on (each machine's own table)
    "cpu24-linear.json": "AMD EPYC with AVX-512 (BF16, VBMI)",
    "cpu24-linear-rerun.json": "the same AMD EPYC, a second run the same hour (1 and 4 rows)",
    "cpu24-linear-avx2.json": "AMD EPYC (Zen 3), AVX2 only",
    "cpu24-linear-amx.json": "Intel Xeon with AVX-512 and AMX",
    "cpu24-linear-zen4.json": "AMD EPYC, another core (32 KB L1D, Zen 4), the hardware-prefetch path as a column",
    "cpu24-linear-zen4-hp.json": "the same Zen 4 core, the 2:4 and careful weights on huge pages as the layers lay them",
    "cpu24-linear-zen4-hp-rerun.json": "the same, a second run ten minutes later",
}


def linear_rows(name: str = "cpu24-linear.json") -> tuple[list[dict], dict]:
    d = json.loads((RESULTS / name).read_text())
    rows = []
    for r in d["results"]:
        row = {"shape": r["shape"], "threads": r["threads"], "rows": r["rows"], "torch_ms": round(r["ms"]["torch"], 3),
               "careful_ms": round(r["ms"]["careful"], 3), "sparse_ms": round(r["ms"]["2:4"], 3),
               "w8_ms": round(r["ms"]["2:4+W8"], 3), "x_torch": round(r["x_torch"], 2),
               "x_careful": round(r["x_careful"], 2), "careful_x_torch": round(r["careful_x_torch"], 2),
               "w8_x_torch": round(r["w8_x_torch"], 2), "w8_x_24": round(r["ms"]["2:4"] / r["ms"]["2:4+W8"], 2),
               "gbps_24": round(r["gbps"]["2:4"], 1), "gbps_torch": round(r["gbps"]["torch"], 1)}
        if "torch hp" in r["ms"]:  # torch on huge pages (runs since cpu24-notes.md §27)
            row.update(torch_hp_ms=round(r["ms"]["torch hp"], 3), best_x_torch_hp=round(r["best_x_torch_hp"], 2))
        for key, col in EXTRA.items():  # the other 2:4 paths the run timed, and the fastest of all
            if key in r["ms"]:
                row.update({f"{col}_ms": round(r["ms"][key], 3),
                            f"{col}_x_torch": round(r["ms"]["torch"] / r["ms"][key], 2),
                            "best": r["best"], "best_x_torch": round(r["best_x_torch"], 2)})
        rows.append(row)
    return rows, {"file": name, "cpu": LINEAR.get(name, name), "command": d["command"], "machine": d["machine"],
                  "when": d["when"], "goals": d["goals"], "max_rel_err": d["max_rel_err"],
                  "huge_pages": d.get("huge_pages")}


def linear_table(lin: list[dict], meta: dict) -> list[str]:
    extra = [name for name in EXTRA.values() if any(f"{name}_ms" in r for r in lin)]
    hp = any("torch_hp_ms" in r for r in lin)
    cols = "".join(f"2:4 {name} ms | " for name in extra)
    pages = ("" if meta.get("huge_pages") is None else " 2:4 and careful weights on huge pages" + (
        "" if meta["huge_pages"] == "on" else f": no ({meta['huge_pages']})") + "; torch's where its allocator puts"
        " them" + (", torch hp's on huge pages" if hp else "") + ".")
    out = [f"## Per linear, LLaMA-7B shapes, weights cycled past L3 — {meta['cpu']} (`{meta['command']}`)", "",
           f"{meta['machine']}; {meta['when']}. Max |Δ|/max|y| against a float64 product: {meta['max_rel_err']:.2e}."
           + pages, "",
           "| shape | threads | rows | torch dense bf16 ms | " + ("torch on huge pages ms | " if hp else "")
           + "careful dense ms | 2:4 ms | 2:4+W8 ms | "
           + cols + "2:4 GB/s | 2:4 / torch | 2:4 / careful | 2:4+W8 / torch |"
           + (" fastest 2:4 / torch |" if extra else "") + (" fastest 2:4 / torch hp |" if hp else ""),
           "|---|---:|---:|---:|" + ("---:|" if hp else "") + "---:|---:|---:|" + "---:|" * len(extra)
           + "---:|---:|---:|---:|" + ("---:|" if extra else "") + ("---:|" if hp else "")]
    out += [f"| {r['shape']} | {r['threads']} | {r['rows']} | {r['torch_ms']:.3f} | "
            + (f"{r['torch_hp_ms']:.3f} | " if hp else "") + f"{r['careful_ms']:.3f} | "
            f"{r['sparse_ms']:.3f} | {r['w8_ms']:.3f} | " + "".join(f"{r[f'{n}_ms']:.3f} | " for n in extra)
            + f"{r['gbps_24']:.1f} | {r['x_torch']:.2f}× | {r['x_careful']:.2f}× | {r['w8_x_torch']:.2f}× |"
            + (f" {r['best_x_torch']:.2f}× ({BEST.get(r['best'], 'gather')}) |" if extra else "")
            + (f" {r['best_x_torch_hp']:.2f}× |" if hp else "")
            for r in lin]
    out += ["", "Goals of issue 48 (worst cell" + (", the fastest 2:4 path" if extra else "") + "): " + "; ".join(
        f"{g['rows']} row{'s' if g['rows'] > 1 else ''}: {g['min_x_torch']:.2f}× torch (goal {g['goal_x_torch']}×"
        + (f"; {g['min_x_torch_hp']:.2f}× torch on huge pages" if "min_x_torch_hp" in g else "") + ")"
        + (f", {g['min_x_careful']:.2f}× careful (goal {g['goal_x_careful']}×)" if g["goal_x_careful"] else "")
        + (" — met" if g["met"] else " — not met") for g in meta["goals"]), ""]
    return out


def main() -> int:
    lin, meta = linear_rows()
    mod = model_rows()
    summary = {"linear": lin, "linear_run": meta, "models": mod,
               "batch1_x_torch": [min(r["x_torch"] for r in lin if r["rows"] == 1),
                                  max(r["x_torch"] for r in lin if r["rows"] == 1)],
               "batch1_x_careful": [min(r["x_careful"] for r in lin if r["rows"] == 1),
                                    max(r["x_careful"] for r in lin if r["rows"] == 1)]}
    out = ["# CPU 2:4: measured tables", "",
           "Generated by `python benchmarks/cpu24_report.py` from the committed measurements; the kernel's history "
           "(predictions, misses) is in [cpu24-notes.md](cpu24-notes.md).", ""]
    out += linear_table(lin, meta)
    for name in LINEAR:
        if name != "cpu24-linear.json" and (RESULTS / name).is_file():
            other, other_meta = linear_rows(name)
            summary.setdefault("linear_other", {})[name] = {"rows": other, "run": other_meta}
            out += linear_table(other, other_meta)
    out += ["## Whole models: `cast-llm bench-inference --device cpu --dtype bf16` (batch 1, median of 3)", "",
            "| model | workload | prefill tok/s dense → 2:4 | decode tok/s dense → 2:4 | decode without the head's gain | target weights held MiB |",
            "|---|---|---:|---:|---:|---:|"]
    out += [f"| {r['model']} | {r['workload']} | {r['prefill_dense']:,} → {r['prefill_24']:,} ({r['prefill_ratio']:.2f}×) | "
            f"{r['decode_dense']} → {r['decode_24']} (**{r['decode_ratio']:.2f}×**) | "
            f"{r['decode_ratio_without_head'] or '—'}× | {r['target_mib_dense']} → {r['target_mib_24']} |" for r in mod]
    out += ["", "The 2:4 side runs each decoder linear on the kernel its dispatcher measured fastest for that token "
            "count (\"plan\" in each JSON) and the LM head on the careful dense GEMV where that measured faster "
            "(\"head\" in the JSON); \"decode without the head's gain\" puts torch's head time back, leaving what the "
            "2:4 layers buy. \"target weights held\": with a dense copy kept for the token counts where dense is "
            "faster (prefill), the 2:4 side holds more, not less; `--no-dense-copy` holds 0.5625× (the SmolLM2 "
            "row) and pays for it in prefill.", ""]
    (RESULTS / "cpu24-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (RESULTS / "cpu24.md").write_text("\n".join(out))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
