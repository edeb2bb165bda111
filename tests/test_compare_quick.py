"""``benchmarks/compare_methods.py --tier quick`` end to end, so the comparison script cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
                  "SR-STE", "AST", "CAST (paper-exact)", "CAST (best configuration)"):
        assert f"| {label} |" in text, label
    assert "## The best CAST configuration against the strongest alternatives" in text
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
