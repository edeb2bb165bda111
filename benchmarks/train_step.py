"""Benchmark 3: one whole training step — plain AdamW training vs CAST w/o KD vs CAST with KD (method.md §7).

Same model, same batch, the trainer's own step (see ``_common.py``; bf16 = autocast with fp32 master weights,
as the trainer on a GPU): ``plain`` = the dense model, CE, ``AdamW(fused=True)``; ``cast_nokd`` =
ScaledLinear targets + AdamS with masks recomputed every T1 steps; ``cast_kd`` = the same + the frozen teacher
and the KD loss (Eq. 13). Targets (issue 21): CAST w/o KD <= 1.05x, CAST <= 1.40x a plain step (paper, GPT-2
on 8xH800: 1.045x / 1.44x; theory for KD 4/3).

How a configuration is measured, in one process, variants interleaved (the order rotates every round):

* whole steps, synchronised only before and after each step as the trainer runs it; a CAST step whose AdamS
  recomputes the masks (``t % T1 == 0``) is told apart, and its extra time is added amortised over T1:
  ``step = median(other steps) + mean(extra of a mask-update step) / T1``;
* a few rounds synchronised at every phase boundary (forward incl. the loss, backward, clip, optimizer):
  where the time goes;
* one step per variant under ``torch.profiler``: the top ops by device time (CPU time on a CPU) go to one
  table file per configuration and variant (``--profile-dir``), the top 10 also into the JSON.

    python benchmarks/train_step.py --device cuda --json train_step.json --profile-dir profiles
        # the GPU suite: SmolLM2-135M (its config, random init) at 8 x 2048 tokens and a 1B-class LLaMA
        # (TinyLlama-1.1B's config: 22 layers x 2048, 5632 MLP, 32 heads, 4 kv heads, vocabulary 32000,
        # random init) at 4 x 2048, bf16; plus the graphed-teacher row (--teacher-cuda-graph). < 3 minutes.
    python benchmarks/train_step.py --tiny --json out.json      # CPU in seconds: tiny random LLaMAs
    python benchmarks/train_step.py --threads 1 --seq 1024      # one configuration: SmolLM2-135M, 1 x 1024, fp32
    python benchmarks/train_step.py --device cuda --batch 8 --seq 1024       # one: SmolLM2-135M at 8 x 1024
    python benchmarks/train_step.py --device cuda --model llama-1b --batch 4 --seq 2048

The ``_compiled`` variants (``--compiled-rows``, on unless ``CAST_LLM_COMPILE=0``) are CAST with the
``torch.compile`` candidates of the checked kernel paths — the AdamS update and the KD loss — where the other
CAST rows run the hand-written ones (Triton on a GPU, the block-wise AdamS on a CPU); every variant's first
step (checks, compiling) is timed apart.

``--json PATH`` writes ``cast_nokd_over_plain`` / ``cast_kd_over_plain`` (the SmolLM2-135M row),
``cast_nokd_over_plain_1b`` / ``cast_kd_over_plain_1b``, ``rows`` (every variant of every configuration),
``device``, ``versions``, ``settings`` and the command. Ratios are of synchronised wall time on a GPU and of the
process's CPU time on a CPU (the work, whatever the load of a shared machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import (
    DTYPES,
    RANDOM_MODELS,
    Clock,
    build_variants,
    check_finite,
    load,
    machine,
    random_batch,
    train_config,
    train_step,
)

VARIANTS = ["plain", "cast_nokd", "cast_kd"]
CAST = ("cast_nokd", "cast_kd")
COMPILED = ("cast_nokd_compiled", "cast_kd_compiled")  # the same with the torch.compile candidates, over:
PLAIN_COMPILED = "plain_compiled"  # plain AdamW(fused) with its CE through the compiled loss
PHASES = ("forward", "backward", "clip", "optimizer")
LABELS = {"plain": "plain AdamW(fused)", "cast_nokd": "CAST w/o KD", "cast_kd": "CAST (KD)",
          "cast_kd_graph": "CAST (KD), graphed teacher", "plain_compiled": "plain, compiled CE",
          "cast_nokd_compiled": "CAST w/o KD, compiled", "cast_kd_compiled": "CAST (KD), compiled"}
TARGETS = {"cast_nokd": 1.05, "cast_kd": 1.40}


@dataclass
class Config:
    role: str  # "smollm2" (the un-suffixed JSON keys) or "1b" (the "_1b" keys)
    model: str
    batch: int
    seq: int


# the GPU suite: SmolLM2-135M as the project trains it, and a 1B-class LLaMA; both at 16k / 8k tokens per step
GPU_SUITE = [Config("smollm2", "smollm2-135m-random", 8, 2048), Config("1b", "llama-1b", 4, 2048)]
TINY_SUITE = [Config("smollm2", "tiny-llama", 2, 32), Config("1b", "tiny-llama-wide", 2, 32)]


def role_of(model: str) -> str:
    return "1b" if "1b" in model.lower() else "smollm2"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help=f"one configuration: a model for load_model or one of {list(RANDOM_MODELS)} (default: the "
                         "GPU suite on cuda, smollm2-135m on cpu)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES),
                    help="bf16: autocast with fp32 master weights, as the trainer on a GPU (default: bf16 on cuda, "
                         "fp32 on cpu)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per step: one configuration (default: 8 on cuda, 1 on cpu)")
    ap.add_argument("--seq", type=int, default=None,
                    help="tokens per sequence: one configuration (default: 2048 on cuda, 256 on cpu)")
    ap.add_argument("--rounds", type=int, default=None, help="timed whole-step rounds (each steps every variant)")
    ap.add_argument("--phase-rounds", type=int, default=None, help="rounds timed phase by phase")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds first (lazy state, first masks, JIT)")
    ap.add_argument("--mask-interval", type=int, default=None, help="T1: AdamS recomputes the masks every T1 steps")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall seconds for all configurations: rounds are cut to fit (default 150 on cuda)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--profile-dir", type=Path, default=None,
                    help="profiler tables go here (default: beside --json; none without either)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled step")
    ap.add_argument("--graph-teacher-row", action=argparse.BooleanOptionalAction, default=None,
                    help="also time CAST (KD) with the teacher's forward replayed as a CUDA graph (the trainer's "
                         "--teacher-cuda-graph; default: on cuda)")
    ap.add_argument("--compiled-rows", action=argparse.BooleanOptionalAction, default=None,
                    help="also time CAST with the torch.compile candidates (AdamS update, KD loss); their compile "
                         "time is reported apart (default: on, unless CAST_LLM_COMPILE=0)")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny random LLaMAs, a few rounds: runs in seconds")
    ap.add_argument("--quick", action="store_true", help="the same as --tiny")
    args = ap.parse_args(argv)
    tiny = args.tiny or args.quick
    if tiny:
        args.device = "cpu"
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype_name = args.dtype or ("bf16" if cuda else "fp32")
    if tiny:
        suite = TINY_SUITE
    elif args.model is not None or args.batch or args.seq or not cuda:
        # one configuration; without --model: SmolLM2-135M (its config with random init on a GPU, where the
        # values do not matter for timing; the embedded checkpoint on a CPU, as the earlier CPU results)
        model = args.model or ("smollm2-135m-random" if cuda else "smollm2-135m")
        suite = [Config(role_of(model), model, args.batch or (8 if cuda else 1), args.seq or (2048 if cuda else 256))]
    else:
        suite = GPU_SUITE
    settings = dict(
        warmup=args.warmup if args.warmup is not None else (1 if tiny else 2),
        rounds=args.rounds if args.rounds is not None else (4 if tiny else 10),
        phase_rounds=args.phase_rounds if args.phase_rounds is not None else (1 if tiny else 3),
        mask_interval=args.mask_interval or (4 if tiny else 10),
        dtype=dtype_name,
        budget_s=args.budget_s if args.budget_s is not None else (150.0 if cuda else None),
        graph_teacher_row=args.graph_teacher_row if args.graph_teacher_row is not None else cuda,
        compiled_rows=args.compiled_rows if args.compiled_rows is not None else _compile_enabled(),
    )
    profile_dir = args.profile_dir or (args.json.parent / f"{args.json.stem}-profiles" if args.json else None)
    if args.no_profile:
        profile_dir = None

    start = time.perf_counter()
    print(f"machine: {machine()}")
    results, rows = {}, []
    for i, config in enumerate(suite):
        left = None
        if settings["budget_s"] is not None:
            left = (settings["budget_s"] - (time.perf_counter() - start)) / (len(suite) - i)
        out = measure(config, device, settings, profile_dir, left)
        print()
        print(out["report"])
        rows += out["rows"]
        suffix = "" if config.role == "smollm2" else "_1b"
        for name in CAST + (COMPILED if settings["compiled_rows"] else ()):
            results[f"{name}_over_plain{suffix}"] = out["ratios"][name]
        if cuda:  # the next configuration starts from an empty allocator (graphs and models of this one freed)
            del out
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    if args.json is not None:
        doc = {**results, "rows": rows, "device": _device_name(device), "versions": versions(),
               "settings": {**settings, "configs": [vars(c) for c in suite],
                            "clock": "wall (synchronised)" if cuda else "process CPU time", "machine": machine(),
                            "command": " ".join(["benchmarks/train_step.py", *(sys.argv[1:] if argv is None else argv)]),
                            "wall_s": round(time.perf_counter() - start, 1)}}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def measure(config: Config, device: torch.device, settings: dict, profile_dir: Path | None,
            budget_s: float | None) -> dict:
    """Every measurement of one configuration; returns ``{"ratios", "rows", "report"}``."""
    ORDER = (VARIANTS + (["cast_kd_graph"] if settings["graph_teacher_row"] else [])  # noqa: N806
             + ([PLAIN_COMPILED, *COMPILED] if settings["compiled_rows"] else []))
    dtype = DTYPES[settings["dtype"]]
    autocast = dtype if dtype != torch.float32 else None
    t1 = settings["mask_interval"]
    cfg = train_config(model=config.model, mask_interval=t1)
    base = load(config.model, device)
    n_params = sum(p.numel() for p in base.parameters())
    vocab = base.get_output_embeddings().weight.shape[0]
    batch = random_batch(config.batch, config.seq, vocab, device)
    variants = build_variants(base, cfg, ORDER, dtype, foreach_baseline=False)  # the CAST ones share one AdamS
    clock_index = 0 if device.type == "cuda" else 1  # wall on a GPU, CPU time on a CPU
    cast_steps = 0  # steps the shared AdamS has taken: it recomputes the masks when (steps + 1) % T1 == 0

    def step(name: str, phases: bool) -> tuple[dict, bool]:
        nonlocal cast_steps
        update = False
        if name.startswith("cast"):  # every CAST variant steps the one shared AdamS
            update = (cast_steps + 1) % t1 == 0
            cast_steps += 1
        return train_step(variants[name], batch, cfg, autocast, phases=phases, extra=False), update

    def rounds(n: int, phases: bool, offset: int = 0) -> list[tuple[str, dict, bool]]:
        out = []
        for r in range(n):
            k = (r + offset) % len(ORDER)
            for name in ORDER[k:] + ORDER[:k]:  # rotate: no variant always runs first
                times, update = step(name, phases)
                out.append((name, times, update))
        return out

    t0 = time.perf_counter()
    warm = []
    first_step: dict[str, float] = {}  # the first step of every variant: the kernels' checks, compiling (apart)
    for name in ORDER:
        r0 = time.perf_counter()
        step(name, False)
        first_step[name] = time.perf_counter() - r0
    for _ in range(max(1, settings["warmup"])):
        r0 = time.perf_counter()
        rounds(1, phases=False)
        warm.append(time.perf_counter() - r0)
    n_whole, n_phase = settings["rounds"], settings["phase_rounds"]
    note = ""
    if budget_s is not None:  # cut the rounds to what the budget leaves (a profiled step costs ~3 rounds)
        per_round = warm[-1]
        affordable = int((budget_s - (time.perf_counter() - t0)) / per_round) - (3 if profile_dir else 0)
        if affordable < n_whole + n_phase:
            n_phase = min(n_phase, max(1, affordable // 4))
            n_whole = max(3, affordable - n_phase)
            note = f" (cut to fit the time budget of {budget_s:.0f} s)"
    whole = rounds(n_whole, phases=False)
    phased = rounds(n_phase, phases=True, offset=1)

    # whole steps: medians, plus the mask updates' extra time amortised over T1
    normal = {n: statistics.median(t["step"][clock_index] for m, t, u in whole if m == n and not u) for n in ORDER}
    extra = [t["step"][clock_index] - normal[n] for n, t, u in whole if u]
    mask_extra = statistics.fmean(extra) if extra else None
    step_s = {n: normal[n] + (mask_extra / t1 if not n.startswith("plain") and mask_extra is not None else 0.0) for n in ORDER}
    # the hand-written rows over plain; the compiled rows over plain with the compiled CE (the same loss path)
    ratios = {n: step_s[n] / step_s[PLAIN_COMPILED if n in COMPILED else "plain"] for n in ORDER if n in CAST + COMPILED}
    check_finite(variants.values())
    phase_s = {n: {p: statistics.median(t[p][clock_index] for m, t, _ in phased if m == n) for p in PHASES}
               for n in ORDER}

    profiles = {}
    if profile_dir is not None:
        for name in ORDER:
            profiles[name] = profile_step(lambda name=name: step(name, False), device, profile_dir,
                                          f"{config.role}-{config.model}-{name}")

    tokens = config.batch * config.seq
    rows = []
    for name in ORDER:
        row = dict(config=config.role, model=config.model, params_m=round(n_params / 1e6, 1), batch=config.batch,
                   seq=config.seq, tokens=tokens, dtype=settings["dtype"], variant=name,
                   step_ms=_ms(step_s[name]),
                   over_plain=round(step_s[name] / step_s[PLAIN_COMPILED if name in COMPILED else "plain"], 4),
                   median_step_ms=_ms(normal[name]),
                   whole_steps=sum(1 for n, _, u in whole if n == name and not u),
                   tokens_per_s=round(tokens / step_s[name]),
                   phases_ms={p: _ms(phase_s[name][p]) for p in PHASES},
                   first_step_s=round(first_step[name], 2), kernel_paths=_paths_taken(variants[name]))
        if not name.startswith("plain"):
            row.update(mask_update_ms=_ms(mask_extra) if mask_extra is not None else None, mask_interval=t1,
                       mask_update_steps=len(extra))
        if name in profiles:
            row.update(profiles[name])
        if name.startswith("cast_kd"):
            row["teacher_forward"] = variants[name].teacher_forward.mode
        rows.append(row)

    clock = "wall time (synchronised)" if clock_index == 0 else "CPU time (process_time: the work, whatever the load)"
    lines_extra = [f"teacher of CAST (KD): {variants['cast_kd'].teacher_forward.mode} (the trainer's default)"]
    if "cast_kd_graph" in ORDER:
        lines_extra.append(f"teacher of the graphed-teacher row (--teacher-cuda-graph): "
                           f"{variants['cast_kd_graph'].teacher_forward.mode}")
    lines = [
        f"model {config.model} ({n_params / 1e6:.1f}M parameters) on {device}, {settings['dtype']}"
        f"{' (autocast, fp32 master weights)' if dtype != torch.float32 else ''}; batch {config.batch} x "
        f"{config.seq} tokens; {settings['warmup']} warm-up + {n_whole} whole-step + {n_phase} phase rounds"
        f"{note}; T1 = {t1}; {clock}, medians",
        f"{'variant':<28}{'forward':>10}{'backward':>10}{'clip':>9}{'optimizer':>11}{'masks/T1':>10}"
        f"{'step':>11}{'/ plain':>9}{'tokens/s':>11}",
    ]
    for name in ORDER:
        ph = phase_s[name]
        amort = mask_extra / t1 if not name.startswith("plain") and mask_extra is not None else 0.0
        lines.append(f"{LABELS[name]:<28}{_fmt(ph['forward']):>10}{_fmt(ph['backward']):>10}{_fmt(ph['clip']):>9}"
                     f"{_fmt(ph['optimizer']):>11}{_fmt(amort):>10}{_fmt(step_s[name]):>11}"
                     f"{step_s[name] / step_s['plain']:>8.3f}x{tokens / step_s[name]:>11.0f}")
    if mask_extra is None:
        lines.append(f"note: no mask update fell in the timed steps (T1 = {t1}): masks/T1 is not included")
    else:
        lines.append(f"step = median of whole steps + the mask update's extra time ({_fmt(mask_extra)}, mean of "
                     f"{len(extra)}) / T1; the phase columns come from the separately synchronised rounds")
    lines += lines_extra
    for name in ORDER:
        if name in profiles and profiles[name].get("profile_file"):
            p = profiles[name]
            busy = (f"; kernels {p['device_kernel_ms']:.1f} ms of {p['profiled_step_ms']:.1f} ms"
                    if p.get("device_kernel_ms") is not None else "")
            lines.append(f"profile {name}: {p['profile_file']}{busy}")
    lines.append(f"ratios: CAST w/o KD / plain {ratios['cast_nokd']:.3f}x (target <= 1.05x, paper 1.045x); "
                 f"CAST / plain {ratios['cast_kd']:.3f}x (target <= 1.40x, paper 1.44x, theory 1.33x)")
    if "cast_nokd_compiled" in ratios:
        lines.append(f"with the compiled candidates (over plain with the compiled CE): CAST w/o KD / plain "
                     f"{ratios['cast_nokd_compiled']:.3f}x; CAST / plain {ratios['cast_kd_compiled']:.3f}x; over the "
                     f"hand-written plain: {step_s['cast_nokd_compiled'] / step_s['plain']:.3f}x / "
                     f"{step_s['cast_kd_compiled'] / step_s['plain']:.3f}x")
    lines.append("first step of each variant (the kernels' checks and compiling; not in the figures above): "
                 + ", ".join(f"{LABELS[n]} {first_step[n]:.1f} s" for n in ORDER))
    return {"ratios": {n: round(r, 4) for n, r in ratios.items()}, "rows": rows, "report": "\n".join(lines)}


def profile_step(run, device: torch.device, out_dir: Path, stem: str) -> dict:
    """One step under torch.profiler: the table of the top ops by self device time (CPU: self CPU time) to
    ``out_dir/stem.txt``; returns the file, the step's time under the profiler, the kernels' total time and
    the top 10 ops."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    clock = Clock(device)
    with profile(activities=activities) as prof:
        a = clock()
        run()
        b = clock()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"  # "cuda" reads as "device" in newer torch
    averages = prof.key_averages()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.txt"
    wall_ms = (b[0] - a[0]) * 1e3
    path.write_text(f"{stem}: one step under torch.profiler, {wall_ms:.1f} ms wall; sorted by {sort}\n"
                    + averages.table(sort_by=sort, row_limit=40) + "\n")

    def self_time(evt) -> float:
        if cuda:
            return float(getattr(evt, "self_device_time_total", getattr(evt, "self_cuda_time_total", 0.0)))
        return float(evt.self_cpu_time_total)

    kernel_ms = None
    if cuda:  # the kernels' own events (device type CUDA): each kernel once
        kernels = [e for e in averages if str(getattr(e, "device_type", "")).endswith("CUDA")]
        kernel_ms = round(sum(self_time(e) for e in kernels) / 1e3, 3) if kernels else None
    ops = sorted((e for e in averages if not str(getattr(e, "device_type", "")).endswith("CUDA")),
                 key=self_time, reverse=True)
    top = [{"op": e.key, "self_ms": round(self_time(e) / 1e3, 3), "calls": int(e.count)} for e in ops[:10]]
    return {"profile_file": str(path), "profiled_step_ms": round(wall_ms, 3), "device_kernel_ms": kernel_ms,
            "top_ops": top}


def _compile_enabled() -> bool:
    from cast_llm import kernels

    return kernels.compile_enabled()


def _paths_taken(variant) -> dict:
    """The candidates this variant's checked kernel paths may take (its restriction), for the JSON rows."""
    return {k: list(v) for k, v in variant.paths.items()}


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "triton", "accelerate"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # not installed: say so rather than fail the benchmark
            out[name] = None
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {machine().split(';')[0]} ({torch.get_num_threads()} threads)"


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _fmt(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f}ms" if ms < 100 else f"{ms:.0f}ms"


if __name__ == "__main__":
    sys.exit(main())
