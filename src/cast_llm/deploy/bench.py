"""Dense vs 2:4 inference speed and weight memory, side by side in one run (method.md §7).

Measures, for one model on one device:

* **prefill** tokens/s: one forward of ``batch × prompt_len`` tokens that fills the KV cache, the head computed for
  the last position only, as ``generate`` does (``logits_to_keep=1``);
* **decode** tokens/s: ``gen_len`` greedy steps of one token per sequence through the KV cache
  (``batch × gen_len`` tokens), the regime where a 2:4 weight halves the bytes each step reads;
* **per-linear** latency for every distinct target shape at the prefill and decode token counts, dense
  ``F.linear`` vs the fastest 2:4 kernel — the kernel speedup without the rest of the model;
* **weight memory**: bytes of the target weights and of all parameters as held by each path (the 2:4 path:
  compressed weights plus the dense fallback copies its dispatch keeps), and on CUDA the allocator's view.

The dense path runs first, then the targets are swapped in place to :class:`~cast_llm.deploy.sparse24.Sparse24Linear`
(compressed once, cuSPARSELt / CUTLASS kernels), planned for exactly this run's token counts (prefill
``batch × prompt_len``, decode ``batch``) — each layer runs 2:4 where that measures faster on this GPU, dense
elsewhere, and keeps only the forms it uses — and everything is measured again; the logits of the same
prompt are compared as a correctness check (every position, from an untimed forward). On a CPU that does not
multiply bf16 natively the dense model upcast to fp32 is timed too (``--dense-fp32``), paired with the others: there
it is often the faster dense path a user would run. Timings are medians over ``repeats`` runs after ``warmup`` runs,
with CUDA synchronisation; decoding here is the eager Hugging Face loop (``benchmarks/inference24.py`` also
times the decode step inside a CUDA graph). Where 2:4 kernels cannot run (no CUDA, compute capability < 8.0)
the sparse side is reported as skipped with the reason — never estimated.

A dense model is first made 2:4 by magnitude (the values do not change the speed of either path); the
report says so.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from cast_llm import machine
from cast_llm.deploy.config import BenchConfig
from cast_llm.deploy.export import sparsity_report
from cast_llm.deploy.sparse24 import (
    Dispatcher,
    Sparse24Linear,
    available_kernels,
    plan_sparse24_,
    sparse24_layers,
    sparse24_memory,
    timing,
    to_sparse24_,
)
from cast_llm.deploy.sparse24.cycles import cold_bytes
from cast_llm.deploy.sparse24.dense_cpu import use_careful_head_
from cast_llm.deploy.sparse24.dispatch import CPU_MIN_SPEEDUP, beats_dense, paired_ratios
from cast_llm.deploy.sparse24.kernels import KERNELS, default_kernels
from cast_llm.deploy.sparse24.timing import DENSE_FP32, gemm_fn, random_24_weight, rel_err
from cast_llm.errors import CastError
from cast_llm.prune.magnitude import magnitude_prune_
from cast_llm.targets import find_targets


@dataclass
class PathResult:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prefill_ms: float
    decode_ms_per_step: float
    target_weight_bytes: int
    all_weight_bytes: int
    cuda_allocated_bytes: int | None = None
    cuda_peak_bytes: int | None = None
    # each repeat's prefill seconds and whole-decode seconds, in order (repeat i of two paths is a pair when the
    # report's timing is paired)
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)


@dataclass
class BenchReport:
    model: str
    device: str
    dtype: str
    config: dict[str, Any]
    dense: PathResult | None  # None only until a paired timing fills it (run_bench)
    sparse: PathResult | None = None
    # the same dense model upcast to fp32 (--dense-fp32): on a CPU without native bf16 / fp16 arithmetic, the dense
    # path a user would otherwise run for many tokens; dense_fp32_note says why it was timed, or why not
    dense_fp32: PathResult | None = None
    dense_fp32_note: str | None = None
    sparse_skipped: str | None = None
    per_linear: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    max_abs_logit_diff: float | None = None
    logits_rel_err: float | None = None  # max|Δlogit| / max|logit|
    # how far the same dense model moves when every target GEMM is accumulated in fp32 and rounded once (the
    # torch emulated kernel, another correct rounding order): a one-shot-pruned model amplifies bf16 rounding,
    # so a logits difference means something only against this floor, measured on the same prompt
    logits_noise_floor: float | None = None
    logits_within_noise: bool | None = None  # logits_rel_err <= max(0.01, 3 x floor), the GPU path's rule
    plan: dict[str, dict[str, int]] = field(default_factory=dict)  # "<mode>:<tokens>" -> {kernel: layers}
    # the whole-model checks of the plan (plan_sparse24_'s forward): tokens, layers, ratios, reverted
    plan_checks: list[dict[str, Any]] = field(default_factory=list)
    timing: str = ""  # how the two paths' generations were ordered (paired where a dense twin fits, see run_bench)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratios"] = ratios(d)
        d["pair_ratios"] = pair_ratios(d)
        return d


def speedup(dense_v, sparse_v, higher_better: bool = True) -> float | None:
    """One ratio of the table: 2:4 / dense for a rate (tokens/s), dense / 2:4 for a size (bytes) — above 1 the
    2:4 model is faster or smaller. None where either value is missing or 0."""
    if not (dense_v and sparse_v):
        return None
    return sparse_v / dense_v if higher_better else dense_v / sparse_v


def ratios(report: dict[str, Any]) -> dict[str, float]:
    """The table's ratio columns from a report's dict (:meth:`BenchReport.to_dict`): 2:4 / dense tokens/s for
    prefill and decode, dense / 2:4 target-weight bytes, and where the fp32 dense path was timed the tokens/s
    ratios against the better dense path ("vs best dense"). Empty where the 2:4 path did not run."""
    d, s, d32 = report.get("dense"), report.get("sparse"), report.get("dense_fp32")
    if not d or not s:
        return {}
    out = {}
    for key, name in (("prefill_tokens_per_s", "prefill"), ("decode_tokens_per_s", "decode")):
        if (r := speedup(d[key], s[key])) is not None:
            out[name] = r
            if d32 and d32[key]:
                out[f"{name}_vs_best_dense"] = speedup(max(d[key], d32[key]), s[key])
    if (r := speedup(d["target_weight_bytes"], s["target_weight_bytes"], higher_better=False)) is not None:
        out["target_weights"] = r
    return out


def pair_ratios(report: dict[str, Any]) -> dict[str, list[float]]:
    """Where the two paths were timed paired: each repeat's 2:4 / dense tokens/s ratio (dense seconds over 2:4
    seconds of the same pair), for prefill and decode — the spread the table's median ratio hides. Empty where the
    timing was sequential or the 2:4 path did not run."""
    d, s = report.get("dense"), report.get("sparse")
    if not d or not s or not str(report.get("timing", "")).startswith("paired"):
        return {}
    out = {}
    for key, name in (("prefill_s", "prefill"), ("decode_s", "decode")):
        dense_s, sparse_s = d.get(key) or [], s.get(key) or []
        if dense_s and len(dense_s) == len(sparse_s) and all(x > 0 for x in sparse_s):
            out[name] = [a / b for a, b in zip(dense_s, sparse_s)]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def keep_last_kwargs(model) -> dict:
    """``{"logits_to_keep": 1}`` where the model's forward takes it: what ``transformers``' ``generate`` passes to
    the prompt's forward (the head on the last position only; notes §40), else ``{}``."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@torch.inference_mode()
