"""Custom kernels that prove themselves before they touch a run: kernel path → candidates → probe → verdict.

Every fast path of cast-llm (a Triton kernel, a ``torch.compile``'d function, a CUDA graph, a cuSPARSELt
binding) is a **candidate** of a :class:`CheckedPath`, beside the path's **reference** — the plain torch code
the candidate is tested against. Before a candidate first runs in a process, per device and per *variant*
(the dtypes, layouts or flags the candidate's behaviour depends on: what it is compiled for), :func:`choose`

1. runs the path's probe: the candidate and the reference on a small input, the error in the path's own
   measure against its stated tolerance (an exception, a failed compile or a NaN fails);
2. times the candidates that passed, when there is more than one, and takes the fastest;
3. keeps the verdict in memory and in the user's cache (:mod:`cast_llm.kernels.verdicts`, keyed by GPU,
   driver, torch, Triton and cast-llm versions), so later runs skip the probe;
4. for every candidate that failed, prints ONE line naming the kernel, the error and what runs instead.

Paths whose check needs the real input (the teacher's CUDA graph, the decoder's graph) are ``in_situ``: their
integration checks itself on first use and reports with :func:`record`; :func:`choose` then only says
whether the candidate is allowed (not failed before, on this machine). A candidate that raises after passing
is reported with :func:`record` too, and the path runs its reference for the rest of the process.

One switch forces the references everywhere: ``CAST_LLM_KERNELS=reference`` (library users) or
``--kernels reference`` (the commands, through :func:`set_mode`): reference means torch operations only.
``CAST_LLM_COMPILE=0`` leaves the ``torch.compile`` candidates out (no compile time: short runs, the tests).
:func:`taken` says which path every kernel took, for a run's ``results.json``.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cast_llm.kernels.switch import (
    COMPILE_ENV,
    MODE_ENV,
    MODES,
    apply_flag,
    compile_enabled,
    compiled_runs_on,
    host_runs_on,
    interpreting,
    mode,
    reset_mode,
    set_mode,
    triton_runs_on,
)
from cast_llm.kernels.verdicts import VerdictFile, identity

__all__ = ["MODES", "MODE_ENV", "COMPILE_ENV", "REFERENCE", "Candidate", "Check", "CheckedPath", "REGISTRY",
           "register", "mode", "set_mode", "reset_mode", "apply_flag", "compile_enabled", "choose", "record", "implementation", "taken",
           "reset", "seconds_per_call", "describe_device", "interpreting", "triton_runs_on", "host_runs_on",
           "compiled_runs_on", "probing", "why_not", "examine", "restricted"]

REFERENCE = "reference"


@dataclass(frozen=True)
class Candidate:
    """One fast implementation of a path. ``load()`` returns it (imported on first use: Triton is heavy);
    ``runs_on(device)`` is None where it can run, else why not; ``compiles``: a ``torch.compile`` candidate."""

    name: str
    load: Callable[[], Any]
    runs_on: Callable[[torch.device], str | None]
    compiles: bool = False


@dataclass(frozen=True)
class Check:
    """What a probe found: ``error`` in the path's measure, and the largest it may be."""

    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance  # NaN fails


@dataclass(frozen=True)
class CheckedPath:
    """A kernel path: what it computes, its reference, its candidates and how they are checked.

    ``probe(impl, device, variant)`` runs the implementation ``impl`` and the reference on a small input of
    ``variant`` and returns a :class:`Check`; ``timer(impl, device, variant)`` returns seconds per call of
    ``impl`` (None: the reference) at a size where time means something; ``variants(device)`` lists the
    variants ``cast-llm doctor`` checks. ``in_situ``: checked by its integration on the real input.
    """

    name: str
    what: str
    reference: str
    measure: str
    candidates: tuple[Candidate, ...]
    probe: Callable[[Any, torch.device, tuple], Check] | None = None
    timer: Callable[[Any, torch.device, tuple], float] | None = None
    variants: Callable[[torch.device], list[tuple]] = lambda device: [()]
    in_situ: bool = False
    cuda_only: bool = True


REGISTRY: dict[str, CheckedPath] = {}


def register(path: CheckedPath) -> CheckedPath:
    REGISTRY[path.name] = path
    return path


