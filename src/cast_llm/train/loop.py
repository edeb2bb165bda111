"""The one training loop: every training method (CAST and the baselines) and every fine-tuning mode.

What varies lives outside it: a **job** (:class:`Job`: the task's data, model and loss — pre-training with
distillation in :mod:`cast_llm.train.trainer`, fine-tuning in :mod:`cast_llm.finetune.job`), a **method**
(:class:`~cast_llm.train.methods.base.TrainingMethod`: how the model is prepared, which optimizer updates
it, what it does around each step, how the final model is made), and a **distribution**
(:mod:`cast_llm.train.distributed`: one process / DDP, or FSDP2).

Per optimizer step: ``method.begin_step`` → ``grad_accum`` micro-batches (forward, ``job.loss``, backward;
DDP syncs gradients on the last only, FSDP2 reduce-scatters every one; losses summed on the device and
watched for NaN/Inf there, :mod:`cast_llm.train.finite`) → what every rank must agree on, in one all-reduce
(several processes only): a stop signal anywhere, a periodic checkpoint due → ``method.before_optimizer_step``
→ clipping → optimizer step (skipped on the device on every rank after a non-finite loss or gradient on any)
→ ``method.end_step`` → LR schedule → observers and, every ``log_every`` steps, the finiteness check and the
log record (the host's only reads of the step) → a checkpoint (every ``save_every`` steps, or by default
every :data:`AUTO_SAVE_S` of wall time). Around it: the run folder and its lock (with the partial
checkpoints of a killed save removed), exact resume (``--resume`` / ``--resume auto``), SIGTERM/SIGINT →
checkpoint → exit 75, and at the end ``distribution.finish`` (``method.finalize``) and ``job.finish``
(export, evaluation, summary). Work only rank 0 does (``job.setup``'s loading and evaluation, the one-shot
start, ``job.finish``) is bracketed by ``distribution.waiting_for_main``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
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
from cast_llm.optim.schedule import build_scheduler
from cast_llm.train.checkpoint import (
    CheckpointWriteError,
    fingerprint,
    list_checkpoints,
    remove_stale_partials,
    rng_state,
    set_rng_state,
)
from cast_llm.train.distributed import build_distribution
from cast_llm.train.finite import FiniteGuard
from cast_llm.train.fsdp import precision_mode as fsdp_precision_mode
from cast_llm.train.memory import PeakMemory
from cast_llm.train.phases import Phases
from cast_llm.train.preemption import Preempted, StopRequest
from cast_llm.train.rundir import RunLock, prepare_run_dir, record_written, write_marker
from cast_llm.train.threads import setup_threads

__all__ = ["Job", "run", "build_accelerator", "resolve_precision", "device_type"]

# --save-every's default: a checkpoint whenever this much wall time has passed since the last one, so a run
# longer than an hour never has more than half an hour to lose to a node that dies without a signal
AUTO_SAVE_S = 1800.0
# a one-shot start (the SparseGPT warm start) that took longer than this is saved with the run at once (a
# step-0 checkpoint), so a run stopped before its first periodic checkpoint does not compute it again
START_CHECKPOINT_S = 60.0


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

    def before_launch(self, *, world: int, device_type: str, precision: str):
        """Before the processes connect and before anything is loaded: settle what depends on the number of
        processes and refuse, with the options that would work, what cannot run (every rank does the same).
        Returns the :class:`~cast_llm.plan.startup.Timeouts` the process groups should use (None: torch's)."""
        return None

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
        self.phases = Phases(self.device)  # wall time and peak memory of the phases around the steps
        self.t_start = time.perf_counter()
        self.elapsed_before = 0.0  # wall time of the earlier segments of a resumed run

    def elapsed(self) -> float:
        """Wall time of the whole run so far, over all its segments (resumes)."""
        return self.elapsed_before + time.perf_counter() - self.t_start


def resolve_precision(cfg, device_type: str) -> str:
    if cfg.precision == "auto":
        return "bf16" if device_type == "cuda" else "no"
    return "no" if cfg.precision == "fp32" else cfg.precision


def device_type(cfg) -> str:
    """``"cuda"`` or ``"cpu"``: where ``cfg.device`` (``auto``: CUDA when visible) puts the job."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise CastError("--device cuda but no CUDA GPU is visible; use --device cpu")
    cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    return "cpu" if cpu else "cuda"


def build_accelerator(cfg, *, collective_timeout_s: float | None = None):
    """The Accelerator of a job: its device from ``cfg.device`` (``auto``: CUDA when visible) and its mixed
    precision from ``cfg.precision``; returns ``(accelerator, precision)``. ``collective_timeout_s``: the
    process group's timeout (None: torch's default, 10 minutes for NCCL)."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    kind = device_type(cfg)
    precision = resolve_precision(cfg, kind)
    # DDP's gradients as views of its communication buckets: one fp32 copy of the gradients instead of two
    # (the buckets alone are as large as the gradients); the values are the same
    handlers = [DistributedDataParallelKwargs(gradient_as_bucket_view=True)]
    if collective_timeout_s is not None:
        handlers.append(InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout_s)))
    return Accelerator(cpu=kind == "cpu", mixed_precision=precision, kwargs_handlers=handlers), precision


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
    kind = device_type(cfg)
    timeouts = job.before_launch(world=int(os.environ.get("WORLD_SIZE", "1")), device_type=kind,
                                 precision=resolve_precision(cfg, kind))
    accelerator, precision = build_accelerator(cfg, collective_timeout_s=timeouts.collective if timeouts else None)
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
        if lock.unsupported:
            say(f"warning: the filesystem of {out} cannot lock {lock.path.name} ({lock.unsupported}); the run goes "
                "on unlocked: a second job on this folder would not be refused")
    try:
        with StopRequest(say) as stop:
            return _run(job, cfg, accelerator, precision, out, say, stop, set_seed, checkpoint, folder, timeouts)
    finally:
        lock.release()


