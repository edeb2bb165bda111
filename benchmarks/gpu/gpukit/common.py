"""The device's limits, the stages' names and the small helpers every part of the kit uses."""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
KIT_VERSION = 2  # 2: issue 21's perf stage and the `targets` object in results.json
MiB = 1 << 20

# ---------------------------------------------------------------------------------------- the device's limits
PAYLOAD_LIMIT = 64 * MiB  # working tree (tracked + untracked-not-ignored) + carried paths, per call
TREE_MARGIN = 4 * MiB  # the working tree may grow between `prepare` and the calls
MANIFEST_RESERVE = 256 * 1024  # manifest.json in every call folder
CALL_LIMIT_S = 600  # one command's limit
CALL_BUDGET_S = 540  # the kit starts no work after this many seconds of a call (run.sh kills at 585 s)
SESSION_DEVICE_S = 1800  # device time of a developer's session (30 min)
START_COST_S = 150  # device time spent before the kit's first call starts (the machine's start, transfers)
MAX_OUT_FILES = 8  # files that come back from $OUT
GPU_DIR = ".gpu"  # ignored (.gitignore); what the calls carry
RESULTS_DIR = REPO / "docs" / "results" / "gpu"  # where `record` merges what the calls returned
NOTES_FILE = RESULTS_DIR / "notes.md"  # predictions before measurements (travels with the working tree)

# The stages in order of value: `all` runs them in this order, and so does any list of them (setup always first).
# perf measures every target of issue 21; speed holds the older diagnostics, run only when asked.
STAGES = ("setup", "perf", "correctness", "speed", "quality")
STAGE_ALIASES = {"0": "setup", "1": "correctness", "2": "speed", "3": "quality"}  # issue 16's numbers, kept
DEFAULT_FLOW = ("perf", "correctness", "quality")  # what a lent session runs, in this order (docs/gpu.md)
RUN_SH = "bash benchmarks/gpu/run.sh"
JSON_MARK = "KIT-JSON: "


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def sha256_file(path: Path, chunk: int = 4 * MiB) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def human(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def emit_json(obj) -> None:
    """The one line a step's parser reads (the kit's own subcommands end with it)."""
    print(JSON_MARK + json.dumps(obj, default=str), flush=True)


def read_json_mark(text: str):
    for line in reversed(text.splitlines()):
        if line.startswith(JSON_MARK):
            return json.loads(line[len(JSON_MARK):])
    return None


def fmt(v) -> str:
    """A value for a Markdown table: 4 significant digits, '—' for nothing."""
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
