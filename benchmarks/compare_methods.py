"""Every way to get a 2:4 model, on one model at equal compute (method.md §6, §8; the paper's Tables 5/6).

Runs dense, the one-shot baselines (magnitude, Wanda, SparseGPT: ``cast-llm prune``), and the training
methods (naive retraining, SR-STE, AST, CAST; optionally CAST's ablations and MaskLLM: ``cast-llm train``)
with the same model, data, sequence length and evaluation, and writes
``docs/results/compare-<model>-<budget>.md`` (table, tokens, wall time, the command of every run, whether
the paper's ordering holds) plus a bar chart ``compare-<model>-<budget>.png``.

**Equal compute** (method.md §4): distillation costs ~4/3 of plain training, so runs with a teacher get 3/4
of the ``--tokens`` budget of runs without one. **Evaluation**: the trainer's own held-out slice and
WikiText-2 windows (``cast_llm.train.trainer.Evaluator``) for every row, so all rows are comparable.

Tiers::

    python benchmarks/compare_methods.py --tier quick     # tiny random LLaMA, seconds (run by the tests)
    python benchmarks/compare_methods.py --tier cpu       # SmolLM2-135M, small budget, ~1 h on 2 cores
    python benchmarks/compare_methods.py --tier gpu --data big.jsonl   # --device cuda, bf16, 40M tokens

Finished runs are reused when the script is started again (``--fresh`` redoes them); a training run that was
stopped (Ctrl-C, SIGTERM, a crash after a checkpoint) resumes from its newest checkpoint (``--resume auto``;
``--save-every`` sets how often they are written); a failed run is reported in the table and does not stop
the others. ``--seeds 0,1`` runs the rows marked seeded (CAST, naive retraining and its SparseGPT start) once
per seed and reports the mean and the range; the report keeps every seed that finished (also of rows run with
fewer seeds) and says how many each row has. ``--jobs 2`` runs a tuning stage's grid points and a row's seeds two
at a time (each its own process at ``--threads``). An invocation whose rows did not all finish (a run stopped or
failed, a grid point stopped: nothing is chosen then) exits 3; the same command resumes it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_report import (  # noqa: E402
    ORDER_CHECK,
    RERUN_REL,
    portable,
    register_runs_folder,
    wikitext2_description,
    write_chart,
    write_json,
    write_report,
)

from cast_llm.config import load_yaml  # noqa: E402
from cast_llm.io import RunDir, atomic_write_json  # noqa: E402
from cast_llm.train.summary import mask_movement  # noqa: E402

# Tier defaults; every key is a `cast-llm train` option (the one-shot runs use model/data/seq_len/calib), except
# "adams" (lr/λ overrides for every row whose pruned weights AdamS decays) and "row_lr" (a row's own settings:
# the best of the lrs measured for it, docs/results/compare-smollm2-135m-cpu-notes.md). Every row states its lr.
TIERS: dict[str, dict] = {
    # a tiny random LLaMA built locally; seconds in all, so that the test suite runs it (no HTML report per row)
    "quick": dict(tokens=256, seq_len=32, batch_size=2, grad_accum=1, lr=3e-3, l1_decay=1e-4, eta=1 / 3,
                  log_every=2, mask_interval=2, val_sequences=1, test_sequences=2, wikitext_windows=1, eval_seq_len=32,
                  calib_samples=4, device="cpu", precision="fp32", report=False, adams={}),
    # SmolLM2-135M on the embedded corpus (100-150 training tok/s on 2 idle cores). Short sequences (128) buy
    # more optimizer steps for the same tokens: 94 steps without KD, 71 with at 48k. Evaluation: 64 held-out
    # sequences, 64 WikiText-2 windows of 512. lr: 5e-4 for the runs that start from the one-shot magnitude
    # model (it needs large steps to repair) and for paper-exact CAST (its decay needs travel); 1e-4 for the
    # runs that start from SparseGPT (near a good model: 5e-4 lost ground, measured) — CAST's AdamS builds its
    # second moment from the momentum, so noise moves every weight ~lr per step and 5e-4 damages a warm start.
    "cpu": dict(model="smollm2-135m", data="wiki-summaries", tokens=48_000, seq_len=128, batch_size=4,
                grad_accum=1, lr=5e-4, l1_decay=1e-4, eta=0.5, lr_schedule="cosine", log_every=10,
                mask_interval=10, val_sequences=64, test_sequences=64, wikitext_windows=64, eval_seq_len=512, calib_samples=128,
                device="cpu", precision="fp32", adams={},
                row_lr={"naive-sgpt": {"lr": 1e-4}, "cast-best": {"lr": 1e-4}, "naive-kd-sgpt": {"lr": 1e-4},
                        "naive-kd-scaling-sgpt": {"lr": 1e-4}, "cast-best-no-scaling": {"lr": 1e-4},
                        "cast-best-no-kd": {"lr": 1e-4}, "cast-best-no-repair": {"lr": 1e-4}, "cast-best-no-decay": {"lr": 1e-4, "l1_decay": 0.0}, "cast-best-adamw": {"lr": 1e-4, "l1_decay": 0.0}, "cast-mix25": {"lr": 1e-4}, "cast-mix50": {"lr": 1e-4},
                        "cast-mix100": {"lr": 1e-4}, "cast-regrow10": {"lr": 1e-4},
                        "cast-regrow30": {"lr": 1e-4}, "ast-lr1e-4": {"lr": 1e-4}, "ast-lr1e-3": {"lr": 1e-3}}),
    # one GPU, bf16 autocast: tens of millions of tokens (bring a corpus larger than the budget via --data).
    # 8k-token steps (4 × 2048): 4,883 steps without KD, 3,662 with, so that AdamS's lr·T/2 ≈ 0.18 at lr 1e-4
    # covers the typical |pruned w| (SmolLM2-135M: median 0.060, p90 0.16). Not yet run.
    "gpu": dict(model="smollm2-135m", data="wiki-summaries", tokens=40_000_000, seq_len=2048, batch_size=4,
                grad_accum=1, lr=1e-4, l1_decay=2e-5, eta=0.5, lr_schedule="cosine", log_every=10,
                mask_interval=10, val_sequences=64, test_sequences=64, wikitext_windows=0, eval_seq_len=2048, calib_samples=128,
                device="cuda", precision="bf16", adams={}),
}
SHARED_KEYS = ("model", "data", "seq_len", "seed")  # what the one-shot runs share with the training runs


@dataclass
class Entry:
    """One row: ``kind`` dense / oneshot / train; ``args`` extra `cast-llm train` (or prune) flags."""

    key: str
    label: str
    kind: str
    args: list[str] = field(default_factory=list)
    kd: bool = False
    adams: bool = False  # AdamS decays the pruned weights: the tier's "adams" hyperparameters apply
    weight_update: str = "—"
    mask: str = "—"
    seeded: bool = False  # run once per --seeds value (mean and range in the table)


# CAST's best configuration for short budgets (docs/results/compare-smollm2-135m-cpu-notes.md says how it was
# chosen): the same flags are `cast-llm train`'s defaults, so `--method cast` alone gives it; they are spelled
# out here so that the table's command says what the row is.
CAST_BEST = ["--warm-start", "--init-mask", "sparsegpt", "--repair-fraction", "0.2", "--final-prune", "hard"]

CORE = [
    Entry("dense", "Dense", "dense"),
    Entry("magnitude", "Magnitude", "oneshot", ["--method", "magnitude"], mask="one-shot"),
    # calibrated one-shot methods draw their calibration samples with the seed: seeded like the training rows
    Entry("wanda", "Wanda", "oneshot", ["--method", "wanda"], mask="one-shot", seeded=True),
    Entry("sparsegpt", "SparseGPT", "oneshot", ["--method", "sparsegpt"], weight_update="OBS", mask="one-shot",
          seeded=True),
    Entry("naive", "Naive retraining", "train", ["--method", "naive"], weight_update="AdamW", mask="fixed",
          seeded=True),
    Entry("naive-sgpt", "Naive retraining from SparseGPT", "train", ["--method", "naive", "--init-mask", "sparsegpt"],
          weight_update="AdamW", mask="fixed (SparseGPT)", seeded=True),
    # the recipe of the public 2:4 models, and what the default CAST configuration is held against seed by seed
    Entry("naive-kd-sgpt", "SparseGPT + KD (fixed mask)", "train",
          ["--method", "naive", "--kd", "--init-mask", "sparsegpt"], kd=True, weight_update="AdamW",
          mask="fixed (SparseGPT)", seeded=True),
    Entry("srste", "SR-STE", "train", ["--method", "srste"], weight_update="AdamW + STE", mask="learned"),
    Entry("ast", "AST", "train", ["--method", "ast"], kd=True, weight_update="AdamS-additive + STE",
          mask="learned", seeded=True),
    Entry("cast", "CAST (paper-exact)", "train", ["--method", "cast", "--paper-exact"], kd=True, adams=True,
          weight_update="AdamS", mask="learned", seeded=True),
    Entry("cast-best", "CAST (default: warm start from SparseGPT)", "train", ["--method", "cast", *CAST_BEST],
          kd=True, adams=True, weight_update="AdamS", mask="Eq. 6 every T1 (SparseGPT start)", seeded=True),
]
# SR-STE's λ_W was tuned for SGD; under AdamW its effect scales with λ_W·|w| / |g| (method.md §6): swept
SRSTE_SWEEP = [Entry(f"srste-{lw}", f"SR-STE, λ_W {lw}", "train", ["--method", "srste", "--srste-decay", lw],
                     weight_update="AdamW + STE", mask="learned") for lw in ("2e-3", "2e-2")]
MASKLLM = [Entry("maskllm", "MaskLLM", "train", ["--method", "maskllm"], weight_update="frozen (logits 10× lr)",
                 mask="learned", seeded=True)]
# The paper's other mask learners, each at its own lr (the issue: "each at its own tuned learning rate"): AST's
# weight lr, and MaskLLM's logit lr (its weights are frozen) around the tier's
LR_SWEEPS = [Entry(f"ast-lr{lr}", f"AST, lr {lr}", "train", ["--method", "ast"], kd=True,
                   weight_update="AdamS-additive + STE", mask="learned", seeded=True) for lr in ("1e-4", "1e-3")] + [
    Entry(f"maskllm-lr{lr}", f"MaskLLM, logit lr {lr}", "train", ["--method", "maskllm", "--maskllm-lr", lr],
          weight_update="frozen", mask="learned", seeded=True) for lr in ("5e-4", "5e-2")]
# The ablation rows mean what the paper's Table 6 means (method.md §6); CAST's own switches on paper-exact CAST.
# The paper's Table 6 on the paper's algorithm: paper-exact CAST (dense start, hard final prune) with one part
# changed. Seeded: a paper-exact run is chaotic (a last-bit change moved a 48k seed's test ppl by 50 %, the
# notes), so a row is read from 3 seeds against paper-exact CAST's.
ABLATIONS = [
    Entry("naive-kd", "Naive + KD", "train", ["--method", "naive", "--kd"], kd=True, weight_update="AdamW",
          mask="fixed", seeded=True),
    Entry("naive-kd-adams", "Naive + KD + AdamS (= CAST w/o scaling)", "train",
          ["--method", "cast", "--paper-exact", "--no-scaling"], kd=True, adams=True, weight_update="AdamS",
          mask="learned", seeded=True),
    Entry("cast-fixed-mask", "CAST, fixed mask (= naive + KD + scaling)", "train",
          ["--method", "naive", "--kd", "--scaling"], kd=True, weight_update="AdamW", mask="fixed", seeded=True),
    Entry("cast-no-kd", "CAST w/o KD", "train", ["--method", "cast", "--paper-exact", "--no-kd"], adams=True,
          weight_update="AdamS", mask="learned", seeded=True),
    Entry("cast-srste", "CAST, SR-STE instead of AdamS", "train",
          ["--method", "cast", "--paper-exact", "--mask-learner", "srste"], kd=True, weight_update="AdamW + STE",
          mask="learned", seeded=True),
    Entry("cast-additive", "CAST, additive decay (AST's) instead of proportional", "train",
          ["--method", "cast", "--paper-exact", "--decay-mode", "additive"], kd=True, adams=True,
          weight_update="AdamS (additive decay)", mask="learned", seeded=True),
    # ours, not rows of the paper: AdamS's decay under a mask that never changes — Eq. 6's, and SparseGPT's
    # (only its mask: the run starts from the dense weights, as paper-exact CAST does)
    Entry("cast-adams-fixed", "CAST, AdamS decay under a fixed mask (ours)", "train",
          ["--method", "cast", "--paper-exact", "--fixed-mask"], kd=True, adams=True, weight_update="AdamS",
          mask="fixed", seeded=True),
    Entry("cast-sgpt-fixed", "CAST, AdamS decay under SparseGPT's fixed mask, dense start (ours)", "train",
          ["--method", "cast", "--no-warm-start", "--repair-fraction", "0", "--final-prune", "hard",
           "--init-mask", "sparsegpt", "--fixed-mask"], kd=True, adams=True, weight_update="AdamS",
          mask="fixed (SparseGPT)", seeded=True),
]
# What each part of CAST's default buys (issue: Table-6 ablations under the final protocol): the default
# configuration with one component taken out, and the strongest cheap recipe it must beat.
DEFAULT_ABLATIONS = [
    Entry("naive-kd-scaling-sgpt", "Naive + KD + scaling from SparseGPT (= default w/o AdamS decay, mask updates)",
          "train", ["--method", "naive", "--kd", "--scaling", "--init-mask", "sparsegpt"], kd=True,
          weight_update="AdamW", mask="fixed (SparseGPT)", seeded=True),
    Entry("cast-best-no-scaling", "CAST default w/o weight scaling", "train",
          ["--method", "cast", *CAST_BEST, "--no-scaling"], kd=True, adams=True, weight_update="AdamS",
          mask="Eq. 6 every T1 (SparseGPT start)", seeded=True),
    # the default without its masked repair: AdamS on the dense forward to the end, then the hard final prune
    Entry("cast-best-no-repair", "CAST default w/o the masked repair (hard prune at the end)", "train",
          ["--method", "cast", "--warm-start", "--init-mask", "sparsegpt", "--repair-fraction", "0",
           "--final-prune", "hard"], kd=True, adams=True, weight_update="AdamS", mask="Eq. 6 every T1 (SparseGPT start)",
          seeded=True),
    Entry("cast-best-no-kd", "CAST default w/o KD", "train", ["--method", "cast", *CAST_BEST, "--no-kd"],
          adams=True, weight_update="AdamS", mask="Eq. 6 every T1 (SparseGPT start)", seeded=True),
    # the default's own optimizer and dense forward, with AdamS's decay (λ = 0) and mask updates taken out
    Entry("cast-best-no-decay", "CAST default w/o AdamS decay and mask updates (λ 0, fixed mask)", "train",
          ["--method", "cast", *CAST_BEST, "--fixed-mask"], kd=True, adams=True, weight_update="AdamS (λ 0)",
          mask="fixed (SparseGPT)", seeded=True),
    # the default with AdamW in place of AdamS on the dense forward (no decay, v from g², the same fixed mask and
    # masked repair): issue 50's ablation of AdamS itself, beside the λ = 0 row (which is still AdamS's update)
    Entry("cast-best-adamw", "CAST default with AdamW on the dense forward (no decay, fixed mask)", "train",
          ["--method", "cast", *CAST_BEST, "--fixed-mask", "--sparse-update", "adam"], kd=True, adams=True,
          weight_update="AdamW", mask="fixed (SparseGPT)", seeded=True),
    # the default without its warm start's weights: SparseGPT's mask only, the dense weights under it (issue 50)
    Entry("cast-best-dense-start", "CAST default w/o the warm start's weights (SparseGPT mask, dense weights)",
          "train", ["--method", "cast", "--no-warm-start", "--init-mask", "sparsegpt", "--repair-fraction", "0.2",
                    "--final-prune", "hard"], kd=True, adams=True, weight_update="AdamS",
          mask="Eq. 6 every T1 (SparseGPT mask, dense start)", seeded=True),
]
# Candidates for learned masks that beat the best fixed mask (the default's masks never move: its warm start
# leaves the pruned weights at exactly 0, too far below the kept ones to win a place at lr 1e-4):
MASK_CANDIDATES = [
    Entry(f"cast-mix{int(100 * f)}", f"CAST, warm start mixed {f:g}·dense (pruned entries start at {f:g}·dense)",
          "train", ["--method", "cast", *CAST_BEST, "--warm-start-mix", f"{f:g}"], kd=True, adams=True,
          weight_update="AdamS", mask=f"Eq. 6 every T1 (SparseGPT mask, {f:g}·dense start)", seeded=True)
    for f in (0.25, 0.5, 1.0)
] + [
    Entry(f"cast-regrow{k}", f"CAST, regrow ×{k} for the first half", "train",
          ["--method", "cast", *CAST_BEST, "--regrow-factor", str(k), "--regrow-fraction", "0.5"], kd=True,
          adams=True, weight_update="AdamS", mask="Eq. 6 every T1 (SparseGPT start, regrow)", seeded=True)
    for k in (10, 30)
]
ALL_ENTRIES = CORE + SRSTE_SWEEP + MASKLLM + LR_SWEEPS + ABLATIONS + DEFAULT_ABLATIONS + MASK_CANDIDATES


def read_row(path: Path) -> dict:
    """A finished run's ``compare_row.json`` (rows written before resumed runs were told apart get their wall
    time from the run's clock here), with its WikiText-2 figure on the first windows where ``--first-windows``
    scored its saved model (``first_windows.json`` beside it)."""
    row = whole_run_wall(json.loads(path.read_text()))
    first = path.with_name(FIRST_WINDOWS_FILE)
    first_rec = json.loads(first.read_text()) if first.is_file() else None
    if first_rec is not None and not first_windows_of_row(first_rec, row):
        first_rec = None  # a record of another run that once stood in this folder
    again = path.with_name(RESCORED_FILE)
    rec = json.loads(again.read_text()) if again.is_file() else None
    if rec is not None and rec.get("row_test_ppl") == row.get("test"):
        # scored again from its saved model on the windows its table describes (a record of another row that
        # once stood here, e.g. a seed a later tuning replaced, is not this row's)
        row["wikitext2_rescored"] = {"windows": rec["windows"], "as_run": row.get("wikitext2"),
                                     "as_run_windows": rec["as_run_windows"]}
        row["wikitext2"], row["wikitext2_window_nll"] = rec["wikitext2_ppl"], rec["wikitext2_window_nll"]
        row["wikitext_windows"] = len(rec["wikitext2_window_nll"])
    if first_rec is not None:
        row.update(wikitext2_first=first_rec["wikitext2_ppl"], wikitext2_first_windows=first_rec["windows"])
    return row


def first_windows_of_row(rec: dict, row: dict) -> bool:
    """Whether ``first_windows.json``'s record ``rec`` is row ``row``'s (its ``compare_row.json`` as written): it
    names the row's test figure (``row_test_ppl``, in every record written since), or, in an older record, the
    row's own per-window NLL gives its figure. A seed that a later tuning set aside leaves its folder to the new
    run, and a record restored beside that run from the committed rows is the old run's (192k paper-exact seed 0
    showed λ 1e-4's 384.17 beside λ 2.6e-3's row): not this row's. An older record of a row without its per-window
    NLL has nothing to tell it by and is taken."""
    if "row_test_ppl" in rec:
        return rec["row_test_ppl"] == row.get("test")
    stored = row.get("wikitext2_window_nll") or []
    if len(stored) < rec.get("windows", 0):
        return True
    from cast_llm.eval.ppl import perplexity_of_windows  # torch: only for an older record

    return abs(perplexity_of_windows(stored, rec["windows"]) / rec["wikitext2_ppl"] - 1) <= 1e-9


def whole_run_wall(row: dict) -> dict:
    """A training run stopped and resumed (a SIGTERM, a machine given back) is finished by a later invocation
    whose own wall time covers only the last segment; the run's clock (``train_wall_s``, results.json's
    ``wall_time_s``) counts every segment. Such a row's wall time is the run's clock, and it says so."""
    train, wall = row.get("train_wall_s"), row.get("wall_s")
    if train is not None and wall is not None and train > wall:
        return {**row, "wall_s": train, "wall_s_last_invocation": wall, "resumed": True}
    return row


def budget_name(tokens: int) -> str:
    """40000 -> 40k, 40000000 -> 40M, 1500000000 -> 1.5B (3 significant digits)."""
    for unit, div in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if tokens >= div:
            return f"{tokens / div:.3g}{unit}"
    return str(tokens)


def _flag(k: str, v) -> list[str]:
    flag = "--" + k.replace("_", "-")
    if isinstance(v, bool):
        return [flag] if v else ["--no-" + k.replace("_", "-")]
    return [flag, str(v)]


class Comparison:
    def __init__(self, opts: argparse.Namespace):
        from cast_llm.config import parse_count

        self.opts = opts
        self.tier = dict(TIERS[opts.tier])
        for k in ("model", "data", "device"):
            if getattr(opts, k):
                self.tier[k] = getattr(opts, k)
        if opts.tokens:
            self.tier["tokens"] = parse_count(opts.tokens)
        self.tier.setdefault("seed", 0)
        self.budget = int(self.tier["tokens"])
        self.inprocess = opts.tier == "quick"
        self.unfinished: list[str] = []  # rows this invocation ran that did not finish (main's exit code)
        if self.inprocess and not opts.threads:
            opts.threads = 1  # tiny matrices: one thread is fastest, and never oversubscribes a CI machine
        if opts.jobs < 1 or (self.inprocess and opts.jobs > 1):
            raise SystemExit(f"--jobs {opts.jobs}: give 1 or more" if opts.jobs < 1 else
                             f"--jobs {opts.jobs}: the quick tier trains in this process, one run at a time; "
                             "drop --jobs")
        root = Path(opts.runs_dir) if opts.runs_dir else REPO / "runs" / "compare"
        register_runs_folder(root, "runs/compare")  # reports name its runs where a fresh clone puts them
        self.entries = (CORE + (SRSTE_SWEEP if opts.sweeps else []) + (MASKLLM if opts.maskllm else [])
                        + (ABLATIONS if opts.ablations else []))
        self.only = set(opts.only.split(",")) if opts.only else None
        if self.only:  # rows named in --only run; other rows of the table are kept if already finished
            unknown = self.only - {e.key for e in ALL_ENTRIES}
            if unknown:
                raise SystemExit(f"--only: unknown row(s) {', '.join(sorted(unknown))}; rows: "
                                 f"{', '.join(e.key for e in ALL_ENTRIES)}")
            self.entries = [e for e in ALL_ENTRIES if e.key in self.only or e in self.entries]
        # --idle-walls: the rows whose wall time is measured once on an idle machine (--only's, else every finished
        # row); nothing else runs, the table is rewritten with those times
        self.wall_entries = ([e for e in ALL_ENTRIES if e.key in self.only] if self.only else None
                             ) if opts.idle_walls else []
        # --rerun-unrecorded: the rows whose unrecorded seeds may be run again (--only's, else every row)
        self.rerun_keys = (set(self.only) if self.only else None) if opts.rerun_unrecorded else set()
        if opts.rerun_unrecorded and not opts.first_windows:
            raise SystemExit("--rerun-unrecorded goes with --first-windows N (it runs a seed again for the per-window "
                             "record that figure is taken from)")
        if opts.report_only or opts.idle_walls or opts.first_windows or opts.rescore_wikitext:
            # nothing runs: the table is rewritten from the finished rows
            self.entries, self.only = [], None
        self.seeds = [int(x) for x in str(opts.seeds).split(",")] if opts.seeds else [0]
        for kv in opts.set or []:  # tier settings of this invocation (e.g. wikitext_windows=0: the full protocol)
            k, _, v = kv.partition("=")
            if k not in self.tier:
                raise SystemExit(f"--set {kv}: no tier setting {k!r} (settings: {', '.join(self.tier)})")
            self.tier[k] = type(self.tier[k])(v) if self.tier[k] is not None else v
        self.grid = None  # (setting, its values or None, multiples of the forecast λ or None)
        if opts.tune:
            self.grid = parse_tune(opts.tune)
        self.tune_only = set(opts.tune_only.split(",")) if opts.tune_only else None
        self.ran_ahead: dict[tuple[str, int], dict] = {}  # (row, seed) → its run's result (run_seeds_ahead)
        if opts.settings_from:
            keys = {e.key for e in ALL_ENTRIES if e.kind == "train"}
            if opts.settings_from not in keys:
                raise SystemExit(f"--settings-from {opts.settings_from}: not a training row (rows: "
                                 f"{', '.join(sorted(keys))})")
            if not self.only or self.only == {opts.settings_from}:
                raise SystemExit(f"--settings-from {opts.settings_from}: name the rows that take its settings with "
                                 "--only")
            if opts.tune:
                raise SystemExit(f"--settings-from {opts.settings_from}: a row either takes another row's settings "
                                 "or is tuned (--tune), not both in one invocation")
        self.tuning_from: dict[str, dict] = {}  # row → the tuning record another budget chose (--tuning-from)
        if opts.tier == "quick":
            self._build_quick_model(root)
        # Other tiers: every run resolves WikiText-2 the same way ($CAST_WIKITEXT2, else the copy packaged with
        # cast-llm); the report names the source once.
        self.model_name = Path(self.tier["model"]).name if opts.tier == "quick" else self.tier["model"]
        self.runs = root / f"{self.model_name}-{budget_name(self.budget)}"
        self.runs.mkdir(parents=True, exist_ok=True)
        self._load_tuning_from(Path(opts.tuning_from) if opts.tuning_from else None)

    # ------------------------------------------------------------------------------------------ setup
    def _load_tuning_from(self, src: Path | None) -> None:
        """Read the tuning choices ``--tuning-from`` names (another budget's runs folder or compare-*.json). The
        runs folder remembers the source (``tuning_from.json``), so a later ``--report-only`` on it reports the
        tuning its rows ran under without being told again."""
        remembered = self.runs / "tuning_from.json"
        if src is None and remembered.is_file():
            src = Path(json.loads(remembered.read_text())["tuning_from"])
        elif src is not None:
            if not src.exists():
                raise SystemExit(f"--tuning-from {src}: no such runs folder or compare-*.json; give the runs folder "
                                 "of the budget whose tuning these rows reuse (e.g. runs/compare/smollm2-135m-48k)")
            remembered.write_text(json.dumps({"tuning_from": str(src.resolve())}, indent=2))
        if src is None:
            return
        if src.is_dir():  # a runs folder of another budget: its rows' tuning.json
            for f in src.glob("*/tuning.json"):
                self.tuning_from[f.parent.name] = {**json.loads(f.read_text()), "from": portable(str(src))}
        else:  # a compare-*.json
            for row in json.loads(src.read_text()).get("rows", []):
                t = row.get("tuning") or {}
                if t.get("chosen_setting"):
                    self.tuning_from[row["name"]] = {**t, "from": portable(str(src))}

    def _build_quick_model(self, root: Path) -> None:
        """A seeded tiny LLaMA with a 512-token BPE trained on a small corpus, and an evaluation text."""
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

        d = root / "quick-assets"
        d.mkdir(parents=True, exist_ok=True)
        words = ("sparse networks keep two of every four weights while training with distillation recovers "
                 "quality and tensor cores accelerate the semi structured pattern").split()
        g = torch.Generator().manual_seed(0)
        docs = []
        for i in range(60):
            idx = torch.randint(len(words), (80,), generator=g).tolist()
            docs.append(f"Document {i}. " + " ".join(words[j] for j in idx))
        corpus = d / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        (d / "eval.txt").write_text(" ".join(words * 40))
        model_dir = d / "tiny-llama"
        if not (model_dir / "config.json").is_file():
            # a small vocabulary keeps the logits (and so every step) cheap
            bpe = Tokenizer(models.BPE())
            bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            bpe.decoder = decoders.ByteLevel()
            bpe.train_from_iterator(docs, trainers.BpeTrainer(
                vocab_size=512, special_tokens=["<|endoftext|>"], show_progress=False,
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
            tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                          bos_token="<|endoftext|>", pad_token="<|endoftext|>")
            cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
                              tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
            tok.save_pretrained(model_dir)
        self.tier.update(model=str(model_dir), data=str(corpus), wikitext_file=str(d / "eval.txt"))

    def train_config(self, tokens: int, extra: list[str], out: Path):
        """The TrainConfig of a training row (flags resolved exactly as the CLI resolves them)."""
        from cast_llm.cli import build_parser
        from cast_llm.cli.train import build_config

        return build_config(build_parser().parse_args(self.train_argv(tokens, extra, out)))

    def train_argv(self, tokens: int, extra: list[str], out: Path, seed: int | None = None) -> list[str]:
        # a stopped row resumes from its newest checkpoint; --fresh starts it again
        again = ["--overwrite"] if self.opts.fresh else ["--resume", "auto"]
        argv = ["train", "--output-dir", str(out), "--tokens", str(tokens), "--no-progress", "--no-baseline-eval",
                *again]
        for k, v in self.tier.items():
            if k not in ("tokens", "adams", "row_lr") and not (k == "seed" and seed is not None):
                argv += _flag(k, v)
        if seed is not None:
            argv += ["--seed", str(seed)]
        if self.opts.save_every:
            argv += ["--save-every", str(self.opts.save_every)]
        return argv + extra + shlex.split(self.opts.train_args or "")

    def prune_argv(self, extra: list[str], out: Path, seed: int | None = None) -> list[str]:
        t = self.tier
        return ["prune", *extra, "--model", t["model"], "--data", t["data"], "--seq-len", str(t["seq_len"]),
                "--calib-samples", str(t["calib_samples"]), "--seed", str(t["seed"] if seed is None else seed),
                "--device", t["device"], "--output-dir", str(out), "--overwrite"]

    # ------------------------------------------------------------------------------------------ running
    def _run_cli(self, argv: list[str], log: Path, cpu: list[float] | None = None) -> int:
        """``cast-llm argv`` in its own process (the quick tier: in this one), its output to ``log``; the CPU
        seconds that process used are appended to ``cpu`` (its own, not a run beside it: ``--jobs``)."""
        if self.inprocess:
            from cast_llm.cli import main

            return main(argv)
        env = dict(os.environ)
        if self.opts.threads:
            # on a shared machine, spinning OpenMP workers waiting for descheduled siblings waste most of the
            # CPU: fewer threads and a passive wait policy are much faster there
            env.update(OMP_NUM_THREADS=str(self.opts.threads), OMP_WAIT_POLICY="PASSIVE")
        with log.open("w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "cast_llm.cli", *argv], stdout=f,
                                    stderr=subprocess.STDOUT, cwd=REPO, env=env)
            try:
                _, status, usage = os.wait4(proc.pid, 0)  # this child's own CPU, whatever else this script runs
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            proc.returncode = os.waitstatus_to_exitcode(status)
        if cpu is not None:
            cpu.append(usage.ru_utime + usage.ru_stime)
        return proc.returncode

    def evaluator(self):
        """The trainer's Evaluator on the same held-out slice and WikiText-2 windows as the training runs."""
        if getattr(self, "_evaluator", None) is None:
            from cast_llm.data import prepare
            from cast_llm.eval.evaluator import Evaluator
            from cast_llm.models import load_tokenizer

            cfg = self.train_config(self.budget, [], self.runs / "_eval")
            tok = load_tokenizer(cfg.model)
            data = prepare(cfg.data, tok, cfg.seq_len, train_sequences=1, val_sequences=cfg.val_sequences,
                           test_sequences=cfg.test_sequences, val_fraction=cfg.val_fraction,
                           test_fraction=cfg.test_fraction, max_documents=cfg.max_documents)
            self._evaluator = Evaluator(cfg, tok, data.test, None, val=data.val)
            self.split_sha256 = data.split_sha256
        return self._evaluator

    def current_split(self) -> str:
        """The digest of the validation and test windows every row of this budget is scored on."""
        self.evaluator()
        return self.split_sha256

    def evaluate_checkpoint(self, path: str) -> dict:
        import torch

        from cast_llm.models import load_model

        device = "cuda" if self.tier["device"] == "cuda" else "cpu"
        model = load_model(path, dtype=torch.float32).to(device).eval()
        with torch.no_grad():
            return self.evaluator().both(model, validation=True)

    def run_entry(self, e: Entry, seeds: list[int] | None = None) -> dict:
        """The row of entry ``e``: one run, or (seeded rows) one per seed with the mean and the range."""
        if self.grid and e.kind == "train" and (not self.tune_only or e.key in self.tune_only):
            values, forecast = self.grid_values(e)
            if self.grid_changed(e.key, values) and self.tune(e, values, forecast) is None:
                # a grid point stopped (a signal after its checkpoint): nothing chosen, no seed run at a choice
                # made without it; the same command resumes the point and then chooses
                return {"key": e.key, "label": e.label, "kind": e.kind, "status": "stopped", "heldout": None,
                        "wikitext2": None, "seed": self.seeds[0],
                        "error": "a grid point of its tuning stopped before it finished; nothing was chosen"}
        if not e.seeded:
            return self._run_one(e, self.runs / e.key, self.seeds[0] if e.kind == "train" else None)
        seeds = seeds or self.seeds
        if e.kind != "train":  # one-shot rows evaluate in this process: one at a time
            return self.aggregate([self._run_one(e, self.runs / e.key / f"seed-{s}", s) for s in seeds])
        return self.aggregate(self.side_by_side([
            lambda s=s: self.ran_ahead.pop((e.key, s), None) or self._run_one(e, self.runs / e.key / f"seed-{s}", s)
            for s in seeds]))

    def run_seeds_ahead(self, entries: list[Entry]) -> None:
        """With ``--jobs`` above 1, the seed runs of every seeded training row in ``entries`` whose settings are
        already fixed (not tuned by this invocation) run in one pool, so that no core waits for a row's last seed
        while the next row's seeds could run (two rows of three seeds: three rounds of two, not four); each row
        then takes its results in order (``ran_ahead``)."""
        if self.opts.jobs < 2:
            return
        ahead = [(e, s) for e in entries if e.kind == "train" and e.seeded
                 and not (self.grid and (not self.tune_only or e.key in self.tune_only)) for s in self.seeds]
        if len({e.key for e, _ in ahead}) < 2:
            return  # one row: its own seeds already run side by side
        print(f"          {len(ahead)} seed runs of {len({e.key for e, _ in ahead})} rows, {self.opts.jobs} at a "
              "time ...", flush=True)
        results = self.side_by_side([lambda e=e, s=s: self._run_one(e, self.runs / e.key / f"seed-{s}", s)
                                     for e, s in ahead])
        self.ran_ahead.update({(e.key, s): r for (e, s), r in zip(ahead, results)})

    def side_by_side(self, calls: list) -> list:
        """The results of ``calls`` (each a training run in its own process), in order, ``--jobs`` of them at a
        time: the grid points of a tuning stage and the seeds of a row do not depend on each other. Each run keeps
        its ``--threads`` and records the cores the others kept busy (``machine``), as a row beside any other job
        does; at one thread a run computes the same whatever runs beside it."""
        if self.opts.jobs == 1 or len(calls) < 2:
            return [c() for c in calls]
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.opts.jobs) as pool:
            return list(pool.map(lambda c: c(), calls))

    def finished_seeds(self, e: Entry) -> list[int]:
        """The seeds of entry ``e`` whose run finished, whatever ``--seeds`` says (the report keeps them all)."""
        found = [p.name.removeprefix("seed-") for p in (self.runs / e.key).glob("seed-*")
                 if (p / "compare_row.json").is_file()]
        return sorted(int(x) for x in found if x.isdigit())

    @staticmethod
    def aggregate(runs: list[dict]) -> dict:
        """One table row from the runs of a seeded entry: the mean over the seeds and the range."""
        if len(runs) == 1:
            return {**runs[0], "seeds": runs}
        ok = [r for r in runs if r.get("status") == "ok"]
        row = dict(runs[0])
        row["seeds"] = runs
        if len(ok) < len(runs):
            row.update(status="stopped" if all(r.get("status") in ("ok", "stopped") for r in runs) else "failed",
                       error="; ".join(r.get("error", "") for r in runs if r.get("status") != "ok"))
            return row
        for split in ("heldout", "wikitext2"):
            vals = [r[split] for r in ok]
            row[split] = sum(vals) / len(vals)
            row[f"{split}_range"] = [min(vals), max(vals)]
        row.pop("wikitext2_first", None), row.pop("wikitext2_first_windows", None)  # seed 0's, until all have it
        if len({r.get("wikitext2_first_windows") for r in ok}) == 1 and ok[0].get("wikitext2_first") is not None:
            vals = [r["wikitext2_first"] for r in ok]
            row.update(wikitext2_first=sum(vals) / len(vals), wikitext2_first_range=[min(vals), max(vals)],
                       wikitext2_first_windows=ok[0]["wikitext2_first_windows"])
        for key in ("sparse_weight_ratio", "tokens_per_s", "wall_s", *MOVEMENT_KEYS):
            vals = [r[key] for r in ok if r.get(key) is not None]
            row[key] = sum(vals) / len(vals) if vals else None
        row["command"] = ok[0]["command"] + f"  (and with --seed {', '.join(str(r['seed']) for r in ok[1:])})"
        return row

    def _run_one(self, e: Entry, out: Path, seed: int | None, hp_override: dict | None = None) -> dict:
        done = out / "compare_row.json"
        if done.is_file() and not self.opts.fresh:
            return read_row(done)
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        machine, cpu = MachineLoad(), []  # cpu: the training run's own CPU seconds (its process)
        code = code_version()  # the checkout the row's processes start from (taken at the end, it could be later's)
        row = {"key": e.key, "label": e.label, "kind": e.kind, "kd": e.kd, "weight_update": e.weight_update,
               "mask": e.mask, "tokens": 0, "seed": seed}
        if e.kind == "dense":
            row["command"] = f"(evaluation of {self.tier['model']})"
            ppl = self.evaluate_checkpoint(self.tier["model"])
        elif e.kind == "oneshot":
            argv = self.prune_argv(e.args, out / "model", seed if e.seeded else None)
            row["command"] = "cast-llm " + shlex.join(argv)
            if self._run_cli(argv, out / "log.txt") != 0:
                return self._failed(row, out)
            ppl = self.evaluate_checkpoint(str(out / "model"))
            row["calib_tokens"] = self.tier["calib_samples"] * self.tier["seq_len"]
        else:
            argv, hp = self.entry_train_argv(e, out, seed, hp_override)
            row["lr"] = hp["lr"]
            row["hyperparameters"] = hp
            row["command"] = "cast-llm " + shlex.join(argv)
            if (rc := self._run_cli(argv, out / "log.txt", cpu)) != 0:
                return self._failed(row, out, rc)
            res = json.loads(RunDir(out / "model").results.read_text())
            ppl = {split: res["perplexity"].get(split, {}).get("sparse") for split in ("heldout", "validation",
                                                                                      "wikitext2")}
            row["tokens"] = res["tokens_trained"]
            row["train_wall_s"] = res["wall_time_s"]
            row["threads"] = res.get("threads")
            row["split_sha256"] = (res.get("data_split") or {}).get("sha256")
            row["wikitext_windows"] = res.get("wikitext_windows")
            row["wikitext2_window_nll"] = res.get("wikitext2_window_nll")  # any first windows' figure, model-free
            row.update(run_statistics(out / "model", res))
        if e.kind != "train":
            ev = self.evaluator()
            row["wikitext_windows"], row["wikitext2_window_nll"] = ev.windows, ppl.get("wikitext2_window_nll")
            row["split_sha256"] = self.split_sha256
            row["threads"] = self.opts.threads or None
        # test = the held-out test split (kept under "heldout" too, the key earlier tables used)
        row.update(heldout=ppl["heldout"], test=ppl["heldout"], validation=ppl.get("validation"),
                   wikitext2=ppl["wikitext2"], wall_s=round(time.perf_counter() - t0, 1), status="ok",
                   machine=machine.finish(sum(cpu) if cpu else None), code=code)
        if (end := code_version()) != code:  # the checkout moved during the row: a resumed segment may have run it
            row["code_at_end"] = end
        row = whole_run_wall(row)
        done.write_text(json.dumps(row, indent=2))
        return row

    def entry_train_argv(self, e: Entry, out: Path, seed: int | None,
                         hp_override: dict | None = None) -> tuple[list[str], dict]:
        """The `cast-llm train` argv of training row ``e`` (and its lr/λ): equal compute, the row's own lr — the
        one its tuning chose on the validation split when it was tuned (``hp_override``: a grid point)."""
        tokens = self.budget * 3 // 4 if e.kd else self.budget  # equal compute: KD costs 4/3 (§4)
        hp = {**{k: self.tier[k] for k in ("lr", "l1_decay")}, **(self.tier["adams"] if e.adams else {})}
        hp.update(self.tier.get("row_lr", {}).get(e.key, {}))  # a row's own best lr (docs: the sweep)
        hp.update(self.tuned(e.key).get("chosen_setting", {}))
        hp.update(hp_override or {})
        argv = self.train_argv(tokens, e.args + [x for k, v in hp.items() for x in _flag(k, v)], out / "model", seed)
        return argv, hp

    # ------------------------------------------------------------------------------------------ tuning
    def tuned(self, key: str) -> dict:
        """The tuning record of row ``key``: this runs folder's ``tuning.json`` (a grid run here), else the
        one ``--tuning-from`` names (192k reuses 48k's choice); {} when the row was not tuned."""
        local = self.runs / key / "tuning.json"
        if local.is_file():
            return json.loads(local.read_text())
        return self.tuning_from.get(key, {})

    def tuning_record(self, key: str) -> dict | None:
        """Row ``key``'s tuning record of this runs folder with its stages (``stages``: one per tuned setting, in
        the order they were tuned; a record of one lr grid, written before stages existed, is its one stage). A
        record copied from another budget's table (``from``: the choice this budget's rows reuse) is not this
        budget's tuning: None, so that ``--tune`` here runs its own grid (192k's lr checks of the rows that reuse
        48k's choice would otherwise see 48k's grid as already run)."""
        local = self.runs / key / "tuning.json"
        if not local.is_file():
            return None
        rec = json.loads(local.read_text())
        return None if rec.get("from") or rec.get("settings_from") else with_stages(rec)

    def take_settings_from(self, src: str) -> None:
        """``--settings-from src``: each training row this invocation runs (but ``src``) takes the settings
        ``src``'s rows run at (its lr and λ: those its own tuning chose at this budget, the others as they stand),
        recorded as its ``tuning.json`` (``settings_from``: not tuned on the row itself); its seeds made at
        another value of those settings are set aside."""
        rec = self.tuning_record(src)
        if not rec or not rec.get("chosen_setting"):
            raise SystemExit(f"--settings-from {src}: {src} has no tuning of its own at this budget "
                             f"({portable(str(self.runs / src / 'tuning.json'))}); run its --tune line first")
        entry = next(e for e in ALL_ENTRIES if e.key == src)
        hp = self.entry_train_argv(entry, self.runs / src, self.seeds[0])[1]  # what src's rows run at
        full = {k: hp[k] for k in TUNABLE if k in hp}
        for e in self.entries:
            if e.kind != "train" or e.key == src or e.key not in self.only:
                continue
            # only what the row's training reads: SR-STE in place of AdamS has no λ (a λ passed to it would set
            # its seeds aside for runs identical to them)
            setting = {k: v for k, v in full.items() if self.reads_setting(e, k)}
            (self.runs / e.key).mkdir(parents=True, exist_ok=True)
            record = {"grid": None, "chosen": {k: f"{v:g}" for k, v in setting.items()}, "chosen_setting": setting,
                      "metric": f"{src}'s choice ({rec.get('metric')})", "settings_from": src,
                      "source_setting": full}
            (self.runs / e.key / "tuning.json").write_text(json.dumps(record, indent=2))
            for k, v in setting.items():
                self._set_aside_other_choices(e.key, k, f"{v:g}")

    def reads_setting(self, e: Entry, name: str) -> bool:
        """Whether training row ``e`` reads setting ``name``: the lr always; λ (``l1_decay``) only where AdamS
        learns the masks (``--method cast`` with ``--mask-learner adams``)."""
        if name != "l1_decay":
            return True
        cfg = self.train_config(self.budget, e.args, self.runs / "_settings")
        return cfg.method == "cast" and cfg.mask_learner == "adams"

    def grid_changed(self, key: str, values: list[float] | None = None) -> bool:
        """Whether ``--tune``'s grid has a value row ``key`` was not tuned over for that setting (or it was not
        tuned, or a point of it stopped): a wider grid (its choice was the old grid's edge) re-chooses, running
        only the new points; a grid the recorded one already covers (an earlier, narrower queue line run again)
        changes nothing."""
        values = self.grid[1] if values is None else values
        stage = stage_named(self.tuning_record(key), self.grid[0])
        if stage is None or not {f"{v:g}" for v in values} <= set(stage["values"]):
            return True
        # a point recorded as stopped (a record written before a stopped point held the choice back) runs again
        return any((stage.get("results") or {}).get(f"{v:g}", {}).get("status") == "stopped" for v in values)

    def grid_values(self, e: Entry) -> tuple[list[float], dict | None]:
        """The values ``--tune`` runs for row ``e``: the grid given, or (``l1_decay=forecast:F1,F2,...``) the
        multiples of the λ that the trainer's decay forecast says finishes the decay at this budget (the row's
        other settings as they stand), with that forecast."""
        name, values, multiples = self.grid
        if values is not None:
            return values, None
        fc = self.decay_forecast(e)
        # centred on the λ that finishes the decay; where none does (a short run: S_T has a ceiling below the
        # target whatever λ), on the λ past which a larger one hardly raises S_T (90 % of the way to the ceiling)
        lam = fc.get("l1_decay_to_finish")
        fc["centre"] = "finishes the decay" if lam is not None else "knee (no λ finishes the decay at this lr)"
        lam = lam if lam is not None else fc.get("l1_decay_knee")
        if lam is None:
            raise SystemExit(f"--tune {name}=forecast:...: the decay forecast of {e.key} gives no λ; give the "
                             "grid's values")
        fc["centre_l1_decay"] = lam
        return [float(f"{lam * m:.2g}") for m in multiples], fc

    def decay_forecast(self, e: Entry) -> dict:
        """The decay forecast the trainer makes before row ``e``'s first update (seed 0, its settings without
        the tuned λ, i.e. the tier's), kept in ``<runs>/<row>/forecast.json`` for the same command."""
        seed = self.seeds[0]
        hp = {"l1_decay": self.tier["l1_decay"]}  # the search starts from the tier's λ, whatever was chosen
        argv, hp = self.entry_train_argv(e, self.runs / e.key / "forecast", seed, hp)
        command = without_output_dir("cast-llm " + shlex.join(argv))
        cache = self.runs / e.key / "forecast.json"
        if cache.is_file() and (rec := json.loads(cache.read_text())).get("command") == command:
            return rec
        from cast_llm.cli import build_parser
        from cast_llm.cli.train import build_config

        print(f"          decay forecast of {e.key} at this budget (lr {hp['lr']:g}, λ {hp['l1_decay']:g}) ...",
              flush=True)
        t0 = time.perf_counter()
        rec = {**start_forecast(build_config(build_parser().parse_args(argv))), "command": command,
               "wall_s": round(time.perf_counter() - t0, 1)}
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cache, rec)
        print(f"          forecast S_T {rec['sparse_weight_ratio']:.3f} at λ {hp['l1_decay']:g}; λ that finishes "
              f"the decay (S_T ≥ {rec['target']}): {rec['l1_decay_to_finish']}; past λ {rec['l1_decay_knee']:.3g} "
              f"(S_T {rec['sparse_weight_ratio_at_knee']:.3f}) a larger λ hardly helps (ceiling "
              f"{rec['sparse_weight_ratio_ceiling']:.3f} at ×1000)", flush=True)
        return rec

    def _set_aside_other_choices(self, key: str, name: str, best: str) -> None:
        """Seed runs of row ``key`` made at an earlier choice than ``best`` (finished or partial): renamed
        ``seed-N.superseded-<name>-<value>`` (kept, out of the table), so the row's seeds run at the new choice."""
        for d in sorted((self.runs / key).glob("seed-*")):
            if not d.name.removeprefix("seed-").isdigit():
                continue
            row, config = d / "compare_row.json", RunDir(d / "model").config
            if row.is_file():
                value = (read_row(row).get("hyperparameters") or {}).get(name)
            elif config.is_file():  # interrupted: the setting its run was started with
                value = load_yaml(config).get(name)
            else:
                continue
            if value is not None and f"{float(value):g}" != best:
                target = d.with_name(f"{d.name}.superseded-{name}-{float(value):g}")
                twin = target / "compare_row.json"
                if row.is_file() and twin.is_file() and twin.read_text() == row.read_text():
                    # set aside before, and restored again from the committed rows (which kept both): a copy
                    shutil.rmtree(d)
                    print(f"          {key} {d.name}: a copy of {target.name} (set aside before): removed", flush=True)
                    continue
                k = 2
                while target.exists():  # another run at that setting was set aside already: keep both
                    target = d.with_name(f"{d.name}.superseded-{name}-{float(value):g}.{k}")
                    k += 1
                d.rename(target)
                print(f"          {key} {d.name}: ran at {name}={float(value):g}, not the new choice {best}: "
                      f"set aside as {target.name}", flush=True)

    def tune(self, e: Entry, values: list[float] | None = None, forecast: dict | None = None) -> dict | None:
        """Run ``--tune``'s grid for training row ``e`` at the first seed, the row's other settings as they stand
        (those earlier stages chose: a coordinate search, one setting at a time), choose the value with the lowest
        validation perplexity, record it as that setting's stage in ``tuning.json``, and make the grid run at
        the chosen settings the row's run of that seed. None, with nothing recorded, where a grid point stopped
        (a signal after its checkpoint): a choice among the other points would not be the grid's."""
        if values is None:
            values, forecast = self.grid_values(e)
        seed = self.seeds[0]
        name = self.grid[0]
        rec = self.tuning_record(e.key) or {"stages": []}
        old = [x["name"] for x in rec["stages"]]
        stages = [x for x in rec["stages"] if x["name"] != name]
        at = old.index(name) if name in old else len(stages)
        names = sorted({x["name"] for x in stages} | {name})
        hp = self.entry_train_argv(e, self.runs / e.key, seed)[1]  # the settings as they stand (earlier choices)
        fixed = {k: hp[k] for k in TUNABLE if k != name}
        results, points = {}, []
        for v in values:
            point = {**{k: hp[k] for k in names}, name: v}
            points.append((v, point, self._grid_dir(e.key, point, names, stages, seed)))

        def grid_run(v, point, out):
            print(f"          grid {e.key} {name}={v:g} ({', '.join(f'{k} {x:g}' for k, x in fixed.items())}; seed "
                  f"{seed}) ...", flush=True)
            return self._run_one(e, out, seed, point)

        runs = self.side_by_side([lambda p=p: grid_run(*p) for p in points])
        for (v, point, out), r in zip(points, runs):
            results[f"{v:g}"] = {"validation": r.get("validation"), "test": r.get("test"),
                                 "wikitext2": r.get("wikitext2"), "status": r.get("status"),
                                 "setting": {k: (r.get("hyperparameters") or point).get(k) for k in TUNABLE},
                                 "dir": str(out.relative_to(self.runs / e.key))}
            for k in ("sparse_weight_ratio", "prune_validation_before", "prune_validation_after"):
                if r.get(k) is not None:
                    results[f"{v:g}"][k] = r[k]
        if stopped := [k for k, r in results.items() if r["status"] == "stopped"]:
            print(f"          {e.key}: grid point(s) {', '.join(f'{name}={k}' for k in stopped)} stopped (resumable): "
                  "nothing chosen; the same command resumes them and then chooses", flush=True)
            return None
        before = stage_named(rec, name)
        if before is not None and before.get("fixed") == fixed:  # points tuned before at the same other settings
            kept = {k: r for k, r in before["results"].items() if k not in results}  # stay in the choice
            results = dict(sorted({**kept, **results}.items(), key=lambda kv: float(kv[0])))
        ok = {k: r["validation"] for k, r in results.items() if r["status"] == "ok" and r["validation"] is not None}
        if not ok:
            raise SystemExit(f"--tune {e.key}: no grid run finished; see {self.runs / e.key / 'grid'}")
        best = min(ok, key=ok.get)
        stage = {"name": name, "values": list(results), "fixed": fixed, "results": results, "chosen": best}
        if forecast is not None:
            stage["grid_from"] = {"forecast": {k: forecast.get(k) for k in (
                "centre", "centre_l1_decay", "l1_decay_to_finish", "l1_decay_knee", "sparse_weight_ratio_at_knee",
                "sparse_weight_ratio_ceiling", "sparse_weight_ratio", "target", "lr", "l1_decay", "total_steps")},
                "multiples": self.grid[2]}
        stages.insert(at, stage)
        record = stages_record(stages, seed)
        (self.runs / e.key / "tuning.json").write_text(json.dumps(record, indent=2))
        for x in stages:  # seed runs at another value of any tuned setting are set aside
            self._set_aside_other_choices(e.key, x["name"], x["chosen"])
        src = self.runs / e.key / results[best]["dir"] / "compare_row.json"
        dst = self.runs / e.key / f"seed-{seed}"
        if not (dst / "compare_row.json").is_file():
            dst.mkdir(parents=True, exist_ok=True)
            row = json.loads(src.read_text())
            row["from_grid"] = ",".join(f"{x['name']}={x['chosen']}" for x in stages)
            row["grid_dir"] = results[best]["dir"]
            (dst / "compare_row.json").write_text(json.dumps(row, indent=2))
        print(f"          {e.key}: chose {name}={best} (validation {ok[best]:.2f}; grid {ok})", flush=True)
        return record

    def _grid_dir(self, key: str, point: dict, names: list[str], stages: list[dict], seed: int) -> Path:
        """Where a grid point of row ``key`` runs: ``grid/<setting>-<value>/seed-N`` while one setting is tuned
        (as records of one lr grid have it); with several, an earlier stage's run at exactly these settings (the
        same run: reused), else ``grid/<s1>-<v1>_<s2>-<v2>/seed-N``."""
        if len(names) == 1:
            return self.runs / key / "grid" / f"{names[0]}-{point[names[0]]:g}" / f"seed-{seed}"
        want = {k: f"{float(point[k]):g}" for k in names}
        for x in stages:
            for r in x["results"].values():
                got = {k: f"{float(v):g}" for k, v in (r.get("setting") or {}).items() if k in want and v is not None}
                if got == want and r.get("dir") and (self.runs / key / r["dir"] / "compare_row.json").is_file():
                    return self.runs / key / r["dir"]
        return self.runs / key / "grid" / "_".join(f"{k}-{float(point[k]):g}" for k in names) / f"seed-{seed}"

    def expected_command(self, e: Entry, seed: int | None) -> str | None:
        """The command row ``e`` (seed ``seed``) runs with today's settings, without its output folder (the
        recorded-row check); None for the dense row (an evaluation)."""
        out = self.runs / e.key / (f"seed-{seed}" if e.seeded else "")
        if e.kind == "train":
            argv = self.entry_train_argv(e, out, seed)[0]
        elif e.kind == "oneshot":
            argv = self.prune_argv(e.args, out / "model", seed if e.seeded else None)
        else:
            return None
        return without_output_dir("cast-llm " + shlex.join(argv))

    def reuse_recorded(self, path: Path) -> list[str]:
        """Put the runs recorded in ``path`` (a committed ``compare-*.json``) into the runs folder where it has
        none, when today's settings would run exactly the recorded command; returns what was taken.

        The runs folder is a cache (not in the repository); the JSON next to the table is the record. So a
        fresh checkout regenerates the table from it and runs only what is new or changed (``--fresh``:
        nothing recorded is reused)."""
        if self.opts.fresh or not path.is_file():
            return []
        entries = {e.key: e for e in ALL_ENTRIES}
        taken = []
        for row in json.loads(path.read_text()).get("rows", []):
            e = entries.get(row.get("name"))
            if e is None:
                continue
            tuning = row.get("tuning") or {}
            if tuning.get("chosen_setting") and not (self.runs / e.key / "tuning.json").is_file():
                (self.runs / e.key).mkdir(parents=True, exist_ok=True)  # the choice the recorded seeds ran with
                (self.runs / e.key / "tuning.json").write_text(json.dumps(tuning, indent=2))
            for run in row.get("seeds", []):
                out = self.runs / e.key / (f"seed-{run.get('seed')}" if e.seeded else "")
                want = self.expected_command(e, run.get("seed"))
                if (out / "compare_row.json").is_file() or run.get("status") != "ok" or (
                        want is not None and without_output_dir(run.get("command", "")) != want):
                    continue
                if run.get("split_sha256") is None or run.get("split_sha256") != self.current_split():
                    continue  # scored on other text (the seed-dependent split of earlier versions)
                out.mkdir(parents=True, exist_ok=True)
                run.setdefault("recorded_in", portable(str(path)))
                (out / "compare_row.json").write_text(json.dumps(run, indent=2))
                taken.append(f"{e.key}{'' if run.get('seed') is None else ' seed ' + str(run['seed'])}")
        return taken

    # ------------------------------------------------------------------------------------------ first windows
    def finished_runs(self) -> list[tuple[Entry, Path]]:
        """Every finished run of this budget: (its entry, the folder holding its ``compare_row.json``)."""
        out = []
        for e in ALL_ENTRIES:
            if (self.runs / e.key / "compare_row.json").is_file():
                out.append((e, self.runs / e.key))
            elif e.seeded:
                out += [(e, self.runs / e.key / f"seed-{s}") for s in self.finished_seeds(e)]
        return out

    def saved_model(self, e: Entry, run: Path, row: dict) -> str | None:
        """The model a finished run scored: the dense model itself, else the run's saved model (a seed taken
        from the tuning grid: the grid run's); None where it is not on this machine."""
        if e.kind == "dense":
            return str(self.tier["model"])
        places = [run / "model"]
        if row.get("grid_dir"):
            places.append(self.runs / e.key / row["grid_dir"] / "model")
        elif row.get("from_grid"):
            name, _, value = row["from_grid"].partition("=")
            places.append(self.runs / e.key / "grid" / f"{name}-{value}" / run.name / "model")
        return next((str(p) for p in places if (p / "config.json").is_file()), None)

    def rescore_wikitext(self) -> None:
        """Score again, from its saved model, every finished run whose command scored WikiText-2 on other windows
        than this invocation's setting (a queue line at 192k that missed ``--set wikitext_windows=0``), so that
        its table describes one evaluation. The run's test figure is scored again with it (a model that does not
        give the row's test figure is not the row's model: nothing is written); the figure and its per-window
        NLLs go to ``wikitext_rescored.json`` beside the row, which stays as it ran (``read_row`` takes the
        figure from the record and keeps the one as run beside it)."""
        import torch

        from cast_llm.eval.ppl import perplexity
        from cast_llm.models import load_model

        ev = self.evaluator()
        want = int(self.tier["wikitext_windows"] or 0)  # 0: every window
        if ev.wiki_ids is None:
            raise SystemExit("--rescore-wikitext: no WikiText-2 text to score (set $CAST_WIKITEXT2 or the tier's "
                             "wikitext_file)")
        for e, run in self.finished_runs():
            name = f"{e.key}{'' if run.name == e.key else ' ' + run.name}"
            row = json.loads((run / "compare_row.json").read_text())
            ran = re.findall(r"--wikitext-windows (\S+)", row.get("command") or "")
            done = run / RESCORED_FILE
            if row.get("status") != "ok" or not ran or int(float(ran[-1])) == want:
                continue
            if done.is_file() and json.loads(done.read_text()).get("windows") == want:
                print(f"          {name}: scored again on {want or 'every'} window(s) already", flush=True)
                continue
            model_path = self.saved_model(e, run, row)
            if model_path is None:
                print(f"          {name}: ran with --wikitext-windows {ran[-1]} and its saved model is not on this "
                      "machine: not scored again (run it again, or report it with that setting)", flush=True)
                continue
            t0 = time.perf_counter()
            model = load_model(model_path, dtype=torch.float32).eval()
            with torch.no_grad():
                test = ev.heldout(model, name)
                if test is None or abs(test / row["test"] - 1) > 1e-6:
                    print(f"          {name}: {model_path} scores test {test}, its row {row['test']}: not the "
                          "row's model, not scored", flush=True)
                    continue
                res = perplexity(model, ev.wiki_ids, ev.eval_len, batch_size=1, max_windows=want or None,
                                 progress=True, desc=f"{name} WikiText-2")
            rec = {"windows": want, "seq_len": ev.eval_len, "wikitext2_ppl": res.perplexity,
                   "wikitext2_window_nll": list(res.window_nll), "as_run_windows": int(float(ran[-1])),
                   "as_run_wikitext2_ppl": row.get("wikitext2"), "test_ppl": test, "row_test_ppl": row["test"],
                   "model": portable(model_path), "wall_s": round(time.perf_counter() - t0, 1),
                   "code": code_version()}
            atomic_write_json(done, rec)
            print(f"          {name}: WikiText-2 on {want or 'every'} window(s) {res.perplexity:.2f} (as run, on "
                  f"{ran[-1]}: {row.get('wikitext2'):.2f}; test {test:.2f}, as its row; {rec['wall_s']:.0f} s)",
                  flush=True)
            del model

    def score_first_windows(self, n: int) -> None:
        """Score every finished row's model again on the first ``n`` WikiText-2 windows, so that a table scored
        on every window compares with tables scored on ``n`` (the same first windows: the evaluation cuts the
        text the same way). Each figure goes to ``first_windows.json`` beside the run's row; the run's test
        figure is scored again with it, and a model that does not give the row's test figure is not the row's
        model: nothing is written for it."""
        import torch

        from cast_llm.eval.ppl import perplexity, perplexity_of_windows
        from cast_llm.models import load_model

        ev = self.evaluator()
        if ev.wiki_ids is None:
            raise SystemExit("--first-windows: no WikiText-2 text to score (set $CAST_WIKITEXT2 or the tier's "
                             "wikitext_file)")
        if n < 1 or n > ev.windows_total:
            raise SystemExit(f"--first-windows {n}: give 1 to {ev.windows_total} (the windows of "
                             f"{ev.eval_len} tokens WikiText-2 holds)")
        for e, run in self.finished_runs():
            name = f"{e.key}{'' if run.name == e.key else ' ' + run.name}"
            done = run / FIRST_WINDOWS_FILE
            row = json.loads((run / "compare_row.json").read_text())
            if done.is_file():
                rec = json.loads(done.read_text())
                if rec.get("windows") == n and first_windows_of_row(rec, row):
                    print(f"          {name}: first {n} windows scored already", flush=True)
                    continue
            if row.get("status") != "ok":
                continue
            stored, source = row.get("wikitext2_window_nll") or [], "the row's per-window NLL (wikitext2_window_nll)"
            whole = row.get("wikitext2")  # what the record over every window must give
            rerun = None if stored else self.reproducing_rerun(e, row)
            if (rerun is None and not stored and self.saved_model(e, run, row) is None and e.kind == "train"
                    and (self.rerun_keys is None or e.key in self.rerun_keys)):
                rerun = self.rerun_for_record(e, row)
            if rerun is not None:
                stored, source, whole = rerun
            if len(stored) >= n and whole is not None:
                # the run recorded every window's NLL: the first n need no model (its figure over all of them
                # must be the run's, else the record is not the run's)
                if abs(perplexity_of_windows(stored, len(stored)) / whole - 1) > 1e-9:
                    print(f"          {name}: its per-window record does not give its WikiText-2 figure: not "
                          "scored", flush=True)
                    continue
                rec = {"windows": n, "seq_len": ev.eval_len, "wikitext2_ppl": perplexity_of_windows(stored, n),
                       "row_test_ppl": row["test"], "source": source, "code": code_version()}
                atomic_write_json(done, rec)
                whose = "its" if rerun is None else "its rerun's"
                print(f"          {name}: WikiText-2 on the first {n} windows {rec['wikitext2_ppl']:.2f} (from "
                      f"{whose} per-window record)", flush=True)
                continue
            model_path = self.saved_model(e, run, row)
            if model_path is None:
                print(f"          {name}: its saved model is not on this machine (a row recorded elsewhere): "
                      "not scored", flush=True)
                continue
            t0 = time.perf_counter()
            model = load_model(model_path, dtype=torch.float32).eval()
            with torch.no_grad():
                test = ev.heldout(model, name)
                if test is None or abs(test / row["test"] - 1) > 1e-6:
                    print(f"          {name}: {model_path} scores test {test}, its row {row['test']}: not the "
                          "row's model, not scored", flush=True)
                    continue
                wiki = perplexity(model, ev.wiki_ids, ev.eval_len, batch_size=1, max_windows=n).perplexity
            wall = round(time.perf_counter() - t0, 1)
            rec = {"windows": n, "seq_len": ev.eval_len, "wikitext2_ppl": wiki, "test_ppl": test,
                   "row_test_ppl": row["test"], "model": portable(model_path), "wall_s": wall, "code": code_version()}
            atomic_write_json(done, rec)
            print(f"          {name}: WikiText-2 on the first {n} windows {wiki:.2f} (test {test:.2f}, as its "
                  f"row; {rec['wall_s']:.0f} s)", flush=True)
            del model

    def reproducing_rerun(self, e: Entry, row: dict) -> tuple[list[float], str, float] | None:
        """The per-window WikiText-2 record of a run of the same row and seed made again (the idle-wall run,
        ``<runs>/walls/<row>``) when it reproduces the row: the same seed, and its test and WikiText-2 figures
        (the latter over every window of the record) within RERUN_REL of the row's — the same run up to the last
        bits a code version rounds differently. The source says by how much it differs. None otherwise (a row run
        before the record existed and not run again, or a rerun that came out different)."""
        for f in (self.runs / "walls" / e.key / "compare_row.json", self.rerun_dir(e, row) / "compare_row.json"):
            if not f.is_file():
                continue
            r = read_row(f)
            stored = r.get("wikitext2_window_nll") or []
            if r.get("status") != "ok" or r.get("seed") != row.get("seed") or not stored:
                continue
            diff = rerun_difference(r, row)
            if max(diff.values()) > RERUN_REL:
                continue
            return stored, (f"the per-window NLL of the row run again ({portable(str(f.parent))}, code "
                            f"{r.get('code')}), whose test and WikiText-2 figures are the row's within relative "
                            f"{diff['test']:.1e} and {diff['wikitext2']:.1e}"), r["wikitext2"]
        return None

    def rerun_dir(self, e: Entry, row: dict) -> Path:
        """Where ``--rerun-unrecorded`` runs a row's seed again (``<runs>/reruns/<row>/seed-N``)."""
        return self.runs / "reruns" / e.key / f"seed-{row.get('seed')}"

    def record_reruns(self, key: str) -> list[dict]:
        """Row ``key``'s seeds run again by ``--rerun-unrecorded`` (``<runs>/reruns/<row>/seed-N``) that finished:
        each one's seed, perplexities and code, for the table to set against the row's."""
        out = []
        for f in sorted((self.runs / "reruns" / key).glob("seed-*/compare_row.json")):
            r = read_row(f)
            if r.get("status") == "ok":
                out.append({"seed": r.get("seed"), "test_ppl": r.get("test"), "wikitext2_ppl": r.get("wikitext2"),
                            "code": r.get("code"), "threads": r.get("threads"), "wall_s": r.get("wall_s")})
        return out

    def rerun_for_record(self, e: Entry, row: dict) -> tuple[list[float], str, float] | None:
        """``--rerun-unrecorded``: run the row's seed again (its setting, its seed: the same run) for the per-window
        record the row lacks, and return it as :meth:`reproducing_rerun` does; None (said why) if the rerun
        failed or came out different."""
        out = self.rerun_dir(e, row)
        print(f"          {e.key} seed {row.get('seed')}: no per-window record and no saved model here: run again "
              f"into {portable(str(out))} ...", flush=True)
        r = self._run_one(e, out, row.get("seed"))
        if r.get("status") != "ok":
            return None
        got = self.reproducing_rerun(e, row)
        if got is None:
            diff = rerun_difference(r, row)
            print(f"          {e.key} seed {row.get('seed')}: the rerun gives test {r.get('test')} / WikiText-2 "
                  f"{r.get('wikitext2')}, the row {row.get('test')} / {row.get('wikitext2')} (relative "
                  f"{diff['test']:.1e} / {diff['wikitext2']:.1e}, more than {RERUN_REL:.0e}): not the row's run, "
                  "not scored", flush=True)
        return got

    # ------------------------------------------------------------------------------------------ idle walls
    def idle_wall(self, key: str) -> dict | None:
        """Row ``key``'s wall time from one run on an otherwise idle machine (``<runs>/walls/<row>``), or None
        where none was measured (or the machine turned out busy during it)."""
        f = self.runs / "walls" / key / "compare_row.json"
        if not f.is_file():
            return None
        r = read_row(f)
        other = (r.get("machine") or {}).get("other_cores")
        if r.get("status") != "ok" or other is None or other > IDLE_CORES:
            return None
        # the re-run's own perplexities and code: a check that the row reproduces (same seed, same command)
        return {"wall_s": r["wall_s"], "threads": r.get("threads"), "other_cores": other, "seed": r.get("seed"),
                "tokens": r.get("tokens"), "calib_tokens": r.get("calib_tokens"), "test_ppl": r.get("test"),
                "wikitext2_ppl": r.get("wikitext2"), "code": r.get("code"), "command": r.get("command"),
                "hyperparameters": r.get("hyperparameters")}

    def superseded_seed(self, key: str, seed, setting: dict) -> dict | None:
        """Row ``key``'s run of ``seed`` at ``setting`` that a later tuning set aside
        (``seed-N.superseded-<name>-<value>``): what an idle-wall run made at that earlier setting reproduces."""
        for f in sorted((self.runs / key).glob(f"seed-{seed}.superseded-*/compare_row.json")):
            r = read_row(f)
            if r.get("status") == "ok" and r.get("hyperparameters") == setting:
                return {"seed": r.get("seed"), "test": r.get("test"), "wikitext2": r.get("wikitext2"),
                        "code": r.get("code"), "dir": f.parent.name}
        return None

    def superseded(self, key: str) -> list[dict]:
        """Row ``key``'s seeds at the settings a later tuning replaced (``seed-N.superseded-*``), one entry per
        setting: its seeds' test / WikiText-2 / S_T, and their means — what the row measured before its tuning."""
        groups: dict[str, list[dict]] = {}
        for f in sorted((self.runs / key).glob("seed-*.superseded-*/compare_row.json")):
            r = read_row(f)
            if r.get("status") == "ok":
                groups.setdefault(json.dumps(r.get("hyperparameters"), sort_keys=True), []).append(r)
        out = []
        for runs in groups.values():
            runs.sort(key=lambda r: r.get("seed") or 0)
            mean = {k: sum(r[k] for r in runs) / len(runs) for k in ("test", "wikitext2")
                    if all(r.get(k) is not None for r in runs)}
            out.append({"setting": runs[0].get("hyperparameters"), **mean,
                        "seeds": [{k: r.get(k) for k in ("seed", "test", "wikitext2", "validation",
                                                         "sparse_weight_ratio", "code")} for r in runs]})
        return out

    def pending_grid(self, key: str) -> list[dict]:
        """The grid points of row ``key`` finished so far where the row has no seed yet (its tuning under way)."""
        out = []
        for f in sorted((self.runs / key / "grid").glob("*/seed-*/compare_row.json")):
            r = read_row(f)
            if r.get("status") == "ok":
                out.append({"setting": r.get("hyperparameters"), "seed": r.get("seed"),
                            "validation": r.get("validation")})
        return sorted(out, key=lambda x: sorted((x["setting"] or {}).items()))

    def measure_idle_walls(self, entries: list[Entry], busy=None) -> None:
        """Run each row of ``entries`` once (its first seed, its tuned setting) into ``<runs>/walls/<row>`` and keep
        its wall time, everything included (calibration, the teacher, the evaluations), for the table. Refuses to
        start a row while other processes keep the machine busy, and does not keep a time during which they did:
        the rows' own wall times are taken beside other jobs (their cells say how many cores)."""
        import shutil

        from cast_llm.train.threads import busy_cores

        busy = busy or (lambda: busy_cores(os.cpu_count() or 1))
        for e in entries:
            if self.idle_wall(e.key) is not None:
                print(f"          {e.key}: idle wall time measured already ({self.runs / 'walls' / e.key})")
                continue
            used = busy()
            if used is not None and used > IDLE_CORES:
                raise SystemExit(f"--idle-walls: other processes keep {used:.1f} cores busy; the wall times need "
                                 "an otherwise idle machine (stop the other jobs and run this again: rows measured "
                                 "so far are kept)")
            out = self.runs / "walls" / e.key
            if out.exists():  # an interrupted or busy measurement of ours: a resumed run's clock is not one run's
                shutil.rmtree(out)
            seed = self.seeds[0] if e.seeded or e.kind == "train" else None
            print(f"          idle wall time of {e.key} (seed {seed}) ...", flush=True)
            r = self._run_one(e, out, seed)
            other = (r.get("machine") or {}).get("other_cores")
            if r.get("status") == "ok":
                print(f"          {e.key}: {r['wall_s']:.0f} s, {r.get('threads')} thread(s), other processes "
                      f"{other} cores{'' if other is None or other <= IDLE_CORES else ' — busy: not kept'}",
                      flush=True)

    def _failed(self, row: dict, out: Path, rc: int | None = None) -> dict:
        """The row of a run that did not finish: ``stopped`` where training was stopped by a signal after writing
        its checkpoint (exit code ``EXIT_PREEMPTED``: the same command resumes it), else ``failed``."""
        from cast_llm.train.preemption import EXIT_PREEMPTED

        log = out / "log.txt"
        tail = log.read_text().strip().splitlines()[-1:] if log.is_file() else ["(in-process run failed)"]
        stopped = rc == EXIT_PREEMPTED
        row.update(status="stopped" if stopped else "failed", error=tail[0][-300:] if tail else "", heldout=None,
                   wikitext2=None)
        print(f"  {row['key']} {'STOPPED (resumable: the same command resumes it)' if stopped else 'FAILED'}: "
              f"{row['error']}", flush=True)
        return row

    def run(self) -> tuple[Path, Path]:
        import torch

        if self.opts.threads:
            torch.set_num_threads(self.opts.threads)  # the in-process runs and the evaluations
        t0 = time.perf_counter()
        docs = Path(self.opts.docs_dir) if self.opts.docs_dir else REPO / "docs" / "results"
        stem = f"compare-{self.model_name}-{budget_name(self.budget)}"
        taken = self.reuse_recorded(docs / f"{stem}.json")
        if taken:
            print(f"reused {len(taken)} recorded run(s) of {portable(str(docs / (stem + '.json')))}: "
                  f"{', '.join(taken)}", flush=True)
        # every row that already finished stays in the table, whichever invocation ran it
        finished = {e.key for e in ALL_ENTRIES
                    if (self.runs / e.key / "compare_row.json").is_file() or (e.seeded and self.finished_seeds(e))}
        if self.opts.rescore_wikitext:
            self.rescore_wikitext()
        if self.opts.first_windows:
            self.score_first_windows(self.opts.first_windows)
        if self.opts.idle_walls:
            self.measure_idle_walls([e for e in ALL_ENTRIES if e.key in finished]
                                    if self.wall_entries is None else self.wall_entries)
        if self.opts.settings_from:
            self.take_settings_from(self.opts.settings_from)
        # rows whose every seed a new setting set aside, none finished at it yet (--settings-from, a tuning that
        # moved): kept in the report as pending, with what they measured before
        pending = {e.key for e in ALL_ENTRIES if e.kind == "train" and e.key not in finished
                   and any((self.runs / e.key).glob("seed-*.superseded-*/compare_row.json"))}
        entries = [e for e in ALL_ENTRIES if e in self.entries or e.key in finished | pending]
        self.run_seeds_ahead([e for e in entries if e in self.entries and (not self.only or e.key in self.only)])
        rows = []
        for e in entries:
            if (self.only and e.key not in self.only) or e not in self.entries:  # reused, never run here
                done = self.runs / e.key / "compare_row.json"
                if done.is_file():
                    rows.append(read_row(done))
                elif e.seeded and (seeds := self.finished_seeds(e)):
                    # the seeds that finished, aggregated without running (--fresh redoes only the rows it runs)
                    rows.append(self.aggregate([read_row(self.runs / e.key / f"seed-{x}" / "compare_row.json")
                                                for x in seeds]))
                elif e.key in pending:
                    rows.append({"key": e.key, "kind": "train", "kd": e.kd, "tokens": 0, "seed": None,
                                 "status": "pending", "heldout": None, "wikitext2": None,
                                 "error": "none of its seeds at its current setting has finished; those at the "
                                          "settings before are under \"Before the tuning\""})
                if rows and rows[-1]["key"] == e.key:  # the entry describes the row; its runs give the numbers
                    rows[-1].update(label=e.label, weight_update=e.weight_update, mask=e.mask)
                continue
            print(f"[{time.perf_counter() - t0:7.0f} s] {e.key} ...", flush=True)
            rows.append(self.run_entry(e))
            r = rows[-1]
            if r["status"] != "ok":
                self.unfinished.append(f"{e.key} ({r['status']})")
            r.update(label=e.label, weight_update=e.weight_update, mask=e.mask)
            if r["status"] == "ok":
                print(f"          held-out {r['heldout']}  WikiText-2 {r['wikitext2']}  ({r['wall_s']:.0f} s)",
                      flush=True)
        if (clash := evaluation_clash(rows, self.tier)) is not None:
            raise SystemExit(clash)
        for r in rows:  # the row's wall time measured on an idle machine, where --idle-walls measured it
            if (wall := self.idle_wall(r["key"])) is not None:
                own = (r.get("seeds") or [r])[0].get("hyperparameters")
                if wall.get("hyperparameters") and own and wall["hyperparameters"] != own:
                    # measured at a setting a later tuning replaced: not this row's time; kept as a rerun of
                    # the run it repeats (that setting's seed, set aside by the tuning), where that run is here
                    wall["against"] = self.superseded_seed(r["key"], wall.get("seed"), wall["hyperparameters"])
                    r["idle_wall_other_setting"] = wall
                else:
                    r["idle_wall"] = wall
            if reruns := self.record_reruns(r["key"]):  # its seeds run again for their records (--rerun-unrecorded)
                r["reruns"] = reruns
            if before := self.superseded(r["key"]):  # what it measured at the settings its tuning replaced
                r["superseded"] = before
        for r in rows:  # how each training row's setting was chosen (on the validation split), or that it was not
            if r.get("kind") == "train":
                t = self.tuned(r["key"])
                ran = (r.get("seeds") or [r])[0].get("hyperparameters") or {}
                if (t.get("from") or t.get("settings_from")) and r.get("status") != "pending" and any(
                        ran.get(k) != v for k, v in (t.get("chosen_setting") or {}).items()):
                    t = {}  # another budget's (or row's) choice this row did not run at (it ran before that tuning)
                r["tuning"] = ({k: t[k] for k in ("grid", "chosen", "chosen_setting", "metric", "search", "stages",
                                                  "results", "from", "settings_from", "source_setting")
                                if k in t} if t else {"grid": None, "chosen": "not retuned", "metric": None,
                                                   "setting": {"lr": r.get("lr")}})
        docs.mkdir(parents=True, exist_ok=True)
        meta = {"tier": self.opts.tier, "model": self.tier["model"], "data": self.tier["data"],
                "budget": self.budget, "settings": self.tier, "total_wall_s": round(time.perf_counter() - t0, 1),
                "command": "python benchmarks/compare_methods.py " + shlex.join(self.opts.argv),
                "regenerate": " && ".join("python benchmarks/compare_methods.py " + shlex.join(x)
                                          for x in regenerate_argv(self.opts.argv, rows)),
                "runs_dir": portable(str(self.runs)), "wikitext2": wikitext2_description(self.tier),
                "table6": [e.key for e in ABLATIONS], "code_versions": codes_not_in_history(rows),
                # where the default's gain comes from: each ablation of the default against it (run or not)
                "gain": [{"key": e.key, "label": e.label,
                          "pending": [] if e.key in {r["key"] for r in rows} else self.pending_grid(e.key)}
                         for e in DEFAULT_ABLATIONS]}
        png = write_chart(rows, meta, docs / f"{stem}.png")
        md = write_report(rows, meta, docs / f"{stem}.md", png)
        js = write_json(rows, meta, docs / f"{stem}.json")
        (self.runs / "rows.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {md}, {js} and {png} ({meta['total_wall_s']:.0f} s in all)")
        return md, png


