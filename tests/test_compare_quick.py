"""``benchmarks/compare_methods.py --tier quick`` end to end, so the comparison script cannot rot."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_compare_quick_tier_writes_table_and_chart(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    docs = tmp_path / "docs"
    assert compare_methods.main(["--tier", "quick", "--runs-dir", str(tmp_path / "runs"), "--docs-dir",
                                 str(docs)]) == 0
    md = docs / "compare-tiny-llama-256.md"
    png = docs / "compare-tiny-llama-256.png"
    assert md.is_file() and png.is_file() and png.stat().st_size > 10_000
    text = md.read_text()
    for label in ("Dense", "Magnitude", "Wanda", "SparseGPT", "Naive retraining", "Naive retraining from SparseGPT",
                  "SparseGPT + KD (fixed mask)", "SR-STE", "AST", "CAST (paper-exact)",
                  "CAST (default: warm start from SparseGPT)"):
        assert f"| {label} |" in text, label
    assert "## Against SparseGPT + KD (fixed mask), seed by seed" in text
    assert "## Tuning (validation split only)" in text and "not retuned" in text
    assert "failed" not in text and "## The paper's ordering" in text and "cast-llm train" in text
    rows = json.loads((tmp_path / "runs" / "tiny-llama-256" / "rows.json").read_text())["rows"]
    assert all(r["status"] == "ok" and r["heldout"] > 1 and r["wikitext2"] > 1 for r in rows)
    tokens = {r["key"]: r["tokens"] for r in rows}
    assert tokens["cast"] == tokens["ast"] == 3 * tokens["naive"] // 4 == 3 * tokens["srste"] // 4  # equal compute
    # finished runs are reused, and --only adds rows to the same table
    before = (tmp_path / "runs" / "tiny-llama-256" / "cast" / "seed-0" / "compare_row.json").stat().st_mtime
    compare_methods.main(["--tier", "quick", "--runs-dir", str(tmp_path / "runs"), "--docs-dir", str(docs),
                          "--only", "cast,cast-no-kd"])
    assert (tmp_path / "runs" / "tiny-llama-256" / "cast" / "seed-0" / "compare_row.json").stat().st_mtime == before
    text = md.read_text()
    assert "| CAST w/o KD |" in text and "| Wanda |" in text
    # the table grew by --only; its top gives the one command that runs all its rows
    rerun = text.splitlines()[2]  # first under the title; without this machine's runs and docs folders
    assert rerun.startswith("Rerun every row from scratch") and "`python benchmarks/compare_methods.py --tier quick" \
        in rerun and ",cast-no-kd`" in rerun and "--seeds 0 --only dense," in rerun and "--runs-dir" not in rerun
    # the JSON beside the table: every row with its seeds, what a script checks
    data = json.loads((docs / "compare-tiny-llama-256.json").read_text())
    by = {r["name"]: r for r in data["rows"]}
    assert set(by) == {r["key"] for r in json.loads((tmp_path / "runs" / "tiny-llama-256" / "rows.json")
                                                     .read_text())["rows"]}
    cast = by["cast-best"]
    assert cast["seeds"][0]["seed"] == 0 and cast["heldout"] == cast["seeds"][0]["heldout"] > 1
    assert cast["initial_flip_rate"] is not None and cast["changed_groups"] is not None  # masks moved, or not
    assert by["naive"]["initial_flip_rate"] == 0.0  # a fixed mask never moves
    # every trained row says how its setting was chosen: the grid, the choice, the metric (or "not retuned")
    for r in data["rows"]:
        if r["kind"] == "train":
            assert {"grid", "chosen", "metric"} <= set(r["tuning"]), r["name"]
            assert (r["tuning"]["chosen"] == "not retuned") == (r["tuning"]["grid"] is None), r["name"]
    # a fresh checkout has no runs folder: the recorded runs are reused, nothing is trained again
    import shutil

    shutil.rmtree(tmp_path / "runs" / "tiny-llama-256")
    compare_methods.main(["--tier", "quick", "--runs-dir", str(tmp_path / "runs"), "--docs-dir", str(docs),
                          "--only", "dense"])
    again = json.loads((docs / "compare-tiny-llama-256.json").read_text())
    assert {r["name"]: r["heldout"] for r in again["rows"]} == {r["name"]: r["heldout"] for r in data["rows"]}
    assert not (tmp_path / "runs" / "tiny-llama-256" / "cast" / "seed-0" / "model").exists()
    text = md.read_text()
    assert " †" in text and "taken from `" in text


def test_report_keeps_the_seeds_that_finished(tmp_path):
    """A seeded row run with fewer seeds than ``--seeds`` stays in the table, with its seed count."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
        from compare_report import _ppl, paired, write_chart
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    cmp = compare_methods.Comparison(compare_methods.parse_args(
        ["--tier", "cpu", "--tokens", "1k", "--seeds", "0,1", "--runs-dir", str(tmp_path)]))
    entry = {e.key: e for e in compare_methods.ALL_ENTRIES}
    for key, seed, ppl in (("naive", 0, (40.0, 140.0)), ("naive", 1, (44.0, 150.0)), ("cast", 0, (200.0, 400.0))):
        out = cmp.runs / key / f"seed-{seed}"
        out.mkdir(parents=True)
        (out / "compare_row.json").write_text(json.dumps(
            {"key": key, "seed": seed, "status": "ok", "heldout": ppl[0], "wikitext2": ppl[1], "wall_s": 10.0,
             "command": f"cast-llm train --seed {seed}", "sparse_weight_ratio": 0.9, "tokens_per_s": 100.0}))
    (cmp.runs / "cast" / "seed-x").mkdir()  # not a seed directory: ignored
    assert cmp.finished_seeds(entry["naive"]) == [0, 1] and cmp.finished_seeds(entry["cast"]) == [0]
    assert cmp.finished_seeds(entry["cast-best"]) == []
    naive = cmp.run_entry(entry["naive"], cmp.finished_seeds(entry["naive"]))
    assert naive["heldout"] == 42.0 and naive["wikitext2_range"] == [140.0, 150.0] and len(naive["seeds"]) == 2
    assert naive["command"].endswith("(and with --seed 1)")
    assert _ppl(naive, "heldout") == "42.00<br>(s0 40.00, s1 44.00)"
    # paired by seed: differences -1 and +1 -> mean 0, sd sqrt(2), half-width t(1) * sqrt(2) / sqrt(2) = 12.706
    other = {**naive, "key": "other", "seeds": [{**x, "heldout": x["heldout"] + d}
                                                 for x, d in zip(naive["seeds"], (1.0, -1.0))]}
    p = paired(naive, other, "test")
    assert p["against"] == "other" and p["n"] == 2 and p["mean_diff"] == 0.0 and p["ci95"] == [-12.706, 12.706]
    assert p["verdict"] == "level" and [x["diff"] for x in p["per_seed"]] == [-1.0, 1.0]
    worse = {**naive, "key": "worse", "seeds": [{**x, "heldout": x["heldout"] - d}
                                                 for x, d in zip(naive["seeds"], (3.0, 3.1))]}
    assert paired(naive, worse, "test")["verdict"] == "worse" and paired(worse, naive, "test")["verdict"] == "better"
    one = {**naive, "seeds": [{**naive["seeds"][1], "heldout": 45.0}]}
    assert paired(naive, one, "test") is None  # one common seed: no interval
    cast = cmp.run_entry(entry["cast"], cmp.finished_seeds(entry["cast"]))
    assert len(cast["seeds"]) == 1 and _ppl(cast, "wikitext2") == "400.00<br>(1 seed)"
    argv = ["--tier", "cpu", "--tokens", "192k", "--only", "naive", "--seeds=0", "--fresh", "--threads", "2"]
    assert compare_methods.regenerate_argv(argv, [naive, cast, {"key": "dense", "seed": None}]) == [[
        "--tier", "cpu", "--tokens", "192k", "--threads", "2", "--seeds", "0,1", "--only", "naive,cast,dense"]]
    # rows tuned over different grids: one tuning invocation per grid, then every row with every seed
    tuned = [{**naive, "tuning": {"grid": {"lr": ["1e-4", "2e-4"]}}}, {**cast, "tuning": {"grid": {"lr": ["1e-3"]}}},
             {"key": "far", "seeds": [], "tuning": {"grid": {"lr": ["1"]}, "from": "runs/48k"}}]
    base = ["--tier", "cpu", "--tokens", "192k", "--threads", "2"]
    assert compare_methods.regenerate_argv(argv, tuned) == [
        # the other budget's tuning first (the rerun starts from nothing), then this budget's grids
        ["--tier", "cpu", "--threads", "2", "--tokens", "48k", "--tune", "lr=1", "--tune-only", "far", "--seeds", "0",
         "--only", "far"],
        base + ["--tune", "lr=1e-4,2e-4", "--tune-only", "naive", "--seeds", "0", "--only", "naive"],
        base + ["--tune", "lr=1e-3", "--tune-only", "cast", "--seeds", "0", "--only", "cast"],
        base + ["--tuning-from", "runs/48k", "--seeds", "0,1", "--only", "naive,cast,far"]]
    for r, kind, label in ((naive, "train", "Naive"), (cast, "train", "CAST")):
        r.update(kind=kind, label=label)
    png = write_chart([naive, cast], {"model": "m", "budget": 1000, "tier": "cpu"}, tmp_path / "c.png")
    assert png.is_file() and png.stat().st_size > 10_000  # whiskers for the 2-seed row, none for the other


