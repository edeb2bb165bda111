"""The batch of a run on any number of processes: ``--global-batch`` split into micro-batch × accumulation ×
processes, the micro-batch chosen to fit the memory plan.

The paper's batch is global (LLaMA: 256 sequences per optimizer step). A run on W processes with a
micro-batch of b sequences per process accumulates ``global / (b · W)`` micro-batches, so the optimizer
sees the same batch on 1, 2 or 8 GPUs. ``--batch-size 0`` takes the largest b that divides ``global / W``
and fits the plan (:func:`split_global_batch`).
"""

from __future__ import annotations

from collections.abc import Callable

from cast_llm.errors import CastError

__all__ = ["split_global_batch"]


def split_global_batch(global_batch: int | None, world: int, *, batch_size: int, grad_accum: int,
                       fits: Callable[[int, int], bool]) -> tuple[int, int]:
    """``(micro-batch, accumulation)`` per process for ``global_batch`` sequences per step over ``world``
    processes. ``batch_size`` 0: the largest micro-batch (dividing the per-process share) for which
    ``fits(micro, accum)`` holds, else 1 (the caller's memory check then says what would fit); a given
    ``batch_size`` must divide the share. ``grad_accum`` other than 1 must equal the derived one. Without a
    global batch, ``(batch_size, grad_accum)`` as given (``batch_size`` 0 is refused)."""
    if global_batch is None:
        if batch_size == 0:
            raise CastError("--batch-size 0 (the largest micro-batch that fits) needs --global-batch to divide; "
                            "give --batch-size N or --global-batch N")
        return batch_size, grad_accum
    if global_batch % world:
        near = [w for w in range(1, 2 * world + 1) if global_batch % w == 0]
        raise CastError(f"--global-batch {global_batch} sequences cannot be split over {world} processes; launch "
                        f"a number that divides it (e.g. {', '.join(map(str, near[-4:]))}) or change --global-batch")
    share = global_batch // world
    if batch_size:
        if share % batch_size:
            raise CastError(f"--batch-size {batch_size} does not divide the {share} sequences each of the {world} "
                            f"process(es) takes of --global-batch {global_batch}; use a divisor of {share} or "
                            "--batch-size 0 (the largest that fits)")
        micro = batch_size
    else:
        divisors = [b for b in range(share, 0, -1) if share % b == 0]
        micro = next((b for b in divisors if fits(b, share // b)), 1)
    accum = share // micro
    if grad_accum not in (1, accum):
        raise CastError(f"--grad-accum {grad_accum} contradicts --global-batch {global_batch} on {world} process(es) "
                        f"with --batch-size {micro} (which needs {accum}); leave --grad-accum out")
    return micro, accum