RESCORED_FILE = "wikitext_rescored.json"  # a run's model scored again on its table's windows (--rescore-wikitext)
FIRST_WINDOWS_FILE = "first_windows.json"  # a run's model scored on the first N WikiText-2 windows (--first-windows)
IDLE_CORES = 0.25  # other processes' average use, in cores, below which a machine counts as idle for a wall time
MOVEMENT_KEYS = ("initial_flip_rate", "changed_groups", "flip_rate_mean", "flipped_fraction")


TUNABLE = ("lr", "l1_decay")  # the settings --tune chooses on the validation split


def parse_tune(spec: str) -> tuple[str, list[float] | None, list[float] | None]:
    """``--tune``'s ``lr=V1,V2,...`` / ``l1_decay=V1,V2,...`` (a grid), or ``l1_decay=forecast:F1,F2,...``
    (multiples of the λ the decay forecast says finishes the decay at this budget): (setting, values, multiples)."""
    name, _, values = spec.partition("=")
    if name not in TUNABLE or not values:
        raise SystemExit("--tune takes lr=V1,V2,... or l1_decay=V1,V2,... (a grid), or l1_decay=forecast:F1,F2,... "
                         "(multiples of the λ that the decay forecast says finishes the decay at this budget)")
    if values.startswith("forecast:"):
        if name != "l1_decay":
            raise SystemExit("--tune: only l1_decay takes forecast:F1,F2,... (the forecast gives a λ)")
        return name, None, [float(x) for x in values.removeprefix("forecast:").split(",")]
    return name, [float(x) for x in values.split(",")], None


