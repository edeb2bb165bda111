"""``cast-llm plan``: what a CAST run will need, before it runs — memory per GPU, whether it fits and with
which options, how long it takes, and whether the decay will finish.

The parts, each a small pure module: :mod:`~cast_llm.plan.shapes` (the model's counts from its config, on
the meta device), :mod:`~cast_llm.plan.activations` (bytes autograd keeps per token),
:mod:`~cast_llm.plan.memory` (the per-GPU breakdown and its peak), :mod:`~cast_llm.plan.advice` (the options
that make it fit), :mod:`~cast_llm.plan.timing`, :mod:`~cast_llm.plan.decay` (S_T in closed form),
:mod:`~cast_llm.plan.startup` (around the steps), :mod:`~cast_llm.plan.report` (the text).
:mod:`~cast_llm.plan.run` reads a training configuration into them: :func:`plan_run` (``cast-llm plan``), and
:func:`setup_for_run` / :func:`startup_work`, which ``cast-llm train`` calls for its own run.
"""

from __future__ import annotations

from cast_llm import lazy_exports as _lazy_exports
from cast_llm.machine import machine_ram, process_rss  # (re-exported: the plan's old import path)
from cast_llm.plan.config import PlanOptions
from cast_llm.plan.memory import MemoryPlan, Setup, plan_memory
from cast_llm.plan.shapes import ModelShape, model_shape, shape_of
from cast_llm.plan.sizes import fmt_size, parse_size
from cast_llm.plan.startup import StartupPlan, StartupWork, Timeouts, plan_startup, startup_fits

__all__ = ["Plan", "PlanOptions", "Setup", "MemoryPlan", "ModelShape", "plan_run", "model_shape", "shape_of",
           "plan_memory", "parse_size", "fmt_size", "setup_for_run", "startup_work", "process_rss", "machine_ram",
           "StartupPlan", "StartupWork", "Timeouts", "plan_startup", "startup_fits"]

# cast_llm.plan.run reads the evaluator's and the pruner's settings (torch): loaded when first asked for, so that
# `cast-llm --help` (which reads PlanOptions) starts without torch
_LAZY = {name: "run" for name in ("Plan", "plan_run", "setup_for_run", "startup_work")}
__getattr__, __dir__ = _lazy_exports(__name__, _LAZY)
