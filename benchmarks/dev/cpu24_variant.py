"""A/B of build variants of the CPU 2:4 extension: one variant (its ``-D`` flags) timed on LLaMA-7B shapes.

The A/B records of docs/results/cpu24-notes.md §14-17 (software prefetch distances, one row or four a block):
each variant is built into its own folder with extra compiler flags, and two or more variants are alternated in
one quiet spell, each in its own process (``ab_rounds.sh``), so that the machine's slow spells fall on all of them.
Weights are cycled past the last-level cache, as in a model's forward; every product is checked against float64
before it is timed. One JSON line per (shape, rows[, values dtype]) on stdout.

    python benchmarks/dev/cpu24_variant.py pf128 -DCAST_PF_GATHER=128 --rows 1 --threads 1
    python benchmarks/dev/cpu24_variant.py f8k -DCAST_PF_F32=8192 --loop fp32      # the fp32-activation loop
    python benchmarks/dev/cpu24_variant.py rk0 -DCAST_ROWS_KCHUNK=0 --path avx512-bf16-rows --rows 16
    python benchmarks/dev/cpu24_variant.py old --source /tmp/old.cpp --path avx2-hwpf   # another source

``--loop bf16`` (default): bf16 activations, bf16 values, against torch's ``F.linear`` and the careful dense
kernel (``dense_mm``); ``--loop fp32``: fp32 activations with bf16 and fp32 values (the ``cpu-avx512`` loop), the
2:4 kernel alone. Builds go to ``--build-root`` (default: a folder under the system's temporary directory).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the record's own timing loop
from cpu24 import rel_err, seconds  # noqa: E402

from cast_llm.deploy.sparse24 import cpu as cpu24  # noqa: E402
from cast_llm.deploy.sparse24.timing import l3_bytes, random_24_weight  # noqa: E402

SHAPES = [(4096, 4096, "qkvo"), (11008, 4096, "gate/up"), (4096, 11008, "down")]


def load_variant(tag: str, flags: list[str], root: Path, source: Path = cpu24.SOURCE):
    folder = root / f"build_{tag}"
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "sparse24_cpu.cpp"
    shutil.copy(source, src)
    so = folder / f"{cpu24.NAME}.so"
    if not so.exists():
        cpp_extension.load(name=cpu24.NAME, sources=[str(src)], extra_cflags=cpu24.CFLAGS + flags,
                           build_directory=str(folder), is_python_module=False, verbose=False)
    else:
        torch.ops.load_library(str(so))
    return getattr(torch.ops, cpu24.NAME)


def nbytes(held) -> int:
    if isinstance(held, dict):
        return sum(t.numel() * t.element_size() for t in held.values())
    return held.numel() * held.element_size()


def copies_of(held, place=None) -> list:
    """``held`` and its copies past 2x the last-level cache, each tensor laid out by ``place`` (None: torch's)."""
    count = max(1, -(-2 * l3_bytes() // nbytes(held)))
    lay = (lambda t: place(t.clone())) if place else (lambda t: t.clone())
    clone = (lambda h: {a: lay(t) for a, t in h.items()}) if isinstance(held, dict) else lay
    return [clone(held) if place else held] + [clone(held) for _ in range(count - 1)]


def timed(fn, held, ref, bound: float, place=None) -> float:
    err = rel_err(fn(held), ref)
    if not err < bound:
        raise SystemExit(f"wrong product: relative error {err:.3g} >= {bound}")
    return seconds([lambda c=c: fn(c) for c in copies_of(held, place)], repeats=7, min_time=0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tag", help="the variant's name (its build folder)")
    ap.add_argument("--rows", default="1", help="comma-separated token counts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--loop", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--path", choices=("avx512-bf16", "avx512-bf16-hwpf", "avx512-bf16-rows", "avx2", "avx2-hwpf"),
                    default="avx512-bf16",
                    help="the bf16 loop's 2:4 path: the gather (default), the gather without software prefetch,"
                         " lanes over output rows (many tokens), or the AVX2 loop (bf16 x widened once per call;"
                         " CPUs without AVX-512)")
    ap.add_argument("--pages", choices=("layer", "torch"), default="layer",
                    help="layer: the 2:4 and careful weights on huge pages as a Sparse24Linear lays them (where the OS"
                         " allows), torch's where its allocator puts it; torch: every weight where torch puts it")
    ap.add_argument("--source", type=Path, default=cpu24.SOURCE,
                    help="the extension's C++ source to build (default: the package's; e.g. an older commit's, saved"
                         " with git show, for an A/B of two sources)")
    ap.add_argument("--build-root", default=str(Path(tempfile.gettempdir()) / "cast-llm-cpu24-variants"))
    args, flags = ap.parse_known_args()  # the rest: extra compiler flags, e.g. -DCAST_PF_GATHER=128
    if any(not f.startswith(("-D", "-f", "-m", "-O")) for f in flags):
        ap.error(f"not compiler flags: {[f for f in flags if not f.startswith(('-D', '-f', '-m', '-O'))]}")
    torch.set_num_threads(args.threads)
    ops = load_variant(args.tag, flags, Path(args.build_root), args.source)
    for o, i, name in SHAPES:
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, i, generator=torch.Generator().manual_seed(1))
            res = {"tag": args.tag, "shape": name, "rows": rows, "threads": args.threads, "loop": args.loop,
                   "pages": args.pages,
                   **({"path": args.path} if args.loop == "bf16" else {})}
            if args.loop == "bf16":
                w = random_24_weight(o, i, torch.bfloat16, "cpu")
                xb, s24 = x.bfloat16(), cpu24.compress(w)
                ref = xb.double() @ w.double().t()
                hp = cpu24.on_huge_pages if args.pages == "layer" else None
                forms = {"torch": (lambda w_, xb=xb: F.linear(xb, w_), w, None),
                         "careful": (lambda w_, xb=xb: ops.dense_mm(xb, w_, None), w, hp),
                         "2:4": (lambda s, xb=xb: ops.sparse24_mm(xb, s["values"], s["meta"], None, None,
                                                                  cpu24.PATHS[args.path]), s24, hp)}
                for k, (fn, held, place) in forms.items():
                    s = timed(fn, held, ref, 0.02, place)
                    res[k], res[k + "_gbps"] = round(s * 1e3, 4), round(nbytes(held) / s / 1e9, 1)
                res["x_torch"] = round(res["torch"] / res["2:4"], 3)
                res["x_careful"] = round(res["careful"] / res["2:4"], 3)
                print(json.dumps(res), flush=True)
            else:
                for vd in (torch.bfloat16, torch.float32):
                    w = random_24_weight(o, i, vd, "cpu")
                    s24 = cpu24.compress(w)
                    ref = x.double() @ w.double().t()
                    s = timed(lambda s_, x=x: ops.sparse24_mm(x, s_["values"], s_["meta"], None, None, 1), s24, ref,
                              1e-4)
                    print(json.dumps({**res, "values": str(vd).removeprefix("torch."), "ms": round(s * 1e3, 4),
                                      "gbps": round(nbytes(s24) / s / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()
