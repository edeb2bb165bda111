"""A tiny real training run writes the analysis files; `cast-llm report` on one and two runs (CPU, seconds)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import tiny
from safetensors.torch import load_file

from cast_llm.analysis.files import DYNAMICS_FILE, LAYERS_FILE, RATIO_FILE, load_ratio_histograms, read_layers
from cast_llm.cli import main

SECTIONS = ("## Runs", "## Final evaluation", "## Training curves", "## Validation perplexity",
            "## Mask-learning dynamics", "### Flip rates", "### Sparse-weight ratio and tracked weights",
            "magnitude ratios inside N:M groups", "### Per-layer flip rates")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    tiny.save_model(d / "llama", "llama")
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    return d


def _train(d, out, *extra):
    argv = ["train", "--model", str(d / "llama"), "--data", str(d / "corpus.jsonl"), "--output-dir", str(out),
            "--wikitext-file", str(d / "eval.txt"), "--batch-size", "2", "--seq-len", "32", "--val-sequences", "2",
            "--no-progress", "--lr", "3e-3", "--l1-decay", "1e-4", "--mask-interval", "2", "--log-every", "2",
            "--max-steps", "8", "--track-weights", "500", "--paper-exact", *extra]
    assert main(argv) == 0


@pytest.fixture(scope="module")
def run_dir(workdir):
    _train(workdir, workdir / "run", "--eval-every", "4")
    return workdir / "run"


def test_training_run_writes_the_analysis_files(run_dir):
    # and, by default, its HTML report (the other test modules train with --no-report)
    assert json.loads((run_dir / "results.json").read_text())["report"] == str(run_dir / "report" / "report.html")
    assert (run_dir / "report" / "report.html").is_file()
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [2, 4, 6, 8]
    assert all(r["tracked_kept_abs"] > r["tracked_pruned_abs"] > 0 for r in recs)
    lay = read_layers(run_dir / LAYERS_FILE)
    assert lay["steps"].tolist() == [2, 4, 6, 8] and len(lay["names"]) == 14
    state = load_file(run_dir / "model.safetensors")
    sizes = np.array([state[f"{n}.weight"].numel() for n in lay["names"]])
    for i, r in enumerate(recs):  # the per-layer rates, weighted by size, are the aggregate ones
        for key in ("flip_rate", "initial_flip_rate"):
            assert (lay[key][i] * sizes).sum() / sizes.sum() == pytest.approx(r[key], abs=1e-5)
    dyn = json.loads((run_dir / DYNAMICS_FILE).read_text())
    wt = dyn["weight_tracking"]
    assert wt["sample_size"] == 500 and wt["last_step"] == 8 and wt["checks"] == 5  # steps 1, 2, 4, 6, 8
    assert 0 < wt["last_flip_progress"] <= 1 and wt["kept_mean_abs"] > 0
    z = load_ratio_histograms(run_dir / RATIO_FILE)
    assert z["steps"].tolist() == [1, 4, 8]  # the default 0.1, 0.5, 1.0 of 8 steps
    assert (z["lin_counts"].sum(1) + z["lin_overflow"] == z["groups"]).all()
    assert [s["step"] for s in dyn["ratio_histograms"]["steps"]] == [1, 4, 8]


def _analysis_files(d):
    z = load_ratio_histograms(d / RATIO_FILE)
    metrics = [{k: v for k, v in json.loads(x).items() if k != "tokens_per_s"}
               for x in (d / "metrics.jsonl").read_text().splitlines()]
    return ((d / LAYERS_FILE).read_text(), json.loads((d / DYNAMICS_FILE).read_text()),
            {k: v.tolist() for k, v in z.items()}, metrics)


def test_resumed_run_rewrites_the_analysis_files_identically(workdir):
    out = workdir / "resumed"
    _train(workdir, out, "--save-every", "4", "--no-baseline-eval", "--ratio-hist-steps", "0.25,0.75,1.0",
           "--keep-checkpoints-after")
    ref = _analysis_files(out)
    _train(workdir, out, "--save-every", "4", "--no-baseline-eval", "--ratio-hist-steps", "0.25,0.75,1.0",
           "--resume")  # from the step-4 checkpoint: steps 5-8 and the end again
    assert _analysis_files(out) == ref


def _images(md: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def test_report_on_one_run_writes_markdown_html_and_pngs(run_dir, capsys):
    assert main(["report", str(run_dir), "--html"]) == 0
    folder = run_dir / "report"
    md = (folder / "report.md").read_text()
    for s in SECTIONS:
        assert s in md, s
    assert "run (cast)" in md and "no `zeroshot.json`" in md
    images = _images(md)
    assert set(images) == {"loss.png", "schedule.png", "validation.png", "flips.png", "weights.png",
                           "ratio_hist.png", "layers_0.png"}
    for name in images:
        data = (folder / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    html = (folder / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == len(images)
    assert re.findall(r'src="(?!data:)', html) == []  # self-contained: no external references
    assert "<table>" in html and "Mask-learning dynamics" in html
    assert "report.md" in capsys.readouterr().out


def test_report_overlays_two_runs_and_shows_zeroshot(run_dir, tmp_path):
    other = tmp_path / "sweep" / "run"  # same folder name: labels widen to parent/name
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("report", "*.safetensors"))
    zs = {"tasks": [{"task": "piqa", "acc": 0.61, "acc_norm": 0.62}, {"task": "winogrande", "acc": 0.51}],
          "subtasks": [], "average": {"acc": 0.56, "acc_norm": 0.565, "n_tasks": 2}, "num_fewshot": None,
          "limit": None, "seconds": 1.0, "lm_eval_version": "0.4.9", "model": str(other)}
    (other / "zeroshot.json").write_text(json.dumps(zs))
    out = tmp_path / "cmp"
    assert main(["report", str(run_dir), str(other), "--output", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert f"{run_dir.parent.name}/run (cast)" in md and "sweep/run (cast)" in md
    assert "Zero-shot accuracy (lm-eval)" in md and "| piqa | 61.00 / 62.00 |" in md and "| winogrande | 51.00 / — |" in md
    assert "layers_1.png" in _images(md) and not (out / "report.html").exists()
    assert md.count("| sweep/run (cast) |") >= 4  # runs, perplexity, weight tracking, ratio summary rows


def test_report_on_a_run_in_progress(run_dir, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()[:2]
    (partial / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')  # torn last line
    assert main(["report", str(partial)]) == 0
    md = (partial / "report" / "report.md").read_text()
    assert "stopped at step 4, no checkpoint (it cannot be resumed)" in md and "No `results.json`" in md
    assert "No ratio histograms recorded" in md and "loss.png" in _images(md)
    from cast_llm.train.rundir import RunLock

    with RunLock(partial):  # a job holds the folder: the run is still going
        assert main(["report", str(partial)]) == 0
    assert "running (step 4)" in (partial / "report" / "report.md").read_text()
    (partial / "checkpoints" / "step-00000004").mkdir(parents=True)
    (partial / "checkpoints" / "step-00000004" / "meta.json").write_text("{}")
    assert main(["report", str(partial)]) == 0
    assert "stopped at step 4; `--resume` continues from step-00000004" in (partial / "report" / "report.md").read_text()


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "is not a cast-llm run folder"),
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text("x"), "is a file"),
])
def test_not_a_run_folder_is_a_one_line_error(tmp_path, capsys, make, message):
    p = tmp_path / "thing"
    make(p)
    assert main(["report", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and str(p) in err and len(err.splitlines()) == 1