def _run(job, cfg, accelerator, precision, out, say, stop, set_seed, checkpoint, folder, timeouts) -> dict[str, Any]:
    distribution = build_distribution(accelerator, getattr(cfg, "fsdp", False),
                                      wait_timeout_s=timeouts.wait if timeouts else None,
                                      precision_mode=fsdp_precision_mode(cfg, precision))
    is_main = distribution.is_main
    with distribution.waiting_for_main("preparing the run folder"):
        if is_main:
            prepare_run_dir(out, is_main=True, **folder)
            removed, size = remove_stale_partials(out)  # what a killed save of ours left behind
            if removed:
                say(f"removed {len(removed)} partial checkpoint folder(s) a killed save left ({size / 2**30:.2f} "
                    "GiB): " + ", ".join(p.name for p in removed))
    if not is_main:
        found = list_checkpoints(out) if cfg.resume else []
        checkpoint = found[-1] if found else None
    ctx = LoopContext(cfg, accelerator, distribution, out, say, precision)
    set_seed(cfg.seed)
    method = job.method

    results: dict[str, Any] = {}
    if checkpoint is not None and (out / "results.json").is_file():
        results = json.loads((out / "results.json").read_text())
    resuming = checkpoint is not None
    job.setup(ctx, results, resuming=resuming)
    total_steps = job.total_steps
    start = distribution.start_mode(resuming)
    with distribution.waiting_for_main("computing the run's one-shot start") as work, ctx.phases("one-shot start"):
        t0 = time.perf_counter()
        model = method.prepare_model(job.model, cfg, data=getattr(job, "data", None), device=ctx.device,
                                     start=start) or job.model
        job.after_prepare(ctx, model, results, resuming=resuming)
        if work.main:
            work.shared["start_s"] = time.perf_counter() - t0
    if resuming:
        say("start: the one-shot start (warm start, initial masks) is in the checkpoint; not computed again")
    else:
        say(f"start: model prepared for {method.name}, its one-shot start included, in {work.shared['start_s']:.1f} s"
            + (" on rank 0 alone" if ctx.world > 1 else ""))
    model.train()
    teacher = job.teacher
    with ctx.phases("student: sharded" if cfg_fsdp(cfg) else "student: to the device"):
        distribution.shard(model, teacher, cfg, say, fill=not resuming)
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
        del states  # the model's copy was copied into its parameters: a second one for the whole run otherwise
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
    timing = {"saves": 0, "last_save": time.perf_counter(), "step_s": None}

    def save(step: int, *, required: bool) -> Path | None:
        """Write checkpoint ``step``. A failed periodic checkpoint is a warning (the run goes on, the previous
        one stays); a failed required one (preemption) is an error naming the last good one. The first one
        of a segment says what it cost: what a SIGTERM's grace period must cover."""
        nonlocal last_good
        guard.check(last_good)  # never a checkpoint of a run that went non-finite
        t0 = time.perf_counter()
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
        seconds = time.perf_counter() - t0
        timing["last_save"] = time.perf_counter()
        if timing["saves"] == 0:
            _report_save_cost(ctx, distribution, out / "checkpoints" / f"step-{step:08d}", seconds,
                              timing["step_s"], results)
        timing["saves"] += 1
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
    guard = FiniteGuard(ctx.device)  # losses checked on the device, read on log steps (train/finite.py)
    if not resuming and cfg.save_every != 0 and work.shared.get("start_s", 0.0) >= START_CHECKPOINT_S:
        save(0, required=False)  # the one-shot start is saved with the run: a resume never computes it again
    grad_accum = cfg.grad_accum
    save_every = cfg.save_every
    peak.start()
    step_t0 = time.perf_counter()
    for step in range(start_step, total_steps):
        method.begin_step(raw, raw_opt, step)
        for micro in range(grad_accum):
            batch = job.batch(step, micro)
            with distribution.no_sync(model, micro == grad_accum - 1), distribution.autocast():
                loss, parts, tokens = job.loss(model, teacher, batch)
                guard.watch(loss, step)
                accelerator.backward(loss / grad_accum)
            window["loss"] += loss.detach() / grad_accum  # on the device: read on log steps only
            for k, v in parts.items():
                window["parts"][k] = window["parts"].get(k, 0.0) + v / grad_accum
            window["tokens"] += tokens * ctx.world
        distribution.sync_gradients(raw)  # FSDP2: the replicated weight scales' gradients (one all-reduce)
        # what every rank must agree on, in one all-reduce (several processes only; one process reads no
        # device value here): a stop signal anywhere stops every rank at this step; rank 0's clock says when a
        # periodic checkpoint is due (--save-every's default). A non-finite loss is agreed on the device by
        # the guard (every rank skips the step alike, and every rank stops at the next log step)
        due = save_every is None and is_main and time.perf_counter() - timing["last_save"] >= AUTO_SAVE_S
        stopping, due = distribution.any_of([stop.requested, due])
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
        timing["step_s"] = time.perf_counter() - step_t0
        step_t0 = time.perf_counter()

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
        if stopping and done < total_steps:
            if bar is not None:
                bar.close()
            results["phases"] = ctx.phases.gathered(distribution)
            _report_peak(job, ctx, distribution, peak, results)  # this segment's steps (before the save's copy)
            path = save(done, required=True)
            if tb is not None:
                tb.close()
            msg = (f"stopped at step {done} of {total_steps} ({stop.signal_name or 'signal on another rank'}); "
                   f"checkpoint {path}. Resume with: {resume_command(cfg)}")
            say(msg)
            raise Preempted(msg)
        if (due or (save_every and done % save_every == 0)) and done != total_steps:
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
    if (save_every or (save_every is None and timing["saves"])) and start_step < total_steps:
        save(total_steps, required=False)
    if observers:
        end_ctx = StepContext(step=total_steps, total_steps=total_steps, model=raw, is_log_step=False, run_dir=out,
                              is_main=is_main, cfg=cfg, evaluator=getattr(job, "evaluator", None),
                              masks_fn=lambda: method.current_masks(raw, raw_opt))
        for ob in observers:
            ob.on_end(end_ctx)
    job.before_finalize(ctx, raw, results)
    teacher = job.teacher = None  # training is over: its memory goes to gathering and evaluating the final model
    if getattr(job, "teacher_forward", None) is not None:
        job.teacher_forward = None
    with ctx.phases("final model: gathered and folded" if cfg_fsdp(cfg) else "final model: folded"):
        final = distribution.finish(raw, raw_opt, method, cfg, out)
    results.update(method.results())
    results["kernels"] = kernels.taken()  # which path each checked kernel took (cast_llm.kernels)
    with distribution.waiting_for_main("exporting and evaluating the final model"):
        results = job.finish(ctx, final, results)
    results["phases"] = ctx.phases.gathered(distribution)
    if is_main:
        atomic_write_json(out / "results.json", results)
    if tb is not None:
        tb.close()
    with distribution.waiting_for_main("removing the run's checkpoints"):
        if is_main:
            _drop_checkpoints(out, say, keep=getattr(cfg, "keep_checkpoints_after", False))
    accelerator.end_training()
    return results


