"""``docs/results/gpu/notes.md``: the predictions a session writes before each measurement (METHOD.md: predict,
change, measure, look back), read beside the measured figures.

The file's first Markdown table whose header names the columns ``target`` and ``predicted`` is the notes
table (columns, in any order: ``date``, ``change``, ``target``, ``predicted``, ``measured``, ``command``). A
row's ``target`` is a key of ``targets.TARGETS`` (backticks allowed) or anything else for a figure that is no
target; ``predicted`` is free text written before measuring (a number, a range ``1.2–1.4``, ``≥ 1.3``). The
prediction shown for a target is the last row naming it with a prediction; ``record`` fills the empty
``measured`` (and ``command``) cell of that row when a call returns a figure for it.
"""

from __future__ import annotations

import re
from pathlib import Path

_SPLIT = re.compile(r"(?<!\\)\|")  # a cell boundary: a pipe that is not escaped
_RULE = re.compile(r"^:?-{3,}:?$")


def _cells(line: str) -> list[str] | None:
    s = line.strip()
    if not s.startswith("|"):
        return None
    s = s[1:-1] if s.endswith("|") and len(s) > 1 else s[1:]
    return [c.strip() for c in _SPLIT.split(s)]


def read_rows(text: str) -> tuple[list[str], list[tuple[int, dict]]]:
    """``(header, [(line index, {column: cell})])`` of the notes table; ``([], [])`` when there is none."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        head = _cells(line)
        if not head or not {"target", "predicted"} <= {h.lower() for h in head}:
            continue
        header = [h.lower() for h in head]
        rows = []
        for j in range(i + 1, len(lines)):
            cells = _cells(lines[j])
            if cells is None:
                break
            if all(_RULE.match(c) for c in cells if c):
                continue
            cells += [""] * (len(header) - len(cells))
            row = dict(zip(header, cells))
            row["target"] = row.get("target", "").strip("` ")
            row["_cells"] = cells  # as written (for rewriting the row)
            rows.append((j, row))
        return header, rows
    return [], []


def predictions(text: str) -> dict[str, dict]:
    """target key -> the last row naming it with a prediction."""
    out: dict[str, dict] = {}
    for _, row in read_rows(text)[1]:
        if row.get("target") and row.get("predicted"):
            out[row["target"]] = row
    return out


def load_predictions(path: Path) -> dict[str, dict]:
    return predictions(path.read_text()) if path.is_file() else {}


def fill_measured(text: str, measured: dict[str, tuple[str, str | None]]) -> tuple[str, list[str]]:
    """Write ``measured[key] = (figure, command)`` into the ``measured`` cell (and the empty ``command`` cell)
    of the last row predicting ``key`` whose ``measured`` is still empty. Returns the text and the keys filled."""
    header, rows = read_rows(text)
    if "measured" not in header:
        return text, []
    last: dict[str, tuple[int, dict]] = {}
    for j, row in rows:
        if row.get("target") and row.get("predicted"):
            last[row["target"]] = (j, row)
    lines = text.splitlines(keepends=True)
    filled = []
    for key, (figure, command) in measured.items():
        if key not in last or last[key][1].get("measured"):
            continue
        j, row = last[key]
        cells = list(row["_cells"][: len(header)])
        cells[header.index("measured")] = figure.replace("|", "\\|")
        if "command" in header and not row.get("command") and command:
            cells[header.index("command")] = f"`{command}`".replace("|", "\\|")
        end = "\n" if lines[j].endswith("\n") else ""
        lines[j] = "| " + " | ".join(cells) + " |" + end
        filled.append(key)
    return "".join(lines), filled
