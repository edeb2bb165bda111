"""The default warm-up is defined once (optim/schedule.py) and every user of a run's schedule reads it."""

from __future__ import annotations

import dataclasses

import pytest
import tiny

from cast_llm.finetune.job import FinetuneJob
from cast_llm.optim.schedule import FINETUNE_WARMUP, TRAIN_WARMUP, build_scheduler
from cast_llm.train.config import RunConfig, TrainConfig
from cast_llm.train.methods import get_method
from cast_llm.train.trainer import PretrainJob


def test_jobs_and_help_read_the_one_definition():
    assert PretrainJob.default_warmup == TRAIN_WARMUP and FinetuneJob.default_warmup == FINETUNE_WARMUP
    help_text = next(f.metadata["help"] for f in dataclasses.fields(RunConfig) if f.name == "warmup_steps")
    assert f"{TRAIN_WARMUP:.0%} of the steps for train" in help_text and f"{FINETUNE_WARMUP:.0%} for finetune" in help_text


@pytest.mark.parametrize("warmup", [None, 7])
def test_the_decay_forecast_sees_the_schedule_the_run_steps(warmup):
    """CAST's decay forecast integrates the lr schedule: it must be the one the loop's scheduler follows, with
    the same default warm-up (2 % of 200 steps: 4) or the given --warmup-steps."""
    steps = 200
    cfg = TrainConfig(output_dir="unused", max_steps=steps, lr=1e-2, paper_exact=True, warmup_steps=warmup)
    model = tiny.model("llama")
    method = get_method("cast")
    method.prepare_model(model, cfg)
    opt = method.build_optimizer(model, cfg, steps)
    sched = build_scheduler(opt, cfg, steps, default_warmup=PretrainJob.default_warmup)
    run_lrs = [cfg.lr * sched.lr_lambdas[0](k) for k in range(steps)]
    assert method._lrs == run_lrs
    w = warmup if warmup is not None else round(TRAIN_WARMUP * steps)
    assert run_lrs[w - 1] < cfg.lr and run_lrs[w] == cfg.lr