def with_stages(record: dict) -> dict:
    """A tuning record with its ``stages`` (one per setting tuned, in order); a record of one grid written before
    stages existed becomes its one stage (tuned with nothing else fixed by an earlier stage)."""
    if "stages" in record or not record.get("grid"):
        return {**record, "stages": list(record.get("stages") or [])}
    name, values = next(iter(record["grid"].items()))
    return {**record, "stages": [{"name": name, "values": list(values), "fixed": None,
                                  "results": record.get("results") or {},
                                  "chosen": (record.get("chosen") or {}).get(name)}]}


def stage_named(record: dict | None, name: str) -> dict | None:
    """The stage of tuning record ``record`` (with its stages) that tuned setting ``name``; None if none did."""
    return next((x for x in (record or {}).get("stages", []) if x["name"] == name), None)


def stages_record(stages: list[dict], seed: int) -> dict:
    """The tuning record (``tuning.json``, a row's ``tuning``) of a search over ``stages``: the grid and choice of
    every setting, and (several settings) how the search went — one setting at a time, the others fixed."""
    metric = f"validation perplexity, seed {seed}"
    record = {"grid": {x["name"]: x["values"] for x in stages}, "chosen": {x["name"]: x["chosen"] for x in stages},
              "chosen_setting": {x["name"]: float(x["chosen"]) for x in stages}, "metric": metric,
              "stages": stages}
    if len(stages) == 1:
        record["results"] = stages[0]["results"]
    else:
        record["search"] = "coordinate, one setting at a time: " + "; then ".join(
            f"{x['name']} over {', '.join(x['values'])}"
            + (f" at {', '.join(f'{k} {v:g}' for k, v in x['fixed'].items() if k != x['name'])}"
               if x.get("fixed") else "") for x in stages)
        record["results"] = {f"{x['name']}={v}": r for x in stages for v, r in x["results"].items()}
    return record


