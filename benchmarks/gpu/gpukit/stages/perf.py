"""Stage perf (issue 21): every speed target measured side by side, in one device call of at most 10 minutes.

``PERF_TABLE`` is the one place that says what runs: each benchmark script, its exact arguments on the GPU
(and for the ``--device cpu`` dry run), the targets its JSON holds, its own time limit, the least time it is
started with, and what it waits for. Each script is called as ``python SCRIPT ARGS --json FILE`` and writes one
JSON object whose top-level keys include its targets' names (``null``: not measured), besides ``rows``,
``device`` and ``versions``.

Time: the steps run in the table's order; a step starts only if its minimum fits in what is left of the call,
and runs at most its own limit, cut shorter where needed to leave the later steps of this call their minimum
(so one slow benchmark cannot starve the others); what does not fit is deferred to the next call, with the
reason in the summary. Every step's figures are saved and
written under ``$OUT`` as soon as it ends, so a later step's failure, time-out or the call's hard stop loses
nothing that finished.

Parsing is defensive: a missing key, ``null``, a string, a boolean, NaN or infinity is "not measured" — never a
number the script did not write. The JSON is removed before each run, so a figure never comes from an earlier
call's file.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from gpukit.executor import Ctx, Step

BENCH_DIR_ENV = "CAST_KIT_BENCHMARKS"  # another folder of benchmark scripts (the tests' fakes); --benchmarks-dir
ROWS_LIMIT = 100_000  # characters of a benchmark's `rows` kept in results.json (the rest is counted, not kept)
PROFILE_TEXT = (".txt", ".md", ".csv", ".tsv", ".log")  # profiler tables that come back in perf-profile.txt
PROFILE_FILE_LIMIT = 1 << 20  # bytes of one profiler table kept
PROFILE_LIMIT = 8 << 20  # bytes of perf-profile.txt


@dataclass(frozen=True)
class Bench:
    """One benchmark of the perf stage (a row of ``PERF_TABLE``)."""

    name: str  # the step's name: perf/NAME in the summary and results.json
    script: str  # a file of benchmarks/
    args: tuple[str, ...]  # its arguments on the GPU (then --json FILE, and --profile-dir DIR if profile)
    keys: tuple[str, ...]  # the targets its JSON holds (names of targets.TARGETS)
    timeout_s: int  # its own limit
    min_s: int  # not started with less time than this
    needs: tuple[str, ...] = ()  # "model": SmolLM2-135M's weights, complete only in the second carrying call
    profile: bool = False  # gets --profile-dir; the text tables there come back in perf-profile.txt
    dry_args: tuple[str, ...] = ("--device", "cpu", "--tiny")  # the dry run's arguments (targets null)


# The exact command of every perf step, in the order they run; adjust here when a script's options change.
# The limits add up to 495 s of the kit's 540 s per call (setup takes ~25 s when the model is not converted).
# `needs=("model",)`: the script loads SmolLM2-135M's real weights (cast_llm.models.load_model), which arrive
# complete only with the second carrying call; a script that builds SmolLM2's shape with random weights needs
# nothing, and then runs in the first call. train_step.py times its configurations within its own budget
# (150 s on cuda by default): its limit leaves room for its start and its profiled step.
PERF_TABLE: tuple[Bench, ...] = (
    # linear24 / inference24 run on CUDA by themselves (--tiny: CPU, the 2:4 side skipped, targets null)
    Bench("linear24", "linear24.py", (), ("linear24_prefill_speedup",), timeout_s=60, min_s=25,
          dry_args=("--tiny",)),
    Bench("optimizer", "optimizer_step.py", ("--device", "cuda"),  # SmolLM2 and LLaMA-7B shapes, always both
          ("adams_over_fused", "adams_over_fused_smollm2", "adams_copy_fraction"), timeout_s=60, min_s=30),
    Bench("inference24", "inference24.py", (),
          ("model24_prefill_speedup", "model24_decode_speedup", "model24_min_speedup", "model24_logits_rel_err"),
          timeout_s=195, min_s=90, needs=("model",), dry_args=("--tiny",)),
    # on cuda its default suite is SmolLM2-135M's config and a 1B-class LLaMA, bf16 autocast
    Bench("train-step", "train_step.py", ("--device", "cuda", "--dtype", "bf16"),
          ("cast_nokd_over_plain", "cast_kd_over_plain", "cast_nokd_over_plain_1b", "cast_kd_over_plain_1b"),
          timeout_s=180, min_s=60, profile=True),
)


def json_file(ctx: Ctx, b: Bench) -> Path:
    return ctx.kit / "perf" / f"{b.name}.json"


def profile_dir(ctx: Ctx, b: Bench) -> Path:
    return ctx.kit / "perf" / f"{b.name}-profile"


def bench_argv(ctx: Ctx, b: Bench) -> list[str]:
    """``[script, *args, --json FILE (, --profile-dir DIR)]``, run with the kit's interpreter from the repo root."""
    script = str(ctx.bench_dir / b.script) if ctx.bench_dir is not None else f"benchmarks/{b.script}"
    argv = [script, *(b.dry_args if ctx.dry else b.args), "--json", str(json_file(ctx, b))]
    if b.profile:
        argv += ["--profile-dir", str(profile_dir(ctx, b))]
    return argv


