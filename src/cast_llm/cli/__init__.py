"""The ``cast-llm`` command line: a thin layer over the library.

Each sub-command lives in its own module of this package and exposes ``register(subparsers)``; the
module registers a parser whose ``func`` receives the parsed arguments. Heavy imports happen inside the
command functions so that ``cast-llm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from cast_llm.config import renamed_option
from cast_llm.errors import CastError

# sub-command modules, in the order they are listed by --help
COMMAND_MODULES = [
    "cast_llm.cli.train",
    "cast_llm.cli.plan",
    "cast_llm.cli.prepare_data",
    "cast_llm.cli.prune",
    "cast_llm.cli.evaluate",
    "cast_llm.cli.export",
    "cast_llm.cli.quantize",
    "cast_llm.cli.bench",
    "cast_llm.cli.generate",
    "cast_llm.cli.finetune",
    "cast_llm.cli.report",
    "cast_llm.cli.scaling_law",
    "cast_llm.cli.doctor",
]


class OneLineErrors(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a missing value) as one line, exit code 2, no usage dump."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):  # a flag renamed since: say its new name
            given = [a.split("=")[0] for a in message.split(":", 1)[1].split() if a.startswith("--")]
            renamed = [f"{flag} is now --{new.replace('_', '-')}" for flag in given
                       if (new := renamed_option(flag[2:].replace("-", "_")))]
            message += f" ({'; '.join(renamed)})" if renamed else ""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help; a value that starts with '-' is "
                     "written --flag=-1e-3)\n")


def build_parser() -> argparse.ArgumentParser:
    from cast_llm import __version__

    parser = OneLineErrors(
        prog="cast-llm",
        description="Turn a dense LLM into a 2:4 sparse model by sparsity-aware training (CAST).",
    )
    parser.add_argument("--version", action="version", version=f"cast-llm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrors)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0) or a one-line argparse error (2)
        return int(e.code or 0)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from cast_llm.train.preemption import Preempted

    try:
        rc = args.func(args)
    except CastError as e:  # one line, whatever the message holds
        msg = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"cast-llm {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except Preempted as e:  # stopped by SIGTERM/SIGINT after writing a checkpoint (the message said where)
        return int(e.code)
    except KeyboardInterrupt:
        print(f"cast-llm {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the machine, not the input: a full disk, a vanished folder, a permission
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"cast-llm {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    return int(rc or 0)


def entry() -> None:  # pragma: no cover - console script shim
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
