"""What a run says while it trains: the log window, its records, the progress bar, metrics.jsonl, TensorBoard.

The window sums the losses of the steps since the last record on the device (no host read per micro-batch);
a record reads them in ONE transfer (log steps, steps with the job's extra entries, and checkpoints, which
keep the window in progress: a run stopped between two log steps logs exactly what an uninterrupted one
does). Records go to ``metrics.jsonl`` and TensorBoard on the main process.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from cast_llm.io import RunDir, append_jsonl, truncate_jsonl

__all__ = ["MetricsLog"]


class MetricsLog:
    """The log of one run segment (see the module docstring). ``ctx``: the loop's
    :class:`~cast_llm.train.loop.LoopContext`; ``tokens_per_step``: the job's (None: tokens counted as seen);
    ``window``: the one a resumed checkpoint kept."""

    def __init__(self, ctx, scheduler, *, total_steps: int, start_step: int, desc: str,
                 tokens_per_step: int | None, window: dict[str, Any] | None = None):
        cfg = ctx.cfg
        self.out, self.is_main, self.distribution, self.world = ctx.out, ctx.is_main, ctx.distribution, ctx.world
        self.scheduler = scheduler
        self.grad_accum = cfg.grad_accum
        self.tokens_per_step = tokens_per_step
        self.tb = self.bar = None
        if self.is_main:
            truncate_jsonl(RunDir(self.out).metrics, start_step)
            if cfg.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(RunDir(self.out).tensorboard), purge_step=start_step + 1 if start_step else None)
            if cfg.progress:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step", dynamic_ncols=True)
        self.window = _new_window()
        if window:
            self.window.update(window)

    def add(self, loss: torch.Tensor, parts: dict[str, Any], tokens: int) -> None:
        """One micro-batch (on the device: read on log steps only)."""
        w = self.window
        w["loss"] += loss.detach() / self.grad_accum
        for k, v in parts.items():
            w["parts"][k] = w["parts"].get(k, 0.0) + v / self.grad_accum
        w["tokens"] += tokens * self.world

    def stepped(self) -> None:
        self.window["n"] += 1

    def record(self, step: int, *entries: dict[str, Any]) -> dict[str, Any]:
        """The record of the window ending at ``step`` (``entries`` added to it) into metrics.jsonl and
        TensorBoard; a new window starts."""
        rec = _record(step, self.window, self.tokens_per_step, self.scheduler, self.distribution)
        for e in entries:
            rec.update(e)
        if self.is_main:
            append_jsonl(RunDir(self.out).metrics, rec)
            if self.tb is not None:
                for k, v in rec.items():
                    if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                        self.tb.add_scalar(f"train/{k}", v, step)
        self.window = _new_window()
        if self.bar is not None:
            self.bar.set_postfix(**_postfix(rec))
        return rec

    def host_window(self) -> dict[str, Any]:
        """The window in progress as plain numbers (what a checkpoint keeps)."""
        return _host_window(self.window)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        """The progress bar and TensorBoard closed (again: nothing)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _new_window() -> dict[str, Any]:
    return {"loss": 0.0, "parts": {}, "n": 0, "tokens": 0, "t0": time.perf_counter()}


def _host_window(window: dict) -> dict[str, Any]:
    """The log window with its device sums read in ONE transfer (log steps and checkpoints only)."""
    names = list(window["parts"])
    values = [window["loss"]] + [window["parts"][k] for k in names]
    device = next((v.device for v in values if torch.is_tensor(v)), None)
    if device is not None:
        values = torch.stack([v.detach().double() if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64)
                              .to(device) for v in values]).tolist()
    out = {k: v for k, v in window.items() if k != "t0"}
    out["loss"], out["parts"] = float(values[0]), {k: float(v) for k, v in zip(names, values[1:])}
    return out


def _record(step: int, window: dict, tokens_per_step: int | None, scheduler, distribution) -> dict[str, Any]:
    n = max(window["n"], 1)
    dt = time.perf_counter() - window["t0"]
    window = _host_window(window)
    names = list(window["parts"])
    vals = torch.tensor([window["loss"] / n] + [window["parts"][k] / n for k in names])
    if distribution.world > 1:
        vals = distribution.accelerator.reduce(vals.to(distribution.device), reduction="mean").cpu()
    rec = {"step": step}
    if tokens_per_step:
        rec["tokens"] = step * tokens_per_step
    rec["loss"] = float(vals[0])
    rec.update({k: float(v) for k, v in zip(names, vals[1:])})
    rec["lr"] = scheduler.get_last_lr()[0]
    rec["tokens_per_s"] = window["tokens"] / dt if dt > 0 else math.nan
    return rec


def _postfix(rec: dict[str, Any]) -> dict[str, str]:
    out = {"loss": f"{rec['loss']:.3f}", "tok_s": f"{rec['tokens_per_s']:.0f}"}
    if "flip_rate" in rec:
        out["flips"] = f"{rec['flip_rate']:.2%}"
    if "val_loss" in rec:
        out["val"] = f"{rec['val_loss']:.3f}"
    return out