def _generate(model, prompt: torch.Tensor, gen_len: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one greedy generation with the KV cache, as ``generate`` runs it."""
    device, keep_last = prompt.device, keep_last_kwargs(model)
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=prompt, use_cache=True, **keep_last)
    _sync(device)
    t1 = time.perf_counter()
    cache, logits = out.past_key_values, out.logits
    token = logits[:, -1:].argmax(-1)
    for _ in range(gen_len):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


@torch.inference_mode()
def prompt_logits(model, prompt: torch.Tensor) -> torch.Tensor:
    """The logits of every prompt position (untimed): what the correctness check compares."""
    return model(input_ids=prompt).logits


def _target_bytes(model, fqns) -> int:
    """Bytes the target layers hold: a 2:4 layer's compressed weight plus its dense fallback (if kept), a
    dense layer's weight."""
    total = 0
    for fqn in fqns:
        m = model.get_submodule(fqn)
        if isinstance(m, Sparse24Linear):
            b = m.nbytes()
            total += b["compressed"] + b["dense"]
        else:
            total += m.weight.numel() * m.weight.element_size()
    return total


def cache_flusher(device: torch.device) -> tuple[Callable[[], object], int]:
    """``(flush, bytes)``: on a CPU a read of twice the cache a cold timing must overflow
    (:func:`~cast_llm.deploy.sparse24.cycles.cold_bytes`), run before every timed generation so that no path's
    prefill finds weights the generation before left in the cache; elsewhere nothing. Without it the paired order
    favoured dense: its prefill followed its own decode (a pass over the same weights) in two of five repeats, the
    2:4 model's prefill (dense copies) never did, since its decode reads the compressed form (§55)."""
    if device.type != "cpu":
        return (lambda: None), 0
    buf = torch.ones(flush_bytes() // 4)
    return buf.sum, flush_bytes()


def flush_bytes() -> int:
    """What :func:`cache_flusher` reads on a CPU: twice :func:`~cast_llm.deploy.sparse24.cycles.cold_bytes`."""
    return 2 * cold_bytes()


def measure_path(model, prompt: torch.Tensor, cfg: BenchConfig, fqns) -> PathResult:
    device = prompt.device
    flush, _ = cache_flusher(device)
    for _ in range(cfg.warmup):
        _generate(model, prompt, min(cfg.gen_len, 4))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs = []
    for _ in range(cfg.repeats):
        flush()
        runs.append(_generate(model, prompt, cfg.gen_len))
    return _path_result(model, prompt, cfg, fqns, runs)


def measure_paired(dense_model, sparse_model, prompt: torch.Tensor, cfg: BenchConfig, fqns,
                   fp32_model=None) -> tuple[PathResult, PathResult, PathResult | None]:
    """The paths timed **paired**: each repeat generates once with the dense twin, once with its fp32 copy (where
    given) and once with the 2:4 model, so a slow spell of the host falls on all of them (a CPU's memory bandwidth
    drifts by ±30 % within seconds), in the order dense, (fp32,) 2:4 on even repeats and the reverse on odd ones,
    because on the CPU the first generation of a pair measured 8-10 % faster than the second whichever model it
    was (docs/results/cpu24-notes.md §11). Every generation starts with the caches flushed (:func:`cache_flusher`).
    (dense result, 2:4 result, fp32 dense result or None)."""
    models = {"dense": dense_model, "dense_fp32": fp32_model, "sparse": sparse_model}
    models = {k: m for k, m in models.items() if m is not None}
    flush, _ = cache_flusher(prompt.device)
    for _ in range(cfg.warmup):
        for m in models.values():
            _generate(m, prompt, min(cfg.gen_len, 4))
    runs = {k: [] for k in models}
    for r in range(cfg.repeats):
        for path in (list(models) if r % 2 == 0 else list(models)[::-1]):
            flush()
            runs[path].append(_generate(models[path], prompt, cfg.gen_len))
    results = {k: _path_result(models[k], prompt, cfg, fqns, runs[k]) for k in models}
    return results["dense"], results["sparse"], results.get("dense_fp32")


def fp32_baseline(cfg: BenchConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the dense model is also timed upcast to fp32 (``--dense-fp32``), or None where it is not."""
    half = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if cfg.dense_fp32 == "off" or half is None:
        return None
    if cfg.dense_fp32 == "on":
        return "asked for (--dense-fp32 on)"
    if device.type != "cpu" or machine.native_half_matmul(half) is not False:
        return None
    return (f"this CPU does not multiply {half} natively (no AVX512-{half.upper()} or AMX): torch's {half} GEMM "
            f"is emulated there, and fp32 can be the faster dense path a user would run (--dense-fp32 off: not "
            f"timed)")


def paired_fits(model, device: torch.device, extra_bytes: int = 0) -> str | None:
    """None where a dense twin of ``model`` fits beside it and its 2:4 forms (a CPU with MemAvailable above 3× the
    model's bytes, plus ``extra_bytes``: an fp32 copy), else why the timing stays sequential."""
    if device.type != "cpu":
        return "on a GPU the two paths are timed one after the other (the allocator's peak is reported per path)"
    need = 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + extra_bytes
    free = machine.available_memory()
    if free is None or free < need:
        have = "unknown" if free is None else f"{free / 2**30:.1f} GiB"
        return f"a dense twin does not fit (needs {need / 2**30:.1f} GiB available, {have} is)"
    return None


def _path_result(model, prompt: torch.Tensor, cfg: BenchConfig, fqns, runs) -> PathResult:
    device = prompt.device
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    b, p = prompt.shape
    result = PathResult(
        prefill_tokens_per_s=b * p / prefill,
        decode_tokens_per_s=b * cfg.gen_len / decode if cfg.gen_len else 0.0,
        prefill_ms=prefill * 1e3,
        decode_ms_per_step=decode * 1e3 / max(cfg.gen_len, 1),
        target_weight_bytes=_target_bytes(model, fqns),
        all_weight_bytes=sparse24_memory(model)["total"],
        prefill_s=[r[0] for r in runs],
        decode_s=[r[1] for r in runs],
    )
    if device.type == "cuda":
        result.cuda_allocated_bytes = torch.cuda.memory_allocated(device)
        result.cuda_peak_bytes = torch.cuda.max_memory_allocated(device)
    return result


def linear_shapes(targets) -> dict[tuple[int, int], list[str]]:
    """Distinct (out, in) target shapes -> short layer names sharing it."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for t in targets:
        shape = (t.out_features, t.in_features)
        short = t.fqn.rsplit(".", 1)[-1]
        names = shapes.setdefault(shape, [])
        if short not in names:
            names.append(short)
    return shapes


@torch.inference_mode()
def bench_linears(shapes: dict[tuple[int, int], list[str]], token_counts: dict[str, int], *, dtype: torch.dtype,
                  device: torch.device, kernels, warmup: int = 3, repeats: int = 20,
                  dense_fp32: bool = False) -> list[dict[str, Any]]:
    """Latency per distinct shape and token count: dense ``F.linear`` and the fastest of ``kernels`` (and, with
    ``dense_fp32`` on the CPU, the layer upcast to fp32 in the same interleaved measurement)."""

    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for (out_f, in_f), names in shapes.items():
        w = random_24_weight(out_f, in_f, dtype, device)
        for regime, tokens in token_counts.items():
            if device.type == "cpu":
                # dense and every kernel timed together, interleaved, each weight cycled past the last-level cache
                # (the dispatcher's own paired measurement): timed one after another, a slow spell of this CPU's
                # memory falls on one column only (measured: a table at 0.75x where its dispatcher, and a rerun
                # of the table, saw 1.14x; docs/results/cpu24-notes.md §18)
                baselines = ["dense", DENSE_FP32] if dense_fp32 else ["dense"]
                got = timing.measure_gemms_rounds([*baselines, *kernels], out_f, in_f, dtype, tokens, "eager", device)
                secs = {k: sec for k, (sec, _, _) in got.items()}
                rounds = {k: r for k, (_, _, r) in got.items() if r}
            else:
                x = torch.randn(tokens, in_f, generator=gen).to(device=device, dtype=dtype)
                secs = {k: timed(gemm_fn(k, w, x), device, warmup=warmup, repeats=repeats) for k in ["dense", *kernels]}
                rounds = {}
            dense_s = secs["dense"]
            dense_bytes = w.numel() * w.element_size()
            row = {"layers": ",".join(names), "out": out_f, "in": in_f, "regime": regime, "tokens": tokens,
                   "dense_us": dense_s * 1e6, "dense_gbps": dense_bytes / dense_s / 1e9}
            if math.isfinite(secs.get(DENSE_FP32, math.inf)):
                row["dense_fp32_us"] = secs[DENSE_FP32] * 1e6
            best = None
            for k in kernels:
                s = secs[k]
                if math.isfinite(s) and (best is None or s < best[1]):  # inf: the kernel failed or was wrong
                    best = (k, s)
            if best is not None:
                held = sum(t.numel() * t.element_size() for t in KERNELS[best[0]].compress(w).values())
                # the weight bytes each form reads per call, and the speed-up those bytes allow (dense / held)
                row.update(sparse_us=best[1] * 1e6, speedup=dense_s / best[1], kernel=best[0],
                           sparse_gbps=held / best[1] / 1e9, byte_limit=dense_bytes / held)
                if "dense_fp32_us" in row:
                    row["speedup_vs_fp32"] = secs[DENSE_FP32] / best[1]
                if (ratios := paired_ratios(rounds, best[0])) is not None:
                    # the dispatcher's paired rule on these rounds: faster in how many, and whether it would choose it
                    row.update(rounds_won=sum(r > 1 for r in ratios), rounds=len(ratios),
                               paired_rule_takes_it=beats_dense(best[0], secs, CPU_MIN_SPEEDUP, rounds))
            rows.append(row)
    return rows


def _plan_summary(plan: dict[str, dict[str, str]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for chosen in plan.values():
        for case, kernel in chosen.items():
            out.setdefault(case, {}).setdefault(kernel, 0)
            out[case][kernel] += 1
    return out


BACKENDS = {"auto": None, "cusparselt": ("cusparselt-direct", "cusparselt"), "cutlass": ("cutlass",)}  # auto: the device's


def allocate_alike(a, b, fqns) -> None:
    """Re-allocate the weights at ``fqns`` of models ``a`` and ``b`` (one architecture) layer by layer, alternating
    which model goes first, so that neither model's weights are systematically the older allocation (values and
    parameter objects unchanged: ties hold). A CPU VM's memory read the most recent allocation faster (§49)."""
    with torch.no_grad():
        for i, fqn in enumerate(fqns):
            for model in ((a, b) if i % 2 == 0 else (b, a)):
                weight = model.get_submodule(fqn).weight
                weight.data = weight.data.clone()


def run_bench(model, *, name: str, cfg: BenchConfig, seed: int = 0) -> BenchReport:
    """The whole side-by-side benchmark on the model's device and dtype (see the module docstring)."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    targets = find_targets(model, n=2, m=4, skip_incompatible=True)
    fqns = [t.fqn for t in targets]
    notes = []
    if not all(r.is_nm for r in sparsity_report(model, n=2, m=4, targets=targets)):
        with torch.no_grad():
            for t in targets:
                w = t.weight.data
                magnitude_prune_(w.t() if t.transposed else w, 2, 4)
        notes.append("the model was not 2:4: its targets were magnitude-pruned to 2:4 for timing "
                     "(both paths use the same weights; values do not change kernel speed)")
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (cfg.batch_size, cfg.prompt_len), generator=gen).to(device)
    tokens = {"prefill": cfg.batch_size * cfg.prompt_len, "decode": cfg.batch_size}
    if cfg.backend not in BACKENDS:
        raise CastError(f"unknown 2:4 backend {cfg.backend!r}; use {', '.join(BACKENDS)}")
    kernels, why = available_kernels(device, dtype, BACKENDS[cfg.backend] or default_kernels(device))
    fp32_why = fp32_baseline(cfg, device, dtype)
    fp32_timed = fp32_why is not None
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters()) if fp32_timed else 0
    why_not_paired = paired_fits(model, device, fp32_bytes) if kernels else "no 2:4 kernel runs here"
    twin = twin32 = dense32 = None
    if why_not_paired is None:  # timed later, paired with the 2:4 model (and the fp32 copy)
        twin = copy.deepcopy(model)
        if device.type == "cpu":
            allocate_alike(model, twin, fqns)
            notes.append("both paths' target weights were re-allocated alike (layer by layer, in alternating order) "
                         "before timing: on a VM the model allocated last prefilled up to 1.5x faster "
                         "(docs/results/cpu24-notes.md §49)")
        twin32 = copy.deepcopy(model).float() if fp32_timed else None
        dense = None
    else:
        dense = measure_path(model, prompt, cfg, fqns)
        free = machine.available_memory() if device.type == "cpu" else None
        if fp32_timed and device.type == "cpu" and (free is None or free < 1.5 * fp32_bytes):
            fp32_timed, fp32_why = False, "not timed: an fp32 copy of the model does not fit in the memory available"
        elif fp32_timed:  # timed before the 2:4 swap, one path after the other as the dense path was
            copy32 = copy.deepcopy(model).float()
            dense32 = measure_path(copy32, prompt, cfg, fqns)
            del copy32
    dense_logits = prompt_logits(model, prompt)
    floor_logits = noise_floor_logits(model, prompt, targets)
    report = BenchReport(model=name, device=_device_name(device), dtype=str(dtype).removeprefix("torch."),
                         config=asdict(cfg), dense=dense, notes=notes, dense_fp32=dense32, dense_fp32_note=fp32_why)
    report.per_linear = bench_linears(linear_shapes(targets), tokens, dtype=dtype, device=device, kernels=kernels,
                                      warmup=min(cfg.warmup, 3) + 1, repeats=cfg.linear_repeats,
                                      dense_fp32=fp32_timed)
    if not kernels:
        report.sparse_skipped = "; ".join(f"{k}: {r}" for k, r in why.items())
        return report
    dispatcher = Dispatcher(device=device, cache_path=cfg.dispatch_cache)
    swapped = to_sparse24_(model, targets=targets, kernels=kernels, dispatch=dispatcher, skip_incompatible=True,
                           keep_dense=cfg.dense_copy)
    skipped = getattr(model, "_sparse24_skipped", [])
    if skipped:
        notes.append(f"{len(skipped)} target(s) stayed dense: {'; '.join(skipped[:3])}")
    # decide every layer for exactly this run's token counts, then keep only the forms those choices use; on a CPU
    # with the dense copies kept, the prefill's plan is checked on the whole model against those layers dense
    checks: list[dict] = []
    check = device.type == "cpu" and cfg.dense_copy
    keep = keep_last_kwargs(model)
    report.plan = _plan_summary(plan_sparse24_(
        model, list(tokens.values()), modes=("eager",), release=True, checks=checks,
        forward=(lambda n: model(input_ids=prompt[:, : n // prompt.shape[0]], use_cache=True, **keep)) if check
        else None, flush=cache_flusher(device)[0] if check else None))
    report.plan_checks = checks
    for c in checks:
        if c["layers"]:
            notes.append(
                f"whole-model check at {c['tokens']} tokens: the plan ({c['layers']} layers on other kernels than "
                f"dense F.linear) against the same model with them dense, dense / plan in each pair "
                + " ".join(f"{r:.2f}" for r in c["ratios"])
                + (": those layers run dense at that count" if c["reverted"] else ": the plan is kept"))
    notes.append(f"{len(swapped)} target(s) swapped to 2:4 layers; {len(sparse24_layers(model))} of them run a 2:4 "
                 f"kernel for some token count of this run, the others run dense (2:4 measured no faster here)")
    if device.type == "cpu":  # the dense head too, where the careful GEMV measures faster (its own check)
        head = use_careful_head_(model)
        if head:
            notes.append(head)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if twin is not None:
        report.dense, report.sparse, report.dense_fp32 = measure_paired(twin, model, prompt, cfg, fqns, twin32)
        del twin, twin32
        report.timing = ("paired: each repeat generates once with the dense twin"
                         + (", once with its fp32 copy" if report.dense_fp32 else "")
                         + " and once with the 2:4 model, the order reversed on every other repeat")
    else:
        report.sparse = measure_path(model, prompt, cfg, fqns)
        report.timing = f"sequential: the dense path's repeats, then the 2:4 path's ({why_not_paired})"
    if device.type == "cpu":
        report.timing += (f"; every generation starts after a read of {flush_bytes() / 2**20:,.0f} MiB "
                          "(no weights left in a cache by the one before)")
    sparse_logits = prompt_logits(model, prompt)
    diff = (sparse_logits.float() - dense_logits.float()).abs().max()
    report.max_abs_logit_diff = float(diff)
    report.logits_rel_err = float(diff / dense_logits.float().abs().max())
    report.logits_noise_floor = rel_err(floor_logits, dense_logits)
    report.logits_within_noise = report.logits_rel_err <= within_noise_bound(report.logits_noise_floor)
    return report


NOISE_MIN, NOISE_FACTOR = 0.01, 3.0  # "within bf16 noise": <= max(0.01, 3 x the noise floor) (docs/deployment.md)


def within_noise_bound(floor: float) -> float:
    """The largest logits difference (max|Δ| / max|logit|) that is still bf16 rounding, given the floor."""
    return max(NOISE_MIN, NOISE_FACTOR * floor)


@torch.no_grad()
def noise_floor_logits(model, prompt: torch.Tensor, targets) -> torch.Tensor:
    """The prompt's logits with every target GEMM accumulated in fp32 and rounded once to the model's dtype (what
    the torch ``emulated`` kernel computes; done with forward hooks, so nothing of the model is replaced or
    copied): the same dense model under another correct rounding order, so ``rel_err(these, dense)`` is the bf16
    noise floor of this model on this prompt."""

    def fp32_once(t):
        def hook(module, inputs, out):
            x = inputs[0]
            w = t.weight.float()
            y = x.float() @ (w if t.transposed else w.t())  # Conv1D stores (in, out)
            if getattr(module, "bias", None) is not None:
                y = y + module.bias.float()
            return y.to(out.dtype)
        return hook

    handles = [t.module.register_forward_hook(fp32_once(t)) for t in targets]
    try:
        with torch.no_grad():
            return model(input_ids=prompt).logits
    finally:
        for h in handles:
            h.remove()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm{cap[0]}{cap[1]})"
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def format_report(r: BenchReport) -> str:
    """A side-by-side text table of a :class:`BenchReport`."""
    c = r.config
    lines = [f"bench-inference {r.model} on {r.device}, {r.dtype}, batch {c['batch_size']}, prompt {c['prompt_len']}, "
             f"generate {c['gen_len']} (median of {c['repeats']})"]
    s, d, d32 = r.sparse, r.dense, r.dense_fp32

    def ratio(dense_v, sparse_v, higher_better):
        x = speedup(dense_v, sparse_v, higher_better)
        return float("nan") if x is None else x

    def row(label, key, fmt, scale=1.0, higher_better=True):
        dense_v, sparse_v = getattr(d, key) * scale, s and getattr(s, key) * scale
        cells = f"  {label:<26} {fmt.format(dense_v):>14}"
        if d32 is not None:
            cells += f" {fmt.format(getattr(d32, key) * scale):>14}"
        if s is None:
            return cells + f" {'skipped':>14}"
        cells += f" {fmt.format(sparse_v):>14} {ratio(dense_v, sparse_v, higher_better):>8.2f}x"
        if d32 is not None:  # against the better of the two dense paths on this row
            pick = max if higher_better else min
            cells += f" {ratio(pick(dense_v, getattr(d32, key) * scale), sparse_v, higher_better):>12.2f}x"
        return cells

    head = f"  {'':<26} {'dense ' + r.dtype:>14}" + (f" {'dense fp32':>14}" if d32 is not None else "")
    lines.append(head + f" {'2:4 sparse':>14} {'ratio':>9}" + (f" {'vs best dense':>13}" if d32 is not None else ""))
    lines.append(row("prefill tokens/s", "prefill_tokens_per_s", "{:,.0f}"))
    lines.append(row("decode tokens/s", "decode_tokens_per_s", "{:,.1f}"))
    mib = 1 / 2**20
    lines.append(row("target weights (MiB)", "target_weight_bytes", "{:,.1f}", mib, higher_better=False))
    lines.append(row("all weights (MiB)", "all_weight_bytes", "{:,.1f}", mib, higher_better=False))
    if d.cuda_peak_bytes is not None:
        lines.append(row("CUDA peak (MiB)", "cuda_peak_bytes", "{:,.1f}", mib, higher_better=False))
    if s is not None:
        lines.append(f"  ratio: 2:4 / dense {r.dtype} for tokens/s, dense / 2:4 for memory: above 1x the 2:4 model is "
                     "faster or smaller" + ("; vs best dense: the same against the better of dense "
                                            f"{r.dtype} and dense fp32 on each row" if d32 is not None else ""))
    if r.dense_fp32_note:
        lines.append(f"  dense fp32: {r.dense_fp32_note}")
    if r.sparse_skipped:
        lines.append(f"  sparse path skipped: {r.sparse_skipped}")
    if r.timing:
        lines.append(f"  timing: {r.timing}")
    for name, rs in pair_ratios(r.to_dict()).items():
        lines.append(f"  {name} 2:4 / dense in each pair: " + " ".join(f"{x:.2f}" for x in rs)
                     + f" (range {min(rs):.2f}-{max(rs):.2f}x: the spread of this machine over the run)")
    if r.max_abs_logit_diff is not None:
        line = (f"  logits on the prompt: max|dense - 2:4| = {r.max_abs_logit_diff:.4g}, "
                f"/ max|logit| = {r.logits_rel_err:.3g}")
        if r.logits_noise_floor is not None:
            verdict = "within" if r.logits_within_noise else "OUTSIDE"
            line += (f"; bf16 noise floor {r.logits_noise_floor:.3g} (the dense model with fp32-accumulated GEMMs): "
                     f"{verdict} max(0.01, 3 x floor)")
        lines.append(line)
    for case, kernels in r.plan.items():
        lines.append(f"  layers per kernel at {case} tokens: " + ", ".join(f"{k} {n}" for k, n in kernels.items()))
    lines.append("  per-linear latency (us) and weight GB/s: dense F.linear vs the fastest 2:4 kernel, the speed-up and "
                 "the byte limit (dense bytes / 2:4 bytes)"
                 + ("; then the layer in fp32 (weight and input upcast) and 2:4's speed-up over it"
                    if any("dense_fp32_us" in p for p in r.per_linear) else ""))
    lines += [linear_line(p) for p in r.per_linear]
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


def linear_line(p: dict[str, Any]) -> str:
    """One row of the per-linear table (a row of :func:`bench_linears`) as text."""
    sp = (f"{p['sparse_us']:>10.1f} {p.get('sparse_gbps', 0):>6.1f} GB/s {p['speedup']:>6.2f}x "
          f"(limit {p.get('byte_limit', float('nan')):.2f}x) {p['kernel']}" if "sparse_us" in p
          else f"{'skipped':>10}")
    if "rounds" in p:
        sp += (f", faster in {p['rounds_won']}/{p['rounds']} rounds: "
               + ("the paired rule takes it" if p["paired_rule_takes_it"] else "the paired rule keeps dense"))
    if "speedup_vs_fp32" in p:
        sp += f"; dense fp32 {p['dense_fp32_us']:.1f} us, 2:4 {p['speedup_vs_fp32']:.2f}x it"
    return (f"    {p['layers']:<28} {p['out']:>6}x{p['in']:<6} {p['regime']:<8} {p['tokens']:>6} tok "
            f"{p['dense_us']:>10.1f} {p.get('dense_gbps', 0):>6.1f} GB/s {sp}")


def plot_report(r: BenchReport, path: str) -> None:
    """Two panels: prefill and decode tokens/s, dense against 2:4; the per-linear speed-up of every shape and
    regime (1.0 = dense)."""
    from pathlib import Path

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    a, b = fig.subplots(1, 2)
    s, d32 = r.sparse, r.dense_fp32
    bars = [("dense " + r.dtype, r.dense, "tab:gray")] + ([("dense fp32", d32, "silver")] if d32 else [])
    bars.append(("2:4", s, "tab:blue"))
    width = 0.8 / len(bars)
    for i, (_label, key) in enumerate((("prefill", "prefill_tokens_per_s"), ("decode", "decode_tokens_per_s"))):
        d_v = getattr(r.dense, key)
        for j, (label, result, color) in enumerate(bars):
            x = i - 0.4 + width * (j + 0.5)
            v = getattr(result, key) if result else 0.0
            a.bar([x], [v], width, color=color, label=label if i == 0 else None)
            if result is s and s and d_v:  # the ratio to the dense path in the model's own dtype, as in the table
                a.annotate(f"{v / d_v:.2f}x", (x, v), ha="center", va="bottom", fontsize=8)
    a.set_xticks([0, 1], ["prefill", "decode"])
    a.set_yscale("log")
    a.set_ylabel("tokens/s")
    a.set_title(f"{r.model}, {r.dtype}, batch {r.config['batch_size']}")
    a.legend(fontsize=8)
    rows = [p for p in r.per_linear if "speedup" in p]
    b.bar(range(len(rows)), [p["speedup"] for p in rows], color=["tab:blue" if p["regime"] == "decode" else "tab:orange"
                                                                for p in rows])
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xticks(range(len(rows)), [f"{p['out']}x{p['in']}\n{p['regime']} {p['tokens']}" for p in rows], fontsize=6)
    b.set_ylabel("dense time / 2:4 time")
    b.set_title("per linear (blue: decode, orange: prefill)")
    fig.suptitle(f"bench-inference on {r.device}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