# ------------------------------------------------------------------------------------------- the decisions
_CHOICES: dict[tuple, str] = {}  # (path, device, variant, allowed, mode) -> candidate name or REFERENCE
_TAKEN: dict[tuple, dict] = {}  # the same keys -> what results.json records
_WARNED: set[tuple] = set()
_IMPLS: dict[tuple[str, str], Any] = {}
_FILE: list[VerdictFile] = []


def _verdicts() -> VerdictFile:
    if not _FILE:
        _FILE.append(VerdictFile())
    return _FILE[0]


def reset() -> None:
    """Forget this process's decisions (the next use decides again, from the verdict file if it has them) and
    its ``set_mode`` (back to the default mode: the environment's, as the user set it)."""
    reset_mode()
    for d in (_CHOICES, _TAKEN, _IMPLS):
        d.clear()
    _WARNED.clear()
    _FILE.clear()


def implementation(name: str, candidate: str) -> Any:
    """The loaded implementation of ``candidate`` of path ``name``."""
    key = (name, candidate)
    if key not in _IMPLS:
        _IMPLS[key] = next(c for c in REGISTRY[name].candidates if c.name == candidate).load()
    return _IMPLS[key]


def describe_device(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(device.index or 0)})"
    return str(device)


def _variant_text(variant: tuple) -> str:
    return ", ".join(str(v).removeprefix("torch.") for v in variant) or "-"


def _cache_key(name: str, device: torch.device, variant: tuple) -> str:
    return f"{identity(device.type, device.index)} | {name} | {device} | {_variant_text(variant)}"


def _first_line(err: BaseException | str) -> str:
    text = err if isinstance(err, str) else f"{type(err).__name__}: {str(err).strip()}"
    return (text.strip().splitlines() or [""])[0][:200].rstrip(": ")


def choose(name: str, device: torch.device | str, variant: tuple = (), only: tuple[str, ...] | None = None) -> str:
    """The candidate to run for ``variant`` on ``device`` (see the module docstring), or :data:`REFERENCE`;
    ``only``: the candidates the caller allows (e.g. AdamS's ``fused=False``). The first call per key may probe
    (and print one line per failed candidate); later calls are a dictionary lookup."""
    if _RESTRICT:
        limit = _RESTRICT.get(name)
        if limit is not None:
            only = limit if only is None else tuple(c for c in only if c in limit)
    key = (name, device, variant, only, mode())
    hit = _CHOICES.get(key)
    if hit is not None:
        return hit
    return _decide(name, torch.device(device), variant, key, only)


_RESTRICT: dict[str, tuple[str, ...]] = {}


@contextlib.contextmanager
def restricted(name: str, candidates: tuple[str, ...]):
    """Inside, path ``name`` may only take ``candidates`` (checked as always; the reference otherwise) — how
    a benchmark times one candidate against another in one process."""
    before = _RESTRICT.get(name)
    _RESTRICT[name] = tuple(candidates)
    try:
        yield
    finally:
        if before is None:
            _RESTRICT.pop(name, None)
        else:
            _RESTRICT[name] = before


_PROBING: list[bool] = [False]


def probing() -> bool:
    """True while a probe or a timing runs (a test counting a kernel's calls leaves those out)."""
    return _PROBING[0]


def _usable(path: CheckedPath, device: torch.device, only=None) -> tuple[list[Candidate], dict[str, str]]:
    usable, why = [], {}
    for c in path.candidates:
        if only is not None and c.name not in only:
            continue
        reason = c.runs_on(device)
        if reason is None and c.compiles and not compile_enabled():
            reason = f"torch.compile candidates are off ({COMPILE_ENV}=0)"
        if reason is None:
            usable.append(c)
        else:
            why[c.name] = reason
    return usable, why


