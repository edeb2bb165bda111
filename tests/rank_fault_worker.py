"""Run under torchrun by tests/test_train.py: ``cast-llm train`` whose loss turns NaN on one rank only (rank
``CAST_TEST_NAN_RANK``, at its third micro-batch). Every rank must stop at the same step with one line —
the rank that saw it names the value, the others say it happened elsewhere — instead of one rank dying and
the others hanging in the next collective."""

from __future__ import annotations

import os
import sys

import torch

import cast_llm.train.trainer as trainer
from cast_llm.cli import main

BAD_RANK = int(os.environ["CAST_TEST_NAN_RANK"])
_loss = trainer.PretrainJob.loss
calls = 0


def loss(self, model, teacher, batch):
    global calls
    out, parts, tokens = _loss(self, model, teacher, batch)
    calls += 1
    if calls == 3 and int(os.environ["RANK"]) == BAD_RANK:
        out = out * torch.tensor(float("nan"))
    return out, parts, tokens


trainer.PretrainJob.loss = loss
sys.exit(main(sys.argv[1:]))
