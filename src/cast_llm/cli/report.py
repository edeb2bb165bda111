"""``cast-llm report RUN_DIR [RUN_DIR…]``: a Markdown (and, with ``--html``, a self-contained HTML) report
of one or several training runs, with PNG plots; several runs are overlaid on the same axes.

Writes ``report.md``, ``report.html`` and the PNGs to ``--output`` (default: ``RUN_DIR/report`` for one
run, ``./cast-llm-report`` for several). What each plotted quantity means: docs/analysis.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.cli.options import add_config_command, resolve_options, summary
from cast_llm.config import option
from cast_llm.errors import CastError


@dataclass
class ReportOptions:
    output: str | None = option(None, "folder for report.md, report.html and the PNGs (default: RUN_DIR/report "
                                      "for one run, ./cast-llm-report for several)")
    html: bool = option(False, "also write report.html with the PNGs embedded (one self-contained file)")
    title: str | None = option(None, "report title (default: the run labels)")


def register(subparsers) -> None:
    p = add_config_command(subparsers, "report", ReportOptions, func=run,
                           help="Markdown/HTML report with plots of one or several training runs",
                           description=summary(__doc__))
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s) written by cast-llm train")


def run(args) -> int:
    from cast_llm.report import build_report

    opts = resolve_options(ReportOptions, args)
    try:
        files = build_report(args.run_dirs, opts.output, html=opts.html, title=opts.title)
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as e:  # (a CastError is none of these)
        raise CastError(f"the files of {', '.join(map(str, args.run_dirs))} hold a value cast-llm does not write "
                        f"({type(e).__name__}: {str(e)[:120]}); was one edited by hand? restore or remove it") from None
    print(f"report: {files.markdown}" + (f", {files.html}" if files.html else "")
          + f" ({len(files.images)} figures in {files.folder})")
    return 0
