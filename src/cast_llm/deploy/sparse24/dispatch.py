"""Per-shape dispatch: a layer runs its 2:4 GEMM only where that measures faster than dense.

A 2:4 GEMM halves the weight bytes and the tensor-core work, but at a few tokens it can still lose to dense
(padding to a row block, a less tuned kernel, host cost per call). So for every
``(GPU, library versions, mode, dtype, out, in, token bucket)`` the :class:`Dispatcher` times the candidates
once — ``dense`` (``F.linear``) and each available 2:4 kernel, on random weights of that shape (values do not
change kernel speed) — and remembers the winner:

* **token bucket** — the power of two at or above the token count (rows of the flattened input), capped at
  :data:`MAX_BUCKET`; the decision measured at the bucket applies to every count in ``(bucket/2, bucket]``;
* **mode** — ``eager`` (host time counts: timed as back-to-back calls) or ``graph`` (inside a CUDA graph only
  the GPU time counts: timed by replaying a captured graph). A kernel with a high per-call host cost (torch's
  ``_cslt_sparse_mm`` builds a plan per call) can lose in eager mode and win in a graph;
* **rule** — the fastest sparse kernel that is at least ``min_speedup`` × faster than dense (1.02 on a GPU, 1.10
  on a CPU, whose timings are noisier) wins, else the layer runs dense (:func:`choose_kernel`). On a CPU the
  candidates are timed in interleaved rounds, and "faster" is paired: the median of the per-round ratios above the
  margin, and the kernel faster than dense in all rounds but one in five (:func:`beats_dense`), so a margin that
  lucky rounds carry while the kernel lost two rounds of five does not put a layer on it; and a kernel ahead of
  dense among many candidates is timed again against dense alone (:meth:`Dispatcher.decide`). A candidate that
  failed or gave wrong results is timed ``inf``.

Decisions live in memory and, with ``cache_path``, in a small JSON file (``{"written_by": CACHE_MARKER,
"format": 1, "entries": {key: decision}}``). A file that exists without that marker is never read as a cache
nor overwritten. The timing itself is injected (``measure``), so all of this is tested on CPU with a fake
timer; the real one is :func:`cast_llm.deploy.sparse24.timing.measure_gemms` (on a CPU the candidates of one key
timed interleaved, a paired comparison).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24 import timing
from cast_llm.deploy.sparse24.buckets import MAX_BUCKET, token_bucket
from cast_llm.errors import CastError
from cast_llm.io import atomic_write_json
from cast_llm.machine import cpu_model

__all__ = ["CACHE_MARKER", "MAX_BUCKET", "MODES", "Decision", "Dispatcher", "choose_kernel", "dense_beaters",
           "token_bucket"]

CACHE_MARKER = "cast-llm sparse24 dispatch"
CACHE_FORMAT = 1
MODES = ("eager", "graph")
DENSE = "dense"
# the dense weight held by a layer, multiplied by the CPU extension's careful dense GEMM (cpu.dense_mm) instead of
# torch's F.linear: a candidate where a layer holds its dense copy on a CPU (bf16); like a 2:4 kernel it must beat
# F.linear by the margin to be chosen. Measured: on an AVX2-only CPU it beats both torch and the 2:4 kernel from 4
# tokens (docs/results/cpu24-notes.md §7)
DENSE_CAREFUL = "dense-careful"
DENSE_FORMS = (DENSE, DENSE_CAREFUL)  # the candidates that run the held dense weight
CPU_MIN_SPEEDUP = 1.10  # a 2:4 kernel on a CPU must measure 10 % faster than dense to be chosen over it
CPU_RULE = "paired rule, head to head"  # part of a CPU decision's key (default_identity): the rule it was made by

# measure(kernel, out_features, in_features, dtype, tokens, mode) -> (seconds per call, note or None)
Measure = Callable[[str, int, int, torch.dtype, int, str], tuple[float, "str | None"]]


def wins_needed(rounds: int) -> int:
    """Rounds of ``rounds`` paired ones a candidate must win against dense: all but one in five (5 of 5 rounds
    lost by at most one: 4; 3 of 3; 8 of 10). A sign test at 5 % would need all 5 of 5, and on a VM whose memory
    moves ±30 % within a second one outlier round then refused kernels 1.23-1.37× faster by the median in 3 of 36
    fresh timings of TinyLlama's shapes, the same key choosing differently between timings (cpu24-notes.md §52);
    two lost rounds of five, with the median margin still met, is what this rule refuses."""
    return rounds - rounds // 5


def paired_ratios(rounds: dict[str, list[float]] | None, kernel: str) -> list[float] | None:
    """Dense's seconds over ``kernel``'s in each paired round (> 1: the kernel was faster in that round), None
    where the two were not timed in the same rounds."""
    if not rounds or not rounds.get(DENSE) or not rounds.get(kernel) or len(rounds[DENSE]) != len(rounds[kernel]):
        return None
    return [d / k if k > 0 else math.inf for d, k in zip(rounds[DENSE], rounds[kernel])]


def beats_dense(kernel: str, seconds: dict[str, float], min_speedup: float,
                rounds: dict[str, list[float]] | None = None) -> bool:
    """Whether ``kernel`` is clearly faster than ``dense``. Timed in paired rounds (``rounds``, the CPU's
    interleaved timing): the median of the paired ratios above ``min_speedup`` **and** faster in
    :func:`wins_needed` of the rounds (all but one in five), so a median margin that lucky rounds carry while two
    of five are lost does not count. Otherwise: its median seconds × ``min_speedup`` below dense's."""
    ratios = paired_ratios(rounds, kernel)
    if ratios is None:
        return seconds.get(kernel, math.inf) * min_speedup < seconds.get(DENSE, math.inf)
    return (statistics.median(ratios) > min_speedup
            and sum(r > 1 for r in ratios) >= wins_needed(len(ratios)))