def cfg_fsdp(cfg) -> bool:
    return bool(getattr(cfg, "fsdp", False))


def _report_save_cost(ctx, distribution, folder: Path, seconds: float, step_s: float | None,
                      results: dict[str, Any]) -> None:
    """The first checkpoint of a segment: what it cost (the slowest rank), which is what a SIGTERM's grace
    period must cover after the step in flight; into results.json (``checkpoint``) and the log."""
    mine = 0
    if folder.is_dir():
        sharded = any(folder.glob("*-rank00000.*"))  # FSDP2: every rank's own files; else rank 0 wrote it all
        files = folder.glob(f"*-rank{ctx.rank:05d}.*") if sharded else (folder.iterdir() if ctx.is_main else [])
        mine = sum(f.stat().st_size for f in files if f.is_file())
    every = distribution.gather((seconds, mine))
    slowest = max(s for s, _ in every)
    largest = max(b for _, b in every)
    need = slowest + (step_s or 0.0)
    results["checkpoint"] = {"seconds": round(slowest, 2), "bytes_per_rank": largest,
                             "step_seconds": None if step_s is None else round(step_s, 2),
                             "sigterm_grace_needed_s": round(need, 2)}
    step = f" + one step ({step_s:.1f} s)" if step_s is not None else ""
    ctx.say(f"checkpoint: {largest / 2**30:.2f} GiB per process written in {slowest:.1f} s; a SIGTERM needs "
            f"{need:.0f} s{step} of grace (SLURM --signal=TERM@…, torchrun --shutdown-timeout; docs/training.md)")