def _number(v) -> float | None:
    """A finite int or float as float; anything else (None, bool, str, NaN, inf, …) is no measurement."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def read_bench_json(path: Path, keys: tuple[str, ...]) -> dict:
    """What a benchmark's JSON says about its targets: ``measured`` (a number or None per key), the keys not
    measured, those absent from the file or holding no number, the other top-level scalars (``figures``: the
    bounds a script reports beside its targets), and ``rows``, ``device``, ``versions`` as written."""
    none = {k: None for k in keys}
    if not path.is_file():
        return {"ok": False, "error": f"the benchmark wrote no {path.name}", "measured": none,
                "not_measured": list(keys)}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"ok": False, "error": f"{path.name} is not JSON: {e}"[:300], "measured": none,
                "not_measured": list(keys)}
    if not isinstance(data, dict):
        return {"ok": False, "error": f"{path.name} holds a {type(data).__name__}, not an object",
                "measured": none, "not_measured": list(keys)}
    measured = {k: _number(data.get(k)) for k in keys}
    res: dict = {"measured": measured, "not_measured": [k for k in keys if measured[k] is None]}
    absent = [k for k in keys if k not in data]
    if absent:
        res["absent_keys"] = absent
    invalid = {k: repr(data[k])[:80] for k in keys if k in data and data[k] is not None and measured[k] is None}
    if invalid:
        res["invalid"] = invalid
    figures = {k: v for k, v in data.items() if k not in keys and k not in ("rows", "device", "versions")
               and (v is None or isinstance(v, (str, int, float, bool)))}
    if figures:
        res["figures"] = dict(list(figures.items())[:50])
    for k in ("device", "versions"):
        if k in data:
            res[k] = data[k]
    rows = data.get("rows")
    if isinstance(rows, list):
        kept, size = [], 0
        for r in rows:
            size += len(json.dumps(r, default=str))
            if size > ROWS_LIMIT:
                break
            kept.append(r)
        res["rows"] = kept
        if len(kept) < len(rows):
            res["rows_left_out"] = len(rows) - len(kept)
    res["json"] = str(path)
    return res


def _parser(b: Bench, path: Path):
    def parse(text: str, ctx: Ctx) -> dict:  # read even after a failure or time-out: what was written counts
        return read_bench_json(path, b.keys)

    return parse


def _before(path: Path, prof: Path | None):
    def before(ctx: Ctx) -> None:  # never read an earlier call's file
        path.unlink(missing_ok=True)
        if prof is not None:
            shutil.rmtree(prof, ignore_errors=True)
            prof.mkdir(parents=True, exist_ok=True)

    return before


def steps(ctx: Ctx) -> list[Step]:
    (ctx.kit / "perf").mkdir(parents=True, exist_ok=True)
    built = [Step(b.name, argv=bench_argv(ctx, b), timeout_s=b.timeout_s, min_s=b.min_s, needs=b.needs,
                  parse=_parser(b, json_file(ctx, b)),
                  before=_before(json_file(ctx, b), profile_dir(ctx, b) if b.profile else None))
             for b in PERF_TABLE]
    # each step leaves the later ones that can run in this call their minimum (executor.reserve)
    due = [ctx.selected(s) and not ctx.settled("perf", s) and all(ctx.ready(n) for n in s.needs) for s in built]
    for i, s in enumerate(built):
        s.reserve_for = tuple(x.min_s for x, d in zip(built[i + 1:], due[i + 1:]) if d)
    return built


def profile_text(ctx: Ctx) -> str | None:
    """The profiler tables the perf steps wrote (text files), one file for ``$OUT``; other files are listed."""
    parts, left_out, total = [], [], 0
    for b in PERF_TABLE:
        folder = profile_dir(ctx, b)
        if not b.profile or not folder.is_dir():
            continue
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            rel = f"{b.name}/{f.relative_to(folder)}"
            size = f.stat().st_size
            if f.suffix.lower() not in PROFILE_TEXT or size > PROFILE_FILE_LIMIT or total + size > PROFILE_LIMIT:
                left_out.append(f"{rel} ({size:,} bytes)")
                continue
            parts.append(f"===== {rel}\n{f.read_text(errors='replace').rstrip()}\n")
            total += size
    if not parts and not left_out:
        return None
    if left_out:
        parts.append("===== not carried back (kept on the kit's disk while the machine is warm):\n"
                     + "\n".join(left_out) + "\n")
    return "\n".join(parts)
