"""The memory plan of a training run (printed at its top) and the peak it actually reached (at its end).

:func:`plan_for_run` is :mod:`cast_llm.plan` applied to the model ``cast-llm train`` loaded, with the run's
own options (the same :func:`~cast_llm.plan.run.setup_for_run` and :func:`~cast_llm.plan.run.startup_work`
that ``cast-llm plan`` calls); :class:`PeakMemory` measures the same quantity over the training steps:

* on CUDA, ``torch.cuda.max_memory_allocated`` — what the caching allocator handed out, the quantity the
  plan predicts (the CUDA context and the allocator's cached-but-free blocks are outside it; the plan's
  verdict adds them);
* on the CPU, the process's peak resident set (``VmHWM``, reset at the first step through
  ``/proc/self/clear_refs``): torch's CPU allocator returns large blocks to the system when they are freed, so
  the resident set follows the live tensors, plus the interpreter and libraries the plan counts as
  ``framework`` (the resident set measured before the model was loaded).
"""

from __future__ import annotations

import os

import torch

from cast_llm import dtensor
from cast_llm.data import steps_for_tokens
from cast_llm.errors import CastError
from cast_llm.machine import machine_ram
from cast_llm.plan import fmt_size, plan_memory, shape_of, startup_fits
from cast_llm.plan.advice import make_it_fit
from cast_llm.plan.report import memory_lines, startup_lines
from cast_llm.plan.run import setup_for_run, startup_work
from cast_llm.plan.startup import plan_startup

SPLIT_WINDOWS_UNKNOWN = 64  # see plan_for_run

__all__ = ["PeakMemory", "plan_for_run", "device_capacity", "peak_rss", "reset_rss_peak", "refuse_if_too_large"]


def peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current RSS (Linux ≥ 4.0)
        return True
    except OSError:
        return False




def tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages of the tensors in modules / optimizers / tensors (DTensors: local shard)."""
    seen: set[int] = set()
    total = 0

    def add(t):
        nonlocal total
        if torch.is_tensor(t):
            t = dtensor.local(t)
            if t.device.type == "meta":
                return
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()

    for obj in objs:
        if obj is None:
            continue
        if isinstance(obj, torch.nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                add(t)
        elif hasattr(obj, "state") and hasattr(obj, "param_groups"):
            for st in obj.state.values():
                for v in st.values():
                    add(v)
        else:
            add(obj)
    return total


class PeakMemory:
    """Peak memory of this process from :meth:`start` to :meth:`read` (bytes; None where unmeasurable).

    On the CPU, :meth:`measure_framework` measures ``framework``: the resident set less the tensors the memory
    plan counts that exist at that moment (weights, teacher, optimizer state made so far) — the
    interpreter, libraries, tokenizer and data, which the plan does not model. It is called before the
    model is wrapped for DDP, whose gradient buckets the plan counts."""

    def __init__(self, device: torch.device):
        self.device = device
        self.ok = False
        self.framework: int | None = None

    @property
    def what(self) -> str:
        return "max_memory_allocated" if self.device.type == "cuda" else "peak RSS (VmHWM)"

    def measure_framework(self, *counted) -> None:
        if self.device.type == "cpu" and reset_rss_peak():
            rss = peak_rss()  # = the current resident set, just after the reset
            if rss is not None:
                self.framework = max(0, rss - tensor_bytes(*counted))

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.ok = True
        else:
            self.ok = reset_rss_peak()

    def read(self) -> int | None:
        if not self.ok:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return peak_rss()

    def reserved(self) -> int | None:
        """CUDA: the caching allocator's peak reserved bytes over the same span (its ratio to :meth:`read` is
        the fragmentation the plan's margin stands for); None elsewhere."""
        if not self.ok or self.device.type != "cuda":
            return None
        return int(torch.cuda.max_memory_reserved(self.device))


def device_capacity(device: torch.device, world: int) -> int:
    """Bytes one process may use: the GPU's memory, or this machine's RAM shared by its processes."""
    if device.type == "cuda":
        index = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", "0"))
        return int(torch.cuda.get_device_properties(index).total_memory)
    return machine_ram() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def plan_for_run(cfg, model, *, world: int, device: torch.device, precision: str, framework: int,
                 native_bytes: int = 4):
    """``(MemoryPlan, StartupPlan, lines to print)`` for the run about to start on ``model`` (before any
    wrapping; an empty model on the meta device will do: only its shape is read)."""
    shape = shape_of(model, name=cfg.model, source="loaded", n=cfg.n, m=cfg.m)
    setup = setup_for_run(cfg, world=world, device_type=device.type, precision=precision, framework=framework)
    plan = plan_memory(shape, setup)
    per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * world
    steps = cfg.max_steps or steps_for_tokens(cfg.tokens, per_step)
    # --test-sequences / --val-sequences 0 score all their split holds, unknown before the data is read: the
    # start-up estimate (the timeouts) then assumes SPLIT_WINDOWS_UNKNOWN windows
    work = startup_work(cfg, native_bytes=native_bytes, train_tokens=steps * per_step,
                        all_split_windows=SPLIT_WINDOWS_UNKNOWN, gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)), host_memory=machine_ram())
    startup = plan_startup(shape, setup, work)
    capacity = device_capacity(device, world)
    lines = [f"memory plan (cast-llm plan; {fmt_size(framework)} of it measured before loading the model):"
             if device.type == "cpu" else "memory plan (cast-llm plan):"]
    lines += memory_lines(plan, capacity)
    lines += startup_lines(startup, setup)
    return plan, startup, lines


def refuse_if_too_large(plan, device: torch.device, world: int, startup=None) -> None:
    """Before anything is loaded: a :class:`CastError` with the options that would make the run fit, when the
    plan says it does not — its steps, or (``startup``) rank 0's start-up and end on the device (``cast-llm
    train --no-memory-check`` starts anyway)."""
    capacity = device_capacity(device, world)
    if startup is not None and device.type == "cuda":
        f = startup_fits(startup, plan.setup, capacity, None)
        if not f["device_fits"]:
            worst = max((k for k in startup.memory if "device" in k), key=startup.memory.get)
            fix = ("--no-baseline-eval leaves the whole model off the GPU" if "baseline" in worst
                   else "a GPU with more memory is needed")
            raise CastError(f"the memory plan's start-up needs {fmt_size(f['device_needed'])} on one GPU ({worst}) "
                            f"and {fmt_size(capacity)} are available; {fix} (cast-llm plan shows every term; "
                            "--no-memory-check starts anyway)")
    if plan.fits(capacity):
        return
    fit = make_it_fit(plan.shape, plan.setup, capacity)
    if fit.gpus == 0:
        fix = "nothing up to 4096 GPUs makes it fit"
    else:
        fix = f"it would fit with {' '.join(fit.flags)}" + (f" on {fit.gpus} processes" if fit.gpus else "") + \
            f" ({fmt_size(fit.plan.needed())})"
    raise CastError(f"the memory plan needs {fmt_size(plan.needed())} per process and {fmt_size(capacity)} are "
                    f"available: this run would run out of memory; {fix} (cast-llm plan shows every option; "
                    "--no-memory-check starts anyway)")
