"""The GPU kit's entry point (issues 16 and 21): ``python benchmarks/gpu/kit.py SUBCOMMAND …``.

``prepare.sh`` (this machine) and ``run.sh`` (the lent GPU machine) call it, and so do the stages for the kit's
own steps; ``record`` merges a call's returned files into ``docs/results/gpu/``. The logic lives in the package
``gpukit`` beside this file, one concern per module (its ``__init__`` lists them); ``docs/gpu.md`` is the guide.
Only the standard library is imported at module level: the kit runs before anything is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpukit.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
