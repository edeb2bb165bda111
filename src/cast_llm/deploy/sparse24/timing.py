"""Timing a GEMM on the GPU it will run on, the way it will run: eager (host cost included) or in a CUDA graph.

* ``eager``: ``calls`` back-to-back calls, then one synchronisation; per-call time = wall time / calls. When
  the host is slower than the GPU (small GEMMs, or an op with host-side setup per call) this measures the
  host, exactly as a model running eagerly will experience it.
* ``graph``: the ``calls`` are captured once into a CUDA graph (after warm-up on a side stream, as
  ``torch.cuda.graphs`` requires) and the graph is replayed between CUDA events: GPU time only, as inside a
  graph-captured decode step.

:func:`measure_gemm` times one candidate of the dispatcher on random 2:4 weights and first checks its output
against ``F.linear`` (max|Δ|/max|y| ≤ 0.02) — in graph mode, the output of a graph replay: a kernel that
is fast but wrong (or wrong only inside a graph) is never chosen.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cast_llm.deploy.sparse24 import cpu
from cast_llm.deploy.sparse24.cycles import cycled, cycled_many, cycled_rounds, l3_bytes
from cast_llm.deploy.sparse24.kernels import KERNELS, bound_call
from cast_llm.sparsity.mask import nm_mask

DENSE_CAREFUL = "dense-careful"  # = dispatch.DENSE_CAREFUL (dispatch imports this module: not imported from there)
# the same layer as an fp32 model runs it (weight and activations upcast, torch's fp32 F.linear): a baseline that
# bench-inference times where the CPU does not multiply bf16 natively, never a dispatch candidate
DENSE_FP32 = "dense-fp32"

__all__ = ["cycled_seconds", "l3_bytes", "measure_gemm", "measure_gemms", "measure_gemms_rounds", "random_24_weight",
           "time_call"]

WRONG_RESULT_TOL = 0.02  # max|Δ|/max|y| of a bf16 GEMM vs F.linear is ~0.4 %; 2 % means a wrong kernel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], *, mode: str, device: torch.device, warmup: int = 3, calls: int | None = None,
              repeats: int = 5, validate: Callable[[object], str | None] | None = None) -> float:
    """Median seconds per call of ``fn()`` in ``mode`` (``eager`` or ``graph``); see the module docstring.

    ``validate(output)`` (None = fine, else why not) is applied to an output produced the way it is timed —
    in graph mode, by a replay of the captured graph — and a complaint raises RuntimeError.
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    if calls is None:  # enough calls per repeat to last ~2 ms, so timer and launch jitter stay small
        t0 = time.perf_counter()
        fn()
        _sync(device)
        calls = int(min(50, max(3, 2e-3 / max(time.perf_counter() - t0, 1e-6))))
    if mode == "eager":
        if validate is not None and (why := validate(fn())):
            raise RuntimeError(why)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            times.append((time.perf_counter() - t0) / calls)
        return statistics.median(times)
    if mode != "graph":
        raise ValueError(f"mode must be 'eager' or 'graph', got {mode!r}")
    if device.type != "cuda":
        raise RuntimeError("graph timing needs a CUDA device")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    graph.replay()
    _sync(device)
    if validate is not None and (why := validate(out)):
        raise RuntimeError(f"inside a CUDA graph: {why}")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