def test_table6_rows_are_held_against_paper_exact_seed_by_seed(tmp_path):
    """The paper's Table 6 ablates its own algorithm: each ablation row is set against paper-exact CAST on the
    seeds both ran — with an interval from two seeds on, as one seed's difference (no verdict) with one — and
    paper-exact's own seed spread is printed as the scale a one-seed difference must beat."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
        from compare_report import paired_lines, seed_difference, table6_lines, write_json
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    keys = [e.key for e in compare_methods.ABLATIONS]
    assert {"cast-no-kd", "naive-kd-adams", "cast-srste", "cast-additive", "cast-sgpt-fixed"} <= set(keys)

    def row(key, vals, label):
        seeds = [{"seed": i, "status": "ok", "heldout": t, "wikitext2": w} for i, (t, w) in vals.items()]
        return {"key": key, "label": label, "kind": "train", "status": "ok", "seeds": seeds,
                "heldout": sum(x["heldout"] for x in seeds) / len(seeds),
                "wikitext2": sum(x["wikitext2"] for x in seeds) / len(seeds)}

    cast = row("cast", {0: (100.0, 400.0), 1: (140.0, 410.0), 2: (70.0, 270.0)}, "CAST (paper-exact)")
    no_kd = row("cast-no-kd", {0: (120.0, 500.0)}, "CAST w/o KD")
    adams = row("naive-kd-adams", {0: (90.0, 380.0), 1: (120.0, 400.0)}, "Naive + KD + AdamS")
    other = row("naive-kd-sgpt", {0: (27.0, 70.0)}, "SparseGPT + KD")  # not a Table 6 row
    one = seed_difference(no_kd, cast, "test")
    assert one["n"] == 1 and one["mean_diff"] == 20.0 and one["ci95"] is None and one["verdict"] is None
    two = seed_difference(adams, cast, "test")
    assert two["n"] == 2 and two["mean_diff"] == -15.0 and two["verdict"] == "level"
    assert seed_difference(no_kd, row("cast", {5: (1.0, 1.0)}, "x"), "test") is None
    lines = table6_lines([cast, no_kd, adams, other], keys)
    assert lines[0].startswith("Paper-exact CAST's own seeds span 70.00–140.00 on test (×2.00)")
    assert "- CAST w/o KD: test +20.00 (+20.0 %, seed 0 only: no interval); WikiText-2 +100.00" in lines[2]
    assert "2 seeds): **level**" in lines[3] and not any("SparseGPT + KD" in x for x in lines)
    assert table6_lines([no_kd, adams], keys) == []  # no paper-exact row: nothing to hold them against
    # against SparseGPT + KD the same words: one common seed is that seed's difference, none is said so
    vs_kd = paired_lines([cast, other, row("cast-best", {7: (1.0, 1.0)}, "CAST (default)")])
    assert vs_kd[0].startswith("- CAST (paper-exact): test +73.00 (+270.4 %, seed 0 only: no interval); "
                               "WikiText-2 +330.00 (+471.4 %, seed 0 only: no interval)"), vs_kd
    assert vs_kd[1].startswith("- CAST (default): test: no common seed; WikiText-2: no common seed"), vs_kd
    doc = json.loads(write_json([cast, no_kd, other], {"table6": keys}, tmp_path / "t.json").read_text())
    by = {r["name"]: r for r in doc["rows"]}
    assert by["cast-no-kd"]["paired_paper_exact"]["test"]["mean_diff"] == 20.0
    assert "paired_paper_exact" not in by["naive-kd-sgpt"] and "paired_paper_exact" not in by["cast"]
    # rows that record their setting are held against paper-exact at that setting: its row where it ran there, else
    # its seeds a later tuning set aside (192k: the ablations ran at λ 1e-4, paper-exact was tuned to 2.6e-3)
    def at(r, lr, decay):
        return {**r, "seeds": [{**x, "hyperparameters": {"lr": lr, "l1_decay": decay}} for x in r["seeds"]]}

    tuned = {**at(row("cast", {0: (40.0, 150.0)}, "CAST (paper-exact)"), 5e-4, 2.6e-3),
             "superseded": [{"setting": {"lr": 5e-4, "l1_decay": 1e-4},
                             "seeds": [{"seed": x["seed"], "test": x["heldout"], "wikitext2": x["wikitext2"]}
                                       for x in cast["seeds"]]}]}
    lines = table6_lines([tuned, at(no_kd, 5e-4, 1e-4), at(adams, 5e-4, 2.6e-3), at(other, 4e-4, 0.0),
                          at(row("cast-srste", {0: (1.0, 1.0)}, "SR-STE"), 1e-3, 1e-4)], keys)
    assert lines[0].startswith("Paper-exact CAST's own seeds at lr 0.0005, l1_decay 0.0001 span 70.00–140.00")
    assert lines[2].startswith("- CAST w/o KD (against paper-exact at lr 0.0005, l1_decay 0.0001, its seeds before "
                               "the tuning): test +20.00 (+20.0 %, seed 0 only"), lines
    assert lines[3].startswith("- Naive + KD + AdamS (against paper-exact at lr 0.0005, l1_decay 0.0026, its row): "
                               "test +50.00 (+125.0 %, seed 0 only"), lines
    assert lines[4] == ("- SR-STE: paper-exact CAST has no run at this row's setting (lr 0.001, l1_decay 0.0001): "
                        "not paired")
    doc = json.loads(write_json([tuned, at(no_kd, 5e-4, 1e-4)], {"table6": keys}, tmp_path / "u.json").read_text())
    kd_pair = next(r for r in doc["rows"] if r["name"] == "cast-no-kd")["paired_paper_exact"]
    assert kd_pair["runs"] == "its seeds before the tuning" and kd_pair["test"]["mean_diff"] == 20.0


def test_fresh_redoes_only_the_rows_it_runs(tmp_path):
    """``--fresh --only naive`` reruns naive; the other finished rows of the table are reused as they are."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    cmp = compare_methods.Comparison(compare_methods.parse_args(
        ["--tier", "cpu", "--tokens", "1k", "--seeds", "0", "--fresh", "--only", "naive", "--runs-dir",
         str(tmp_path / "runs"), "--docs-dir", str(tmp_path / "docs")]))
    for key, seed in (("naive", 0), ("cast", 0), ("cast", 1)):
        out = cmp.runs / key / f"seed-{seed}"
        out.mkdir(parents=True)
        (out / "compare_row.json").write_text(json.dumps(
            {"key": key, "label": key, "kind": "train", "kd": False, "weight_update": "-", "mask": "-", "tokens": 1,
             "seed": seed, "status": "ok", "heldout": 40.0 + seed, "wikitext2": 140.0, "wall_s": 10.0,
             "command": f"cast-llm train --seed {seed}"}))
    ran = []

    def fake(e, out, seed):
        ran.append((e.key, seed))
        return {**json.loads((out / "compare_row.json").read_text()), "heldout": 30.0}

    cmp._run_one = fake
    cmp.run()
    assert ran == [("naive", 0)]
    rows = {r["name"]: r for r in json.loads((tmp_path / "docs" / "compare-smollm2-135m-1k.json").read_text())["rows"]}
    assert rows["naive"]["heldout"] == 30.0 and rows["cast"]["heldout"] == 40.5 and len(rows["cast"]["seeds"]) == 2


