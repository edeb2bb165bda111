"""The one training loop: every training method (CAST and the baselines) and every fine-tuning mode.

What varies lives outside it: a **job** (:class:`Job`: the task's data, model and loss — pre-training with
distillation in :mod:`cast_llm.train.trainer`, fine-tuning in :mod:`cast_llm.finetune.job`), a **method**
(:class:`~cast_llm.train.methods.base.TrainingMethod`: how the model is prepared, which optimizer updates
it, what it does around each step, how the final model is made), and a **distribution**
(:mod:`cast_llm.train.distributed`: one process / DDP, or FSDP2).

Per optimizer step: ``method.begin_step`` → ``grad_accum`` micro-batches (forward, ``job.loss``, backward,
no gradient sync before the last; losses summed on the device and watched for NaN/Inf there,
:mod:`cast_llm.train.finite`) → ``method.before_optimizer_step`` → clipping → optimizer step (skipped on the
device after a non-finite loss or gradient) → ``method.end_step`` → LR schedule → observers and, every
``log_every`` steps, the finiteness check and the log record (the host's only reads of the step) → a
checkpoint every ``save_every`` steps. Around it: the run folder and its lock, exact resume
(``--resume`` / ``--resume auto``), SIGTERM/SIGINT → checkpoint → exit 75, and at the end
``distribution.finish`` (``method.finalize``) and ``job.finish`` (export, evaluation, summary).
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from cast_llm import kernels
from cast_llm.analysis.base import StepContext
from cast_llm.config import dump_yaml
from cast_llm.errors import CastError
from cast_llm.io import append_jsonl, atomic_write_json, truncate_jsonl
from cast_llm.train.checkpoint import (
    CheckpointWriteError,
    fingerprint,
    list_checkpoints,
    rng_state,
    set_rng_state,
)
from cast_llm.train.distributed import build_distribution
from cast_llm.train.finite import FiniteGuard
from cast_llm.train.memory import PeakMemory
from cast_llm.train.preemption import Preempted, StopRequest
from cast_llm.train.rundir import RunLock, prepare_run_dir, record_written, write_marker
from cast_llm.train.schedule import build_scheduler
from cast_llm.train.threads import setup_threads

__all__ = ["Job", "run", "build_accelerator", "resolve_precision"]


class Job:
    """What a training job brings to the loop (subclassed by the pre-training and fine-tuning jobs).

    Attributes the loop reads: ``cfg`` (the job's config dataclass), ``method`` (its TrainingMethod),
    ``kind`` (``"run"`` or ``"fine-tuning run"``, for messages), ``marker_kind`` (written into the run
    marker), ``fingerprint_keys`` (config keys a resume must match), ``default_warmup`` (fraction of the
    steps), ``desc`` (progress-bar label), and after :meth:`setup`: ``total_steps``, ``model``, ``teacher``
    (or None), ``tokenizer``.
    """

    kind = "run"
    marker_kind = "cast-llm-run"
    default_warmup = 0.02
    uses_fsdp = False

    def setup(self, ctx: LoopContext, results: dict[str, Any], resuming: bool) -> None:
        """Load tokenizer, data and model (``self.model``, ``self.teacher``), set ``self.total_steps``; on a
        fresh start, measure the starting point into ``results``."""
        raise NotImplementedError

    def after_prepare(self, ctx: LoopContext, model, results: dict[str, Any], resuming: bool) -> None:
        """After ``method.prepare_model``, before training (e.g. measure a warm-started starting point)."""

    def batch(self, step: int, micro: int) -> Any:
        """Micro-batch ``micro`` of optimizer step ``step`` (0-based), on the training device."""
        raise NotImplementedError

    def loss(self, model, teacher, batch) -> tuple[torch.Tensor, dict[str, float | torch.Tensor], int]:
        """(loss to back-propagate, named parts for the log — detached device scalars, read on log steps only,
        or floats — tokens in the batch)."""
        raise NotImplementedError

    def observers(self, ctx: LoopContext) -> list:
        return []

    def log_extra(self, ctx: LoopContext, step: int, raw) -> dict[str, Any]:
        """Extra entries of a log record (e.g. validation metrics)."""
        return {}

    def before_finalize(self, ctx: LoopContext, raw, results: dict[str, Any]) -> None:
        """After the last step, before ``method.finalize`` (e.g. measure the model as trained)."""

    def finish(self, ctx: LoopContext, final, results: dict[str, Any]) -> dict[str, Any]:
        """Export and evaluate the final model (``final``: on the main process; None elsewhere)."""
        raise NotImplementedError


class LoopContext:
    """What the loop shares with the job and the method: processes, device, folder, and how to speak."""

    def __init__(self, cfg, accelerator, distribution, out: Path, say, precision: str):
        self.cfg = cfg
        self.accelerator = accelerator
        self.distribution = distribution
        self.device = accelerator.device
        self.is_main = accelerator.is_main_process
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index
        self.out = out
        self.say = say
        self.precision = precision
        self.t_start = time.perf_counter()
        self.elapsed_before = 0.0  # wall time of the earlier segments of a resumed run

    def elapsed(self) -> float:
        """Wall time of the whole run so far, over all its segments (resumes)."""
        return self.elapsed_before + time.perf_counter() - self.t_start


def resolve_precision(cfg, device_type: str) -> str:
    if cfg.precision == "auto":
        return "bf16" if device_type == "cuda" else "no"
    return "no" if cfg.precision == "fp32" else cfg.precision


def build_accelerator(cfg):
    """The Accelerator of a job: its device from ``cfg.device`` (``auto``: CUDA when visible) and its mixed
    precision from ``cfg.precision``; returns ``(accelerator, precision)``."""
    from accelerate import Accelerator

    cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise CastError("--device cuda but no CUDA GPU is visible; use --device cpu")
    precision = resolve_precision(cfg, "cpu" if cpu else "cuda")
    from accelerate.utils import DistributedDataParallelKwargs

    # DDP's gradients as views of its communication buckets: one fp32 copy of the gradients instead of two
    # (the buckets alone are as large as the gradients); the values are the same
    ddp = DistributedDataParallelKwargs(gradient_as_bucket_view=True)
    return Accelerator(cpu=cpu, mixed_precision=precision, kwargs_handlers=[ddp]), precision


def keep_output_dtype(module) -> None:
    """Undo accelerate's mixed-precision forward wrapper (autocast + cast of every output to fp32).

    For a causal LM that cast is a second, twice as large copy of the full-vocabulary logits, for the
    student and for the teacher. The loop already runs forward, loss and backward under
    ``accelerator.autocast()`` and the losses compute in fp32 chunk by chunk, so the logits can stay in the
    autocast dtype: numerically identical (bf16 -> fp32 is exact, and the gradient went back to bf16 anyway).
    """
    if module is not None and "_original_forward" in module.__dict__:
        module.forward = module.__dict__.pop("_original_forward")


def resume_command(cfg) -> str:
    """The command that continues this run (its own config.yaml supplies every other setting)."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "cast-llm"
    sub = "finetune" if "finetune" in sys.argv[1:2] else "train"
    if prog in ("__main__.py", "cli"):
        prog = "cast-llm"
    return f"{prog if prog.startswith('cast-llm') else 'cast-llm'} {sub} --output-dir {shlex.quote(str(cfg.output_dir))} --resume"


def _choose_checkpoint(cfg, out: Path, say) -> Path | None:
    """The checkpoint to resume: ``--resume`` (latest; an error without one), ``--resume auto`` (latest, or
    a fresh start when there is none)."""
    if not cfg.resume:
        return None
    found = list_checkpoints(out) if out.is_dir() else []
    if found:
        return found[-1]
    if cfg.resume == "auto":
        say(f"--resume auto: no checkpoint in {out}; starting from the beginning")
        return None
    raise CastError(f"--resume: {out} holds no checkpoint yet; start it again without --resume "
                    "(with --overwrite), use --resume auto, or set --save-every")


def run(job: Job, *, log=print) -> dict[str, Any]:
    """Run ``job`` to the end (or to a preemption: raises :class:`~cast_llm.train.preemption.Preempted`)."""
    from accelerate.utils import set_seed

    cfg = job.cfg
    kernels.apply_flag(getattr(cfg, "kernels", None))  # --kernels auto|reference (or CAST_LLM_KERNELS)
    threads_note = setup_threads(cfg)
    accelerator, precision = build_accelerator(cfg)
    is_main = accelerator.is_main_process
    say = log if is_main else (lambda *a, **k: None)
    if threads_note and accelerator.device.type == "cpu":
        say(threads_note)
    out = Path(cfg.output_dir)
    lock = RunLock(out)
    checkpoint = None
    folder = {}
    if is_main:
        checkpoint = _choose_checkpoint(cfg, out, say)
        folder = dict(resume=checkpoint is not None, overwrite=cfg.overwrite or bool(cfg.resume),
                      model=getattr(cfg, "model", None), kind=job.kind)
        prepare_run_dir(out, is_main=False, **folder)  # every refusal before anything is written
        lock.acquire()
    try:
        with StopRequest(say) as stop:
            return _run(job, cfg, accelerator, precision, out, say, stop, set_seed, checkpoint, folder)
    finally:
        lock.release()


def _run(job, cfg, accelerator, precision, out, say, stop, set_seed, checkpoint, folder) -> dict[str, Any]:
    distribution = build_distribution(accelerator, getattr(cfg, "fsdp", False))
    is_main = distribution.is_main
    if is_main:
        prepare_run_dir(out, is_main=True, **folder)
    distribution.barrier()
    if not is_main:
        found = list_checkpoints(out) if cfg.resume else []
        checkpoint = found[-1] if found else None
    ctx = LoopContext(cfg, accelerator, distribution, out, say, precision)
    set_seed(cfg.seed)
    method = job.method

    results: dict[str, Any] = {}
    if checkpoint is not None and (out / "results.json").is_file():
        results = json.loads((out / "results.json").read_text())
    job.setup(ctx, results, resuming=checkpoint is not None)
    total_steps = job.total_steps
    model = method.prepare_model(job.model, cfg, data=getattr(job, "data", None), device=ctx.device) or job.model
    job.after_prepare(ctx, model, results, resuming=checkpoint is not None)
    model.train()
    teacher = job.teacher
    distribution.shard(model, teacher, cfg, say)
    optimizer = method.build_optimizer(model, cfg, total_steps)
    scheduler = build_scheduler(optimizer, cfg, total_steps, default_warmup=job.default_warmup)
    # the scheduler is stepped by us once per optimizer step (accelerate's wrapper would step it per process)
    peak = PeakMemory(ctx.device)  # the steps' peak, against the plan printed at the top
    peak.measure_framework(model, teacher, optimizer)  # before DDP's buckets exist: they are the plan's
    model, optimizer, teacher = distribution.wrap(model, optimizer, teacher)
    raw = accelerator.unwrap_model(model)
    for module in (raw, teacher):
        keep_output_dtype(module)
    raw_opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it; methods need the real one
    observers = job.observers(ctx)

    cfg_dict = asdict(cfg)
    fp = fingerprint(cfg_dict, job.fingerprint_keys)
    start_step = 0
    resumed_window = None
    if checkpoint is not None:
        states, meta = distribution.load(checkpoint, fp)
        distribution.load_model_state(method, raw, states["model"])
        distribution.load_optimizer_state(raw_opt, states["optimizer"])
        scheduler.load_state_dict(states["scheduler"])
        method.load_extra_state(states.get("method"))
        set_rng_state(states["rng"])
        start_step = int(meta["step"])
        resumed_window = states.get("loop", {}).get("window")
        ctx.elapsed_before = float(meta.get("elapsed_s", 0.0))
        for ob in observers:
            ob.load_state_dict(states.get("observers", {}).get(ob.name, {}))
        say(f"resumed from {checkpoint} at step {start_step}")
    if is_main:
        dump_yaml(cfg, out / "config.yaml")
        write_marker(out, {"kind": job.marker_kind, "method": getattr(cfg, "method", None) or getattr(cfg, "mode", None),
                           "config": cfg_dict})
        truncate_jsonl(out / "metrics.jsonl", start_step)
    tb = None
    if is_main and getattr(cfg, "tensorboard", True):
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    last_good = checkpoint

    def save(step: int, *, required: bool) -> Path | None:
        """Write checkpoint ``step``. A failed periodic checkpoint is a warning (the run goes on, the previous
        one stays); a failed required one (preemption) is an error naming the last good one."""
        nonlocal last_good
        guard.check(last_good)  # never a checkpoint of a run that went non-finite
        if hasattr(method, "verify"):
            method.verify(raw)
        states = {"model": distribution.model_state(method, raw), "optimizer": distribution.optimizer_state(raw_opt),
                  "scheduler": scheduler.state_dict(), "rng": rng_state(),
                  "observers": {ob.name: ob.state_dict() for ob in observers}}
        extra = method.extra_state()
        if extra is not None:
            states["method"] = extra
        # the log window in progress: a run stopped between two log steps logs exactly what an uninterrupted one does
        states["loop"] = {"window": _host_window(window)}
        meta = {"fingerprint": fp, "tokens": step * (getattr(job, "tokens_per_step", 0) or 0),
                "kind": job.marker_kind, "elapsed_s": ctx.elapsed()}
        try:
            distribution.save(out, step, states, meta, cfg.keep_last)
            ok = True
        except CheckpointWriteError as e:
            ok, err = False, e
        ok = distribution.all(ok)
        if not ok:
            where = f"the last complete checkpoint is {last_good}" if last_good else "no checkpoint was written yet"
            msg = f"{err if is_main and 'err' in locals() else 'a checkpoint write failed'}; {where}"
            if required:
                raise CastError(msg)
            say(f"warning: {msg}; training goes on")
            return None
        if is_main:
            record_written(out, ["checkpoints"])
            atomic_write_json(out / "results.json", results)
        distribution.barrier()
        last_good = list_checkpoints(out)[-1] if is_main else out / "checkpoints" / f"step-{step:08d}"
        return last_good

    # ---- the loop
    bar = None
    if is_main and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=start_step, desc=job.desc, unit="step", dynamic_ncols=True)
    window = _new_window()
    if resumed_window:
        window.update(resumed_window)
    grad_accum = cfg.grad_accum
    guard = FiniteGuard(ctx.device)  # losses checked on the device, read on log steps (train/finite.py)
    peak.start()
    for step in range(start_step, total_steps):
        method.begin_step(raw, raw_opt, step)
        for micro in range(grad_accum):
            batch = job.batch(step, micro)
            with distribution.no_sync(model, micro == grad_accum - 1), accelerator.autocast():
                loss, parts, tokens = job.loss(model, teacher, batch)
                guard.watch(loss, step)
                accelerator.backward(loss / grad_accum)
            window["loss"] += loss.detach() / grad_accum  # on the device: read on log steps only
            for k, v in parts.items():
                window["parts"][k] = window["parts"].get(k, 0.0) + v / grad_accum
            window["tokens"] += tokens * ctx.world
        method.before_optimizer_step(raw, raw_opt, step)
        if cfg.grad_clip > 0:
            distribution.clip(model, cfg.grad_clip)
        method.before_update(raw, raw_opt, step, ctx, results)
        guard.arm(raw_opt, last_good)  # a non-finite step is skipped on the device
        optimizer.step()
        guard.stepped(step)
        method.end_step(raw, raw_opt, step)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        window["n"] += 1

        is_log = done % cfg.log_every == 0 or done == total_steps
        measured = {}
        if observers:
            sctx = StepContext(step=done, total_steps=total_steps, model=raw, is_log_step=is_log, run_dir=out,
                               is_main=is_main, cfg=cfg, evaluator=getattr(job, "evaluator", None),
                               masks_fn=lambda: method.current_masks(raw, raw_opt))
            for ob in observers:
                measured.update(ob.on_step(sctx) or {})
        extra = job.log_extra(ctx, done, raw)
        if is_log:
            guard.check(last_good)
        if is_log or extra:
            rec = _record(done, window, job, scheduler, distribution)
            rec.update(measured)
            rec.update(method.log_metrics(raw, raw_opt, step, results) if is_log else {})
            rec.update(extra)
            if is_main:
                append_jsonl(out / "metrics.jsonl", rec)
                if tb is not None:
                    for k, v in rec.items():
                        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                            tb.add_scalar(f"train/{k}", v, done)
            window = _new_window()
            if bar is not None:
                bar.set_postfix(**_postfix(rec))
        stopping = distribution.any(stop.requested) if ctx.world > 1 else stop.requested
        if stopping and done < total_steps:
            if bar is not None:
                bar.close()
            path = save(done, required=True)
            if tb is not None:
                tb.close()
            msg = (f"stopped at step {done} of {total_steps} ({stop.signal_name or 'signal on another rank'}); "
                   f"checkpoint {path}. Resume with: {resume_command(cfg)}")
            say(msg)
            raise Preempted(msg)
        if cfg.save_every and done % cfg.save_every == 0 and done != total_steps:
            save(done, required=False)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if start_step < total_steps:
        _report_peak(job, ctx, distribution, peak, results)
        if is_main:  # the figure survives whatever happens in the export
            atomic_write_json(out / "results.json", results)

    # ---- finish: the final model (pruned, folded, merged), then the job's export and evaluation. With
    # checkpoints on, the last step is saved first, so a failure in the export (a full disk, …) costs no
    # training: --resume goes straight to the finish.
    if cfg.save_every and start_step < total_steps:
        save(total_steps, required=False)
    if observers:
        end_ctx = StepContext(step=total_steps, total_steps=total_steps, model=raw, is_log_step=False, run_dir=out,
                              is_main=is_main, cfg=cfg, evaluator=getattr(job, "evaluator", None),
                              masks_fn=lambda: method.current_masks(raw, raw_opt))
        for ob in observers:
            ob.on_end(end_ctx)
    job.before_finalize(ctx, raw, results)
    final = distribution.finish(raw, raw_opt, method, cfg, out)
    results.update(method.results())
    results["kernels"] = kernels.taken()  # which path each checked kernel took (cast_llm.kernels)
    distribution.barrier()
    results = job.finish(ctx, final, results)
    if tb is not None:
        tb.close()
    if is_main:
        _drop_checkpoints(out, say, keep=getattr(cfg, "keep_checkpoints_after", False))
    distribution.barrier()
    accelerator.end_training()
    return results


