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


def test_rows_are_read_from_the_committed_tables(tmp_path):
    doc = {"budget": 48000, "rows": [{"name": "cast", "status": "ok", "heldout": 2.0},
                                     {"name": "srste", "status": "failed"}]}
    (tmp_path / "compare-m-48k.json").write_text(json.dumps(doc))
    assert dc.load_rows(tmp_path, "m") == {48000: {"cast": doc["rows"][0]}}
