"""Table 7 of the paper, in shape, for one model: dense vs 2:4 sparse at 16 / 4 / 3 bits (RTN and AWQ).

WikiText-2 perplexity (method.md §7) of every combination, measured in one run. Quantization happens in
memory (same code as `cast-llm quantize`, no checkpoint written); zeros are verified exactly zero for each.

    python benchmarks/quant_table.py --dense smollm2-135m --sparse PATH/TO/2to4-model \
        --windows 16 --seq-len 512 --calib-samples 32 --search-tokens 1024 --json out.json

On a CPU (~600 tokens/s for SmolLM2-135M) use a few windows; state the window length and count with the
numbers. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dense", default="smollm2-135m", help="the dense model")
    ap.add_argument("--sparse", required=True, help="its 2:4 sparse version (HF folder)")
    ap.add_argument("--sparse-label", default="2:4", help="how to name the sparse model in the table")
    ap.add_argument("--windows", type=int, default=16, help="score the first this many WikiText-2 windows")
    ap.add_argument("--seq-len", type=int, default=512, help="perplexity window length")
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    ap.add_argument("--methods", nargs="+", default=["rtn", "awq"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--data", default="wiki-summaries", help="AWQ calibration text")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--search-tokens", type=int, default=1024)
    ap.add_argument("--grid", type=int, default=20)
    ap.add_argument("--skip-dense", action="store_true", help="measure only the sparse model's rows")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    from cast_llm.data import calibration_samples, prepare
    from cast_llm.eval.ppl import perplexity, tokenize_text, wikitext2_text
    from cast_llm.models import load_model, load_tokenizer
    from cast_llm.quant import quantize_model_

    tok = load_tokenizer(args.dense)
    ids = tokenize_text(wikitext2_text(), tok)
    calib = None
    if "awq" in args.methods:
        data = prepare(args.data, tok, args.calib_seq_len, train_sequences=args.calib_samples,
                       calib_samples=args.calib_samples, min_train_sequences=args.calib_samples)
        calib = calibration_samples(data, args.calib_samples, seed=0)
    rows = []

    def record(model_label, method, bits, model, seconds=None, zeros=None):
        res = perplexity(model, ids, args.seq_len, max_windows=args.windows)
        row = {"model": model_label, "method": method, "bits": bits, "ppl": res.perplexity,
               "windows": res.windows, "seq_len": res.seq_len, "quant_seconds": seconds, "zeros_verified": zeros}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=2)

    models = [("dense", args.dense)] * (not args.skip_dense) + [(args.sparse_label, args.sparse)]
    for label, path in models:
        base = load_model(path, dtype=torch.float32)
        record(label, "-", 16, base)
        for bits in args.bits:
            for method in args.methods:
                model = copy.deepcopy(base)
                t0 = time.perf_counter()
                res = quantize_model_(model, method=method, bits=bits, group_size=args.group_size, calib_ids=calib,
                                      grid=args.grid, search_tokens=args.search_tokens)
                record(label, method, bits, model, time.perf_counter() - t0, res.zeros_checked)
                del model
        del base

    print(f"\nWikiText-2 perplexity, first {args.windows} windows of {args.seq_len} tokens\n")
    cols = ["16-bit"] + [f"{m.upper()} w{b}" for b in args.bits for m in args.methods]
    print("| model | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for label, _ in models:
        cells = [r for r in rows if r["model"] == label]
        print(f"| {label} | " + " | ".join(f"{r['ppl']:.2f}" for r in cells) + " |")


if __name__ == "__main__":
    main()