def start_forecast(cfg) -> dict:
    """The decay forecast the trainer makes before a run's first update (``CastMethod.before_update``:
    :func:`cast_llm.optim.forecast.forecast_decay` on the whole lr schedule, the first batch's gradient setting
    the noise), made here without the run: the run's config, data, first batch, loss and clipping, the method's
    own model preparation and optimizer. With the λ that finishes the decay at this budget
    (:func:`cast_llm.optim.forecast.l1_decay_to_finish`); ~1 minute for SmolLM2-135M at one thread."""
    import copy

    import torch

    from cast_llm.data import prepare, steps_for_tokens
    from cast_llm.data.batches import BatchSampler
    from cast_llm.models import load_model, load_tokenizer
    from cast_llm.optim.forecast import l1_decay_knee, l1_decay_to_finish
    from cast_llm.train.methods import get_method
    from cast_llm.train.trainer import lm_loss

    tok = load_tokenizer(cfg.model)
    per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
    total = cfg.max_steps or steps_for_tokens(cfg.tokens, per_step)
    data = prepare(cfg.data, tok, cfg.seq_len, train_sequences=total * per_step // cfg.seq_len,
                   val_sequences=cfg.val_sequences, test_sequences=cfg.test_sequences, val_fraction=cfg.val_fraction,
                   test_fraction=cfg.test_fraction, calib_samples=cfg.calib_samples,
                   min_train_sequences=cfg.batch_size, max_documents=cfg.max_documents, cache_root=cfg.data_cache)
    method = get_method(cfg.method, mask_learner=cfg.mask_learner)
    model = load_model(cfg.model, dtype=torch.float32)
    teacher = copy.deepcopy(model).eval().requires_grad_(False) if method.uses_kd(cfg) else None
    torch.manual_seed(cfg.seed)
    method.prepare_model(model, cfg, data=data, device=torch.device("cpu"))
    opt = method.build_optimizer(model, cfg, total)
    if not hasattr(method, "_forecast") or not method.forecasts:
        raise SystemExit(f"start_forecast: --method {cfg.method} makes no decay forecast (AdamS's proportional decay)")
    sampler = BatchSampler(data.train.shape[0], cfg.batch_size, seed=cfg.seed)
    model.train()
    for micro in range(cfg.grad_accum):
        batch = data.train[sampler.index_list(micro)]
        t_logits = None
        if teacher is not None:
            with torch.no_grad():
                t_logits = teacher(input_ids=batch, use_cache=False).logits
        loss = lm_loss(model(input_ids=batch, use_cache=False).logits, t_logits, batch, cfg)[0]
        (loss / cfg.grad_accum).backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    fc = method._forecast(opt, suggest=True)
    lam = l1_decay_to_finish(opt, method._lrs, target=cfg.forecast_target)
    knee, knee_ratio, ceiling = l1_decay_knee(opt, method._lrs)
    return {"sparse_weight_ratio": fc.sparse_weight_ratio, "target": fc.target, "l1_decay_to_finish": lam,
            "l1_decay_knee": knee, "sparse_weight_ratio_at_knee": knee_ratio, "sparse_weight_ratio_ceiling": ceiling,
            "suggestions": dict(fc.suggestions), "lr": cfg.lr, "l1_decay": cfg.l1_decay, "total_steps": total,
            "made": "before the first update, as the trainer (benchmarks/compare_methods.py start_forecast)"}


