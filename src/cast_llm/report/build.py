"""Assemble the run report: tables and figures for one or several run folders → Markdown (+ HTML).

Sections: runs, final evaluation (results.json perplexities, zeroshot.json accuracies), training curves,
validation perplexity dense vs hard-masked (the paper's Fig. 4), mask-learning dynamics (flip rates,
sparse-weight ratio, weight tracking = Table 2, ratio histograms = Fig. 3, per-layer heatmaps). Every
quantity is defined in docs/analysis.md.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path

from cast_llm.errors import CastError
from cast_llm.io import RunDir, atomic_write_text
from cast_llm.report import plots
from cast_llm.report.document import Block, Heading, Image, Para, Table, to_html, to_markdown
from cast_llm.report.runs import Run, load_runs
from cast_llm.train.checkpoint import list_checkpoints
from cast_llm.train.rundir import RunLock
from cast_llm.train.summary import reading

PAPER_TABLE2 = "paper (Table 2): CAST 0.142 / 0.106 / 16.9 %; SR-STE 0.095 / 0.006 / 46.6 %"


@dataclass
class ReportFiles:
    folder: Path
    markdown: Path
    html: Path | None = None
    images: list[Path] = field(default_factory=list)


def _num(v, fmt: str = "{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def _pct(v, digits: int = 1) -> str:
    return "—" if v is None else f"{100 * v:.{digits}f} %"


def _ratio(v) -> str:
    if v is None:
        return "—"
    if v == 0:
        return "< 1e-6"
    return "∞" if v == float("inf") else (f"{v:.2f}" if v >= 0.1 else f"{v:.2g}")


def _tokens(v) -> str:
    if v is None:
        return "—"
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= div:
            return f"{v / div:.3g}{unit}"
    return f"{int(v)}"


class _Builder:
    def __init__(self, runs: list[Run], folder: Path):
        self.runs, self.folder = runs, folder
        self.blocks: list[Block] = []
        self.images: list[Path] = []

    def add(self, *blocks: Block) -> None:
        self.blocks.extend(blocks)

    def figure(self, fig, name: str, alt: str, missing: str) -> None:
        if fig is None:
            self.add(Para(missing))
            return
        path = self.folder / f"{name}.png"
        plots.save(fig, path)
        self.images.append(path)
        self.add(Image(path.name, alt))

    # ------------------------------------------------------------------------------------- sections
    def overview(self) -> None:
        rows = []
        for r in self.runs:
            c, res = r.config, r.results
            finished = bool((res.get("perplexity") or {}).get("heldout", {}).get("sparse") is not None
                            or res.get("tokens_trained"))
            last = r.metrics[-1]["step"] if r.metrics else 0
            status = "finished" if finished else _unfinished_status(r.path, last)
            kd = c.get("kd")
            kd_txt = "—" if kd is None and "eta" not in c else ("off" if kd is False else f"η={c.get('eta', 0):.2f}")
            rows.append([r.label, str(c.get("model", res.get("model", "—"))), res.get("pattern") or
                         f"{c.get('n', '?')}:{c.get('m', '?')}", _num(res.get("steps") or c.get("max_steps"), "{}"),
                         _tokens(r.total_tokens), _num(c.get("lr"), "{:g}"), _num(c.get("l1_decay"), "{:g}"),
                         kd_txt, _num(res.get("wall_time_s"), "{:.0f} s"), status])
        self.add(Heading(2, "Runs"),
                 Table(["run", "model", "pattern", "steps", "tokens", "lr", "λ (l1_decay)", "KD", "wall time",
                        "status"], rows, ["l", "l", "l", "r", "r", "r", "r", "l", "r", "l"]))
        self.add(Para("Folders: " + "; ".join(f"`{r.path}`" for r in self.runs)))

    def evaluation(self) -> None:
        self.add(Heading(2, "Final evaluation"))
        with_res = [r for r in self.runs if r.results.get("perplexity")]
        if not with_res:
            self.add(Para("No `results.json` with perplexities yet (runs still in progress)."))
        else:
            rows = []
            for r in with_res:
                ppl = r.results["perplexity"]
                h, w = ppl.get("heldout") or {}, ppl.get("wikitext2") or {}
                one = "oneshot" if h.get("oneshot") is not None or w.get("oneshot") is not None else "magnitude"
                rows.append([r.label] + [_num(d.get(k)) for d in (h, w) for k in ("dense", one, "sparse")])
            self.add(Table(["run", "held-out dense", "held-out one-shot (start)", "held-out trained sparse",
                            "WikiText-2 dense", "WikiText-2 one-shot (start)", "WikiText-2 trained sparse"], rows))
            notes = [f"{r.label}: held-out {r.results.get('heldout_sequences', '?')} sequences of "
                     f"{r.results.get('seq_len', '?')} tokens; WikiText-2 window {r.results.get('eval_seq_len', '?')}, "
                     f"{r.results.get('wikitext_windows', '?')} windows" for r in with_res]
            self.add(Para("Perplexity = exp(mean token NLL), lower is better; the sparse model is the exported one "
                          "(pruned, scales folded). " + "; ".join(notes) + "."))
            readings = [f"**{r.label}** — {line.removeprefix('reading: ')}" for r in with_res
                        if (line := reading(r.results))]
            if readings:
                self.add(Heading(3, "Reading"), *[Para(x) for x in readings])
        self.zeroshot()

    def zeroshot(self) -> None:
        zs = [r for r in self.runs if r.zeroshot and r.zeroshot.get("tasks")]
        if not zs:
            self.add(Para("Zero-shot accuracy: no `zeroshot.json` in the run folders "
                          "(`cast-llm eval zeroshot --model RUN_DIR --output-dir RUN_DIR` writes one)."))
            return
        tasks: list[str] = []
        for r in zs:
            tasks += [t["task"] for t in r.zeroshot["tasks"] if t["task"] not in tasks]
        rows = []
        for task in tasks + ["average"]:
            row = [f"**{task}**" if task == "average" else task]
            for r in zs:
                if task == "average":
                    a = r.zeroshot.get("average") or {}
                    row.append(f"{_num(_p(a.get('acc')))} / {_num(_p(a.get('acc_norm')))}")
                    continue
                t = next((t for t in r.zeroshot["tasks"] if t["task"] == task), {})
                row.append(f"{_num(_p(t.get('acc')))} / {_num(_p(t.get('acc_norm')))}")
            rows.append(row)
        self.add(Heading(3, "Zero-shot accuracy (lm-eval)"),
                 Table(["task"] + [f"{r.label} acc / acc_norm (%)" for r in zs], rows),
                 Para("Average of acc_norm uses acc for tasks without acc_norm. " + "; ".join(
                     f"{r.label}: lm-eval {r.zeroshot.get('lm_eval_version', '?')}, few-shot "
                     f"{r.zeroshot.get('num_fewshot') if r.zeroshot.get('num_fewshot') is not None else 'default'}"
                     + (f", limit {r.zeroshot['limit']} (subset)" if r.zeroshot.get("limit") else "") for r in zs)
                     + "."))

    def curves(self) -> None:
        self.add(Heading(2, "Training curves"))
        self.figure(plots.plot_loss(self.runs), "loss", "training loss", "No training records (`metrics.jsonl`).")
        self.figure(plots.plot_schedule(self.runs), "schedule", "learning rate and throughput",
                    "No learning-rate / throughput records.")
        self.add(Heading(2, "Validation perplexity: dense forward vs hard-masked"))
        self.add(Para("The same held-out slice scored with the dense in-training weights (what CAST's forward pass "
                      "uses) and with the weights hard-masked by the current masks (what pruning now would give). "
                      "The paper's Fig. 4: CAST keeps both close and the dense model healthy; SR-STE's dense model "
                      "degrades. In-between points need `--eval-every`."))
        self.figure(plots.plot_validation(self.runs), "validation", "validation perplexity",
                    "No validation perplexities during training (the run had no `--eval-every N`); its start and "
                    "end are in the evaluation table above.")

    def dynamics(self) -> None:
        self.add(Heading(2, "Mask-learning dynamics"),
                 Para("Definitions, equations and how to read each quantity: `docs/analysis.md` (method.md §7)."))
        self.add(Heading(3, "Flip rates"))
        self.figure(plots.plot_flips(self.runs), "flips", "flip rates", "No flip rates recorded.")
        self.add(Heading(3, "Sparse-weight ratio and tracked weights"))
        self.figure(plots.plot_weights(self.runs), "weights", "sparse-weight ratio and tracked |w|",
                    "No sparse-weight ratio recorded.")
        self.tracking_table()
        self.add(Heading(3, "|pruned| / |kept| magnitude ratios inside N:M groups"))
        self.add(Para("ρ = max |pruned| / min |kept| per group: near 1 the group is about to swap an entry; near 0 "
                      "the pruned weights have decayed and the final hard prune removes almost nothing. "
                      "Proportional decay (CAST) drives ρ towards 0; additive decay (SR-STE) leaves a tail near 1 "
                      "(the paper's Fig. 3)."))
        self.figure(plots.plot_ratio_histograms(self.runs), "ratio_hist", "ratio histograms",
                    "No ratio histograms recorded (`--ratio-hist-steps`).")
        rows = [[r.label, str(s["step"]), _pct(s["progress"], 0), f"{s['groups']:,}", _ratio(s.get("median")),
                 _ratio(s.get("p90")), _pct(s.get("below_1e-6")), _pct(s.get("below_0.1")), _pct(s.get("above_0.5")),
                 _num(s.get("mean"), "{:.3g}")]
                for r in self.runs for s in (r.dynamics.get("ratio_histograms") or {}).get("steps", [])]
        if rows:
            self.add(Table(["run", "step", "progress", "groups", "median ρ", "p90 ρ", "ρ < 1e-6", "ρ < 0.1", "ρ > 0.5",
                            "mean ρ"], rows),
                     Para("Quantiles are read off the bins: ±0.005 above 0.1, ±6 % below (log bins)."))
        self.add(Heading(3, "Per-layer flip rates"))
        for i, r in enumerate(self.runs):
            self.figure(plots.plot_layer_heatmap(r), f"layers_{i}", f"per-layer mask dynamics of {r.label}",
                        f"{r.label}: no per-layer statistics (`layers.jsonl`, `--layer-stats`).")

    def tracking_table(self) -> None:
        rows = []
        for r in self.runs:
            t = r.dynamics.get("weight_tracking")
            last = r.metrics[-1] if r.metrics else {}
            if not t and not last:
                continue
            t = t or {}
            rows.append([r.label, _num(t.get("kept_mean_abs"), "{:.4f}"), _num(t.get("pruned_mean_abs"), "{:.4f}"),
                         _num(t.get("last_flip_mean_abs"), "{:.4f}"), _pct(t.get("last_flip_progress")),
                         _pct(t.get("flipped_fraction")), _num(t.get("sample_size"), "{:,}"),
                         _pct(last.get("initial_flip_rate"), 2), _num(last.get("sparse_weight_ratio"), "{:.4f}")])
        if rows:
            self.add(Table(["run", "kept mean |w|", "pruned mean |w|", "mean |w| at last flip",
                            "progress at last flip", "sample flipped ≥ once", "sample", "final i_t", "final S_t"], rows),
                     Para(f"Weight tracking on a fixed random sample of target weights; {PAPER_TABLE2} (kept / at last "
                          "flip / progress). Final i_t is the total flipped mask ratio (paper: 3.4–16 %)."))


def _unfinished_status(path: Path, last_step: int) -> str:
    """A run without final results: still running (its lock is held), or stopped (resumable or not)."""
    if RunLock.held(path):  # probed: a report never creates, writes or follows anything in a run folder
        return f"running (step {last_step})"
    found = list_checkpoints(path)
    if found:
        return f"stopped at step {last_step}; `--resume` continues from {found[-1].name}"
    return f"stopped at step {last_step}, no checkpoint (it cannot be resumed)"


def _p(v):
    return None if v is None else 100 * v


def default_output(runs: list[Run]) -> Path:
    return runs[0].path / RunDir.REPORT_ASSETS if len(runs) == 1 else Path("cast-llm-report")


def build_report(run_dirs: list[str | Path], output: str | Path | None = None, *, html: bool = False,
                 title: str | None = None) -> ReportFiles:
    """Write ``report.md`` (and ``report.html`` with embedded PNGs) plus the PNGs into ``output``."""
    runs = load_runs(list(run_dirs))
    folder = Path(output) if output else default_output(runs)
    if not output and folder.is_symlink():  # planted in a received run folder: never written through
        raise CastError(f"{folder} is a link, not the report folder cast-llm writes; remove it, or pass --output")
    if folder.exists() and not folder.is_dir():
        raise CastError(f"--output {folder} exists and is a file; choose a folder")
    folder.mkdir(parents=True, exist_ok=True)
    title = title or ("cast-llm report: " + ", ".join(r.label for r in runs))
    b = _Builder(runs, folder)
    b.add(Heading(1, title), Para(f"Generated {_dt.date.today().isoformat()} by `cast-llm report` from "
                                  f"{len(runs)} run folder(s)."))
    b.overview()
    b.evaluation()
    b.curves()
    b.dynamics()
    md = folder / "report.md"
    atomic_write_text(md, to_markdown(b.blocks))
    out = ReportFiles(folder=folder, markdown=md, images=b.images)
    if html:
        out.html = folder / "report.html"
        atomic_write_text(out.html, to_html(b.blocks, folder, title))
    return out
