"""Host reads during the training loop's steps, counted on CPU (shared by tests/test_step_syncs.py).

A read of device memory by the host — ``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``,
``.numpy()``, and the ops whose output size depends on the data (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``…) — makes the host wait for the device on a GPU. On a CPU nothing waits, so
these are counted instead: a ``TorchDispatchMode`` sees every aten op (``_local_scalar_dense`` is what every
scalar read calls), and the Python-level transfers are wrapped. Run with ``TRITON_INTERPRET=1``, every
training-step kernel path of a GPU run takes its Triton candidate on the CPU tensors (AdamS update and mask
refresh, the KD loss, the block-grouped scaled weights), so the code counted is the CUDA code. What this
cannot see on a CPU: host-to-device copies from pageable memory (they synchronise on CUDA) — the CUDA variant
of the test, under ``torch.cuda.set_sync_debug_mode("error")``, covers those.

Reads made by Triton's interpreter itself (it runs the kernels in numpy) are not the program's and are left
out, by the module of the calling frame.
"""

from __future__ import annotations

import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cast_llm.kernels.registry import probing

ATEN = torch.ops.aten
# ops that read device memory on the host, or whose output shape depends on the data (a sync on CUDA)
SYNCING_OPS = {ATEN._local_scalar_dense.default, ATEN.nonzero.default, ATEN.masked_select.default,
               ATEN.equal.default, ATEN.is_nonzero.default, ATEN._unique2.default, ATEN.unique_consecutive.default,
               ATEN.unique_dim.default, ATEN.repeat_interleave.Tensor, ATEN.allclose.default}
PY_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def _from_triton(depth: int = 40) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith("triton"):
            return True
        frame = frame.f_back
    return False


class HostReads(TorchDispatchMode):
    """Records every host read while ``active``; ``reads`` holds (label, what, where)."""

    def __init__(self):
        super().__init__()
        self.active = False
        self.label = None
        self.reads: list[tuple] = []
        self.probe_reads = 0
        self._saved = {}

    def _note(self, what: str) -> None:
        if self.active and probing():  # a kernel's check before its first use (cast_llm.kernels): once per
            self.probe_reads += 1  # process and variant, and none where the verdict is cached
        elif self.active and not _from_triton():
            where = "".join(traceback.format_stack(sys._getframe(2), limit=4)[::-1][:2]).strip().replace("\n", " | ")
            self.reads.append((self.label, what, where[:400]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING_OPS:
            self._note(str(func))
        elif func in (ATEN.index.Tensor, ATEN.index_put_.default, ATEN.index_put.default):
            indices = args[1] if len(args) > 1 else ()
            if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
                self._note(f"{func} with a boolean mask")
        return func(*args, **kwargs)

    def __enter__(self):
        for name in PY_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapped(t, *a, _original=original, _name=name, **k):
                self._note(f"Tensor.{_name}")
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def count_in_training(workdir: str, *, counted=(1, 2, 3), log_every: int = 5, max_steps: int = 5) -> dict:
    """A CAST run (the paper's: dense start) with KD, 3 micro-batches per step, masks refreshed at t = 3;
    host reads are counted during the optimizer steps ``counted`` (0-based; none of them a log step).
    Returns the reads, the steps seen and which path each checked kernel took."""
    from pathlib import Path

    import tiny

    from cast_llm import kernels
    from cast_llm.cli import main
    from cast_llm.train.methods import cast as cast_method

    work = Path(workdir)
    # one block, width 32: what is counted does not depend on size, and the Triton interpreter runs a program per
    # tile in Python (with the 2-block, width-64 model this test took 33 s in the suite here, 12 s alone now)
    tiny.save_model(work / "llama", "llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    tiny.write_corpus(work / "corpus.jsonl")
    (work / "eval.txt").write_text(tiny.CORPUS)
    reads = HostReads()
    seen = []
    real_begin = cast_method.CastMethod.begin_step

    def begin_step(self, model, optimizer, step):
        reads.active = step in counted  # from this step's start to the next step's start
        reads.label = step
        seen.append(step)
        return real_begin(self, model, optimizer, step)

    cast_method.CastMethod.begin_step = begin_step
    real_finalize = cast_method.CastMethod.finalize

    def finalize(self, *a, **k):
        reads.active = False
        return real_finalize(self, *a, **k)

    cast_method.CastMethod.finalize = finalize
    argv = ["train", "--model", str(work / "llama"), "--data", str(work / "corpus.jsonl"),
            "--output-dir", str(work / "run"), "--batch-size", "1", "--seq-len", "16", "--grad-accum", "3",
            "--max-steps", str(max_steps), "--log-every", str(log_every), "--kd", "--mask-interval", "3",
            "--no-progress", "--no-baseline-eval", "--val-sequences", "2", "--device", "cpu",
            "--wikitext-file", str(work / "eval.txt"), "--track-weights", "0", "--ratio-hist-steps=", "--no-report",
            "--paper-exact"]
    try:
        with reads:
            rc = main(argv)
    finally:
        cast_method.CastMethod.begin_step, cast_method.CastMethod.finalize = real_begin, real_finalize
    return {"rc": rc, "reads": reads.reads, "probe_reads": reads.probe_reads, "seen": seen, "kernels": kernels.taken()}
