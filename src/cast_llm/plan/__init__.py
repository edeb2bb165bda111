"""``cast-llm plan``: what a CAST run will need, before it runs — memory per GPU, whether it fits and with
which options, how long it takes, and whether the decay will finish.

The parts, each a small pure module: :mod:`~cast_llm.plan.shapes` (the model's counts from its config, on
the meta device), :mod:`~cast_llm.plan.activations` (bytes autograd keeps per token),
:mod:`~cast_llm.plan.memory` (the per-GPU breakdown and its peak), :mod:`~cast_llm.plan.advice` (the options
that make it fit), :mod:`~cast_llm.plan.timing`, :mod:`~cast_llm.plan.decay` (S_T in closed form),
:mod:`~cast_llm.plan.report` (the text). :func:`make_plan` puts them together for a :class:`PlanConfig`;
``cast-llm train`` prints the memory part for its own configuration (:func:`setup_for_run`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cast_llm.machine import machine_ram, process_rss  # (re-exported: the plan's old import path)
from cast_llm.plan.advice import Fit, make_it_fit, option_effects
from cast_llm.plan.config import (
    GRAD_RMS_AT_512,
    PAPER_GLOBAL_BATCH,
    PAPER_STEPS,
    WEIGHT_RMS,
    PlanConfig,
    PlanOptions,
)
from cast_llm.plan.decay import DecayPlan, plan_decay
from cast_llm.plan.memory import MemoryPlan, Setup, plan_memory
from cast_llm.plan.shapes import ModelShape, embedded_key, model_shape, shape_of
from cast_llm.plan.sizes import fmt_size, parse_size
from cast_llm.plan.startup import StartupPlan, StartupWork, Timeouts, plan_startup, startup_fits
from cast_llm.plan.timing import TimePlan, interconnect, plan_time

__all__ = ["Plan", "PlanConfig", "PlanOptions", "Setup", "MemoryPlan", "ModelShape", "make_plan", "model_shape", "shape_of",
           "plan_memory", "parse_size", "fmt_size", "setup_for_run", "process_rss", "machine_ram", "StartupPlan",
           "StartupWork", "Timeouts", "plan_startup", "startup_fits"]


@dataclass
class Plan:
    cfg: PlanConfig
    shape: ModelShape
    setup: Setup
    capacity: int  # bytes one process may use
    memory: MemoryPlan
    fit: Fit | None  # None when it fits as given
    effects: list  # [(Option, MemoryPlan)] each option alone
    time: TimePlan
    decay: DecayPlan | None
    fit_time: TimePlan | None = None  # the time with the options of `fit` (they change the FLOPs)
    startup: StartupPlan | None = None  # around the steps: start-up and end peaks, host per node, timeouts

    def as_dict(self) -> dict:
        from dataclasses import asdict

        from cast_llm.plan.advice import remedy
        from cast_llm.plan.report import precision_text

        memory = self.memory.as_dict()
        memory["largest_term"]["remedy"] = remedy(memory["largest_term"]["name"], self.setup)
        return {"model": self.shape.name, "source": self.shape.source, "shape": asdict(self.shape),
                "setup": asdict(self.setup), "precision": {
                    "policy": self.setup.policy, "what": precision_text(self.setup)},
                "recomputation": self.setup.recompute, "capacity": self.capacity, "memory": memory,
                "fits": self.memory.fits(self.capacity),
                "make_it_fit": None if self.fit is None else {
                    "flags": self.fit.flags, "gpus": self.fit.gpus, "needed": self.fit.plan.needed()},
                "options": [{"flag": o.flag, "needed": p.needed(), "fits": p.fits(self.capacity)}
                            for o, p in self.effects],
                "time": self.time.as_dict(), "time_with_options": self.fit_time and self.fit_time.as_dict(),
                "decay": None if self.decay is None else self.decay.as_dict(),
                "startup": None if self.startup is None else {
                    **self.startup.as_dict(), **startup_fits(self.startup, self.setup, self.capacity,
                                                              self.cfg.host_memory and parse_size(
                                                                  self.cfg.host_memory, "--host-memory"))}}


def _setup(cfg: PlanConfig, framework: int, capacity: int | None = None, shape: ModelShape | None = None) -> Setup:
    precision = cfg.precision if cfg.precision != "auto" else ("bf16" if cfg.device == "cuda" else "fp32")
    strategy = "fsdp" if cfg.fsdp else ("ddp" if cfg.gpus > 1 else "single")

    def setup(batch: int, accum: int) -> Setup:
        return Setup(device=cfg.device, world=cfg.gpus, strategy=strategy, precision=precision,
                     batch_size=batch, grad_accum=accum, seq_len=cfg.seq_len, kd=cfg.kd, scaling=cfg.scaling,
                     scale_groups=cfg.scale_groups, activation_checkpointing=cfg.activation_checkpointing,
                     fsdp_precision="autocast" if cfg.fsdp_precision == "autocast" else "policy",
                     teacher_dtype=cfg.teacher_dtype, fused_head=cfg.fused_head, kd_chunk_size=cfg.kd_chunk_size,
                     packed_masks=cfg.packed_masks, framework=framework)

    # the global batch: given (a preset's, --global-batch), else the paper's unless --grad-accum says otherwise
    global_batch = cfg.global_batch or (None if cfg.grad_accum else PAPER_GLOBAL_BATCH)
    if cfg.batch_size == 0:  # as `cast-llm train --batch-size 0` chooses it
        from cast_llm.plan.batch import split_global_batch

        batch, accum = split_global_batch(global_batch or PAPER_GLOBAL_BATCH, cfg.gpus, batch_size=0,
                                          grad_accum=cfg.grad_accum or 1,
                                          fits=lambda b, a: plan_memory(shape, setup(b, a)).fits(capacity))
        return setup(batch, accum)
    accum = max(1, math.ceil(global_batch / (cfg.batch_size * cfg.gpus))) if global_batch else cfg.grad_accum
    return setup(cfg.batch_size, accum)


def make_plan(cfg: PlanConfig, shape: ModelShape | None = None) -> Plan:
    """The whole plan for ``cfg`` (``shape``: already known, e.g. from a loaded model)."""
    from cast_llm.optim.schedule import schedule_lrs

    cfg.validate()
    shape = shape or model_shape(cfg.model)
    cpu = cfg.device == "cpu"
    total = parse_size(cfg.gpu_memory) if cfg.gpu_memory else (machine_ram() if cpu else 80 * 10**9)
    capacity = total // cfg.gpus if cpu else total  # CPU processes share the machine's RAM
    setup = _setup(cfg, framework=process_rss() if cpu else 0, capacity=capacity, shape=shape)
    memory = plan_memory(shape, setup)
    fit = None if memory.fits(capacity) else make_it_fit(shape, setup, capacity)
    effects = option_effects(shape, setup)
    per_step = setup.batch_size * setup.seq_len * setup.grad_accum * setup.world
    tokens = cfg.tokens or (cfg.max_steps or PAPER_STEPS) * per_step
    link = interconnect(cfg.interconnect, cfg.gpus, cfg.gpus_per_node)
    bandwidth = cfg.link_bandwidth * 1e9 if cfg.link_bandwidth else None
    time = plan_time(shape, setup, tokens, tokens_per_s=cfg.tokens_per_s, gpu_tflops=cfg.gpu_tflops, mfu=cfg.mfu,
                     link=link, bandwidth=bandwidth)
    if cpu and cfg.tokens_per_s is None:  # no FLOP rate to assume for a CPU: only a measured throughput
        time.tokens_per_s = float("nan")
    fit_time = None
    if fit is not None and fit.gpus != 0 and cfg.tokens_per_s is None and not cpu:  # options change the FLOPs
        gpus = fit.gpus or cfg.gpus
        name = "auto" if cfg.interconnect == "nvlink" and gpus > cfg.gpus_per_node else cfg.interconnect
        fit_link = interconnect(name, gpus, cfg.gpus_per_node)
        fit_time = plan_time(shape, fit.setup, tokens, gpu_tflops=cfg.gpu_tflops, mfu=cfg.mfu, link=fit_link,
                             bandwidth=bandwidth)
    decay = None
    if cfg.l1_decay > 0:
        steps = time.steps
        lrs = schedule_lrs(cfg, steps, cfg.lr, default_warmup=0.02)  # the run's own schedule code
        repair = cfg.repair_fraction if cfg.repair_fraction is not None else (0.0 if cfg.paper_exact else 0.2)
        prune_step = steps - round(repair * steps) if repair > 0 else steps
        weight_rms = cfg.weight_rms or WEIGHT_RMS.get(embedded_key(cfg.model) or "", 0.02)
        grad_rms = cfg.grad_rms or GRAD_RMS_AT_512 * math.sqrt(512 / per_step)
        decay = plan_decay(lrs, total_steps=steps, l1_decay=cfg.l1_decay, grad_rms=grad_rms, weight_rms=weight_rms,
                           warm_start=not cfg.paper_exact, prune_step=prune_step, target=cfg.forecast_target)
    work = StartupWork(baseline_eval=cfg.baseline_eval, warm_start=not cfg.paper_exact,
                       calib_tokens=cfg.calib_samples * cfg.seq_len, eval_tokens=(16 + 64) * cfg.seq_len,
                       eval_window=max(cfg.seq_len, setup.batch_size * cfg.seq_len), native_bytes=shape.native_bytes,
                       gpus_per_node=cfg.gpus_per_node,
                       host_memory=parse_size(cfg.host_memory, "--host-memory") if cfg.host_memory else None)
    startup = plan_startup(shape, setup, work)
    return Plan(cfg, shape, setup, capacity, memory, fit, effects, time, decay, fit_time, startup)


def setup_for_run(cfg, *, world: int, device_type: str, precision: str, framework: int = 0) -> Setup:
    """The :class:`Setup` of a ``cast-llm train`` configuration (``precision``: the loop's, 'bf16' or 'no')."""
    return Setup(device="cuda" if device_type == "cuda" else "cpu", world=world,
                 strategy="fsdp" if cfg.fsdp else ("ddp" if world > 1 else "single"),
                 precision="bf16" if precision == "bf16" else "fp32", batch_size=cfg.batch_size,
                 grad_accum=cfg.grad_accum, seq_len=cfg.seq_len, kd=cfg.use_kd, scaling=cfg.use_scaling,
                 scale_groups=cfg.scale_groups,
                 activation_checkpointing=getattr(cfg, "activation_checkpointing", "none"),
                 fsdp_precision="autocast" if getattr(cfg, "fsdp_precision", "auto") == "autocast" else "policy",
                 teacher_dtype=getattr(cfg, "teacher_dtype", "auto"), fused_head=getattr(cfg, "fused_head", False),
                 kd_chunk_size=cfg.kd_chunk_size, packed_masks=getattr(cfg, "packed_masks", False),
                 framework=framework)

