"""``cast-llm doctor``: the environment and every checked kernel's verdict on this machine (docs/gpu.md)."""

from __future__ import annotations

import argparse
import json
import sys

from cast_llm.cli.options import resolve_options
from cast_llm.config import ThreadSettings, add_arguments


def run(args: argparse.Namespace) -> int:
    from cast_llm.doctor import doctor, format_doctor
    from cast_llm.train.threads import setup_threads

    # the probes time each candidate against its reference: on a core another job keeps busy, two threads spin
    # at every barrier (measured here, the experiment queue on one core: 132 s at 2 threads, 30 s at 1)
    said = setup_threads(resolve_options(ThreadSettings, args))
    if said and "other processes" in said:
        print(said, file=sys.stderr)
    report = doctor(recheck=args.recheck)
    print(json.dumps(report, indent=2, default=str) if args.json else format_doctor(report))
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="the environment and every custom kernel's verdict on this machine",
        description="Report torch, CUDA, the driver, Triton, cuSPARSELt, the GPUs and NCCL, then every checked "
        "kernel path (AdamS, the KD loss, the scaled-weight backward, the teacher's CUDA graph, the 2:4 GEMMs, the "
        "decoder's CUDA graph): each candidate's verdict against its reference on this machine (from the verdict "
        "file, else probed now) and its time beside the reference's. Without a GPU the CUDA-only checks are "
        "listed, not run.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--recheck", action="store_true",
                   help="probe every candidate again instead of reading the verdict file (the file is updated)")
    add_arguments(p, ThreadSettings)  # --threads, declared once (cast_llm.config)
    p.set_defaults(func=run)
