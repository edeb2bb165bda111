"""The crossover prediction of benchmarks/decay_crossover.py: its fits, on hand-made points."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decay_crossover as dc  # noqa: E402

sys.path.pop(0)


def test_prune_cost_fit_is_exact_through_two_points_and_refuses_one():
    a, c = dc.fit_prune_cost([(0.836, 269.84), (0.947, 86.86)])
    assert math.exp(a + c * (1 - 0.836)) == pytest.approx(269.84)
    assert math.exp(a + c * (1 - 0.947)) == pytest.approx(86.86)
    assert c > 0  # more mass left to prune costs more
    with pytest.raises(SystemExit, match="two budgets"):
        dc.fit_prune_cost([(0.9, 100.0)])


def test_residuals_show_a_point_the_one_term_model_misses():
    # three points on ln ppl = 2 + 10·(1 − S_T), the middle one 40 % above the line
    line = [(s, math.exp(2 + 10 * (1 - s))) for s in (0.83, 0.93, 0.98)]
    pts = [line[0], (line[1][0], line[1][1] * 1.4), line[2]]
    a, c = dc.fit_prune_cost(pts)
    res = dc.fit_residuals([48_000, 192_000, 384_000], pts, a, c)
    assert [r["budget"] for r in res] == [48_000, 192_000, 384_000]
    mid = res[1]
    assert mid["leave_one_out"] == pytest.approx(line[1][1])  # the other two points lie on the line
    assert mid["measured"] / mid["leave_one_out"] == pytest.approx(1.4)
    assert mid["log_residual"] > 0 > res[0]["log_residual"]
    assert sum(r["log_residual"] for r in res) == pytest.approx(0.0, abs=1e-12)  # least squares with an intercept
    two = dc.fit_residuals([48_000, 384_000], [line[0], line[2]], *dc.fit_prune_cost([line[0], line[2]]))
    assert all(r["leave_one_out"] is None and r["log_residual"] == pytest.approx(0.0, abs=1e-12) for r in two)


def test_rows_are_read_from_the_fixed_protocol_tables_only(tmp_path):
    doc = {"budget": 48000, "split_sha256": ["ab" * 32], "rows": [{"name": "cast", "status": "ok", "heldout": 2.0},
                                                                {"name": "srste", "status": "failed"}]}
    (tmp_path / "compare-m-48k.json").write_text(json.dumps(doc))
    earlier = {"budget": 192000, "rows": [{"name": "cast", "status": "ok", "heldout": 1.0}]}  # no split digest
    (tmp_path / "compare-m-192k.json").write_text(json.dumps(earlier))
    assert dc.load_rows(tmp_path, "m") == {48000: {"cast": doc["rows"][0]}}
    (tmp_path / "compare-m-384k.json").write_text(json.dumps({**earlier, "budget": 384000, "split_sha256": "cd" * 32}))
    with pytest.raises(SystemExit, match="tables are scored on different splits"):
        dc.load_rows(tmp_path, "m")
    (tmp_path / "compare-m-384k.json").write_text(json.dumps({**earlier, "split_sha256": ["ab" * 32, "cd" * 32]}))
    with pytest.raises(SystemExit, match="compare-m-384k.json: its rows are scored on different splits"):
        dc.load_rows(tmp_path, "m")


def test_bootstrap_crossover_reports_an_interval_and_the_share_that_never_crosses():
    grid = [48_000, 192_000, 768_000, 3_000_000, 12_000_000]
    s_t = dict(zip(grid, (0.83, 0.95, 0.99, 0.999, 1.0)))
    # paper-exact: ln ppl = 3 + 20·(1 - S_T) through 48k and 192k; one-shot SparseGPT 80 (3 seeds)
    paper = {48_000: [math.exp(3 + 20 * 0.17) * f for f in (0.95, 1.0, 1.05)], 192_000: [math.exp(3 + 20 * 0.05)]}
    sd = dc.pooled_log_sd(list(paper.values()) + [[78.0, 80.0, 82.0]])
    assert 0 < sd < 0.1
    out = dc.bootstrap_crossover(s_t, grid, paper, [78.0, 80.0, 82.0], {}, sd=sd, draws=400)
    b = out["sparsegpt"]
    assert b["draws"] == 400 and 0 < b["crossed_share"] <= 1 and "sparsegpt_kd" not in out
    assert b["p5"] <= b["p50"] <= b["p95"] and b["p50"] in grid
    text = dc.describe_interval(b)
    assert text.startswith("at ") and "90 % of the crossing draws" in text
    # a comparator that is never reached: said as "no crossover up to <the grid's end>", not "never"
    low = dc.bootstrap_crossover(s_t, grid, paper, [5.0, 5.1], {}, sd=sd, draws=50)["sparsegpt"]
    assert low["crossed_share"] == 0 and dc.describe_interval(low) == "no crossover up to 12M in any of 50 draws"
    # a rare crossing is counted, never rounded to "no crossover in 100 % of the draws"
    rare = {"draws": 2000, "crossed_share": 2 / 2000, "p5": 768_000, "p50": 768_000, "p95": 768_000,
            "grid_max": 48_000_000}
    assert dc.describe_interval(rare).endswith("no crossover up to 48M in 1,998 of the 2,000 draws)")
    # two budgets with a spread: the seed values themselves are resampled
    assert dc.seed_values({"seeds": [{"test": 2.0}, {"heldout": 3.0}]}, "test") == [2.0, 3.0]


def test_a_comparator_measured_at_one_budget_is_not_estimated_rather_than_never():
    split = {"predictions": [{"sparsegpt": 80.0, "sparsegpt_kd": None}, {"sparsegpt": 80.0, "sparsegpt_kd": None}]}
    assert dc._at({"sparsegpt": 384_000, "sparsegpt_kd": None}, split, "sparsegpt") == "at 384k"
    assert dc._at({"sparsegpt": None, "sparsegpt_kd": None}, split, "sparsegpt") == "at no budget of the grid"
    assert dc._at({"sparsegpt": None, "sparsegpt_kd": None}, split, "sparsegpt_kd").startswith("not estimated")


def test_wikitext2_fits_use_only_tables_scored_on_the_same_windows(tmp_path):
    """A 192k table on every WikiText-2 window and 48k / 384k ones on 64 are different metrics: the WikiText-2
    fits leave the 192k table out (the test split, one fixed split, keeps it); a fit whose own tables
    disagree is refused."""
    for budget, windows in ((48000, 64), (192000, 0), (384000, 64)):
        (tmp_path / f"compare-m-{budget // 1000}k.json").write_text(json.dumps(
            {"budget": budget, "settings": {"wikitext_windows": windows}, "rows": []}))
    windows = dc.wikitext_windows(tmp_path, "m")
    assert windows == {48000: 64, 192000: 0, 384000: 64}
    rows = {b: {"cast": {}} for b in windows}
    assert dc.comparable_rows(rows, windows, "heldout", [48000, 384000]) == (rows, [], [])
    kept, left, first = dc.comparable_rows(rows, windows, "wikitext2", [48000, 384000])
    assert sorted(kept) == [48000, 384000] and left == [192000] and first == []
    # unless its rows' models were scored again on the first 64 windows (--first-windows 64): those rows enter
    kd = {"wikitext2": 70.0, "wikitext2_first": 75.0, "wikitext2_first_windows": 64,
          "seeds": [{"seed": 0, "wikitext2": 69.0, "wikitext2_first": 74.0, "wikitext2_first_windows": 64},
                    {"seed": 1, "wikitext2": 71.0, "wikitext2_first": 76.0, "wikitext2_first_windows": 64}]}
    rows[192000] = {"naive-kd-sgpt": kd, "dense": {"wikitext2": 30.0}}
    kept, left, first = dc.comparable_rows(rows, windows, "wikitext2", [48000, 384000])
    assert left == [] and first == [192000] and list(kept[192000]) == ["naive-kd-sgpt"]
    assert kept[192000]["naive-kd-sgpt"]["wikitext2"] == 75.0
    assert dc.seed_values(kept[192000]["naive-kd-sgpt"], "wikitext2") == [74.0, 76.0]
    with pytest.raises(SystemExit, match="different WikiText-2 windows"):
        dc.comparable_rows(rows, windows, "wikitext2", [48000, 192000])
    # a fit budget on every window joins the fit once its paper-exact row has the others' first-window figure
    rows[192000]["cast"] = {"wikitext2": 400.0, "wikitext2_first": 380.0, "wikitext2_first_windows": 64}
    kept, left, first = dc.comparable_rows(rows, windows, "wikitext2", [48000, 192000, 384000])
    assert left == [] and first == [192000] and kept[192000]["cast"]["wikitext2"] == 380.0
    rows[192000]["cast"]["wikitext2_first_windows"] = 32  # scored again, but on other windows: still refused
    with pytest.raises(SystemExit, match="different WikiText-2 windows"):
        dc.comparable_rows(rows, windows, "wikitext2", [48000, 192000, 384000])


def test_the_fit_takes_the_measured_s_t_of_its_budgets_and_the_forecast_elsewhere():
    forecast = {48_000: 0.83, 192_000: 0.93, 768_000: 0.998}
    got = dc.s_t_for_fit(forecast, {48_000: 0.914, 192_000: 0.947}, "measured")
    assert got == {48_000: 0.914, 192_000: 0.947, 768_000: 0.998}
    assert dc.s_t_for_fit(forecast, {48_000: 0.914}, "forecast") == forecast
    with pytest.raises(SystemExit, match="recorded no S_T"):
        dc.s_t_for_fit(forecast, {48_000: None}, "measured")