def test_a_row_stopped_by_a_signal_is_reported_resumable_not_failed(tmp_path, capsys):
    """A training run that exits with EXIT_PREEMPTED (stopped by SIGTERM after its checkpoint) is a ``stopped``
    row, said to be resumable; any other non-zero exit is ``failed``. Neither is kept as finished."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from cast_llm.train.preemption import EXIT_PREEMPTED

    cmp = compare_methods.Comparison(compare_methods.parse_args(
        ["--tier", "cpu", "--tokens", "1k", "--seeds", "0", "--only", "naive", "--runs-dir", str(tmp_path / "runs"),
         "--docs-dir", str(tmp_path / "docs")]))
    entry = next(e for e in compare_methods.ALL_ENTRIES if e.key == "naive")
    for rc, status in ((EXIT_PREEMPTED, "stopped"), (1, "failed")):
        def fake(argv, log, cpu=None, rc=rc):
            log.write_text("training...\nstopped at step 3 of 282 (SIGTERM); checkpoint step-00000003\n")
            return rc

        cmp._run_cli = fake
        out = tmp_path / status
        row = cmp._run_one(entry, out, 0)
        assert row["status"] == status and "step 3 of 282" in row["error"]
        assert not (out / "compare_row.json").is_file()
        printed = capsys.readouterr().out
        assert ("STOPPED (resumable" in printed) == (status == "stopped") and ("FAILED" in printed) == (rc == 1)


def test_report_only_runs_nothing_and_keeps_every_finished_row(tmp_path):
    """``--report-only`` rewrites the table from the finished rows; no row runs, not even one --seeds names."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    argv = ["--tier", "cpu", "--tokens", "1k", "--seeds", "0,1", "--report-only", "--runs-dir",
            str(tmp_path / "runs"), "--docs-dir", str(tmp_path / "docs")]
    cmp = compare_methods.Comparison(compare_methods.parse_args(argv))
    for key, seed in (("naive-kd-sgpt", 0), ("cast-best", 0), ("cast-best", 1)):
        out = cmp.runs / key / f"seed-{seed}"
        out.mkdir(parents=True)
        (out / "compare_row.json").write_text(json.dumps(
            {"key": key, "label": key, "kind": "train", "kd": True, "weight_update": "-", "mask": "-", "tokens": 1,
             "seed": seed, "status": "ok", "heldout": 40.0 + seed, "wikitext2": 140.0, "wall_s": 10.0,
             "command": f"cast-llm train --seed {seed}"}))
    ran = []
    cmp._run_one = lambda e, out, seed: ran.append((e.key, seed))
    cmp.run()
    assert ran == []  # seed 1 of naive-kd-sgpt is missing, and still nothing ran
    data = json.loads((tmp_path / "docs" / "compare-smollm2-135m-1k.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"naive-kd-sgpt", "cast-best"} and len(rows["cast-best"]["seeds"]) == 2
    assert "--report-only" not in data["regenerate"] and "naive-kd-sgpt" in data["regenerate"]
    head = (tmp_path / "docs" / "compare-smollm2-135m-1k.md").read_text().splitlines()[2]
    assert f"from scratch (one command line; on the same runs folder it runs only what is missing): " \
           f"`{data['regenerate']}`" in head  # the table names the command that runs all its rows
    # a row whose every seed a new setting set aside (none finished at it yet) stays, pending, with its figures
    # from before (the table regenerated while --settings-from's seeds run)
    (cmp.runs / "cast-srste" / "seed-0.superseded-lr-0.0005").mkdir(parents=True)
    (cmp.runs / "cast-srste" / "seed-0.superseded-lr-0.0005" / "compare_row.json").write_text(json.dumps(
        {"key": "cast-srste", "kind": "train", "seed": 0, "status": "ok", "test": 50.0, "heldout": 50.0,
         "wikitext2": 150.0, "hyperparameters": {"lr": 5e-4}, "command": "cast-llm train"}))
    cmp.run()
    rows = {r["name"]: r for r in json.loads((tmp_path / "docs" / "compare-smollm2-135m-1k.json").read_text())["rows"]}
    assert rows["cast-srste"]["status"] == "pending" and rows["cast-srste"]["superseded"][0]["test"] == 50.0
    md = (tmp_path / "docs" / "compare-smollm2-135m-1k.md").read_text()
    assert "(pending, its seeds set aside for a new setting)" in md and "| pending | pending |" in md


def test_commands_read_from_the_repository_root_whichever_checkout_ran_them():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_report
        from compare_report import portable, register_runs_folder
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    # a runs folder given with --runs-dir is named where a fresh clone's rerun puts it
    register_runs_folder("/scratch/q/compare", "runs/compare")
    try:
        assert portable("--output-dir /scratch/q/compare/m-48k/cast/seed-0/model x") == \
            "--output-dir runs/compare/m-48k/cast/seed-0/model x"
        assert portable("/scratch/q/compare-old/a") == "/scratch/q/compare-old/a"  # another folder, left alone
    finally:
        compare_report.RUN_FOLDERS.pop("/scratch/q/compare")
    cmd = "cast-llm train --output-dir /elsewhere/wt/runs/compare/m-48k/naive/seed-0/model --data /data/x.jsonl"
    assert portable(cmd) == "cast-llm train --output-dir runs/compare/m-48k/naive/seed-0/model --data /data/x.jsonl"
    assert portable(f"{REPO}/docs/results/x.json") == "docs/results/x.json"


def test_a_resumed_row_reports_the_runs_clock_over_its_segments():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from compare_methods import whole_run_wall
        from compare_report import compute_cell
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    one = {"status": "ok", "wall_s": 700.0, "train_wall_s": 650.0, "threads": 1}
    assert whole_run_wall(one) == one and "resumed" not in compute_cell(one)
    resumed = whole_run_wall({**one, "wall_s": 2021.3, "train_wall_s": 6042.6})
    assert resumed["wall_s"] == 6042.6 and resumed["wall_s_last_invocation"] == 2021.3
    assert compute_cell(resumed).startswith("6043 s") and "resumed" in compute_cell(resumed)


def test_mask_swap_retrains_one_recipe_under_each_mask_and_pairs_them(tmp_path, capsys):
    """benchmarks/mask_swap.py on the quick tier: SparseGPT + KD tuned first (its lr is the recipe), then every
    mask (magnitude, Wanda, SparseGPT, a run's learned one) as a file, each retrained under exactly itself."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
        import mask_swap
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from safetensors.torch import load_file

    from cast_llm.sparsity.mask_io import load_masks

    runs, docs = tmp_path / "c", tmp_path / "d"
    assert compare_methods.main(["--tier", "quick", "--only", "naive-kd-sgpt,cast", "--tune", "lr=1e-3,3e-3",
                                 "--tune-only", "naive-kd-sgpt", "--runs-dir", str(runs), "--docs-dir", str(docs)]) == 0
    tuning = json.loads((runs / "tiny-llama-256" / "naive-kd-sgpt" / "tuning.json").read_text())
    learned = runs / "tiny-llama-256" / "cast" / "seed-0" / "model"
    common = ["--tier", "quick", "--tokens", "256", "--seeds", "0,1", "--recipe-from", str(runs / "tiny-llama-256"),
              "--runs-dir", str(tmp_path / "m"), "--docs-dir", str(docs)]
    # the one-shot masks first, the learned one in a later call: the table holds all four
    assert mask_swap.main(common) == 0
    with pytest.raises(SystemExit, match="--masks: unknown mask.*learned-x"):
        mask_swap.main(common + ["--masks", "learned-x"])
    assert mask_swap.main(common + ["--learned", f"paper-exact CAST={learned}",
                                    "--masks", "learned-paper-exact-cast"]) == 0
    data = json.loads((docs / "mask-swap-tiny-llama-256.json").read_text())
    by = {r["name"]: r for r in data["rows"]}
    assert set(by) == {"magnitude", "wanda", "sparsegpt", "learned-paper-exact-cast"}
    assert data["recipe"]["lr"] == tuning["chosen_setting"]["lr"]
    # one line reruns it from scratch: the recipe's lr grid, the run whose mask is learned, then this benchmark
    steps = data["regenerate"].split(" && ")
    assert steps[0].endswith("--tier quick --tokens 256 --tune lr=0.001,0.003 --tune-only naive-kd-sgpt --seeds 0 "
                             "--only naive-kd-sgpt")
    assert steps[1].endswith("compare_methods.py --tier quick --tokens 256 --only cast --seeds 0")
    assert "--recipe-from runs/compare/tiny-llama-256 " in steps[2]
    assert "'paper-exact CAST=runs/compare/tiny-llama-256/cast/seed-0/model'" in steps[2]
    for name, r in by.items():
        assert [x["seed"] for x in r["seeds"]] == [0, 1] and all(x["test_ppl"] > 1 for x in r["seeds"])
        assert len({x["split_sha256"] for x in r["seeds"]}) == 1
        assert (name == "sparsegpt") == ("paired" not in r)
        # each run kept exactly its mask: the export's zeros are the mask file's
        masks = load_masks(tmp_path / "m" / "tiny-llama-256" / "masks" / f"{name}.safetensors")[0]
        state = load_file(tmp_path / "m" / "tiny-llama-256" / f"mask-{name}" / "seed-0" / "model" / "model.safetensors")
        assert all(torch_equal(state[f"{k}.weight"] != 0, v) for k, v in masks.items())
    assert by["sparsegpt"]["groups_vs_sparsegpt"] == 0 and by["magnitude"]["groups_vs_magnitude"] == 0
    start = by["learned-paper-exact-cast"]["paired_vs_start"]  # the learned mask against the mask it began from
    assert start["against"] == "magnitude" and start["test"]["n"] == 2
    assert "paired_vs_start" not in by["wanda"] and "paired_vs_learned" not in by["learned-paper-exact-cast"]
    pair = by["wanda"]["paired"]["test"]
    assert pair["n"] == 2 and pair["verdict"] in ("better", "worse", "level")
    assert f"**{pair['verdict']}**" in (docs / "mask-swap-tiny-llama-256.md").read_text()

    # a new machine (no runs folder): the committed JSON is the record. The one-shot masks are built again and,
    # being the recorded ones (same digest), keep their recorded seeds; the learned mask, whose run is not
    # given, is listed from the record. Nothing is retrained, and the table says where its rows came from.
    shutil.rmtree(tmp_path / "m")
    assert mask_swap.main(common + ["--masks", "sparsegpt"]) == 0
    again = json.loads((docs / "mask-swap-tiny-llama-256.json").read_text())
    assert [r["name"] for r in again["rows"]] == [r["name"] for r in data["rows"]]
    assert [[x["test_ppl"] for x in r["seeds"]] for r in again["rows"]] == [[x["test_ppl"] for x in r["seeds"]]
                                                                             for r in data["rows"]]
    assert all(x["recorded_in"].endswith("mask-swap-tiny-llama-256.json") for r in again["rows"] for x in r["seeds"])
    assert not list((tmp_path / "m").glob("tiny-llama-256/mask-*/seed-*/model"))  # nothing retrained
    assert again["regenerate"] == data["regenerate"]  # the learned mask's run is still in the rerun line
    assert "† run by an earlier invocation" in (docs / "mask-swap-tiny-llama-256.md").read_text()
    # a record whose mask is not the one built here keeps none of its seeds (those an earlier call took are set aside)
    again["rows"][1]["mask_digest"] = "0" * 64
    (docs / "mask-swap-tiny-llama-256.json").write_text(json.dumps(again))
    capsys.readouterr()
    assert mask_swap.main(common + ["--masks", "sparsegpt"]) == 0
    assert len(list((tmp_path / "m").glob("tiny-llama-256/mask-wanda/seed-*/compare_row.set-aside.json"))) == 2
    assert "wanda: the mask built here is not the one" in capsys.readouterr().out
    assert "wanda" not in {r["name"] for r in json.loads((docs / "mask-swap-tiny-llama-256.json").read_text())["rows"]}


def test_mask_swap_learns_masks_itself_scores_them_before_retraining_and_restores_committed_ones(
        tmp_path, monkeypatch, capsys):
    """``--learn NAME=ROW:SEEDS`` runs a comparison row at its tuned setting once per seed and takes each run's
    mask; every mask's dense ⊙ mask figure before retraining is in the table (the magnitude mask's is magnitude
    pruning's own figure: the same model); a learned mask committed with the rows lets a machine that never ran
    its learner retrain a new seed under it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
        import mask_swap
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    import torch

    from cast_llm.models import load_model

    runs, docs, m = tmp_path / "c", tmp_path / "d", tmp_path / "m"
    assert compare_methods.main(["--tier", "quick", "--only", "naive-kd-sgpt,cast", "--tune", "lr=1e-3,3e-3",
                                 "--tune-only", "naive-kd-sgpt,cast", "--runs-dir", str(runs), "--docs-dir",
                                 str(docs)]) == 0
    chosen = json.loads((runs / "tiny-llama-256" / "cast" / "tuning.json").read_text())["chosen_setting"]
    common = ["--tier", "quick", "--tokens", "256", "--seeds", "0", "--recipe-from", str(runs / "tiny-llama-256"),
              "--runs-dir", str(m), "--docs-dir", str(docs)]
    with pytest.raises(SystemExit, match="--learn 'x=cast': give NAME=ROW:SEEDS"):
        mask_swap.main(common + ["--learn", "x=cast"])
    with pytest.raises(SystemExit, match="not a training row of the comparison"):
        mask_swap.main(common + ["--learn", "x=sparsegpt:0"])
    assert mask_swap.main(common + ["--learn", "tuned CAST=cast:0,1"]) == 0
    data = json.loads((docs / "mask-swap-tiny-llama-256.json").read_text())
    by = {r["name"]: r for r in data["rows"]}
    assert {"learned-tuned-cast-seed-0", "learned-tuned-cast-seed-1"} <= set(by)
    for seed in (0, 1):
        lr = by[f"learned-tuned-cast-seed-{seed}"]["learner"]
        assert lr["row"] == "cast" and lr["seed"] == seed and lr["setting"] == chosen
        ran = json.loads((m / "tiny-llama-256" / "learners" / "cast" / f"seed-{seed}" / "compare_row.json").read_text())
        assert ran["hyperparameters"] == {**ran["hyperparameters"], **chosen} and lr["test"] == ran["test"]
    # seed 0 repeats the comparison's own run of that row at that setting: the same figure
    assert by["learned-tuned-cast-seed-0"]["learner"]["comparison_row"]["test"] == by[
        "learned-tuned-cast-seed-0"]["learner"]["test"]
    assert "--learn 'tuned CAST=cast:0,1'" in data["regenerate"]
    assert "--tune lr=0.001,0.003 --tune-only cast --seeds 0 --only cast" in data["regenerate"]
    # before retraining: the magnitude mask over the dense weights is magnitude pruning's model exactly
    cmp = compare_methods.Comparison(compare_methods.parse_args(["--tier", "quick", "--report-only",
                                                                 "--runs-dir", str(tmp_path / "e")]))
    pruned = load_model(str(m / "tiny-llama-256" / "masks" / "magnitude-model"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert by["magnitude"]["before_retraining"]["test"] == pytest.approx(cmp.evaluator().heldout(pruned),
                                                                              rel=1e-9)
    assert all(r["before_retraining"]["digest"] == r["mask_digest"] for r in data["rows"])
    text = (docs / "mask-swap-tiny-llama-256.md").read_text()
    assert "Before retraining (test / WikiText-2)" in text and "learned by tuned CAST, seed 0" in text
    # a new machine: the learned masks' files come from the committed rows, and a new seed retrains under one
    committed = tmp_path / "committed"
    (committed / "tiny-llama-256").mkdir(parents=True)
    shutil.copytree(m / "tiny-llama-256" / "masks", committed / "tiny-llama-256" / "masks",
                    ignore=shutil.ignore_patterns("*-model", "magnitude*", "wanda*", "sparsegpt*"))
    monkeypatch.setattr(mask_swap, "COMMITTED_MASKS", committed)
    shutil.rmtree(m)
    capsys.readouterr()
    assert mask_swap.main(common[:5] + ["0,1"] + common[6:] + ["--learn", "tuned CAST=cast:0,1",
                                                               "--masks", "learned-tuned-cast-seed-1"]) == 0
    assert "learned-tuned-cast-seed-1: the committed" in capsys.readouterr().out
    assert not (m / "tiny-llama-256" / "learners").exists()  # its learner did not run again
    again = {r["name"]: r for r in json.loads((docs / "mask-swap-tiny-llama-256.json").read_text())["rows"]}
    assert [x["seed"] for x in again["learned-tuned-cast-seed-1"]["seeds"]] == [0, 1]
    assert again["learned-tuned-cast-seed-1"]["learner"]["test"] == by["learned-tuned-cast-seed-1"]["learner"]["test"]


def test_mask_swap_names_the_comparison_run_a_learned_mask_comes_from():
    """A learned mask's exported model, seeded or a row run once (SR-STE), is traced to the comparison run that
    made it, so the report's rerun line runs it first; any other folder is not."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import mask_swap
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert mask_swap.comparison_run("runs/compare/smollm2-135m-384k/cast/seed-0/model") == (
        Path("runs/compare"), "384k", "cast", "0")
    assert mask_swap.comparison_run("/x/runs/compare/smollm2-135m-384k/srste/model") == (
        Path("/x/runs/compare"), "384k", "srste", None)
    assert mask_swap.comparison_run("exports/my-model/model") is None
    opts = type("O", (), {"tier": "cpu", "tokens": "48k"})()
    assert mask_swap.prerequisites(opts, {}, ["SR-STE=runs/compare/smollm2-135m-384k/srste/model"]) == [
        "python benchmarks/compare_methods.py --tier cpu --tokens 384k --only srste"]


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_a_budget_keeps_the_tuning_it_reused_and_refuses_to_misdescribe_its_evaluation(tmp_path):
    """192k reuses 48k's choice (``--tuning-from``): the runs folder remembers it, so ``--report-only`` on it later
    reports that tuning unprompted; a report whose settings differ from the rows' evaluation is refused."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    src = tmp_path / "runs" / "smollm2-135m-48k"
    (src / "cast-best").mkdir(parents=True)
    (src / "cast-best" / "tuning.json").write_text(json.dumps(
        {"grid": {"lr": ["5e-05", "0.0001"]}, "chosen": {"lr": "0.0001"}, "chosen_setting": {"lr": 0.0001},
         "metric": "validation perplexity, seed 0"}))
    base = ["--tier", "cpu", "--tokens", "192k", "--report-only", "--runs-dir", str(tmp_path / "runs"),
            "--docs-dir", str(tmp_path / "docs")]
    first = compare_methods.Comparison(compare_methods.parse_args(base + ["--tuning-from", str(src)]))
    assert first.tuned("cast-best")["chosen"] == {"lr": "0.0001"}
    later = compare_methods.Comparison(compare_methods.parse_args(base))  # not told again
    assert later.tuned("cast-best")["chosen_setting"] == {"lr": 0.0001} and later.tuned("naive-kd-sgpt") == {}
    with pytest.raises(SystemExit, match="--tuning-from .*no such runs folder"):
        compare_methods.Comparison(compare_methods.parse_args(base + ["--tuning-from", str(tmp_path / "nope")]))

    full = {"key": "cast-best", "seeds": [{"seed": 0, "command": "cast-llm train --wikitext-windows 64 --seed 0 "
                                                                  "--wikitext-windows 0"}]}
    clash = compare_methods.evaluation_clash([full], later.tier)  # the cpu tier's default is 64 windows
    assert clash is not None and "--set wikitext_windows=0" in clash and "cast-best" in clash
    assert compare_methods.evaluation_clash([full], {**later.tier, "wikitext_windows": 0}) is None
    assert compare_methods.evaluation_clash([{"key": "sparsegpt", "command": "cast-llm prune"}], later.tier) is None
    (first.runs / "cast-best" / "seed-0").mkdir(parents=True)
    (first.runs / "cast-best" / "seed-0" / "compare_row.json").write_text(json.dumps(
        {"key": "cast-best", "label": "x", "kind": "train", "kd": True, "weight_update": "-", "mask": "-",
         "tokens": 1, "seed": 0, "status": "ok", "heldout": 30.0, "wikitext2": 70.0, "wall_s": 1.0,
         "command": full["seeds"][0]["command"]}))
    with pytest.raises(SystemExit, match="wikitext_windows=0"):
        later.run()


def test_idle_walls_are_measured_on_an_idle_machine_only_and_shown_beside_the_rows(tmp_path):
    """``--idle-walls`` runs a row once into ``<runs>/walls`` and the table shows that time ("idle") above the
    rows' own; it refuses to start on a busy machine, keeps rows measured so far, and drops a time taken while
    other processes were busy; the rerun line measures the walls again."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from compare_report import compute_cell, rerun_lines

    argv = ["--tier", "cpu", "--tokens", "1k", "--seeds", "0", "--threads", "1", "--runs-dir", str(tmp_path / "runs"),
            "--docs-dir", str(tmp_path / "docs")]
    cmp = compare_methods.Comparison(compare_methods.parse_args(argv + ["--idle-walls", "--only", "naive,cast"]))
    assert cmp.entries == [] and [e.key for e in cmp.wall_entries] == ["naive", "cast"]
    for key in ("naive", "cast"):  # the rows, run beside another job
        out = cmp.runs / key / "seed-0"
        out.mkdir(parents=True)
        (out / "compare_row.json").write_text(json.dumps(
            {"key": key, "label": key, "kind": "train", "kd": False, "weight_update": "-", "mask": "-", "tokens": 1,
             "seed": 0, "status": "ok", "heldout": 40.0, "test": 40.0, "wikitext2": 140.0, "wall_s": 100.0,
             "threads": 1, "machine": {"other_cores": 1.1}, "command": "cast-llm train --seed 0"}))
    other = {"naive": 0.02, "cast": 0.9}  # cast's measurement: another process started meanwhile
    ran = []

    def fake(e, out, seed):
        ran.append((e.key, seed, out.parent.name))
        out.mkdir(parents=True, exist_ok=True)
        row = {"key": e.key, "kind": "train", "seed": seed, "status": "ok", "wall_s": 80.0, "threads": 1,
               "tokens": 1, "machine": {"other_cores": other[e.key]}, "command": "cast-llm train --seed 0",
               "test": 40.0, "wikitext2": 140.0, "code": "abc"}
        (out / "compare_row.json").write_text(json.dumps(row))
        return row

    cmp._run_one = fake
    with pytest.raises(SystemExit, match="other processes keep 1.5 cores busy"):
        cmp.measure_idle_walls(cmp.wall_entries, busy=lambda: 1.5)
    assert ran == []
    cmp.measure_idle_walls(cmp.wall_entries, busy=lambda: 0.0)
    assert ran == [("naive", 0, "walls"), ("cast", 0, "walls")]
    assert cmp.idle_wall("naive")["wall_s"] == 80.0 and cmp.idle_wall("cast") is None  # busy: not kept
    cmp.measure_idle_walls(cmp.wall_entries, busy=lambda: 0.0)  # naive is kept; cast is measured again
    assert ran[2:] == [("cast", 0, "walls")]

    cmp.measure_idle_walls = lambda entries: None
    cmp.run()
    rows = {r["name"]: r for r in json.loads((tmp_path / "docs" / "compare-smollm2-135m-1k.json").read_text())["rows"]}
    assert rows["naive"]["idle_wall"]["wall_s"] == 80.0 and "idle_wall" not in rows["cast"]
    text = (tmp_path / "docs" / "compare-smollm2-135m-1k.md").read_text()
    assert "**80 s idle**, 1 thr<br>100 s<br>1 thr, other jobs 1.1 cores" in text and "`--idle-walls`" in text
    assert compute_cell({"wall_s": 5.0, "seeds": [{"status": "ok", "threads": 1}]}) == "5 s<br>1 thr"
    # the re-run reproduces the row (same seed, same command) — or says by how much it does not
    assert "- Naive retraining (seed 0): test 40.00 vs 40.00, WikiText-2 140.00 vs 140.00 — the same (within 0.01 %)" in text
    off = {"key": "c", "seeds": [{"seed": 0, "test": 200.0, "wikitext2": 400.0}],
           "idle_wall": {"seed": 0, "test_ppl": 300.0, "wikitext2_ppl": 300.0}}
    assert rerun_lines([off])[0].startswith("- c (seed 0): test 300.00 vs 200.00, WikiText-2 300.00 vs 400.00 — "
                                            "**+50.0 % / -25.0 %**")
    close = {**off, "idle_wall": {"seed": 0, "test_ppl": 200.0 * (1 + 2.3e-4), "wikitext2_ppl": 400.0 * (1 - 1.4e-5)}}
    assert rerun_lines([close])[0].endswith("— relative +2.3e-04 / -1.4e-05 (code ? vs ?)"), rerun_lines([close])
    shared = {"wall_s": 100.0, "seeds": [{"status": "ok", "threads": 1}],
              "idle_wall": {"wall_s": 80.0, "threads": 1, "other_cores": 0.15}}
    assert compute_cell(shared).startswith("**80 s idle**, 1 thr, other 0.15 cores<br>100 s")
    line = json.loads((tmp_path / "docs" / "compare-smollm2-135m-1k.json").read_text())["regenerate"]
    assert line.endswith("--idle-walls --only naive")


def test_a_wider_grid_rechooses_running_only_its_new_points_and_sets_aside_seeds_of_the_old_choice(tmp_path):
    """A grid whose choice was its edge is widened: ``--tune`` with the new grid re-tunes (only the new points
    run), and the row's seeds made at the old choice — finished or partial — are set aside, not reused."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    argv = ["--tier", "cpu", "--tokens", "1k", "--seeds", "0", "--only", "naive-sgpt", "--runs-dir",
            str(tmp_path / "runs"), "--docs-dir", str(tmp_path / "docs")]
    ran = []

    def fake(e, out, seed, hp=None):
        done = out / "compare_row.json"
        if done.is_file():
            return json.loads(done.read_text())
        ran.append(hp["lr"])
        out.mkdir(parents=True, exist_ok=True)
        row = {"key": e.key, "seed": seed, "status": "ok", "validation": 40.0 - 1e4 * hp["lr"], "test": 1.0,
               "wikitext2": 1.0, "lr": hp["lr"], "hyperparameters": {"lr": hp["lr"]}}
        done.write_text(json.dumps(row))
        return row

    cmp = compare_methods.Comparison(compare_methods.parse_args(argv + ["--tune", "lr=1e-4,2e-4"]))
    cmp._run_one = fake
    entry = next(e for e in compare_methods.ALL_ENTRIES if e.key == "naive-sgpt")
    assert cmp.grid_changed("naive-sgpt")
    assert cmp.tune(entry)["chosen"] == {"lr": "0.0002"} and ran == [1e-4, 2e-4]  # the edge
    assert not cmp.grid_changed("naive-sgpt")  # the same grid again: nothing re-tuned
    seeds = cmp.runs / "naive-sgpt"
    (seeds / "seed-1").mkdir()
    (seeds / "seed-1" / "compare_row.json").write_text(json.dumps({"hyperparameters": {"lr": 2e-4}}))
    (seeds / "seed-2" / "model").mkdir(parents=True)  # interrupted at the old choice
    (seeds / "seed-2" / "model" / "config.yaml").write_text("lr_schedule: cosine\nlr: 0.0002\n")

    wider = compare_methods.Comparison(compare_methods.parse_args(argv + ["--tune", "lr=1e-4,2e-4,4e-4"]))
    wider._run_one = fake
    assert wider.grid_changed("naive-sgpt")
    assert wider.tune(entry)["chosen"] == {"lr": "0.0004"} and ran == [1e-4, 2e-4, 4e-4]  # only 4e-4 ran
    names = sorted(p.name for p in seeds.glob("seed-*"))
    assert names == ["seed-0", "seed-0.superseded-lr-0.0002", "seed-1.superseded-lr-0.0002",
                     "seed-2.superseded-lr-0.0002"]
    assert json.loads((seeds / "seed-0" / "compare_row.json").read_text())["lr"] == 4e-4  # the new choice's run
    # a queue restored from committed rows that kept both a set-aside seed and its stale original (both copies
    # of one run), and another run at an already set-aside setting: the copy goes, the other run is kept
    (seeds / "seed-1").mkdir()
    (seeds / "seed-1" / "compare_row.json").write_text(
        (seeds / "seed-1.superseded-lr-0.0002" / "compare_row.json").read_text())
    (seeds / "seed-2").mkdir()
    (seeds / "seed-2" / "compare_row.json").write_text(json.dumps({"hyperparameters": {"lr": 2e-4}, "other": 1}))
    wider._set_aside_other_choices("naive-sgpt", "lr", "0.0004")
    names = sorted(p.name for p in seeds.glob("seed-*"))
    assert names == ["seed-0", "seed-0.superseded-lr-0.0002", "seed-1.superseded-lr-0.0002",
                     "seed-2.superseded-lr-0.0002", "seed-2.superseded-lr-0.0002.2"], names
    # the queue runs its lines again on a new machine: the earlier, narrower grid changes nothing, and a grid
    # with one new point chooses over every point tuned (not only its own), so no seed is set aside again
    narrower = compare_methods.Comparison(compare_methods.parse_args(argv + ["--tune", "lr=1e-4,2e-4"]))
    narrower._run_one = fake
    assert not narrower.grid_changed("naive-sgpt")
    other = compare_methods.Comparison(compare_methods.parse_args(argv + ["--tune", "lr=5e-5,1e-4"]))
    other._run_one = fake
    assert other.grid_changed("naive-sgpt")
    stage = other.tune(entry)["stages"][0]
    assert ran[-1:] == [5e-5] and stage["chosen"] == "0.0004"
    assert stage["values"] == ["5e-05", "0.0001", "0.0002", "0.0004"]
    assert json.loads((seeds / "seed-0" / "compare_row.json").read_text())["lr"] == 4e-4
    assert not (seeds / "seed-0.superseded-lr-0.0004").exists()


def test_first_windows_scores_the_rows_models_on_the_windows_other_tables_use(tmp_path, capsys):
    """``--first-windows N`` scores every finished row's model again on the first N WikiText-2 windows (the
    saved model, checked against the row's test figure; the dense row: the model) and reports that figure beside
    the row's own, paired against SparseGPT + KD: the same figure a table scored on N windows gives."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    base = ["--tier", "quick", "--runs-dir", str(runs), "--docs-dir", str(docs)]
    compare_methods.main(base + ["--only", "dense,naive-kd-sgpt,cast-best", "--seeds", "0,1",
                                 "--set", "wikitext_windows=0"])
    full = {r["name"]: r for r in json.loads((docs / "compare-tiny-llama-256.json").read_text())["rows"]}
    assert all("wikitext2_first" not in r for r in full.values())
    # every row records each window's NLL (the first windows' figure needs no model), kept out of the table's JSON
    kd_runs = runs / "tiny-llama-256" / "naive-kd-sgpt"
    windows = full["dense"]["seeds"][0]["wikitext_windows"]
    for run in (runs / "tiny-llama-256" / "dense", kd_runs / "seed-0", kd_runs / "seed-1"):
        assert len(json.loads((run / "compare_row.json").read_text())["wikitext2_window_nll"]) == windows > 2
    assert all("wikitext2_window_nll" not in x for r in full.values() for x in r["seeds"])
    # a row recorded before runs kept them (naive + KD's seed 1 here) is scored from its saved model
    row = json.loads((kd_runs / "seed-1" / "compare_row.json").read_text())
    (kd_runs / "seed-1" / "compare_row.json").write_text(json.dumps({**row, "wikitext2_window_nll": None}))
    compare_methods.main(base + ["--first-windows", "2", "--set", "wikitext_windows=0"])
    sources = {p.parent.name: json.loads(p.read_text()) for p in kd_runs.glob("seed-*/first_windows.json")}
    assert "model" in sources["seed-1"] and sources["seed-0"]["source"].startswith("the row's per-window NLL")
    # a record of another run left in the folder (a set-aside seed's, restored from the committed rows) is not this
    # row's: read_row drops it and --first-windows scores the row again
    good = (kd_runs / "seed-0" / "first_windows.json").read_text()
    (kd_runs / "seed-0" / "first_windows.json").write_text(json.dumps({"windows": 2, "wikitext2_ppl": 384.17}))
    assert "wikitext2_first" not in compare_methods.read_row(kd_runs / "seed-0" / "compare_row.json")
    compare_methods.main(base + ["--first-windows", "2", "--set", "wikitext_windows=0", "--only", "naive-kd-sgpt"])
    assert (kd_runs / "seed-0" / "first_windows.json").read_text() == good
    data = json.loads((docs / "compare-tiny-llama-256.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    for name in ("dense", "naive-kd-sgpt", "cast-best"):
        assert rows[name]["wikitext2_first_windows"] == 2
        assert rows[name]["wikitext2"] == full[name]["wikitext2"]  # the row's own figure stays
        assert all(x["wikitext2_first_windows"] == 2 for x in rows[name]["seeds"])
    kd = rows["naive-kd-sgpt"]["seeds"]
    assert rows["naive-kd-sgpt"]["wikitext2_first"] == pytest.approx((kd[0]["wikitext2_first"]
                                                                      + kd[1]["wikitext2_first"]) / 2)
    assert rows["cast-best"]["paired"]["wikitext2_first"]["n"] == 2
    text = (docs / "compare-tiny-llama-256.md").read_text()
    assert "## WikiText-2 on the first 2 windows" in text and "WikiText-2 (first windows)" in text
    assert data["regenerate"].endswith("--first-windows 2")
    # the figure a table scored on those 2 windows gives
    compare_methods.main(["--tier", "quick", "--runs-dir", str(tmp_path / "two"), "--docs-dir",
                          str(tmp_path / "docs-two"), "--only", "dense", "--set", "wikitext_windows=2"])
    two = json.loads((tmp_path / "docs-two" / "compare-tiny-llama-256.json").read_text())["rows"][0]
    assert two["wikitext2"] == pytest.approx(rows["dense"]["wikitext2_first"], rel=1e-12)
    # a model that does not give its row's test figure is not the row's model, a per-window record that does not
    # give the row's WikiText-2 figure is not the row's record: nothing is written for either
    run = runs / "tiny-llama-256" / "naive-kd-sgpt" / "seed-1"
    row = json.loads((run / "compare_row.json").read_text())
    (run / "compare_row.json").write_text(json.dumps({**row, "test": row["test"] * 1.01}))
    (run / compare_methods.FIRST_WINDOWS_FILE).unlink()
    other = kd_runs / "seed-0"
    row = json.loads((other / "compare_row.json").read_text())
    (other / "compare_row.json").write_text(json.dumps({**row, "wikitext2": row["wikitext2"] * 1.01}))
    (other / compare_methods.FIRST_WINDOWS_FILE).unlink()
    compare_methods.main(base + ["--first-windows", "2", "--set", "wikitext_windows=0"])
    assert not (run / compare_methods.FIRST_WINDOWS_FILE).exists()
    assert not (other / compare_methods.FIRST_WINDOWS_FILE).exists()
    # a row without the record takes it from the same seed run again (--idle-walls' run) when that run reproduces
    # the row's test and WikiText-2 figures (up to last-bit rounding, which the source states); a rerun that came
    # out different is not the row's (its model is scored instead)
    (other / "compare_row.json").write_text(json.dumps({**row, "wikitext2_window_nll": None,
                                                        "test": row["test"] * (1 + 2e-6)}))
    rerun = runs / "tiny-llama-256" / "walls" / "naive-kd-sgpt" / "compare_row.json"
    rerun.parent.mkdir(parents=True)
    rerun.write_text(json.dumps(row))
    compare_methods.main(base + ["--first-windows", "2", "--set", "wikitext_windows=0"])
    rec = json.loads((other / compare_methods.FIRST_WINDOWS_FILE).read_text())
    assert rec["source"].startswith("the per-window NLL of the row run again") and "model" not in rec
    assert "within relative 2.0e-06 and 0.0e+00" in rec["source"], rec["source"]
    assert rec["wikitext2_ppl"] == pytest.approx(kd[0]["wikitext2_first"], rel=1e-12)
    (other / "compare_row.json").write_text(json.dumps({**row, "wikitext2_window_nll": None}))
    rerun.write_text(json.dumps({**row, "test": row["test"] * (1 + 5 * compare_methods.RERUN_REL)}))
    (other / compare_methods.FIRST_WINDOWS_FILE).unlink()
    compare_methods.main(base + ["--first-windows", "2", "--set", "wikitext_windows=0"])
    rec = json.loads((other / compare_methods.FIRST_WINDOWS_FILE).read_text())
    assert "source" not in rec and "model" in rec
    assert rec["wikitext2_ppl"] == pytest.approx(kd[0]["wikitext2_first"], rel=1e-9)
    # --rerun-unrecorded: a seed with neither a record nor its saved model is run again (its seed, its setting) into
    # reruns/<row>/seed-N and scored from the rerun's record, which reproduces the row; without the flag: not scored
    seed1 = json.loads((run / "compare_row.json").read_text())
    (run / "compare_row.json").write_text(json.dumps({**seed1, "test": seed1["test"] / 1.01}))
    shutil.rmtree(run / "model")
    compare_methods.main(base + ["--first-windows", "2", "--set", "wikitext_windows=0"])
    assert not (run / compare_methods.FIRST_WINDOWS_FILE).exists()
    with pytest.raises(SystemExit, match="goes with --first-windows"):
        compare_methods.main(base + ["--rerun-unrecorded"])
    compare_methods.main(base + ["--first-windows", "2", "--set", "wikitext_windows=0", "--rerun-unrecorded",
                                 "--only", "naive-kd-sgpt"])
    rec = json.loads((run / compare_methods.FIRST_WINDOWS_FILE).read_text())
    assert "reruns/naive-kd-sgpt/seed-1" in rec["source"] and "model" not in rec, rec
    assert rec["wikitext2_ppl"] == pytest.approx(kd[1]["wikitext2_first"], rel=1e-6)
    # the table sets the rerun against its row
    kd_row = next(r for r in json.loads((docs / "compare-tiny-llama-256.json").read_text())["rows"]
                  if r["name"] == "naive-kd-sgpt")
    assert [x["seed"] for x in kd_row["reruns"]] == [1]
    assert "- SparseGPT + KD (fixed mask) (seed 1, run again for its record): test " in \
        (docs / "compare-tiny-llama-256.md").read_text()
    # a rerun that does not give the row's figures is not the row's run: nothing is written
    (run / compare_methods.FIRST_WINDOWS_FILE).unlink()
    (run / "compare_row.json").write_text(json.dumps({**seed1, "test": seed1["test"] / 1.01 * (1 + 5 * compare_methods.RERUN_REL)}))
    capsys.readouterr()
    compare_methods.main(base + ["--first-windows", "2", "--set", "wikitext_windows=0", "--rerun-unrecorded"])
    assert not (run / compare_methods.FIRST_WINDOWS_FILE).exists()
    assert "(relative 5.0e-03 / 0.0e+00, more than 1e-03): not the row's run" in capsys.readouterr().out
    # a seed taken from the tuning grid scored the grid run's model
    cmp = compare_methods.Comparison(compare_methods.parse_args(base + ["--report-only"]))
    e = next(x for x in compare_methods.ALL_ENTRIES if x.key == "naive-kd-sgpt")
    grid = cmp.runs / "naive-kd-sgpt" / "grid" / "lr-0.001" / "seed-3" / "model"
    grid.mkdir(parents=True)
    (grid / "config.json").write_text("{}")
    assert cmp.saved_model(e, cmp.runs / "naive-kd-sgpt" / "seed-3", {"from_grid": "lr=0.001"}) == str(grid)
    assert cmp.saved_model(e, cmp.runs / "naive-kd-sgpt" / "seed-4", {}) is None


def test_jobs_runs_a_stages_grid_points_and_a_rows_seeds_side_by_side(tmp_path):
    """``--jobs 2``: the grid points of a tuning stage, then the row's seeds, run two at a time (each a training
    process of its own), their results taken in order; a row's own CPU is its process's, not the run beside it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    import threading
    import time

    argv = ["--tier", "cpu", "--tokens", "1k", "--only", "naive-sgpt", "--runs-dir", str(tmp_path / "runs"),
            "--docs-dir", str(tmp_path / "docs")]
    with pytest.raises(SystemExit, match="the quick tier trains in this process"):
        compare_methods.Comparison(compare_methods.parse_args(["--tier", "quick", "--jobs", "2"]))
    with pytest.raises(SystemExit, match="--jobs 0: give 1 or more"):
        compare_methods.Comparison(compare_methods.parse_args(argv + ["--jobs", "0"]))
    lock, running, peak, ran = threading.Lock(), [0], [0], []

    def fake(e, out, seed, hp=None):
        done = out / "compare_row.json"
        if done.is_file():
            return json.loads(done.read_text())
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
            ran.append((seed, (hp or {}).get("lr")))
        lr = (hp or cmp.entry_train_argv(e, out, seed)[1])["lr"]  # a seed runs at the tuned choice
        out.mkdir(parents=True, exist_ok=True)
        row = {"key": e.key, "seed": seed, "status": "ok", "validation": 40.0 - 1e4 * lr + (seed or 0), "test": 1.0,
               "wikitext2": 1.0, "heldout": 1.0, "lr": lr, "hyperparameters": {"lr": lr}, "command": "cast-llm train"}
        done.write_text(json.dumps(row))
        return row

    cmp = compare_methods.Comparison(compare_methods.parse_args(argv + ["--tune", "lr=1e-4,2e-4,4e-4", "--seeds",
                                                                        "0,1,2", "--jobs", "2"]))
    cmp._run_one = fake
    entry = next(e for e in compare_methods.ALL_ENTRIES if e.key == "naive-sgpt")
    t0 = time.perf_counter()
    row = cmp.run_entry(entry)
    assert peak[0] == 2 and time.perf_counter() - t0 < 4 * 0.3  # 3 points in 2 rounds, seeds 1-2 in one
    assert sorted(x[1] for x in ran[:3]) == [1e-4, 2e-4, 4e-4] and sorted(x[0] for x in ran[3:]) == [1, 2]
    assert json.loads((cmp.runs / "naive-sgpt" / "tuning.json").read_text())["chosen"] == {"lr": "0.0004"}
    assert [x["seed"] for x in row["seeds"]] == [0, 1, 2] and {x["lr"] for x in row["seeds"]} == {4e-4}
    # two rows whose settings are fixed: their six seed runs share one pool (three rounds, not four), each row
    # then takes its own results in order, none run twice
    two = compare_methods.Comparison(compare_methods.parse_args(
        argv[:5] + ["naive-sgpt,naive-kd-sgpt"] + argv[6:] + ["--seeds", "0,1,2", "--jobs", "2"]))
    two.runs = tmp_path / "two"
    cmp = two  # the fake reads the settings through cmp
    two._run_one = fake
    ran.clear()
    rows = [e for e in compare_methods.ALL_ENTRIES if e.key in ("naive-sgpt", "naive-kd-sgpt")]
    t0 = time.perf_counter()
    two.run_seeds_ahead(rows)
    assert time.perf_counter() - t0 < 3.6 * 0.3 and len(ran) == 6 and peak[0] == 2
    got = [two.run_entry(e) for e in rows]
    assert len(ran) == 6 and not two.ran_ahead
    assert [[x["seed"] for x in r["seeds"]] for r in got] == [[0, 1, 2], [0, 1, 2]]
    assert [r["key"] for r in got] == ["naive-sgpt", "naive-kd-sgpt"]
    one = compare_methods.Comparison(compare_methods.parse_args(argv + ["--seeds", "0,1", "--jobs", "2"]))
    one._run_one = fake
    one.run_seeds_ahead(rows[:1])  # one row: nothing ahead (its own seeds run side by side in run_entry)
    assert not one.ran_ahead and len(ran) == 6
    # a row's own CPU where it ran in a process of its own: the run beside it is another job
    cpu = []
    assert cmp._run_cli(["--version"], tmp_path / "version.txt", cpu) == 0 and len(cpu) == 1 and cpu[0] > 0
    assert (tmp_path / "version.txt").read_text().startswith("cast-llm ")
    assert cmp._run_cli(["no-such-command"], tmp_path / "bad.txt", cpu) == 2 and len(cpu) == 2
    load = compare_methods.MachineLoad()
    time.sleep(0.05)
    assert load.finish(own_cpu=0.0)["own_cores"] == 0.0


def test_a_grid_point_that_stopped_chooses_nothing_and_the_invocation_exits_unfinished(tmp_path, monkeypatch):
    """A grid point stopped by a signal (resumable) holds the choice back: nothing is recorded, no seed runs at a
    choice made without it, the row is ``stopped`` and the invocation exits EXIT_UNFINISHED (the queue does not take
    the line as done); the same command resumes the point, then chooses. A record that holds a stopped point (as
    older code wrote it) is tuned again."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    argv = ["--tier", "cpu", "--tokens", "1k", "--only", "naive-sgpt", "--runs-dir", str(tmp_path / "runs"),
            "--docs-dir", str(tmp_path / "docs"), "--tune", "lr=1e-4,2e-4", "--seeds", "0,1"]
    stop, ran = {2e-4}, []

    def fake(e, out, seed, hp=None):
        done = out / "compare_row.json"
        if done.is_file():
            return json.loads(done.read_text())
        lr = (hp or cmp.entry_train_argv(e, out, seed)[1])["lr"]
        ran.append((seed, lr))
        if lr in stop:
            return {"key": e.key, "seed": seed, "status": "stopped", "error": "SIGTERM", "heldout": None,
                    "wikitext2": None, "hyperparameters": {"lr": lr}}
        out.mkdir(parents=True, exist_ok=True)
        row = {"key": e.key, "seed": seed, "status": "ok", "validation": 40.0 - 1e4 * lr, "test": 1.0,
               "wikitext2": 1.0, "heldout": 1.0, "lr": lr, "hyperparameters": {"lr": lr}, "command": "cast-llm train"}
        done.write_text(json.dumps(row))
        return row

    cmp = compare_methods.Comparison(compare_methods.parse_args(argv))
    cmp._run_one = fake
    entry = next(e for e in compare_methods.ALL_ENTRIES if e.key == "naive-sgpt")
    row = cmp.run_entry(entry)
    assert row["status"] == "stopped" and "nothing was chosen" in row["error"]
    assert not (cmp.runs / "naive-sgpt" / "tuning.json").exists() and ran == [(0, 1e-4), (0, 2e-4)]
    stop.clear()
    row = cmp.run_entry(entry)  # the stopped point resumes, then the choice and the seeds
    assert row["status"] == "ok" and [x["lr"] for x in row["seeds"]] == [2e-4, 2e-4]
    assert ran[2:] == [(0, 2e-4), (1, 2e-4)]
    rec = json.loads((cmp.runs / "naive-sgpt" / "tuning.json").read_text())
    assert not cmp.grid_changed("naive-sgpt")
    rec["stages"][0]["results"]["0.0002"]["status"] = "stopped"  # as older code recorded a stopped point
    (cmp.runs / "naive-sgpt" / "tuning.json").write_text(json.dumps(rec))
    assert cmp.grid_changed("naive-sgpt")
    # a record copied from another budget (the choice this budget reuses) is not this budget's tuning: --tune here
    # runs its own grid even where the other budget's covered these values
    rec["stages"][0]["results"]["0.0002"]["status"] = "ok"
    (cmp.runs / "naive-sgpt" / "tuning.json").write_text(json.dumps({**rec, "from": "runs/compare/tiny-48k"}))
    assert cmp.grid_changed("naive-sgpt") and cmp.tuned("naive-sgpt")["chosen"] == {"lr": "0.0002"}
    monkeypatch.setattr(compare_methods.Comparison, "run", lambda self: self.unfinished.append("naive-sgpt (stopped)"))
    assert compare_methods.main(argv) == compare_methods.EXIT_UNFINISHED
    monkeypatch.setattr(compare_methods.Comparison, "run", lambda self: None)
    assert compare_methods.main(argv) == 0


def test_a_first_windows_record_is_taken_only_for_the_row_it_was_made_for(tmp_path):
    """``first_windows.json`` names the row's test figure; an older record without it is checked against the row's
    own per-window NLL where the row has one (192k paper-exact seed 0 once read λ 1e-4's 384.17 beside the
    λ 2.6e-3 run that replaced it)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    nll = [1.0, 2.0, 3.0]
    row = {"status": "ok", "test": 10.0, "wikitext2": 7.39, "wikitext2_window_nll": nll}
    (tmp_path / "compare_row.json").write_text(json.dumps(row))
    first = tmp_path / compare_methods.FIRST_WINDOWS_FILE

    def read(rec):
        first.write_text(json.dumps(rec))
        return compare_methods.read_row(tmp_path / "compare_row.json").get("wikitext2_first")

    assert read({"windows": 2, "wikitext2_ppl": math.exp(1.5)}) == math.exp(1.5)  # older record, the row's NLL
    assert read({"windows": 2, "wikitext2_ppl": 384.17}) is None  # older record, another run's
    assert read({"windows": 2, "wikitext2_ppl": 5.0, "row_test_ppl": 10.0}) == 5.0
    assert read({"windows": 2, "wikitext2_ppl": 5.0, "row_test_ppl": 11.0}) is None
    (tmp_path / "compare_row.json").write_text(json.dumps({**row, "wikitext2_window_nll": None}))
    assert read({"windows": 2, "wikitext2_ppl": 384.17}) == 384.17  # nothing to tell it by: taken


def test_every_row_runs_a_command_cast_llm_train_accepts_and_the_ablations_are_the_papers_algorithm(tmp_path):
    """Each training row's command parses and validates as `cast-llm train` would (a row whose flags clash
    fails at once, not hours into a queue); the Table 6 rows change one part of paper-exact CAST and run seeds."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    cmp = compare_methods.Comparison(compare_methods.parse_args(
        ["--tier", "cpu", "--tokens", "48k", "--runs-dir", str(tmp_path / "runs"), "--docs-dir", str(tmp_path)]))
    for e in compare_methods.ALL_ENTRIES:
        if e.kind != "train":
            continue
        argv, _ = cmp.entry_train_argv(e, tmp_path / e.key, 0)
        cfg = cmp.train_config(cmp.budget, argv[argv.index("--seed") + 2:], tmp_path / e.key)
        cfg.validate()
        if e in compare_methods.ABLATIONS:
            assert e.seeded, e.key
    by = {e.key: e for e in compare_methods.ABLATIONS}
    cfg = cmp.train_config(cmp.budget, by["cast-sgpt-fixed"].args, tmp_path / "x")
    assert (cfg.use_warm_start, cfg.effective_repair_fraction, cfg.effective_final_prune, cfg.effective_init_mask,
            cfg.fixed_mask) == (False, 0.0, "hard", "sparsegpt", True)  # paper-exact but for the mask
    assert cmp.train_config(cmp.budget, by["cast-additive"].args, tmp_path / "y").decay_mode == "additive"


def test_paper_exact_tunes_its_decay_around_the_forecast_then_its_lr_and_records_the_prune(tmp_path):
    """``--tune l1_decay=forecast:...``: λ over multiples of the λ the trainer's decay forecast says finishes the
    decay at this budget, then ``--tune lr=...`` at the chosen λ (a coordinate search, recorded as stages; the run
    both stages share is run once); every paper-exact run records its validation perplexity just before and just
    after the final prune."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    # (a few steps: no λ finishes the decay to the default 0.99 there, so the runs aim at a lower target)
    base = ["--tier", "quick", "--only", "cast", "--tune-only", "cast", "--runs-dir", str(runs), "--docs-dir", str(docs),
            "--tokens", "2048", "--train-args", "--forecast-target 0.9"]
    assert compare_methods.main(base + ["--tune", "l1_decay=forecast:0.5,1,2"]) == 0
    folder = runs / "tiny-llama-2.05k" / "cast"
    fc = json.loads((folder / "forecast.json").read_text())
    lam = fc["l1_decay_to_finish"]
    assert lam is not None and fc["l1_decay"] == 1e-4 and fc["total_steps"] > 0
    t = json.loads((folder / "tuning.json").read_text())
    values = [float(f"{lam * m:.2g}") for m in (0.5, 1, 2)]
    assert t["grid"] == {"l1_decay": [f"{v:g}" for v in values]} and t["stages"][0]["fixed"] == {"lr": 3e-3}
    assert t["stages"][0]["grid_from"]["forecast"]["l1_decay_to_finish"] == lam
    for v in t["grid"]["l1_decay"]:
        row = json.loads((folder / "grid" / f"l1_decay-{v}" / "seed-0" / "compare_row.json").read_text())
        assert row["hyperparameters"] == {"lr": 3e-3, "l1_decay": float(v)}
        assert row["prune_validation_before"] > 1 and row["prune_validation_after"] > 1
        assert row["prune_validation_after"] == pytest.approx(row["validation"], rel=1e-4)  # no repair: the export
        assert row["forecast_s_t"] is not None  # the trainer's own forecast, beside the one the grid came from
    best = t["chosen"]["l1_decay"]
    # then lr at the chosen λ: the point at the current lr is the λ stage's run (not run again)
    shared = folder / "grid" / f"l1_decay-{best}" / "seed-0" / "compare_row.json"
    mtime = shared.stat().st_mtime
    assert compare_methods.main(base + ["--tune", "lr=1e-3,3e-3"]) == 0
    assert shared.stat().st_mtime == mtime
    t = json.loads((folder / "tuning.json").read_text())
    assert [x["name"] for x in t["stages"]] == ["l1_decay", "lr"] and set(t["chosen_setting"]) == {"l1_decay", "lr"}
    assert t["stages"][1]["fixed"] == {"l1_decay": float(best)} and "coordinate" in t["search"]
    assert t["stages"][1]["results"]["0.003"]["dir"] == f"grid/l1_decay-{best}/seed-0"
    assert (folder / "grid" / f"l1_decay-{best}_lr-0.001" / "seed-0" / "compare_row.json").is_file()
    seed0 = json.loads((folder / "seed-0" / "compare_row.json").read_text())
    assert seed0["hyperparameters"] == t["chosen_setting"] and seed0["grid_dir"].startswith("grid/")
    # the table's JSON: the row's tuning with both stages, its seeds with the prune's before/after
    data = json.loads((docs / "compare-tiny-llama-2.05k.json").read_text())
    cast = next(r for r in data["rows"] if r["name"] == "cast")
    assert [x["name"] for x in cast["tuning"]["stages"]] == ["l1_decay", "lr"]
    assert cast["seeds"][0]["prune_validation_before"] > 1
    # rerun from scratch: the λ grid (as it ran), then the lr grid, then the seeds
    steps = data["regenerate"].split(" && ")
    assert f"--tune l1_decay={','.join(t['grid']['l1_decay'])} --tune-only cast" in steps[0]
    assert "--tune lr=0.001,0.003 --tune-only cast" in steps[1]
    text = (docs / "compare-tiny-llama-2.05k.md").read_text()
    assert "× the λ" in text and "before → after" in text and "## The final prune (validation split)" in text


def test_rescore_wikitext_scores_a_row_again_on_its_tables_windows(tmp_path, capsys):
    """A row run on other WikiText-2 windows than its table describes (a 192k queue line that missed
    ``--set wikitext_windows=0``) is refused by the report; ``--rescore-wikitext`` scores its saved model again
    on the table's windows (test figure checked) and the report then takes that figure, keeping the one as run
    beside it: the figure a run scored on every window gives."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    base = ["--tier", "quick", "--runs-dir", str(runs), "--docs-dir", str(docs)]
    compare_methods.main(base + ["--only", "naive-kd-sgpt", "--seeds", "0,1"])  # the quick tier's 1 window
    one = {r["name"]: r for r in json.loads((docs / "compare-tiny-llama-256.json").read_text())["rows"]}
    every = base + ["--set", "wikitext_windows=0"]
    with pytest.raises(SystemExit, match="naive-kd-sgpt ran with --wikitext-windows 1.*--rescore-wikitext"):
        compare_methods.main(every + ["--report-only"])
    kd = runs / "tiny-llama-256" / "naive-kd-sgpt"
    row1 = json.loads((kd / "seed-1" / "compare_row.json").read_text())
    (kd / "seed-1" / "compare_row.json").write_text(json.dumps({**row1, "test": row1["test"] * 1.01}))
    with pytest.raises(SystemExit, match="naive-kd-sgpt ran with --wikitext-windows 1"):  # seed 1 is not scored
        compare_methods.main(every + ["--rescore-wikitext"])
    assert "seed-1: " in capsys.readouterr().out and not (kd / "seed-1" / "wikitext_rescored.json").exists()
    (kd / "seed-1" / "compare_row.json").write_text(json.dumps(row1))  # the row's model again
    compare_methods.main(every + ["--rescore-wikitext"])
    rec = json.loads((kd / "seed-0" / "wikitext_rescored.json").read_text())
    assert rec["as_run_windows"] == 1 and rec["windows"] == 0 and len(rec["wikitext2_window_nll"]) > 1
    rows = {r["name"]: r for r in json.loads((docs / "compare-tiny-llama-256.json").read_text())["rows"]}
    seeds = rows["naive-kd-sgpt"]["seeds"]
    assert [x["wikitext2_rescored"]["as_run"] for x in seeds] == [x["wikitext2"]
                                                                   for x in one["naive-kd-sgpt"]["seeds"]]
    assert all(x["wikitext2_rescored"]["windows"] == 0 and x["wikitext_windows"] > 1 for x in seeds)
    # the figure a seed run on every window gives, from its own model (the dense row needs none: the model)
    compare_methods.main(["--tier", "quick", "--runs-dir", str(tmp_path / "all"), "--docs-dir", str(tmp_path / "d2"),
                          "--only", "naive-kd-sgpt", "--seeds", "0", "--set", "wikitext_windows=0"])
    direct = json.loads((tmp_path / "d2" / "compare-tiny-llama-256.json").read_text())["rows"][0]["seeds"][0]
    assert seeds[0]["wikitext2"] == pytest.approx(direct["wikitext2"], rel=1e-9)
    assert "## Scored again on this table's windows" in (docs / "compare-tiny-llama-256.md").read_text()
    kept = (kd / "seed-0" / "compare_row.json").read_text()  # a record of another row there: not applied
    (kd / "seed-0" / "compare_row.json").write_text(json.dumps({**json.loads(kept), "test": 1.0}))
    assert "wikitext2_rescored" not in compare_methods.read_row(kd / "seed-0" / "compare_row.json")
    (kd / "seed-0" / "compare_row.json").write_text(kept)
    compare_methods.main(every + ["--rescore-wikitext"])  # done once: not scored again
    assert "already" in capsys.readouterr().out


def test_settings_from_runs_the_ablations_at_paper_exacts_tuned_setting_and_reports_both(tmp_path):
    """``--settings-from cast``: the paper's Table 6 at paper-exact's tuned λ and lr. The rows it names take the
    settings paper-exact's rows run at (recorded as not tuned on the row), their seeds at the untuned setting are
    set aside, the table pairs each setting against paper-exact there, and a regeneration runs it again."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare_methods
        from compare_report import table6_lines, tuning_lines, write_json
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    runs = tmp_path / "runs"
    argv = ["--tier", "cpu", "--tokens", "1k", "--seeds", "0", "--runs-dir", str(runs), "--docs-dir",
            str(tmp_path / "docs")]

    def comparison(*extra):
        c = compare_methods.Comparison(compare_methods.parse_args(argv + list(extra)))

        def fake(e, out, seed, override=None):  # a run records the settings its command would carry
            done = out / "compare_row.json"
            if done.is_file():
                return json.loads(done.read_text())
            hp = c.entry_train_argv(e, out, seed, override)[1]
            out.mkdir(parents=True, exist_ok=True)
            row = {"key": e.key, "seed": seed, "status": "ok", "validation": 40.0 - 1e4 * hp["lr"], "test": 1.0,
                   "wikitext2": 1.0, "lr": hp["lr"], "hyperparameters": {k: hp[k] for k in ("lr", "l1_decay")}}
            done.write_text(json.dumps(row))
            return row

        c._run_one = fake
        return c

    with pytest.raises(SystemExit, match="not a training row"):
        comparison("--settings-from", "sparsegpt", "--only", "cast-srste")
    with pytest.raises(SystemExit, match="--only"):
        comparison("--settings-from", "cast")
    with pytest.raises(SystemExit, match="not both"):
        comparison("--settings-from", "cast", "--only", "cast-srste", "--tune", "lr=1e-4,2e-4")
    with pytest.raises(SystemExit, match="has no tuning of its own"):
        comparison("--settings-from", "cast", "--only", "cast-srste").take_settings_from("cast")
    entries = {e.key: e for e in compare_methods.ALL_ENTRIES}
    tuned = comparison("--tune", "lr=1e-4,2e-4", "--only", "cast")
    assert tuned.tune(entries["cast"])["chosen"] == {"lr": "0.0002"}
    runs = tuned.runs  # this budget's folder
    for key in ("cast-sgpt-fixed", "cast-srste"):  # each row's seed at paper-exact's untuned setting
        old = runs / key / "seed-0"
        old.mkdir(parents=True)
        (old / "compare_row.json").write_text(json.dumps({"status": "ok", "hyperparameters": {"lr": 5e-4,
                                                                                              "l1_decay": 1e-4}}))
    c = comparison("--settings-from", "cast", "--only", "cast-sgpt-fixed,cast-srste")
    c.take_settings_from("cast")
    rec = json.loads((runs / "cast-sgpt-fixed" / "tuning.json").read_text())
    assert rec["settings_from"] == "cast" and rec["chosen_setting"] == {"lr": 2e-4, "l1_decay": 1e-4}
    assert rec["source_setting"] == {"lr": 2e-4, "l1_decay": 1e-4}
    # SR-STE in place of AdamS reads no λ: it takes the lr only
    assert json.loads((runs / "cast-srste" / "tuning.json").read_text())["chosen_setting"] == {"lr": 2e-4}
    assert c.reads_setting(entries["cast-sgpt-fixed"], "l1_decay") and c.reads_setting(entries["naive"], "lr")
    assert not c.reads_setting(entries["cast-srste"], "l1_decay") and not c.reads_setting(entries["naive"],
                                                                                            "l1_decay")
    assert c.tuning_record("cast-sgpt-fixed") is None  # not this row's own tuning: a --tune here runs its grid
    assert sorted(p.parent.name for p in runs.glob("*/tuning.json")) == ["cast", "cast-sgpt-fixed", "cast-srste"]
    assert c.entry_train_argv(entries["cast-sgpt-fixed"], runs / "cast-sgpt-fixed", 0)[1]["lr"] == 2e-4
    assert sorted(p.name for p in (runs / "cast-sgpt-fixed").glob("seed-*")) == ["seed-0.superseded-lr-0.0005"]
    got = c.run_entry(entries["cast-sgpt-fixed"])["seeds"][0]["hyperparameters"]
    assert got == {"lr": 2e-4, "l1_decay": 1e-4}
    # paper-exact re-tuned to another λ: the row that reads λ is set aside again; SR-STE's seeds at the same lr stay
    (runs / "cast" / "tuning.json").write_text(json.dumps({**json.loads((runs / "cast" / "tuning.json").read_text()),
                                                           "chosen_setting": {"lr": 2e-4, "l1_decay": 4e-3}}))
    (runs / "cast-srste" / "seed-0").mkdir(exist_ok=True)
    (runs / "cast-srste" / "seed-0" / "compare_row.json").write_text(json.dumps(
        {"status": "ok", "hyperparameters": {"lr": 2e-4, "l1_decay": 1e-4}}))
    again = comparison("--settings-from", "cast", "--only", "cast-sgpt-fixed,cast-srste")
    again.take_settings_from("cast")
    assert (runs / "cast-sgpt-fixed" / "seed-0.superseded-l1_decay-0.0001").is_dir()
    assert (runs / "cast-srste" / "seed-0" / "compare_row.json").is_file()

    # the report: the row's settings said to be paper-exact's, and Table 6 at both settings it ran at
    def seeds(vals, lr):
        return [{"seed": i, "status": "ok", "heldout": t, "wikitext2": w, "test": t,
                 "hyperparameters": {"lr": lr, "l1_decay": 1e-4}} for i, (t, w) in vals.items()]

    exact = {"key": "cast", "label": "CAST (paper-exact)", "kind": "train", "status": "ok",
             "seeds": seeds({0: (40.0, 150.0), 1: (42.0, 152.0)}, 2e-4),
             "superseded": [{"setting": {"lr": 5e-4, "l1_decay": 1e-4},
                             "seeds": [{"seed": 0, "test": 100.0, "wikitext2": 400.0},
                                       {"seed": 1, "test": 120.0, "wikitext2": 420.0}]}]}
    srste = {"key": "cast-sgpt-fixed", "label": "CAST, fixed mask", "kind": "train", "status": "ok",
             "seeds": seeds({0: (45.0, 160.0), 1: (47.0, 161.0)}, 2e-4),
             "tuning": {"grid": None, "chosen": {"lr": "0.0002", "l1_decay": "0.0001"}, "settings_from": "cast",
                        "chosen_setting": {"lr": 2e-4, "l1_decay": 1e-4},
                        "source_setting": {"lr": 2e-4, "l1_decay": 1e-4}},
             "superseded": [{"setting": {"lr": 5e-4, "l1_decay": 1e-4},
                             "seeds": [{"seed": 0, "test": 90.0, "wikitext2": 300.0},
                                       {"seed": 1, "test": 100.0, "wikitext2": 330.0}]}]}
    keys = [e.key for e in compare_methods.ABLATIONS]
    lines = table6_lines([exact, srste], keys)
    now = next(x for x in lines if x.startswith("- CAST, fixed mask"))
    assert "l1_decay 0.0001, lr 0.0002" in now or "lr 0.0002, l1_decay 0.0001" in now
    assert "test +5.00" in now, now
    before = next(x for x in lines if x.startswith("  - before, at "))
    assert "its seeds before the tuning" in before and "test −15.00" in before.replace("-", "−"), before
    assert tuning_lines([srste])[0].startswith("- CAST, fixed mask: lr **0.0002**, l1_decay **0.0001**, `cast`'s "
                                               "settings at this budget as its tuning left them")
    # a row that reads no λ, run at paper-exact's lr, is held against paper-exact's own row at its λ
    no_decay = {**srste, "key": "cast-srste", "label": "SR-STE for AdamS", "superseded": [],
                "seeds": [{**x, "hyperparameters": {"lr": 2e-4, "l1_decay": 1e-4}} for x in srste["seeds"]],
                "tuning": {**srste["tuning"], "chosen_setting": {"lr": 2e-4},
                           "source_setting": {"lr": 2e-4, "l1_decay": 2.6e-3}}}
    decayed = {**exact, "seeds": [{**x, "hyperparameters": {"lr": 2e-4, "l1_decay": 2.6e-3}}
                                  for x in exact["seeds"]]}
    line = next(x for x in table6_lines([decayed, no_decay], keys) if x.startswith("- SR-STE for AdamS"))
    assert "against paper-exact at lr 0.0002, l1_decay 0.0026, its row, whose settings this row took" in line, line
    assert "no run at this row's setting" in table6_lines([decayed, {**no_decay, "tuning": {}}], keys)[-1]
    pair = next(r for r in json.loads(write_json([decayed, no_decay], {"table6": keys}, tmp_path / "n.json")
                                      .read_text())["rows"] if r["name"] == "cast-srste")["paired_paper_exact"]
    assert pair["setting"] == {"lr": 2e-4, "l1_decay": 2.6e-3} and pair["runs"].endswith("this row took")
    # while its seeds at the new setting run, the row is pending: what it measured before stays paired
    pending = {"key": "cast-sgpt-fixed", "label": "CAST, fixed mask", "kind": "train", "status": "pending",
               "superseded": srste["superseded"]}
    lines = table6_lines([exact, pending], keys)
    assert lines[-2:][0] == "- CAST, fixed mask: its seeds at its current setting have not finished", lines
    assert lines[-1].startswith("  - before, at lr 0.0005, l1_decay 0.0001 (against paper-exact there, its seeds "
                                "before the tuning): test -15.00"), lines
    kept = next(r for r in json.loads(write_json([exact, pending], {"table6": keys}, tmp_path / "p.json")
                                      .read_text())["rows"] if r["name"] == "cast-sgpt-fixed")
    assert "paired_paper_exact" not in kept and kept["paired_paper_exact_before"][0]["test"]["mean_diff"] == -15.0
    doc = json.loads(write_json([exact, srste], {"table6": keys}, tmp_path / "t.json").read_text())
    row = next(r for r in doc["rows"] if r["name"] == "cast-sgpt-fixed")
    assert row["paired_paper_exact"]["test"]["mean_diff"] == 5.0
    assert row["paired_paper_exact_before"][0]["test"]["mean_diff"] == -15.0
    assert row["paired_paper_exact_before"][0]["setting"] == {"lr": 5e-4, "l1_decay": 1e-4}
    # a regeneration of the table runs the row again the same way, after paper-exact's tuning
    regen = compare_methods.regenerate_argv(["--tier", "cpu", "--tokens", "1k"], [
        {"key": "cast", "tuning": {"grid": {"lr": ["0.0001", "0.0002"]}, "chosen": {"lr": "0.0002"}},
         "seeds": [{"seed": 0}]}, {**srste, "seeds": [{"seed": 0}, {"seed": 1}]}])
    tune_at = next(i for i, a in enumerate(regen) if "--tune" in a)
    take_at = next(i for i, a in enumerate(regen) if "--settings-from" in a)
    assert tune_at < take_at and regen[take_at][-4:] == ["--seeds", "0,1", "--only", "cast-sgpt-fixed"]
    assert "--settings-from" not in regen[-1]
