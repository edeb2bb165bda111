"""A non-finite loss or gradient stops the run — checked on the device, read by the host once per log interval.

Reading a loss on the host (``float(loss)``) makes the host wait for the device at every micro-batch: on a
host-bound model the GPU then idles twice per micro-batch. So the loop hands each micro-batch's loss to
:class:`FiniteGuard`, which keeps, on the device and without any host read:

* ``flag`` — a sticky float32 scalar, 1 once any loss (or, through the optimizer, any gradient) was NaN/Inf;
* the first optimizer step at which it happened, and that step's loss.

Semantics (exact): **a non-finite step is never applied.** Before every optimizer step the flag is handed to
the optimizer as ``found_inf`` — the protocol of torch's ``GradScaler`` for fused optimizers — so the
step is skipped on the device: torch's ``Adam``/``AdamW(fused=True)`` and cast-llm's ``AdamS`` (which also ORs
its own gradient check into the flag) leave weights, moments and step counts untouched. The flag is sticky,
so every later step is skipped too, until the host reads it: at the next log step, before any checkpoint is
written, and at the end — where the run stops with the same error as before, naming the first bad step and
the last good checkpoint. An optimizer that cannot skip on the device (a non-fused torch AdamW, SR-STE's)
gets the flag checked on the host before its step instead (one host read per step, as before).
"""

from __future__ import annotations

import math

import torch

from cast_llm.errors import CastError
from cast_llm.optim.adams import AdamS

__all__ = ["FiniteGuard", "skips_on_device"]


def skips_on_device(optimizer) -> bool:
    """Whether ``optimizer.step()`` honours a ``found_inf`` attribute on the device (no host read)."""
    if isinstance(optimizer, AdamS):
        return True
    if isinstance(optimizer, torch.optim.Adam):  # AdamW too: torch passes found_inf to its fused kernels only
        return all(group.get("fused") for group in optimizer.param_groups)
    return False


class FiniteGuard:
    """See the module docstring. ``watch`` every micro-batch's loss, ``arm`` the optimizer before its step,
    ``stepped`` after it, ``check`` where the host may wait (log steps, checkpoints, the end)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.flag = torch.zeros((), dtype=torch.float32, device=self.device)
        self.first_step = torch.full((), -1, dtype=torch.int64, device=self.device)
        self.first_loss = torch.zeros((), dtype=torch.float32, device=self.device)

    def watch(self, loss: torch.Tensor, step: int) -> None:
        """A micro-batch's loss of optimizer step ``step + 1`` (``step``: steps done, as in the loop)."""
        value = loss.detach().float().to(self.device)
        bad = torch.isfinite(value).logical_not()
        first = bad & (self.flag == 0)
        torch.where(first, value, self.first_loss, out=self.first_loss)
        self.first_step.masked_fill_(first, step + 1)  # a scalar argument: no host-to-device copy
        torch.maximum(self.flag, bad.float(), out=self.flag)

    def arm(self, optimizer, last_good) -> None:
        """Before ``optimizer.step()``: skip it on the device if anything was non-finite (see the module doc).
        Several processes agree first (a MAX all-reduce of the flag, on the device): every rank skips alike."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.flag, op=torch.distributed.ReduceOp.MAX)
        if skips_on_device(optimizer):
            optimizer.found_inf = self.flag
        else:
            self.check(last_good)

    def stepped(self, step: int) -> None:
        """After the optimizer step ``step + 1``: a flag the optimizer raised (a gradient) dates from here."""
        self.first_step.masked_fill_((self.flag != 0) & (self.first_step < 0), step + 1)

    def check(self, last_good) -> None:
        """One host read; a CastError naming the first bad step and ``last_good`` (a checkpoint or None)."""
        flag, step, loss = torch.stack([self.flag.double(), self.first_step.double(), self.first_loss.double()]).tolist()
        if flag == 0:
            return
        where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written"
        step = int(step) if step >= 0 else "?"
        if not math.isfinite(loss):
            raise CastError(f"loss became {loss} at step {step}; stopped ({where}); no update was applied from that "
                            "step on; lower --lr or check the data")
        raise CastError(f"a gradient became non-finite (NaN/Inf) at step {step} while the loss was finite; stopped "
                        f"({where}); no update was applied from that step on; lower --lr or check the data")