def _report_peak(job, ctx, distribution, peak: PeakMemory, results: dict[str, Any]) -> None:
    """The largest per-process peak of the steps (all ranks), beside the plan's, into results.json."""
    measured = peak.read()
    if measured is None:
        return
    framework = peak.framework
    every = distribution.gather((int(measured), framework))  # (the CPU group: no device sync)
    per_rank = [m for m, _ in every]
    measured = max(per_rank)
    if framework is not None:
        framework = max(f or 0 for _, f in every)
    plan = getattr(job, "memory_plan", None)
    entry = {"measured_peak": measured, "measured": peak.what, "per_process": True,
             "measured_per_rank": per_rank, "framework_per_rank": [f for _, f in every]}
    reserved = peak.reserved()  # CUDA: what the margin for fragmentation stands for, this rank's
    if reserved is not None:
        entry.update(reserved_peak=reserved, reserved_over_allocated=reserved / max(1, int(peak.read())))
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
    """A finished run needs no checkpoint to resume: remove them (ours only: complete checkpoints and partial
    ones with our marker; anything else in the folder stays), unless asked to keep them."""
    found = list_checkpoints(out)
    if not found:
        return
    if keep:
        say(f"kept {len(found)} checkpoint(s) in {out / 'checkpoints'}")
        return
    import shutil

    size = sum(f.stat().st_size for c in found for f in c.iterdir() if f.is_file())
    for c in found:
        shutil.rmtree(c, ignore_errors=True)
    remove_stale_partials(out)
    with contextlib.suppress(OSError):  # (left in place when something else is in it)
        (out / "checkpoints").rmdir()
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