def dense_beaters(seconds: dict[str, float], candidates: Sequence[str], min_speedup: float,
                  rounds: dict[str, list[float]] | None = None) -> list[str]:
    """The sparse candidates that beat ``dense`` clearly (:func:`beats_dense`; all of them where dense is not a
    candidate), fastest by median first (ties in candidate order)."""
    sparse = [c for c in candidates if c != DENSE]
    if DENSE in candidates:
        sparse = [c for c in sparse if beats_dense(c, seconds, min_speedup, rounds)]
    return sorted(sparse, key=lambda c: seconds.get(c, math.inf))


def choose_kernel(seconds: dict[str, float], candidates: Sequence[str], min_speedup: float = 1.02,
                  rounds: dict[str, list[float]] | None = None) -> str:
    """The kernel to run: the first of :func:`dense_beaters`, else ``dense``."""
    best = dense_beaters(seconds, candidates, min_speedup, rounds)
    if best:
        return best[0]
    if DENSE in candidates:
        return DENSE
    raise ValueError("no candidate kernel to choose from")


@dataclass
class Decision:
    kernel: str
    seconds: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    # seconds per call of each candidate in each paired round (the CPU's interleaved timing; absent elsewhere)
    rounds: dict[str, list[float]] = field(default_factory=dict)
    # {kernel: {"dense": rounds, kernel: rounds}}: a kernel that beat dense among many candidates, timed again
    # against dense alone (Dispatcher.decide)
    head_to_head: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def to_json(self) -> dict:
        def rounds(r: dict[str, list[float]]) -> dict:  # inf (a failed call) as null, as in "seconds"
            return {k: [None if math.isinf(x) else x for x in v] for k, v in r.items()}

        out = {"kernel": self.kernel,
               "seconds": {k: (None if math.isinf(v) else v) for k, v in self.seconds.items()}, "notes": self.notes}
        if self.rounds:
            out["rounds"] = rounds(self.rounds)
        if self.head_to_head:
            out["head_to_head"] = {k: rounds(v) for k, v in self.head_to_head.items()}
        return out

    @classmethod
    def from_json(cls, d: dict) -> Decision:
        def rounds(r: dict) -> dict[str, list[float]]:
            return {k: [math.inf if x is None else float(x) for x in v] for k, v in r.items()}

        return cls(d["kernel"], {k: (math.inf if v is None else float(v)) for k, v in d["seconds"].items()},
                   dict(d.get("notes", {})), rounds(d.get("rounds", {})),
                   {k: rounds(v) for k, v in d.get("head_to_head", {}).items()})


