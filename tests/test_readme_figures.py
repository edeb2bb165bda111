"""README's "How good is it" quotes measurements only: every figure in it is in a committed result file."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _figures_of_json(obj, out: set[str]) -> set[str]:
    if isinstance(obj, dict):
        for v in obj.values():
            _figures_of_json(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _figures_of_json(v, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out.add(f"{abs(obj):.2f}")
    return out


# a perplexity or a difference as the tables print them (two decimals), not a share ("1.9 %") or a count
FIGURE = re.compile(r"(?<![\d.])\d+\.\d\d(?!\d)(?!\s*%)")


def test_every_figure_of_how_good_is_it_is_a_committed_measurement():
    """Each two-decimal figure of the section is in the comparison / mask-swap JSON (rows, seeds, paired
    intervals) or, for the GPU runs it mentions, in the GPU kit's committed tables: a figure typed by hand, or
    left behind when a table was regenerated, fails here."""
    known: set[str] = set()
    for f in (sorted(RESULTS.glob("compare-*.json")) + sorted(RESULTS.glob("mask-swap-*.json"))
              + [RESULTS / "cpu24-summary.json", RESULTS / "cpu24-linear-avx2.json",
                 RESULTS / "cpu24-linear-zen3-step32.json", RESULTS / "cpu24-prefill-zen3.json"]
              + sorted((RESULTS / "cpu24-models").glob("*/*.json"))  # the CPU speed paragraph (benchmarks/cpu24_report.py)
              + sorted((RESULTS / "compare-rows").glob("*/*/tuning.json"))):  # tuning grids the queue committed
        _figures_of_json(json.loads(f.read_text()), known)
    for f in sorted((RESULTS / "gpu").glob("*.md")):
        known |= set(FIGURE.findall(f.read_text()))
    section = _section((REPO / "README.md").read_text(), "How good is it")
    figures = FIGURE.findall(section)
    assert len(figures) > 20  # the section still quotes its tables
    assert [x for x in figures if x not in known] == []


def test_the_quick_start_screen_is_the_committed_one():
    """The last screen of `make run` the Quick start shows is copied from the committed screen
    (docs/results/make-run-screen.txt), line for line: its numbers come from that file, not from memory."""
    quick = _section((REPO / "README.md").read_text(), "Quick start")
    blocks = quick.split("```")[1::2]  # the fenced blocks: the commands, then the screen
    screen = next(b for b in blocks if "test ppl" in b).strip("\n").splitlines()
    committed = (RESULTS / "make-run-screen.txt").read_text().splitlines()
    assert len(screen) > 10
    start = committed.index(screen[0])
    assert committed[start:start + len(screen)] == screen


def test_every_figure_of_the_training_comparison_is_a_committed_measurement():
    """docs/training.md's "What we measured" (the fixed protocol's tables) quotes committed JSON only."""
    known: set[str] = set()
    for f in sorted(RESULTS.glob("compare-*.json")) + sorted(RESULTS.glob("mask-swap-*.json")):
        _figures_of_json(json.loads(f.read_text()), known)
    for f in sorted((RESULTS / "gpu").glob("*.md")):  # the one-seed GPU comparison it mentions
        known |= set(FIGURE.findall(f.read_text()))
    text = (REPO / "docs" / "training.md").read_text()
    part = text.split("**What we measured**", 1)[1].split("**Which configuration at which budget**", 1)[0]
    figures = FIGURE.findall(part)
    assert len(figures) > 10
    assert [x for x in figures if x not in known] == []
