"""The GPU kit (issues 16 and 21): prepare here, then validate and measure everything GPU-only in one lent session.

``benchmarks/gpu/kit.py`` is the entry point (``prepare.sh`` and ``run.sh`` call it); ``docs/gpu.md`` is the
guide. One concern per module:

* ``common``   — the device's limits, the stage names, small helpers (hashes, the JSON line steps print);
* ``image``    — what the GPU image holds, the wheels the kit carries, the static scan of the stages' imports;
* ``payload``  — the preparation on this machine: files split into device calls under 64 MiB, ``.gpu/``;
* ``executor`` — a call's context (``Ctx``) and the step runner: time limits, deferral, resumption;
* ``stages``   — one module per stage: ``setup``, ``perf``, ``correctness``, ``speed``, ``quality``;
* ``targets``  — issue 21's targets (and issue 16's remaining checks) judged from what the steps measured;
* ``notes``    — ``docs/results/gpu/notes.md``: predictions written before measuring, read beside the figures;
* ``report``   — the files a call writes under ``$OUT``, and ``record``: merging them into ``docs/results/gpu``;
* ``tools``    — the kit's own subcommands that stages run as steps (software, convert, check-export, …);
* ``cli``      — the command line.

Only the standard library is imported at module level anywhere in this package: the kit runs before anything
is installed on the GPU machine.
"""