def random_24_weight(out_features: int, in_features: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """A random ``(out, in)`` weight, exactly 2:4 (magnitude mask), made on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen, device=device, dtype=torch.float32)
    return w.masked_fill_(~nm_mask(w, 2, 4), 0).to(dtype)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max|y - ref| / max|ref| in float32."""
    ref = ref.float()
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def gemm_fn(kernel: str, weight: torch.Tensor, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``x Wᵀ`` by ``kernel`` (``"dense"`` = ``F.linear``, ``"dense-careful"`` = the CPU extension's dense GEMM) as a
    no-argument callable; compresses once."""
    fn, held, _ = _gemm_case(kernel, weight, x)
    return lambda: fn(held)


def _gemm_case(kernel: str, weight: torch.Tensor, x: torch.Tensor, states: dict | None = None):
    """``(fn, held, place)``: ``kernel``'s call on one copy of what it reads (the dense weight, or its compressed
    state) laid out as a layer lays it, and how to lay out more copies, so that :func:`.cycles.cycled` can cycle
    them: a 2:4 layer's CPU tensors lie on huge pages where the OS allows (``Sparse24Linear`` maps them through
    :func:`.cpu.on_huge_pages`), a dense weight where torch's allocator put it. ``states``: compressed states by
    format, shared by the candidates of one format (then :func:`.cycles.cycled_many` gives them one ring of
    copies)."""
    if kernel == "dense":
        return (lambda w: F.linear(x, w)), weight, None
    if kernel == DENSE_CAREFUL:
        return (lambda w: cpu.dense_mm(x, w)), weight, None
    if kernel == DENSE_FP32:
        x32 = x.float()
        return (lambda w: F.linear(x32, w)), weight.float(), None
    k, (out_features, in_features) = KERNELS[kernel], weight.shape
    # what Sparse24Linear's forward runs: on a small layer the general path's extra µs can decide the choice
    states = {} if states is None else states
    if k.fmt not in states:
        states[k.fmt] = cpu.state_on_huge_pages(k.compress(weight))
    return bound_call(k, x, in_features, out_features), states[k.fmt], cpu.on_huge_pages


def _wrong(y: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why ``y`` is not ``ref`` to a bf16 GEMM's rounding (None: it is; NaN is wrong)."""
    err = rel_err(y, ref)
    return None if err <= WRONG_RESULT_TOL else f"wrong results: max|Δ|/max|y| = {err:.3g} against F.linear"


def _cpu_inputs(out_features: int, in_features: int, dtype: torch.dtype, tokens: int):
    weight = random_24_weight(out_features, in_features, dtype, "cpu")
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    return weight, x


def cycled_seconds(kernel: str, out_features: int, in_features: int, dtype: torch.dtype, tokens: int, *,
                   repeats: int | None = None, min_time: float | None = None) -> float:
    """Median seconds per call of ``kernel`` (``"dense"``: ``F.linear``) on the CPU at this shape, the weight
    cycled past the last-level cache (:func:`cast_llm.deploy.sparse24.cycles.cycled`)."""
    weight, x = _cpu_inputs(out_features, in_features, dtype, tokens)
    fn, held, place = _gemm_case(kernel, weight, x)
    return cycled(fn, held, place=place, repeats=repeats, min_time=min_time)


def measure_gemms(kernels, out_features: int, in_features: int, dtype: torch.dtype, tokens: int, mode: str,
                  device: torch.device) -> dict[str, tuple[float, str | None]]:
    """:func:`measure_gemm` for several candidates. On the CPU in eager mode they are checked one by one and then
    timed **interleaved** (:func:`.cycles.cycled_many`: a paired comparison, robust to the memory system's slow
    spells); elsewhere one after another."""
    return {k: (sec, note) for k, (sec, note, _) in
            measure_gemms_rounds(kernels, out_features, in_features, dtype, tokens, mode, device).items()}


def measure_gemms_rounds(kernels, out_features: int, in_features: int, dtype: torch.dtype, tokens: int, mode: str,
                         device: torch.device) -> dict[str, tuple[float, str | None, list[float] | None]]:
    """:func:`measure_gemms` with each candidate's seconds per call in every interleaved round
    (:func:`.cycles.cycled_rounds`; round ``r`` of two candidates is a pair), None where the candidates were not
    timed together (off the CPU or outside eager mode, or a candidate that failed or was timed alone)."""
    device = torch.device(device)
    if device.type != "cpu" or mode != "eager":
        return {k: (*measure_gemm(k, out_features, in_features, dtype, tokens, mode, device), None) for k in kernels}
    weight, x = _cpu_inputs(out_features, in_features, dtype, tokens)
    ref = F.linear(x, weight)
    results, cases, states = {}, {}, {}
    for k in kernels:
        try:
            fn, held, place = _gemm_case(k, weight, x, states)
            if k != "dense" and (why := _wrong(fn(held), ref)):
                raise RuntimeError(why)
            cases[k] = (fn, held, place)
        except Exception as e:  # noqa: BLE001 - any failure of a candidate only removes that candidate
            results[k] = (math.inf, _why(e), None)
    try:
        results.update((k, (statistics.median(r), None, r))
                       for k, r in zip(cases, cycled_rounds(list(cases.values()))))
    except Exception:  # noqa: BLE001 - a failure while timing them together: each alone, a failing one inf
        for k, case in cases.items():
            try:
                results[k] = (cycled_many([case])[0], None, None)
            except Exception as e:  # noqa: BLE001
                results[k] = (math.inf, _why(e), None)
    return {k: results[k] for k in kernels}


def _why(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {first}"


def measure_gemm(kernel: str, out_features: int, in_features: int, dtype: torch.dtype, tokens: int, mode: str,
                 device: torch.device) -> tuple[float, str | None]:
    """(seconds per call, None) for one dispatch candidate, or (inf, why) if it fails or is wrong. On the CPU
    the weights are cycled past the last-level cache (:func:`measure_gemms` with one candidate)."""
    device = torch.device(device)
    if device.type == "cpu" and mode == "eager":
        return measure_gemms([kernel], out_features, in_features, dtype, tokens, mode, device)[kernel]
    weight = random_24_weight(out_features, in_features, dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, in_features, generator=gen, device=device, dtype=torch.float32).to(dtype)
    ref = F.linear(x, weight)
    try:
        fn = gemm_fn(kernel, weight, x)
        return time_call(fn, mode=mode, device=device,
                         validate=None if kernel == "dense" else (lambda y: _wrong(y, ref))), None
    except Exception as e:  # noqa: BLE001 - any failure of a candidate only removes that candidate
        return math.inf, _why(e)
