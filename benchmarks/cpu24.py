"""The CPU 2:4 kernel against dense, per LLaMA-7B linear shape, at batch 1 / 4 / 16 rows and 1 / 2 threads.

Side by side in one process, on random exactly-2:4 weights, every weight cycled through copies that together
hold at least twice the cache this process can hold (``cycles.cold_bytes``: the last-level cache, measured where
sysfs reports a large one; as in a model's forward: each layer's weight comes from DRAM):

* ``torch`` — ``F.linear`` on the dense bf16 weight with zeros, where torch's allocator puts it (what a user
  runs today: 4 KB pages unless ``THP_MEM_ALLOC_ENABLE=1`` or the OS's THP mode is ``always``);
* ``torch hp`` — the same on weights laid on huge pages (:func:`cast_llm.deploy.sparse24.cpu.on_huge_pages`):
  what torch would do with the 2:4 layers' page placement;
* ``careful`` — a dense bf16 kernel written with the same care as the 2:4 one (``cast_llm_cpu24.dense_mm``:
  the same blocks and threading, its weight on huge pages as the 2:4 weights are): what sparsity itself buys;
* ``2:4`` — the widest CPU 2:4 path this CPU runs (``cpu-avx512-bf16``, else ``cpu-avx512``, else ``cpu-avx2``;
  kept values + 2-bit positions, read directly: 0.5625 of the dense bytes);
* ``2:4 hwpf`` — the same loop without software prefetch (``cpu-avx512-bf16-hwpf`` or ``cpu-avx2-hwpf``, the
  twin of the ``2:4`` column's path): the hardware prefetchers alone, faster on some cores (cpu24-notes.md §23, §30);
* ``2:4 amx`` — where the CPU has AMX, the ``cpu-amx-bf16`` path as well (the same bytes, expanded into a dense
  panel in L1 and multiplied on AMX tiles);
* ``2:4 rows`` — where the CPU has AVX512-BF16, the ``cpu-avx512-bf16-rows`` prefill path as well (the same
  bytes, lanes over output rows: a vpermw and a vdpbf16ps per 16 rows, token and group). The goals are judged on
  the fastest 2:4 path of each cell (``best``), which is what the dispatcher picks (``2:4+W8 rows``: the int8
  values through it; ``best_w8``: the faster W8 path);
* ``2:4 tok`` — where the CPU's widest path is AVX2, the ``cpu-avx2-tokens`` prefill path as well (lanes over 16
  tokens: a broadcast and two FMAs per kept value, no permute; cpu24-notes.md §33);
* ``2:4+W8`` — the gather path on int8 kept values widened in registers + fp32 row scales, bf16 activations:
  0.3125 of the dense bf16 bytes plus 4 bytes a row.

The careful dense kernel runs vdpbf16ps where the CPU has AVX512-BF16, else AVX2 FMA on the bf16 weight widened
in registers (``cast_llm.deploy.sparse24.cpu.dense_path``); the JSON names both paths.

Every 2:4 form's compressed tensors lie where a ``Sparse24Linear`` puts them: on huge pages where the OS allows
(``CAST_LLM_HUGE_PAGES=0``: not; the JSON's ``huge_pages`` says which), every copy alike.

Each output is checked against a float64 product (max|Δ|/max|y|). The forms of a cell are timed interleaved
(``cycled_many``: each of the ``--repeats`` rounds times every form in turn), so their ratios are paired. Reported:
ms per call (median of ``--repeats``), GB/s of the bytes each form reads, the byte limit (1.78× for 2:4 over dense bf16) and the
ratios. Time nothing else while it runs (``benchmarks/`` results say what else ran: the load average).

    python benchmarks/cpu24.py --json docs/results/cpu24-linear.json --plot docs/results/cpu24-linear.png
    python benchmarks/cpu24.py --threads 2 --rows 16,64,512 --json docs/results/cpu24-prefill.json  # prefill
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import machine

from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24.cycles import cold_bytes, cycled_many
from cast_llm.deploy.sparse24.kernels import KERNELS
from cast_llm.deploy.sparse24.timing import l3_bytes, random_24_weight

SHAPES = {"q/k/v/o 4096x4096": (4096, 4096), "gate/up 11008x4096": (11008, 4096), "down 4096x11008": (4096, 11008)}
TINY = {"tiny 256x512": (256, 512), "tiny 512x256": (512, 256)}
# a 1B-class model's linears (TinyLlama-1.1B: hidden 2048, 4 KV heads of 64, MLP 5632), where issue 48's whole-model
# decode goal is set: shorter rows than 7B's, so a call's fixed costs weigh more
TINYLLAMA = {"q/o 2048x2048": (2048, 2048), "k/v 256x2048": (256, 2048), "gate/up 5632x2048": (5632, 2048),
             "down 2048x5632": (2048, 5632)}
SHAPE_SETS = {"llama-7b": SHAPES, "tinyllama-1.1b": TINYLLAMA, "tiny": TINY}
TITLES = {"llama-7b": "LLaMA-7B", "tinyllama-1.1b": "TinyLlama-1.1B", "tiny": "tiny"}  # the plot's
GOALS = {1: (3.0, 1.5), 4: (2.0, 1.2), 16: (1.3, None)}  # rows -> (x torch, x careful) from issue 48


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def seconds(fns, repeats: int, min_time: float) -> float:
    """Median seconds per call, cycling through ``fns`` (one per weight copy)."""
    for fn in fns[:2]:
        fn()
    t0 = time.perf_counter()
    for fn in fns:
        fn()
    rounds = max(1, int(min_time / max(time.perf_counter() - t0, 1e-9)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(rounds):
            for fn in fns:
                fn()
        times.append((time.perf_counter() - t0) / (rounds * len(fns)))
    return statistics.median(times)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


def best_path() -> str | None:
    """The widest 2:4 path this CPU runs for bf16 layers (None: none)."""
    paths = cpu24.available_paths()
    return next((p for p in ("avx512-bf16", "avx512", "avx2") if p in paths), None)


# more 2:4 paths, timed where the CPU runs them; a "-hwpf" path (no software prefetch) only beside its own loop
EXTRA = {"avx512-bf16-hwpf": "2:4 hwpf", "avx2-hwpf": "2:4 hwpf", "amx-bf16": "2:4 amx", "avx512-bf16-rows": "2:4 rows",
         "avx2-tokens": "2:4 tok"}


def extra_paths(path: str) -> tuple[str, ...]:
    """The other 2:4 paths timed beside ``path`` on this CPU (the hwpf twin of ``path`` only)."""
    return tuple(p for p in EXTRA if p in cpu24.available_paths()
                 and (not p.endswith("-hwpf") or p == f"{path}-hwpf") and (p != "avx2-tokens" or path == "avx2"))


def measure_shape(out_f: int, in_f: int, rows: int, repeats: int, min_time: float, path: str = "avx512-bf16",
                  extra: tuple[str, ...] = ()) -> dict:
    w = random_24_weight(out_f, in_f, torch.bfloat16, "cpu")
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = x.double() @ w.double().t()
    s24 = KERNELS[f"cpu-{path}"].compress(w)
    w8 = KERNELS[f"cpu-w8-{path}"].compress(w)
    ref8 = x.double() @ cpu24.decompress(w8, out_f, in_f).double().t()
    dense_b, s24_b, w8_b = w.numel() * 2, nbytes(s24), nbytes(w8)
    row = {"out": out_f, "in": in_f, "rows": rows, "bytes": {"dense_bf16": dense_b, "2:4": s24_b, "2:4+W8": w8_b}}
    hp = cpu24.on_huge_pages  # the 2:4 layer's placement (linear.py), applied to every copy cycled
    w_hp = hp(w)
    s24, w8 = cpu24.state_on_huge_pages(s24), cpu24.state_on_huge_pages(w8)
    forms = {  # name -> (fn, held, bytes, reference (None: ref), placement of the copies (None: torch's))
        "torch": (lambda w_: F.linear(x, w_), w, dense_b, None, None),
        "torch hp": (lambda w_: F.linear(x, w_), w_hp, dense_b, None, hp),
        "careful": (lambda w_: cpu24.dense_mm(x, w_), w_hp, dense_b, None, hp),
        "2:4": (lambda s: cpu24.sparse24_mm(path, x, s, None), s24, s24_b, None, hp),
        "2:4+W8": (lambda s: cpu24.sparse24_mm(path, x, s, None), w8, w8_b, ref8, hp),
    }
    for p in extra:
        forms[EXTRA[p]] = (lambda s, p=p: cpu24.sparse24_mm(p, x, s, None), s24, s24_b, None, hp)
        if p not in cpu24.NO_W8_PATHS:  # the same int8 values through this path
            forms[EXTRA[p].replace("2:4", "2:4+W8")] = (lambda s, p=p: cpu24.sparse24_mm(p, x, s, None), w8, w8_b,
                                                       ref8, hp)
    row["ms"], row["gbps"], row["max_rel_err"] = {}, {}, {}
    for name, (fn, held, _, r, _) in forms.items():
        row["max_rel_err"][name] = rel_err(fn(held), ref if r is None else r)
    # every form of the cell timed interleaved, round by round (the dispatcher's paired measurement): a slow
    # spell of this host's memory system falls on all of them, not on one column (cpu24-notes.md §18, §22)
    times = cycled_many([(fn, held, place) for fn, held, _, _, place in forms.values()], repeats=repeats,
                        min_time=min_time)
    for (name, (_, _, b, _, _)), s in zip(forms.items(), times):
        row["ms"][name] = s * 1e3
        row["gbps"][name] = b / s / 1e9
    ms = row["ms"]
    row["x_torch"] = ms["torch"] / ms["2:4"]
    row["x_careful"] = ms["careful"] / ms["2:4"]
    row["w8_x_torch"] = ms["torch"] / ms["2:4+W8"]
    row["best_w8"] = min((k for k in ms if k.startswith("2:4+W8")), key=lambda k: ms[k])
    row["best_w8_x_torch"] = ms["torch"] / ms[row["best_w8"]]
    row["careful_x_torch"] = ms["torch"] / ms["careful"]
    row["best"] = min(["2:4", *(EXTRA[p] for p in extra)], key=lambda k: ms[k])
    row["best_x_torch"] = ms["torch"] / ms[row["best"]]
    row["best_x_careful"] = ms["careful"] / ms[row["best"]]
    row["best_x_torch_hp"] = ms["torch hp"] / ms[row["best"]]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--rows", default="1,4,16", help="rows of x (tokens), comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per repeat")
    ap.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="llama-7b",
                    help="which model's linear shapes (default: LLaMA-7B's, where the per-linear goals are set)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, a few seconds (the test suite's smoke run;"
                    " the same as --shapes tiny)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a bar chart of the ratios here (PNG)")
    args = ap.parse_args(argv)
    path = best_path()
    why = cpu24.extension_reason() or (None if path else "this CPU runs no 2:4 path") or cpu24.dense_unavailable_reason()
    if why:
        print(f"cpu24: the CPU 2:4 kernels cannot run here ({why}); nothing measured", file=sys.stderr)
        return 2
    shape_set = "tiny" if args.tiny else args.shapes
    shapes = SHAPE_SETS[shape_set]
    extra = extra_paths(path)
    amx = "amx-bf16" in extra
    results = []
    print(f"machine: {machine()}; last-level cache {l3_bytes() >> 20} MiB, copies cycled past {cold_bytes() >> 20} MiB;"
          f" 2:4 path {path}"
          f"{''.join(f' and {p}' for p in extra)}, careful dense path {cpu24.dense_path()}")
    print(f"weights on huge pages: {cpu24.huge_pages_reason() or 'yes'} (2:4 forms, careful, torch hp; torch: its allocator)")
    print(f"{'shape':<22}{'thr':>4}{'rows':>5} | {'torch':>8}{'torch hp':>9}{'careful':>9}{'2:4':>8}{'2:4+W8':>8}"
          f"{'2:4 hwpf':>9}{'2:4 amx':>8}{'2:4 rows':>9}{'2:4 tok':>8} ms | {'torch':>6}{'2:4':>6} GB/s | {'2:4/torch':>9}{'2:4/careful':>12}"
          f"{'W8/torch':>9}{'best/torch':>11}{'best/tor.hp':>12}{'best/careful':>13}{'bestW8/torch':>13} best")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for label, (out_f, in_f) in shapes.items():
            for rows in [int(r) for r in args.rows.split(",")]:
                r = measure_shape(out_f, in_f, rows, args.repeats, args.min_time, path, extra)
                r.update(shape=label, threads=threads)
                results.append(r)
                ms, gb = r["ms"], r["gbps"]
                print(f"{label:<22}{threads:>4}{rows:>5} | {ms['torch']:>8.3f}{ms['torch hp']:>9.3f}{ms['careful']:>9.3f}{ms['2:4']:>8.3f}"
                      f"{ms['2:4+W8']:>8.3f}{ms.get('2:4 hwpf', float('nan')):>9.3f}{ms.get('2:4 amx', float('nan')):>8.3f}"
                      f"{ms.get('2:4 rows', float('nan')):>9.3f}{ms.get('2:4 tok', float('nan')):>8.3f}    | {gb['torch']:>6.1f}"
                      f"{gb['2:4']:>6.1f}      | {r['x_torch']:>8.2f}x{r['x_careful']:>11.2f}x{r['w8_x_torch']:>8.2f}x"
                      f"{r['best_x_torch']:>10.2f}x{r['best_x_torch_hp']:>11.2f}x{r['best_x_careful']:>12.2f}x{r['best_w8_x_torch']:>12.2f}x"
                      f" {r['best']}", flush=True)
    worst = max(max(v for k, v in r["max_rel_err"].items() if k.startswith("2:4")) for r in results)
    print(f"max|Δ|/max|y| against float64: {worst:.2e} (bf16 output rounding: ≤ 3.9e-3)")
    goals = []
    if shapes is TINYLLAMA:
        print("issue 48 sets its per-linear goals on LLaMA-7B shapes (--shapes llama-7b); none judged on these")
    for rows, (g_torch, g_careful) in (GOALS.items() if shapes is not TINYLLAMA else ()):
        sel = [r for r in results if r["rows"] == rows]
        if not sel:
            continue
        lo_t = min(r["best_x_torch"] for r in sel)
        lo_c = min(r["best_x_careful"] for r in sel)
        lo_hp = min(r["best_x_torch_hp"] for r in sel)
        ok = lo_t >= g_torch and (g_careful is None or lo_c >= g_careful)
        goals.append({"rows": rows, "min_x_torch": lo_t, "min_x_careful": lo_c, "min_x_torch_hp": lo_hp,
                      "goal_x_torch": g_torch, "goal_x_careful": g_careful, "met": ok})
        print(f"rows {rows}: worst best-2:4/torch {lo_t:.2f}x (goal ≥ {g_torch}x; on huge pages torch {lo_hp:.2f}x),"
              f" worst 2:4/careful {lo_c:.2f}x"
              + (f" (goal ≥ {g_careful}x)" if g_careful else "") + f": {'met' if ok else 'NOT met'}")
    doc = {"benchmark": "cpu24", "shapes": shape_set, "command": "python benchmarks/" + " ".join([Path(__file__).name, *sys.argv[1:]]),
           "machine": machine(), "l3_bytes": l3_bytes(), "cold_bytes": cold_bytes(), "path": path, "amx_path": amx, "extra_paths": list(extra), "dense_path": cpu24.dense_path(),
           "huge_pages": cpu24.huge_pages_reason() or "on", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "results": results, "goals": goals, "max_rel_err": worst}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot, TITLES[shape_set])
    return 0


def plot(results: list[dict], path: str, shapes_name: str = "LLaMA-7B") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({r["threads"] for r in results})
    fig, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], threads):
        sel = [r for r in results if r["threads"] == t]
        labels = [f"{r['shape'].split()[-1]}\n{r['rows']} row{'s' if r['rows'] > 1 else ''}" for r in sel]
        xs = range(len(sel))
        ax.bar([i - 0.2 for i in xs], [r["best_x_torch"] for r in sel], 0.4, label="fastest 2:4 / torch dense bf16")
        ax.bar([i + 0.2 for i in xs], [r["best_x_careful"] for r in sel], 0.4,
               label="fastest 2:4 / careful dense bf16")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.78, color="gray", ls="--", lw=0.8, label="byte limit over dense (1.78x)")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_title(f"{t} thread{'s' if t > 1 else ''}")
        ax.set_ylabel("speed-up (time ratio)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"CPU 2:4 GEMM vs dense, {shapes_name} shapes, weights cycled past L3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