def default_identity(device: torch.device) -> tuple[str, str]:
    """(GPU name, library versions) that key the decisions: a new GPU, torch or cuSPARSELt re-measures."""
    device = torch.device(device)
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        # a CPU's choice depends on its model and on the threads torch runs (bandwidth per core, GEMM speed)
        # (CPU_RULE: decisions made by an earlier rule, e.g. before rounds were kept, are measured again)
        return (f"cpu {cpu_model()} x{torch.get_num_threads()} threads",
                f"torch {torch.__version__}, {cpu24.build_key()}, {CPU_RULE}")
    cslt = torch.backends.cusparselt.version() if torch.backends.cusparselt.is_available() else None
    return gpu, f"torch {torch.__version__}, cuSPARSELt {cslt}"


class Dispatcher:
    """Measured, cached choice of kernel per (shape, dtype, token bucket, mode); see the module docstring."""

    def __init__(self, measure: Measure | None = None, *, device: torch.device | str | None = None,
                 cache_path: str | Path | None = None, gpu: str | None = None, versions: str | None = None,
                 min_speedup: float | None = None):
        if min_speedup is None:
            # a CPU's timings move by ±15 % between runs minutes apart (docs/results/cpu24-notes.md): a 2 % margin
            # there picks the 2:4 kernel on noise where the whole model then runs slower (measured: SmolLM2's
            # down_proj at 128 tokens, prefill 0.76x)
            dev = torch.device(device) if device is not None else None
            min_speedup = CPU_MIN_SPEEDUP if (dev is not None and dev.type == "cpu") or (
                dev is None and not torch.cuda.is_available()) else 1.02
        if min_speedup < 1.0:
            raise ValueError(f"min_speedup must be >= 1 (a sparse kernel must not be slower), got {min_speedup}")
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        ident = default_identity(self.device) if gpu is None or versions is None else (gpu, versions)
        self.gpu = gpu if gpu is not None else ident[0]
        self.versions = versions if versions is not None else ident[1]
        self.min_speedup = min_speedup
        self._measure = measure
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.decisions: dict[str, Decision] = {}
        self.measured: list[str] = []  # keys measured by this process, in order (for reports)
        self._dirty = False
        if self.cache_path is not None:
            self.decisions.update(_read_cache(self.cache_path))

    def key(self, out_features: int, in_features: int, dtype: torch.dtype, bucket: int, mode: str) -> str:
        return (f"{self.gpu} | {self.versions} | {mode} | {str(dtype).removeprefix('torch.')} | "
                f"{out_features}x{in_features} | tokens<={bucket}")

    def measure(self, kernel, out_features, in_features, dtype, tokens, mode) -> tuple[float, str | None]:
        if self._measure is None:
            return timing.measure_gemm(kernel, out_features, in_features, dtype, tokens, mode, self.device)
        return self._measure(kernel, out_features, in_features, dtype, tokens, mode)[:2]

    def measure_all(self, kernels, out_features, in_features, dtype, tokens,
                    mode) -> dict[str, tuple[float, str | None, list[float] | None]]:
        """Every candidate of ``kernels`` measured, as ``(seconds, note, rounds)``: the real timer takes them
        together (on a CPU interleaved, a paired comparison whose ``rounds`` are each round's seconds per call:
        :func:`~cast_llm.deploy.sparse24.timing.measure_gemms_rounds`), an injected one by one (it may return
        ``(seconds, note)`` or ``(seconds, note, rounds)``)."""
        if not kernels:
            return {}
        if self._measure is None:
            return timing.measure_gemms_rounds(kernels, out_features, in_features, dtype, tokens, mode, self.device)
        out = {}
        for k in kernels:
            sec, note, *rounds = self._measure(k, out_features, in_features, dtype, tokens, mode)
            out[k] = (sec, note, rounds[0] if rounds else None)
        return out

    def decide(self, out_features: int, in_features: int, dtype: torch.dtype, tokens: int, mode: str,
               candidates: Sequence[str]) -> Decision:
        """The decision for ``tokens`` rows in ``mode`` among ``candidates`` (``"dense"`` and kernel names),
        measuring the candidates this key has no time for yet (all of them again where the others' times are
        paired rounds, so that every pair the rule compares comes from the same rounds).

        Where paired rounds of more than two candidates put a kernel ahead of dense, that kernel and dense are
        timed again **head to head** and the rule applied to those rounds: on a CPU torch's GEMM read 8-30 %
        slower with nine other candidates' rounds between its own than beside one (the kernel's time unchanged;
        cpu24-notes.md §53), a bias toward the 2:4 kernels about the size of the margin. Failing that, the next
        kernel that beat dense among many is tried the same way, else dense."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        bucket = token_bucket(tokens)
        key = self.key(out_features, in_features, dtype, bucket, mode)
        found = self.decisions.get(key)
        seconds = dict(found.seconds) if found else {}
        notes = dict(found.notes) if found else {}
        rounds = dict(found.rounds) if found else {}
        head = dict(found.head_to_head) if found else {}
        missing = [c for c in candidates if c not in seconds]
        # paired rounds compare only candidates timed together: a new candidate beside ones timed in rounds times
        # them all again (rare: a kernel that became available after the key was decided)
        timed = missing
        if missing and rounds:
            timed, rounds, head = list(candidates), {}, {}
        for c, (sec, note, per_round) in self.measure_all(timed, out_features, in_features, dtype, bucket,
                                                          mode).items():
            seconds[c] = sec
            notes.pop(c, None)
            if note:
                notes[c] = note
            rounds.pop(c, None)
            if per_round:
                rounds[c] = list(per_round)
        measured_head = False

        def head_to_head(kernel: str) -> dict[str, list[float]] | None:
            nonlocal measured_head
            if kernel not in head:
                got = self.measure_all([DENSE, kernel], out_features, in_features, dtype, bucket, mode)
                if math.isinf(got[kernel][0]):  # it failed this time (its check, or a crash): never chosen
                    notes[kernel] = got[kernel][1] or "failed when timed against dense alone"
                    head[kernel] = {DENSE: [1.0], kernel: [math.inf]}
                elif not (got[DENSE][2] and got[kernel][2]):
                    return None
                else:
                    head[kernel] = {DENSE: list(got[DENSE][2]), kernel: list(got[kernel][2])}
                measured_head = True
            return head[kernel]

        kernel = self._rule(seconds, candidates, rounds, head_to_head)
        decision = Decision(kernel, seconds, notes, rounds, head)
        if missing or measured_head or found is None or found.kernel != kernel:
            self.decisions[key] = decision
            self._dirty = True
            if missing:
                self.measured.append(key)
        return decision

    def _rule(self, seconds, candidates, rounds, head_to_head) -> str:
        """:func:`choose_kernel` on the rounds of all candidates (its :func:`dense_beaters`), then, where more than
        two were timed together, each kernel that beat dense there (fastest first) against dense alone
        (``head_to_head(kernel)``: the pair's rounds), the first that beats dense in those too; dense where none
        does."""
        winners = dense_beaters(seconds, candidates, self.min_speedup, rounds)
        if not winners:
            return choose_kernel(seconds, candidates, self.min_speedup, rounds)  # dense (or no candidate: raises)
        if DENSE not in candidates or winners[0] not in rounds or len(rounds) <= 2:
            return winners[0]
        for c in winners:
            pair = head_to_head(c)
            if pair is None:  # not timed in rounds: the many-candidate rule stands
                return winners[0]
            if beats_dense(c, {k: statistics.median(v) for k, v in pair.items()}, self.min_speedup, pair):
                return c
        return DENSE

    def save(self) -> Path | None:
        """Write the decisions to ``cache_path`` (merged with what is there), if any were made."""
        if self.cache_path is None or not self._dirty:
            return None
        merged = _read_cache(self.cache_path)
        merged.update(self.decisions)
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.cache_path, {
            "written_by": CACHE_MARKER, "format": CACHE_FORMAT,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "entries": {k: d.to_json() for k, d in sorted(merged.items())},
        })
        self._dirty = False
        return self.cache_path


def _read_cache(path: Path) -> dict[str, Decision]:
    import json

    if not path.exists():
        return {}
    refuse = (f"{path} exists but was not written by cast-llm's 2:4 dispatch (no \"written_by\": "
              f"\"{CACHE_MARKER}\"); it is neither read nor overwritten — point the dispatch cache at a new file")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        raise CastError(refuse) from None
    if not isinstance(data, dict) or data.get("written_by") != CACHE_MARKER:
        raise CastError(refuse)
    if data.get("format") != CACHE_FORMAT:
        raise CastError(f"{path} is a 2:4 dispatch cache of format {data.get('format')!r}, this version reads "
                        f"format {CACHE_FORMAT}; delete it (it only holds timings) and run again")
    try:
        return {k: Decision.from_json(v) for k, v in data.get("entries", {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CastError(f"{path}: a damaged 2:4 dispatch cache ({e}); delete it and run again") from None
