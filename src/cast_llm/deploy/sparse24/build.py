"""``python -m cast_llm.deploy.sparse24.build``: build the CPU 2:4 extension now (``make install`` does), or say in
one line why the 2:4 layers will run dense on this machine."""

from __future__ import annotations

import sys

from cast_llm.deploy.sparse24 import cpu as cpu24


def main() -> int:
    why = cpu24.extension_reason()
    if why:
        print(f"cast-llm: {why}; 2:4 layers will run dense on this CPU", file=sys.stderr)
        return 0  # not an install failure: everything else works, dense
    paths = cpu24.available_paths()
    print(f"cast-llm: CPU 2:4 kernels ready ({', '.join(paths) or 'no instruction path on this CPU: they run dense'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