def _decide(name: str, device: torch.device, variant: tuple, key: tuple, only) -> str:
    path = REGISTRY[name]
    if mode() == "reference":
        return _settle(key, device, variant, REFERENCE, {}, why=f"{MODE_ENV}=reference (torch operations only)")
    usable, why = _usable(path, device, only)
    if not usable:
        return _settle(key, device, variant, REFERENCE, {}, why="; ".join(f"{k}: {v}" for k, v in why.items()))
    store = _verdicts()
    ckey = _cache_key(name, device, variant)
    results = dict((store.get(ckey) or {}).get("candidates", {}))
    fresh = [c for c in usable if c.name not in results and not path.in_situ]
    for c in fresh:
        results[c.name] = _probe(path, c, device, variant)
    entry = dict(store.get(ckey) or {})
    passing = [c for c in usable if results.get(c.name, {}).get("ok", path.in_situ)]
    if fresh and path.timer is not None and len([c for c in passing if c.name in results]) > 1:
        # several pass: the fastest of them runs (the reference is timed beside them for the record)
        for c in passing:
            results[c.name]["seconds"] = _time(path, c, device, variant)
        entry["reference_seconds"] = _time(path, None, device, variant)
    if fresh:
        entry.update(candidates=results, when=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        store.put(ckey, entry)
    timed = {c.name: results[c.name]["seconds"] for c in passing if results.get(c.name, {}).get("seconds") is not None}
    choice = min(timed, key=timed.get) if timed else (passing[0].name if passing else REFERENCE)
    for c in usable:
        r = results.get(c.name)
        if r is not None and not r.get("ok"):
            _warn(name, c.name, device, variant, r.get("error") or "failed", choice, cached=c not in fresh)
    return _settle(key, device, variant, choice, results)


@contextlib.contextmanager
def _checking():
    """A probe or a timing may wait for the device (it compares and times): flagged as such, and exempt from
    ``torch.cuda.set_sync_debug_mode`` — its syncs are the check's, once per process and variant, not the
    step's."""
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    _PROBING[0] = True
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        _PROBING[0] = False
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def _probe(path: CheckedPath, c: Candidate, device: torch.device, variant: tuple) -> dict:
    with _checking():
        return _probe_unchecked(path, c, device, variant)


def _probe_unchecked(path: CheckedPath, c: Candidate, device: torch.device, variant: tuple) -> dict:
    try:
        check = path.probe(implementation(path.name, c.name), device, variant)
    except Exception as e:  # noqa: BLE001 - a failed compile, a launch error, a wrong binding: all mean "not this"
        return {"ok": False, "error": _first_line(e)}
    if check.ok:
        return {"ok": True, "error": None, "max_error": check.error, "tolerance": check.tolerance}
    return {"ok": False, "max_error": None if math.isnan(check.error) else check.error, "tolerance": check.tolerance,
            "error": f"{path.measure} = {check.error:.3g} > {check.tolerance:.3g}"}


def _time(path: CheckedPath, c: Candidate | None, device: torch.device, variant: tuple) -> float | None:
    """Seconds per call of ``c`` (None: the reference) at the path's timing size; None if it cannot be timed."""
    with _checking():
        try:
            return path.timer(None if c is None else implementation(path.name, c.name), device, variant)
        except Exception:  # noqa: BLE001 - it passed its check: untimed, it is still a valid choice
            return None


def _settle(key: tuple, device: torch.device, variant: tuple, choice: str, results: dict, why: str | None = None
            ) -> str:
    _CHOICES[key] = choice
    failed = {k: v.get("error") for k, v in results.items() if not v.get("ok")}
    _TAKEN[key] = {"path": key[0], "device": str(device), "variant": _variant_text(variant), "took": choice,
                   **({"why_reference": why} if why else {}), **({"failed": failed} if failed else {})}
    return choice


def _warn(name: str, candidate: str, device: torch.device, variant: tuple, error: str, fallback: str, *,
          cached: bool) -> None:
    key = (name, candidate, device, variant)
    if key in _WARNED:
        return
    _WARNED.add(key)
    source = f"; the verdict is cached in {_verdicts().path}" if cached else ""
    print(f"cast-llm: kernel {name} [{candidate}] on {describe_device(device)} ({_variant_text(variant)}) failed its "
          f"check against {REGISTRY[name].reference}: {error}; using {fallback} for the rest of the run{source}",
          file=sys.stderr, flush=True)


def record(name: str, device: torch.device | str, variant: tuple, candidate: str, error: BaseException | str | None,
           check: Check | None = None, *, announce: bool = True) -> str:
    """An in-situ check's outcome, or a candidate that raised while running: kept like a probe's verdict.
    Returns what runs from now on for this key (the candidate if it passed, else the next one or REFERENCE).
    ``announce=False``: the caller prints the one line itself."""
    device = torch.device(device)
    path = REGISTRY[name]
    store = _verdicts()
    ckey = _cache_key(name, device, variant)
    results = dict((store.get(ckey) or {}).get("candidates", {}))
    if error is None and (check is None or check.ok):
        results[candidate] = {"ok": True, "error": None,
                              **({"max_error": check.error, "tolerance": check.tolerance} if check else {})}
    else:
        text = _first_line(error) if error is not None else f"{path.measure} = {check.error:.3g} > {check.tolerance:.3g}"
        results[candidate] = {"ok": False, "error": text}
    store.put(ckey, {"candidates": results, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    usable, _ = _usable(path, device)
    allowed = [c.name for c in usable if results.get(c.name, {}).get("ok", path.in_situ)]
    choice = candidate if candidate in allowed else (allowed[0] if allowed else REFERENCE)
    if not results[candidate]["ok"]:
        if announce:
            _warn(name, candidate, device, variant, results[candidate]["error"], choice, cached=False)
        else:
            _WARNED.add((name, candidate, device, variant))
        for key in [k for k in _CHOICES if k[:3] == (name, device, variant) and _CHOICES[k] == candidate]:
            _CHOICES[key] = choice if key[3] is None or choice in key[3] else REFERENCE
    return _settle((name, device, variant, None, mode()), device, variant, choice, results)


def examine(name: str, device: torch.device | str, variant: tuple, *, recheck: bool = False) -> list[dict]:
    """Every candidate of ``name`` on ``device`` for ``variant`` — ``cast-llm doctor``'s rows: whether it runs
    here, its verdict (from the verdict file unless ``recheck``; probed otherwise, the in-situ paths too) and,
    where it passed, its time paired with the reference's at the path's timing size."""
    device = torch.device(device)
    path = REGISTRY[name]
    store = _verdicts()
    ckey = _cache_key(name, device, variant)
    entry = {} if recheck else dict(store.get(ckey) or {})
    results = dict(entry.get("candidates", {}))
    rows, fresh = [], False
    for c in path.candidates:
        row = {"path": name, "device": str(device), "variant": _variant_text(variant), "candidate": c.name}
        reason = c.runs_on(device)
        if reason is None and c.compiles and not compile_enabled():
            reason = f"off ({COMPILE_ENV}=0)"
        if reason is not None:
            rows.append({**row, "verdict": "not here", "why": reason})
            continue
        r = results.get(c.name)
        if r is None or (r.get("ok") and r.get("max_error") is None and path.probe is not None):
            r = results[c.name] = _probe(path, c, device, variant) if path.probe else {"ok": True, "error": None}
            fresh = True
        if r.get("ok") and r.get("seconds") is None and path.timer is not None:
            r["seconds"] = _time(path, c, device, variant)
            fresh = True
        rows.append({**row, "verdict": "pass" if r.get("ok") else "fail", **{k: r.get(k) for k in
                     ("error", "max_error", "tolerance", "seconds")}})
    if any(row.get("seconds") is not None for row in rows) and entry.get("reference_seconds") is None:
        entry["reference_seconds"] = _time(path, None, device, variant)
        fresh = True
    if fresh:
        entry.update(candidates=results, when=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        store.put(ckey, entry)
    for row in rows:
        if row.get("seconds") is not None:
            row["reference_seconds"] = entry.get("reference_seconds")
    return rows


def why_not(name: str, device: torch.device | str, variant: tuple = ()) -> str:
    """Why ``name`` runs no fast candidate for this key (after :func:`choose`), in a few words."""
    for key, entry in _TAKEN.items():
        if key[:3] == (name, device, variant) or key[:3] == (name, torch.device(device), variant):
            if entry.get("why_reference"):
                return entry["why_reference"]
            if entry.get("failed"):
                return "; ".join(f"{k} failed its check: {v}" for k, v in entry["failed"].items())
            return f"it runs {entry['took']}"
    return "not decided yet"


def taken() -> dict[str, Any]:
    """For ``results.json``: the mode, and per kernel path what ran on which device and variant (and why the
    reference, where it did)."""
    by_path: dict[str, list[dict]] = {}
    for entry in _TAKEN.values():
        by_path.setdefault(entry["path"], []).append({k: v for k, v in entry.items() if k != "path"})
    return {"mode": mode(), "verdicts": str(_verdicts().path), "paths": by_path}


def seconds_per_call(fn: Callable[[], object], device: torch.device, *, min_time: float = 0.01,
                     repeats: int = 5) -> float:
    """Median seconds per call of ``fn()`` (synchronised on CUDA), each repeat lasting at least ``min_time``."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, min(1000, int(min_time / once)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)