def rerun_difference(rerun: dict, row: dict) -> dict[str, float]:
    """How far a rerun's test and WikiText-2 figures are from its row's, relative (inf where either lacks one)."""
    return {k: abs(rerun[k] / row[k] - 1) if rerun.get(k) is not None and row.get(k) else math.inf
            for k in ("test", "wikitext2")}


def code_version() -> str | None:
    """The commit the rows were run with (``+dirty`` when the checkout had uncommitted changes)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) or None


def codes_not_in_history(rows: list[dict]) -> dict:
    """The code versions the rows (every seed, grid point and re-run the table shows) record, and those that are
    no commit of this repository's history (run from a tree that was never committed, or since rewritten): a
    row's ``code`` says which code ran only where it can be checked out."""
    found: set[str] = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "code" and isinstance(v, str):
                    found.add(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(rows)
    missing = []
    for c in sorted(found):
        try:
            r = subprocess.run(["git", "cat-file", "-e", c.split("+")[0] + "^{commit}"], cwd=REPO,
                               capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return {"recorded": sorted(found), "not_in_history": None}
        if r.returncode != 0:
            missing.append(c)
    return {"recorded": sorted(found), "not_in_history": missing,
            "uncommitted_changes": sorted(c for c in found if c.endswith("+dirty"))}


class MachineLoad:
    """What else ran during a row: the cores the whole machine kept busy (``/proc/stat``) less the CPU this
    script and its children used, averaged over the row's wall time — 0 on an otherwise idle machine."""

    def __init__(self):
        import resource

        self._res = resource
        self.t0, self.stat0, self.cpu0 = time.perf_counter(), _proc_stat(), self._cpu()

    def _cpu(self) -> float:
        r = self._res
        return sum(getattr(r.getrusage(who), f) for who in (r.RUSAGE_SELF, r.RUSAGE_CHILDREN)
                   for f in ("ru_utime", "ru_stime"))

    def finish(self, own_cpu: float | None = None) -> dict:
        """``own_cpu``: the row's own CPU seconds where it ran in a child of its own (a training run): runs side
        by side (``--jobs``) are then each other's other jobs, not this script's own CPU."""
        wall = time.perf_counter() - self.t0
        stat1, cpus = _proc_stat(), os.cpu_count() or 1
        own = self._cpu() - self.cpu0 if own_cpu is None else own_cpu
        out = {"cores": cpus, "own_cores": round(own / wall, 2) if wall > 0 else None}
        if self.stat0 and stat1 and stat1[1] > self.stat0[1]:
            busy = cpus * (stat1[0] - self.stat0[0]) / (stat1[1] - self.stat0[1])
            out["busy_cores"] = round(busy, 2)
            out["other_cores"] = round(max(0.0, busy - (out["own_cores"] or 0)), 2)
        return out


def _proc_stat() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(v) - v[3] - v[4], sum(v)


def without_output_dir(cmd: str) -> str:
    """A row's command without its ``--output-dir`` (where the run went is not what it ran)."""
    parts = shlex.split(portable(cmd))
    out = []
    skip = False
    for a in parts:
        if skip:
            skip = False
        elif a == "--output-dir":
            skip = True
        else:
            out.append(a)
    return shlex.join(out)


def run_statistics(run: Path, results: dict) -> dict:
    """S_T (the sparse-weight ratio just before the final prune) and the median training tokens/s of a run."""
    records = []
    metrics = RunDir(run).metrics
    if metrics.is_file():
        records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    pruned = results.get("decay", {}).get("final_prune") or {}
    swr = pruned.get("sparse_weight_ratio")
    if swr is None:
        last = [r["sparse_weight_ratio"] for r in records if r.get("sparse_weight_ratio") is not None]
        swr = last[-1] if last else None
    speeds = sorted(r["tokens_per_s"] for r in records if r.get("tokens_per_s"))
    out = {"sparse_weight_ratio": swr, "tokens_per_s": speeds[len(speeds) // 2] if speeds else None,
           **mask_movement(run)}
    # the final prune's cost: the validation perplexity of the dense-forward model just before it and of the
    # pruned model just after (a run with a masked repair prunes where the repair begins), and the trainer's
    # decay forecast before the first update (S_T, and the λ it says would finish the decay)
    if pruned.get("validation_ppl_before") is not None or pruned.get("validation_ppl_after") is not None:
        out.update(prune_step=pruned.get("step"), prune_validation_before=pruned.get("validation_ppl_before"),
                   prune_validation_after=pruned.get("validation_ppl_after"))
    fc = results.get("decay", {}).get("forecast_at_start") or {}
    if fc:
        out.update(forecast_s_t=fc.get("sparse_weight_ratio"),
                   forecast_l1_decay=(fc.get("suggestions") or {}).get("l1_decay"))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tier", choices=sorted(TIERS), default="cpu", help="quick / cpu / gpu defaults")
    p.add_argument("--tokens", help="training tokens of runs WITHOUT KD (KD runs get 3/4), e.g. 40k, 40M")
    p.add_argument("--model", help="override the tier's model")
    p.add_argument("--data", help="override the tier's data (--data of cast-llm train)")
    p.add_argument("--device", help="override the tier's device (cpu / cuda)")
    p.add_argument("--ablations", action="store_true", help="also run the ablation rows of the paper's Table 6")
    p.add_argument("--sweeps", action="store_true", help="also run SR-STE at other λ_W (its best is in the table)")
    p.add_argument("--seeds", default="0", help="seeds of the seeded rows (CAST, naive), e.g. 0,1 (default 0)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps of each training row "
                                                             "(a stopped row resumes from it)")
    p.add_argument("--train-args", default="", help="extra `cast-llm train` flags for every training row")
    p.add_argument("--maskllm", action="store_true", help="also run MaskLLM")
    p.add_argument("--only", help="comma-separated row keys to run (e.g. maskllm,cast-no-kd); the report "
                                  "also keeps every other row that already finished")
    p.add_argument("--runs-dir", help="where the runs go (default runs/compare)")
    p.add_argument("--docs-dir", help="where the report goes (default docs/results)")
    p.add_argument("--fresh", action="store_true", help="redo runs that already finished")
    p.add_argument("--report-only", action="store_true", help="run nothing: rewrite the table, its JSON and its "
                                                               "chart from the rows that already finished")
    p.add_argument("--threads", type=int, help="CPU threads per run (default: torch's); 1 is fastest for the "
                                               "quick tier and on a crowded machine")
    p.add_argument("--jobs", type=int, default=1,
                   help="training runs at once (default 1): a tuning stage's grid points and a row's seeds run this "
                        "many side by side, each in its own process at --threads (--jobs 2 --threads 1 on 2 cores)")
    p.add_argument("--tune", help="lr=V1,V2,V3 or l1_decay=V1,V2,V3: tune each training row named by --only on this "
                                  "grid at the first seed (choice: lowest validation perplexity), then run its seeds "
                                  "at the choice; l1_decay=forecast:F1,F2,F3: λ at these multiples of the λ the "
                                  "trainer's decay forecast says finishes the decay at this budget (where none "
                                  "does, of the λ past which a larger one hardly raises S_T). A second --tune "
                                  "invocation on another setting tunes it at the first one's choice (a coordinate "
                                  "search, recorded as stages)")
    p.add_argument("--tune-only", help="comma-separated rows that --tune tunes (default: every training row run)")
    p.add_argument("--tuning-from", help="a compare-*.json, or the runs folder of another budget, whose rows' "
                                         "tuning choices this invocation reuses (192k takes 48k's)")
    p.add_argument("--settings-from", metavar="ROW",
                   help="run the training rows --only names at the settings ROW's own tuning chose at this budget "
                        "(the paper's Table 6: paper-exact CAST's tuned λ and lr with one part changed, "
                        "--settings-from cast); each row's tuning.json records where its settings came from, and "
                        "its seeds made at other settings are set aside (kept, reported beside)")
    p.add_argument("--idle-walls", action="store_true",
                   help="measure each row's wall time once (its first seed) on an otherwise idle machine, into "
                        "<runs>/walls/ (rows: --only's, else every finished row); nothing else runs; the table "
                        "shows it beside the rows' own times")
    p.add_argument("--first-windows", type=int, metavar="N",
                   help="score every finished row's model again on the first N WikiText-2 windows (its saved "
                        "model; the dense row: the model), so that a table on every window compares with tables "
                        "on N; nothing else runs; the table shows the figures beside the rows'")
    p.add_argument("--rerun-unrecorded", action="store_true",
                   help="with --first-windows: a training row's seed that has neither a per-window record nor its "
                        "saved model here is run again (its seed, its setting) into <runs>/reruns/<row>/seed-N, "
                        "and scored from the rerun's record when the rerun reproduces the row (rows: --only's, "
                        "else every row; each is a whole training run)")
    p.add_argument("--rescore-wikitext", action="store_true",
                   help="score every finished row whose command scored WikiText-2 on other windows than this "
                        "invocation's setting again from its saved model (its test figure checked), into "
                        "wikitext_rescored.json beside it; nothing else runs; the table takes that figure")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a tier setting for this invocation, e.g. wikitext_windows=0 (every window)")
    opts = p.parse_args(argv)
    opts.argv = list(sys.argv[1:] if argv is None else argv)
    return opts


# the evaluation settings a report describes once for all rows: (train option, tier setting)
EVAL_SETTINGS = (("--wikitext-windows", "wikitext_windows"), ("--test-sequences", "test_sequences"),
                 ("--val-sequences", "val_sequences"), ("--eval-seq-len", "eval_seq_len"), ("--seq-len", "seq_len"))


def evaluation_clash(rows: list[dict], tier: dict) -> str | None:
    """A one-line error when a row ran with an evaluation setting other than this invocation's (its command says
    so), since the report describes the evaluation from the settings: e.g. 192k rows run with every WikiText-2
    window reported by an invocation without ``--set wikitext_windows=0``. None when they agree."""
    for r in rows:
        for run in [r] + list(r.get("seeds") or []):
            cmd = run.get("command") or ""
            for flag, key in EVAL_SETTINGS:
                found = re.findall(rf"{flag} (\S+)", cmd)
                if key == "wikitext_windows" and (run.get("wikitext2_rescored") or {}).get("windows") is not None:
                    found = [str(run["wikitext2_rescored"]["windows"])]  # its model scored again (--rescore-wikitext)
                if found and tier.get(key) is not None and float(found[-1]) != float(tier[key]):
                    return (f"compare_methods: row {r.get('key')} ran with {flag} {found[-1]}, this invocation's "
                            f"setting is {tier[key]}: pass --set {key}={found[-1]} (as the rows were run), or "
                            "the report would describe another evaluation than its rows had"
                            + (" (or --rescore-wikitext: score the row's saved model again on this setting)"
                               if key == "wikitext_windows" else ""))
    return None


def tuning_prerequisites(rows: list[dict], base: list[str]) -> list[list[str]]:
    """The invocations that make the tuning choices rows reuse from another budget (``--tuning-from``): one
    ``--tune`` invocation at that budget per distinct grid, as its own table reruns it."""
    keep = [x for i, a in enumerate(base) if a in ("--tier", "--threads") for x in base[i:i + 2]]
    grids: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        tuning = r.get("tuning") or {}
        if tuning.get("grid") and tuning.get("from"):
            m = re.search(r"(?:^|[-/])(\d+(?:\.\d+)?[kKmMgG]?)(?:\.json)?$", tuning["from"])
            if m is None:
                continue  # a source not named by its budget: --tuning-from alone says where the choice came from
            for grid in stage_grids(tuning):
                grids.setdefault((m.group(1), grid), []).append(r["key"])
    return [keep + ["--tokens", budget, "--tune", grid, "--tune-only", ",".join(keys), "--seeds", "0",
                    "--only", ",".join(keys)] for (budget, grid), keys in grids.items()]


def stage_grids(tuning: dict) -> list[str]:
    """``--tune`` arguments that make a row's tuning record, one per stage in the order it ran (each grid as
    recorded: a grid centred on the decay forecast is given by the values it ran)."""
    return [f"{x['name']}={','.join(map(str, x['values']))}" for x in with_stages(tuning)["stages"]]


def regenerate_argv(argv: list[str], rows: list[dict]) -> list[list[str]]:
    """The invocations that run every row of ``rows`` from scratch, in order (joined with ``&&``, one command
    line): the tuning of another budget the rows reuse (``tuning_prerequisites``), one ``--tune`` invocation per
    distinct grid the rows were tuned over here (seed 0, as tuning runs), one per row whose settings another row's
    tuning chose (``--settings-from``), then one that runs every row with every seed any row has, each tuned row at
    its choice.

    A table grown by several ``--only`` invocations is regenerated by these (finished runs are reused, so on
    the same runs directory they run only what is missing, e.g. the seeds a row ran fewer of)."""
    # (where this invocation kept its runs and wrote its report is this machine's business: the rerun uses the
    # defaults, runs/compare and docs/results)
    dropped = ("--only", "--seeds", "--tune", "--tune-only", "--tuning-from", "--runs-dir", "--docs-dir",
               "--first-windows", "--jobs", "--settings-from")
    base, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in dropped:
            skip = True
        elif not a.startswith(tuple(f"{d}=" for d in dropped)) and a not in ("--fresh", "--report-only",
                                                                             "--idle-walls", "--rerun-unrecorded"):
            base.append(a)
    seeds = sorted({x["seed"] for r in rows for x in r.get("seeds", []) if x.get("seed") is not None})
    # the tuning the rows went through: a grid run here (--tune), or another budget's choice (--tuning-from)
    grids: dict[str, list[str]] = {}
    stage_of: dict[str, int] = {}  # a later stage's grid runs after every earlier stage's (its rows' choices first)
    for r in rows:
        tuning = r.get("tuning") or {}
        if tuning.get("grid") and not tuning.get("from"):
            for i, grid in enumerate(stage_grids(tuning)):
                grids.setdefault(grid, []).append(r["key"])
                stage_of[grid] = max(stage_of.get(grid, 0), i)
    out = tuning_prerequisites(rows, base) + [
        base + ["--tune", grid, "--tune-only", ",".join(keys), "--seeds", "0", "--only", ",".join(keys)]
        for grid, keys in sorted(grids.items(), key=lambda kv: stage_of[kv[0]])]
    sources = [x for src in sorted({r["tuning"]["from"] for r in rows if (r.get("tuning") or {}).get("from")})
               for x in ("--tuning-from", src)]
    # the rows that took another row's tuned settings (--settings-from), once that row's tuning has run
    taken: dict[str, list[str]] = {}
    for r in rows:
        if src := (r.get("tuning") or {}).get("settings_from"):
            taken.setdefault(src, []).append(r["key"])
    out += [base + sources + ["--settings-from", src, "--seeds", ",".join(map(str, seeds or [0])), "--only",
                              ",".join(keys)] for src, keys in sorted(taken.items())]
    walls = [r["key"] for r in rows if r.get("idle_wall")]  # then the wall times measured on an idle machine
    # and the rows' models scored on the first windows (--first-windows)
    first = sorted({x["wikitext2_first_windows"] for r in rows for x in r.get("seeds") or [r]
                    if x.get("wikitext2_first_windows")})
    return out + [base + sources + ["--seeds", ",".join(map(str, seeds or [0])),
                                    "--only", ",".join(r["key"] for r in rows)]] + (
        [base + sources + ["--idle-walls", "--only", ",".join(walls)]] if walls else []) + [
        base + sources + ["--first-windows", str(n)] for n in first]


# the exit code of an invocation whose rows did not all finish (stopped by a signal, or failed): the evidence queue
# then stops instead of taking the line as done; the same command resumes a stopped row
EXIT_UNFINISHED = 3


def main(argv=None) -> int:
    cmp = Comparison(parse_args(argv))
    cmp.run()
    if cmp.unfinished:
        print(f"not finished: {', '.join(cmp.unfinished)} (the same command resumes a stopped row); exit "
              f"{EXIT_UNFINISHED}", file=sys.stderr, flush=True)
        return EXIT_UNFINISHED
    return 0


__all__ = ["ORDER_CHECK", "main", "parse_args", "regenerate_argv", "TIERS", "budget_name", "CORE", "SRSTE_SWEEP",
           "MASKLLM", "ABLATIONS",
           "ALL_ENTRIES", "CAST_BEST", "DEFAULT_ABLATIONS", "MASK_CANDIDATES", "Entry", "Comparison", "run_statistics", "without_output_dir"]

if __name__ == "__main__":
    sys.exit(main())