def _report_peak(job, ctx, distribution, peak: PeakMemory, results: dict[str, Any]) -> None:
    """The largest per-process peak of the steps (all ranks), beside the plan's, into results.json."""
    measured = peak.read()
    if measured is None:
        return
    framework = peak.framework
    if distribution.world > 1:
        import torch.distributed as dist

        t = torch.tensor([float(measured), float(framework or 0)], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        measured, framework = int(t[0].item()), (int(t[1].item()) if framework is not None else None)
    plan = getattr(job, "memory_plan", None)
    entry = {"measured_peak": measured, "measured": peak.what, "per_process": True}
    line = f"peak memory per process over the steps: {measured / 2**30:.2f} GiB ({peak.what})"
    if plan is not None:
        entry.update(planned_peak=plan.peak, planned_moment=plan.peak_moment, plan=plan.as_dict())
        planned = plan.peak
        if framework is not None:  # the plan's framework, measured before the steps (CPU)
            planned = plan.peak - plan.setup.framework + framework
            entry.update(framework_measured=framework, planned_peak_with_framework=planned)
        entry["ratio"] = measured / planned
        line += f"; the plan: {planned / 2**30:.2f} GiB (measured / planned {measured / planned:.2f})"
        if framework is not None:
            line += f", with the {framework / 2**30:.2f} GiB not held in tensors measured before the steps"
    results["memory"] = {**results.get("memory", {}), **entry}
    ctx.say(line)


def _drop_checkpoints(out: Path, say, *, keep: bool) -> None:
    """A finished run needs no checkpoint to resume: remove them (ours), unless asked to keep them."""
    found = list_checkpoints(out)
    if not found:
        return
    if keep:
        say(f"kept {len(found)} checkpoint(s) in {out / 'checkpoints'}")
        return
    import shutil

    size = sum(f.stat().st_size for c in found for f in c.iterdir() if f.is_file())
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    say(f"removed the run's {len(found)} checkpoint(s) ({size / 2**30:.1f} GiB): the run is complete "
        "(--keep-checkpoints-after keeps them)")


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


def _record(step: int, window: dict, job, scheduler, distribution) -> dict[str, Any]:
    n = max(window["n"], 1)
    dt = time.perf_counter() - window["t0"]
    window = _host_window(window)
    names = list(window["parts"])
    vals = torch.tensor([window["loss"] / n] + [window["parts"][k] / n for k in names])
    if distribution.world > 1:
        vals = distribution.accelerator.reduce(vals.to(distribution.device), reduction="mean").cpu()
    rec = {"step": step}
    if getattr(job, "tokens_per_step", None):
        rec["tokens"] = step * job.tokens_per_step
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
