"""One optimizer step: what the training loop runs for every step, and what the step benchmarks time.

:func:`train_step` runs ``grad_accum`` micro-batches — forward and the job's loss, the loss watched for
NaN/Inf on the device (:class:`~cast_llm.train.finite.FiniteGuard`), backward of ``loss / grad_accum``
(DDP syncs gradients on the last micro-batch only, FSDP2 reduce-scatters every one) — then the method's
hooks around clipping and the optimizer step (skipped on the device after a non-finite loss or gradient),
the LR schedule and ``zero_grad``. What it works on, and how the processes take part, is a
:class:`StepSetup`; without a distribution, method or schedule (a benchmark), its defaults are plain torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cast_llm.train.finite import FiniteGuard

__all__ = ["StepSetup", "train_step"]


def _no_context(*_args):
    return contextlib.nullcontext()


@dataclass
class StepSetup:
    """What an optimizer step works on.

    ``model`` / ``optimizer``: as wrapped for training (DDP, FSDP2, accelerate) — forward runs on the one,
    ``step()`` is called on the other; ``raw`` / ``raw_opt``: the plain ones the method's hooks see (default:
    the same). ``loss(model, teacher, batch)`` returns ``(loss, named parts, tokens)`` (a job's
    :meth:`~cast_llm.train.loop.Job.loss`). ``method``: a
    :class:`~cast_llm.train.methods.base.TrainingMethod` whose step hooks run (None: none); ``ctx`` is
    handed to its ``before_update``. ``backward`` / ``clip(max_norm)`` / ``no_sync(last)`` / ``autocast()`` /
    ``sync_gradients()`` (after the last backward): how the distribution does them (default: ``loss.backward()``, ``clip_grad_norm_`` over ``model``, no
    context). ``guard``: created on the first loss's device when None.
    """

    model: torch.nn.Module
    optimizer: Any
    loss: Callable[[Any, Any, Any], tuple[torch.Tensor, dict, int]]
    teacher: Any = None
    raw: Any = None
    raw_opt: Any = None
    method: Any = None
    scheduler: Any = None
    guard: FiniteGuard | None = None
    grad_clip: float = 0.0
    backward: Callable[[torch.Tensor], Any] | None = None
    clip: Callable[[float], Any] | None = None
    no_sync: Callable[[bool], Any] = _no_context
    autocast: Callable[[], Any] = contextlib.nullcontext
    sync_gradients: Callable[[], Any] | None = None  # after the last backward (FSDP2: the replicated scales')
    ctx: Any = None

    def __post_init__(self):
        self.raw = self.model if self.raw is None else self.raw
        self.raw_opt = self.optimizer if self.raw_opt is None else self.raw_opt
        if self.backward is None:
            self.backward = torch.Tensor.backward
        if self.clip is None:
            self.clip = lambda max_norm: torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


def train_step(setup: StepSetup, step: int, batch: Callable[[int], Any], grad_accum: int = 1, *,
               last_good=None, accumulate: Callable[[torch.Tensor, dict, int], Any] | None = None,
               agree: Callable[[], Any] | None = None, mark: Callable[[str], Any] | None = None) -> Any:
    """Optimizer step ``step + 1`` (``step``: steps done, 0-based) over ``grad_accum`` micro-batches
    ``batch(micro)``.

    ``accumulate(loss, parts, tokens)``: each micro-batch's loss after its backward (the log window; nothing
    is read on the host here). ``agree()``: after the last backward, before the optimizer step — what every
    process must agree on (the loop's stop signal and clock); its value is returned. ``last_good``: the
    checkpoint a non-finite step's error names. ``mark(phase)``: called at the end of each phase
    (``"forward"`` and ``"backward"`` of every micro-batch, ``"clip"``, ``"optimizer"`` right after
    ``optimizer.step()``) — the benchmarks' clock."""
    m, raw, opt = setup.method, setup.raw, setup.raw_opt
    if m is not None:
        m.begin_step(raw, opt, step)
    for micro in range(grad_accum):
        b = batch(micro)
        with setup.no_sync(micro == grad_accum - 1), setup.autocast():
            loss, parts, tokens = setup.loss(setup.model, setup.teacher, b)
            if setup.guard is None:
                setup.guard = FiniteGuard(loss.device)
            setup.guard.watch(loss, step)
            if mark is not None:
                mark("forward")
            setup.backward(loss / grad_accum)
        if mark is not None:
            mark("backward")
        if accumulate is not None:
            accumulate(loss, parts, tokens)
    if setup.sync_gradients is not None:
        setup.sync_gradients()
    agreed = agree() if agree is not None else None
    if m is not None:
        m.before_optimizer_step(raw, opt, step)
    if setup.grad_clip > 0:
        setup.clip(setup.grad_clip)
    if mark is not None:
        mark("clip")
    if m is not None:
        m.before_update(raw, opt, step, setup.ctx)
    setup.guard.arm(opt, last_good)  # a non-finite step is skipped on the device
    setup.optimizer.step()
    if mark is not None:
        mark("optimizer")
    setup.guard.stepped(step)
    if m is not None:
        m.end_step(raw, opt, step)
    if setup.scheduler is not None:
        setup.scheduler.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return agreed
