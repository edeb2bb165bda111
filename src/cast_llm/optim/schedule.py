"""The learning-rate schedule of every training and fine-tuning run: linear warm-up, then a decay shape.

The paper gives no schedule (method.md §5); ``--lr-schedule`` chooses the shape after the warm-up and
docs/training.md says which default we measured to be best and why. The cosine is the one of transformers'
``get_cosine_with_min_lr_schedule_with_warmup`` (earlier versions of the trainer used it; runs are
reproduced exactly).
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "TRAIN_WARMUP", "FINETUNE_WARMUP", "lr_factor", "build_scheduler", "schedule_lrs",
           "warmup_steps"]

SCHEDULES = ("cosine", "constant", "linear")  # after the linear warm-up (the paper gives none)
# The warm-up without --warmup-steps, as a fraction of the steps (at least one step; the paper gives none), read
# by every user of a run's schedule: the loop's scheduler, CAST's decay forecast, `cast-llm plan`
TRAIN_WARMUP = 0.02  # cast-llm train
FINETUNE_WARMUP = 0.03  # cast-llm finetune


def warmup_steps(cfg, total_steps: int, default_fraction: float) -> int:
    """``cfg.warmup_steps``, or ``default_fraction`` of the steps (at least 1)."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    return max(1, round(default_fraction * total_steps))


def lr_factor(kind: str, total_steps: int, warmup: int, min_lr_ratio: float = 0.0):
    """The lr multiplier as a function of the scheduler step k (optimizer step k+1 uses it).

    Linear warm-up ``k/W`` over ``W`` steps, then with ``p = (k−W)/(T−W)``: ``cosine``
    ``r + (1−r)·½(1+cos πp)``, ``linear`` ``r + (1−r)(1−p)``, or ``constant`` 1, where ``r = min_lr_ratio``.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r} (choose from {', '.join(SCHEDULES)})")

    def factor(k: int) -> float:
        if k < warmup:
            return float(k) / float(max(1, warmup))
        if kind == "constant":
            return 1.0
        p = float(k - warmup) / float(max(1, total_steps - warmup))
        shape = 0.5 * (1.0 + math.cos(math.pi * p)) if kind == "cosine" else 1.0 - p
        return max(0.0, min_lr_ratio + (1.0 - min_lr_ratio) * shape)

    return factor


def build_scheduler(optimizer, cfg, total_steps: int, *, default_warmup: float):
    """The run's LR scheduler (``cfg.lr_schedule``, ``cfg.min_lr_ratio``), stepped once per optimizer step."""
    w = warmup_steps(cfg, total_steps, default_warmup)
    import torch  # here: the schedule's names and factors need no torch (`cast-llm --help` lists them)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg.lr_schedule, total_steps, w, cfg.min_lr_ratio))


def schedule_lrs(cfg, total_steps: int, peak_lr: float, *, default_warmup: float) -> list[float]:
    """γ_t for t = 1 … T, as the optimizer will see them."""
    w = warmup_steps(cfg, total_steps, default_warmup)
    f = lr_factor(cfg.lr_schedule, total_steps, w, cfg.min_lr_ratio)
    return [peak_lr * f(k) for k in range(total_steps)]
