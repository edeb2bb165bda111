"""The one training loop: every training method (CAST and the baselines) and every fine-tuning mode.

What varies lives outside it: a **job** (:class:`Job`: the task's data, model and loss — pre-training with
distillation in :mod:`cast_llm.train.trainer`, fine-tuning in :mod:`cast_llm.finetune.job`), a **method**
(:class:`~cast_llm.train.methods.base.TrainingMethod`: how the model is prepared, which optimizer updates
it, what it does around each step, how the final model is made), and a **distribution**
(:mod:`cast_llm.train.distributed`: one process / DDP, or FSDP2).

:func:`run` in named steps: the job's inputs checked (before the memory plan prints and before the run
folder exists), the threads chosen (on a resume: the run's own choice again), the processes and the run
folder with its lock (the partial checkpoints of a killed save removed) → :func:`_prepare` (the job's
setup, the method's one-shot start, sharding, optimizer, schedule) → :func:`_resume` (exact resume from a
checkpoint: ``--resume`` / ``--resume auto``) → :func:`_train` → :func:`_finish` (the last checkpoint,
``distribution.finish`` — ``method.finalize`` — and ``job.finish``: export, evaluation, summary). Work only
rank 0 does (``job.setup``'s loading and evaluation, the one-shot start, ``job.finish``) is bracketed by
``distribution.waiting_for_main``.

Per optimizer step (:func:`~cast_llm.train.step.train_step`): ``method.begin_step`` → ``grad_accum``
micro-batches (forward, ``job.loss``, backward; DDP syncs gradients on the last only, FSDP2 reduce-scatters
every one; losses summed on the device and watched for NaN/Inf there, :mod:`cast_llm.train.finite`) → what
every rank must agree on, in one all-reduce (several processes only): a stop signal anywhere, a periodic
checkpoint due → ``method.before_optimizer_step`` → clipping → optimizer step (skipped on the device on
every rank after a non-finite loss or gradient on any) → ``method.end_step`` → LR schedule; then observers
and, every ``log_every`` steps, the finiteness check and the log record (the host's only reads of the step;
:class:`~cast_llm.train.metrics_log.MetricsLog`) → a checkpoint (every ``save_every`` steps, or by default
every :data:`AUTO_SAVE_S` of wall time; SIGTERM/SIGINT → checkpoint → exit 75:
:class:`~cast_llm.train.checkpointer.Checkpointer`).

The job's and the method's hooks return what they measured; the loop merges it into ``results.json``.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from cast_llm import kernels
from cast_llm.analysis.base import StepContext
from cast_llm.config import dump_yaml
from cast_llm.deploy.model_card import refresh_run_card
from cast_llm.errors import CastError
from cast_llm.io import RunDir
from cast_llm.optim.schedule import TRAIN_WARMUP, build_scheduler
from cast_llm.train.checkpoint import (
    fingerprint,
    latest_meta,
    list_checkpoints,
    remove_stale_partials,
    set_rng_state,
)
from cast_llm.train.checkpointer import Checkpointer
from cast_llm.train.distributed import build_distribution
from cast_llm.train.finite import FiniteGuard
from cast_llm.train.fsdp import precision_mode as fsdp_precision_mode
from cast_llm.train.memory import PeakMemory
from cast_llm.train.metrics_log import MetricsLog
from cast_llm.train.phases import Phases
from cast_llm.train.preemption import StopRequest
from cast_llm.train.rundir import (
    PREVIOUS,
    RunLock,
    drop_previous,
    finished_result,
    kept_checkpoints,
    prepare_run_dir,
    read_results,
    write_marker,
    write_results,
)
from cast_llm.train.step import StepSetup, train_step
from cast_llm.train.threads import setup_threads

__all__ = ["Job", "run", "build_accelerator", "resolve_precision", "device_type", "merge_results"]

# --save-every's default: a checkpoint whenever this much wall time has passed since the last one, so a run
# longer than an hour never has more than half an hour to lose to a node that dies without a signal
AUTO_SAVE_S = 1800.0
# a one-shot start (the SparseGPT warm start) that took longer than this is saved with the run at once (a
# step-0 checkpoint), so a run stopped before its first periodic checkpoint does not compute it again
START_CHECKPOINT_S = 60.0


class Job:
    """What a training job brings to the loop (subclassed by the pre-training and fine-tuning jobs).

    Every attribute the loop reads is declared here. Set by the subclass: ``cfg`` (its
    :class:`~cast_llm.train.config.RunConfig`), ``method`` (its TrainingMethod), ``command`` (the ``cast-llm``
    subcommand that runs it, for the resume command), ``kind`` (``"run"`` or ``"fine-tuning run"``, for
    messages), ``marker_kind`` (written into the run marker and checkpoints), ``default_warmup`` (fraction of
    the steps), ``desc`` (progress-bar label); what a resume must match is marked on ``cfg``'s fields
    (:func:`~cast_llm.train.checkpoint.fingerprint`). After :meth:`setup`: ``total_steps``, ``model``,
    ``teacher`` (or None), ``tokenizer``, and where the job has them ``data`` (given to ``method.prepare_model``), ``evaluator`` (for the observers), ``tokens_per_step``
    (None: examples vary in length, the log counts the tokens it saw), ``teacher_forward`` (dropped with the
    teacher when training ends), ``memory_plan`` (compared with the measured peak).

    The hooks return what they measured (entries for ``results.json``, merged by :func:`merge_results`);
    none writes into the run's results.
    """

    command = "train"
    kind = "run"
    marker_kind = "cast-llm-run"
    default_warmup = TRAIN_WARMUP
    desc = "train"
    cfg: Any
    method: Any
    total_steps: int
    model: Any = None
    teacher: Any = None
    tokenizer: Any = None
    data: Any = None
    evaluator: Any = None
    tokens_per_step: int | None = None
    teacher_forward: Any = None
    memory_plan: Any = None

    def check_inputs(self) -> None:
        """Refuse, with one line, inputs that cannot work (a missing ``--data`` file, …) before anything is
        planned, printed, loaded or written (cheap checks only: files are not read here)."""

    def before_launch(self, *, world: int, device_type: str, precision: str):
        """Before the processes connect and before anything is loaded: settle what depends on the number of
        processes and refuse, with the options that would work, what cannot run (every rank does the same).
        Returns the :class:`~cast_llm.plan.startup.Timeouts` the process groups should use (None: torch's)."""
        return None

    def setup(self, ctx: LoopContext, resuming: bool) -> dict[str, Any]:
        """Load tokenizer, data and model (``self.model``, ``self.teacher``), set ``self.total_steps``; on a
        fresh start, measure the starting point. Returns entries for results.json."""
        raise NotImplementedError

    def after_prepare(self, ctx: LoopContext, model, resuming: bool) -> dict[str, Any]:
        """After ``method.prepare_model``, before training (e.g. measure a warm-started starting point).
        Returns entries for results.json."""
        return {}

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

    def before_finalize(self, ctx: LoopContext, raw) -> dict[str, Any]:
        """After the last step, before ``method.finalize`` (e.g. measure the model as trained). Returns
        entries for results.json."""
        return {}

    def finish(self, ctx: LoopContext, final, results: dict[str, Any]) -> dict[str, Any]:
        """Export and evaluate the final model (``final``: on the main process; None elsewhere). ``results``:
        what the run recorded so far (to read). Returns entries for results.json."""
        raise NotImplementedError


# the settings that name a file or folder the run reads (an output folder on one of them is refused)
INPUT_PATHS = ("model", "data", "eval_data", "mask_file", "wikitext_file")


def merge_results(results: dict[str, Any], entries: dict[str, Any] | None) -> dict[str, Any]:
    """``entries`` into ``results`` (in place, and returned): nested mappings merged key by key, anything else
    replaced — what a hook returns adds to what the run holds (e.g. one more perplexity of a split)."""
    for key, value in (entries or {}).items():
        if isinstance(value, dict) and isinstance(results.get(key), dict):
            merge_results(results[key], value)
        else:
            results[key] = value
    return results


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


def resume_command(job: Job) -> str:
    """The command that continues this run (its own config.yaml supplies every other setting)."""
    import shlex

    return f"cast-llm {job.command} --output-dir {shlex.quote(str(job.cfg.output_dir))} --resume"


def _choose_checkpoint(cfg, out: Path, say) -> Path | None:
    """The checkpoint to resume: ``--resume`` (latest; an error without one), ``--resume auto`` (latest, or
    a fresh start when there is none); with ``--overwrite`` a finished run starts afresh (without it a finished
    run never gets here: :func:`run`)."""
    if not cfg.resume:
        return None
    if cfg.overwrite and finished_result(out) is not None:  # --resume auto --overwrite: a finished run afresh
        say(f"{out} holds a finished run; starting it again from the beginning (--overwrite)")
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
    cfg = job.cfg
    out = Path(cfg.output_dir)
    done = finished_result(out) if cfg.resume and not cfg.overwrite else None
    if done is not None and not kept_checkpoints(out):  # a re-submitted job of a finished run: nothing touched
        if os.environ.get("RANK", "0") == "0":
            log(f"already finished: {done}; nothing to resume (`--resume auto --overwrite` trains it again from "
                "the beginning)")
        return {"already_finished": done}
    kernels.apply_flag(cfg.kernels)  # --kernels auto|reference (or CAST_LLM_KERNELS)
    job.check_inputs()  # one line, before the memory plan prints and before the run folder exists
    # --threads 0 chooses once per run: a resume computes with the threads the run chose (its checkpoint's)
    recorded = latest_meta(out).get("threads") if cfg.resume else None
    recorded = recorded if isinstance(recorded, int) and recorded > 0 else None
    threads_note = setup_threads(cfg, recorded=recorded)
    kind = device_type(cfg)
    timeouts = job.before_launch(world=int(os.environ.get("WORLD_SIZE", "1")), device_type=kind,
                                 precision=resolve_precision(cfg, kind))
    cfg = job.cfg  # the run's config as the launch settled it (a job derives a new one: before_launch)
    accelerator, precision = build_accelerator(cfg, collective_timeout_s=timeouts.collective if timeouts else None)
    is_main = accelerator.is_main_process
    say = log if is_main else (lambda *a, **k: None)
    on_cpu = accelerator.device.type == "cpu"
    if threads_note and on_cpu:
        say(threads_note)
    lock = RunLock(out)
    checkpoint = None
    folder = {}
    if is_main:
        checkpoint = _choose_checkpoint(cfg, out, say)
        folder = dict(resume=checkpoint is not None, overwrite=cfg.overwrite or bool(cfg.resume), model=cfg.model,
                      kind=job.kind, inputs={f"--{k.replace('_', '-')}": v for k, v in asdict(cfg).items()
                                             if k in INPUT_PATHS})  # the ones this job's config has
        prepare_run_dir(out, is_main=False, **folder)  # every refusal before anything is written
        lock.acquire()
        if lock.unsupported:
            say(f"warning: the filesystem of {out} cannot lock {lock.path.name} ({lock.unsupported}); the run goes "
                "on unlocked: a second job on this folder would not be refused")
    threads = {"recorded": recorded, "used": torch.get_num_threads()} \
        if on_cpu and checkpoint is not None and recorded not in (None, torch.get_num_threads()) else None
    try:
        with StopRequest(say) as stop:
            return _run(job, accelerator, precision, say, stop, checkpoint, folder, timeouts, threads)
    finally:
        lock.release()


def _run(job, accelerator, precision, say, stop, checkpoint, folder, timeouts, threads) -> dict[str, Any]:
    """The run in its named steps (see the module docstring)."""
    from accelerate.utils import set_seed

    cfg = job.cfg
    out = Path(cfg.output_dir)
    distribution, checkpoint = _open_run(cfg, accelerator, precision, out, say, checkpoint, folder, timeouts)
    ctx = LoopContext(cfg, accelerator, distribution, out, say, precision)
    set_seed(cfg.seed)
    results: dict[str, Any] = read_results(out) if checkpoint is not None else {}
    resuming = checkpoint is not None
    t = _prepare(job, ctx, results, resuming)
    fp = fingerprint(cfg)
    start_step, window = _resume(ctx, t, checkpoint, fp) if resuming else (0, None)
    if threads is not None:  # an explicit --threads that is not the run's choice: "exact" is not exact here
        results.setdefault("threads_resumed", []).append({**threads, "step": start_step})
    if distribution.is_main:
        dump_yaml(cfg, RunDir(out).config)
        write_marker(out, {"kind": job.marker_kind, "method": job.method.name, "config": asdict(cfg)})
    log = MetricsLog(ctx, t.scheduler, total_steps=job.total_steps, start_step=start_step, desc=job.desc,
                     tokens_per_step=job.tokens_per_step, window=window)
    ckpt = Checkpointer(ctx, t, log, fingerprint=fp, marker_kind=job.marker_kind, tokens_per_step=job.tokens_per_step,
                        results=results, last_good=checkpoint, auto_save_s=AUTO_SAVE_S)
    if not resuming:  # the one-shot start is saved with the run when it was slow: a resume never computes it again
        ckpt.at_start(t.start_s, START_CHECKPOINT_S)
    _train(job, ctx, t, log, ckpt, stop, start_step, results)
    return _finish(job, ctx, t, log, ckpt, results, start_step)


def _open_run(cfg, accelerator, precision, out: Path, say, checkpoint, folder, timeouts):
    """The processes' distribution and the run folder (made by rank 0, with what a killed save left removed);
    the checkpoint every rank resumes from."""
    distribution = build_distribution(accelerator, cfg.fsdp, wait_timeout_s=timeouts.wait if timeouts else None,
                                      precision_mode=fsdp_precision_mode(cfg, precision))
    with distribution.waiting_for_main("preparing the run folder"):
        if distribution.is_main:
            prepare_run_dir(out, is_main=True, **folder)
            removed, size = remove_stale_partials(out)  # what a killed save of ours left behind
            if removed:
                say(f"removed {len(removed)} partial checkpoint folder(s) a killed save left ({size / 2**30:.2f} "
                    "GiB): " + ", ".join(p.name for p in removed))
    if not distribution.is_main:
        found = list_checkpoints(out) if cfg.resume else []
        checkpoint = found[-1] if found else None
    return distribution, checkpoint


@dataclass
class Training:
    """The live objects of a run, from :func:`_prepare` on."""

    model: Any  # as wrapped for training (DDP / FSDP2)
    raw: Any  # the plain model (checkpoints, observers, the method's hooks)
    optimizer: Any
    raw_opt: Any
    scheduler: Any
    teacher: Any
    method: Any
    observers: list
    peak: PeakMemory
    guard: FiniteGuard
    step: StepSetup
    start_s: float  # the one-shot start's wall time (rank 0's)

    def drop_teacher(self) -> None:
        self.teacher = self.step.teacher = None


def _prepare(job: Job, ctx: LoopContext, results: dict[str, Any], resuming: bool) -> Training:
    """The job's setup, the method's one-shot start, the student sharded or moved, optimizer and schedule."""
    cfg, method, distribution, say = ctx.cfg, job.method, ctx.distribution, ctx.say
    merge_results(results, job.setup(ctx, resuming=resuming))
    start = distribution.start_mode(resuming)
    with distribution.waiting_for_main("computing the run's one-shot start") as work, ctx.phases("one-shot start"):
        t0 = time.perf_counter()
        model = method.prepare_model(job.model, cfg, data=job.data, device=ctx.device, start=start) or job.model
        merge_results(results, job.after_prepare(ctx, model, resuming=resuming))
        if work.main:
            work.shared["start_s"] = time.perf_counter() - t0
    if resuming:
        say("start: the one-shot start (warm start, initial masks) is in the checkpoint; not computed again")
    else:
        say(f"start: model prepared for {method.name}, its one-shot start included, in {work.shared['start_s']:.1f} s"
            + (" on rank 0 alone" if ctx.world > 1 else ""))
    model.train()
    teacher = job.teacher
    with ctx.phases("student: sharded" if cfg.fsdp else "student: to the device"):
        distribution.shard(model, teacher, cfg, say, fill=not resuming)
    optimizer = method.build_optimizer(model, cfg, job.total_steps)
    # the scheduler is stepped by us once per optimizer step (accelerate's wrapper would step it per process)
    scheduler = build_scheduler(optimizer, cfg, job.total_steps, default_warmup=job.default_warmup)
    peak = PeakMemory(ctx.device)  # the steps' peak, against the plan printed at the top
    peak.measure_framework(model, teacher, optimizer)  # before DDP's buckets exist: they are the plan's
    model, optimizer, teacher = distribution.wrap(model, optimizer, teacher)
    raw = ctx.accelerator.unwrap_model(model)
    for module in (raw, teacher):
        keep_output_dtype(module)
    raw_opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it; methods need the real one
    observers = job.observers(ctx)
    guard = FiniteGuard(ctx.device)  # losses checked on the device, read on log steps (train/finite.py)
    step = StepSetup(model, optimizer, job.loss, teacher=teacher, raw=raw, raw_opt=raw_opt, method=method,
                     scheduler=scheduler, guard=guard, grad_clip=cfg.grad_clip, backward=ctx.accelerator.backward,
                     clip=lambda max_norm: distribution.clip(model, max_norm),
                     no_sync=lambda last: distribution.no_sync(model, last), autocast=distribution.autocast,
                     sync_gradients=lambda: distribution.sync_gradients(raw), ctx=ctx)
    return Training(model, raw, optimizer, raw_opt, scheduler, teacher, method, observers, peak, guard, step,
                    work.shared.get("start_s", 0.0))


def _resume(ctx: LoopContext, t: Training, checkpoint: Path, fp: dict[str, Any]) -> tuple[int, dict | None]:
    """Everything the checkpoint holds back into the run; returns (its step, the log window it kept)."""
    distribution = ctx.distribution
    states, meta = distribution.load(checkpoint, fp)
    distribution.load_model_state(t.method, t.raw, states["model"])
    distribution.load_optimizer_state(t.raw_opt, states["optimizer"])
    t.scheduler.load_state_dict(states["scheduler"])
    t.method.load_extra_state(states.get("method"))
    set_rng_state(states["rng"])
    start_step = int(meta["step"])
    window = states.get("loop", {}).get("window")
    ctx.elapsed_before = float(meta.get("elapsed_s", 0.0))
    for ob in t.observers:
        ob.load_state_dict(states.get("observers", {}).get(ob.name, {}))
    del states  # the model's copy was copied into its parameters: a second one for the whole run otherwise
    ctx.say(f"resumed from {checkpoint} at step {start_step}")
    return start_step, window


def _train(job: Job, ctx: LoopContext, t: Training, log: MetricsLog, ckpt: Checkpointer, stop: StopRequest,
           start_step: int, results: dict[str, Any]) -> None:
    """The steps from ``start_step`` on, each with its observers, log record and checkpoint; a stop signal
    ends the run with a checkpoint (raises :class:`~cast_llm.train.preemption.Preempted`)."""
    cfg, distribution, total = ctx.cfg, ctx.distribution, job.total_steps
    t.peak.start()
    step_t0 = time.perf_counter()
    for step in range(start_step, total):
        # what every rank must agree on, in one all-reduce (several processes only; one process reads no
        # device value here): a stop signal anywhere stops every rank at this step; rank 0's clock says when a
        # periodic checkpoint is due (--save-every's default). A non-finite loss is agreed on the device by
        # the guard (every rank skips the step alike, and every rank stops at the next log step)
        stopping, due = train_step(t.step, step, lambda micro, step=step: job.batch(step, micro), cfg.grad_accum,
                                   last_good=ckpt.last_good, accumulate=log.add,
                                   agree=lambda: distribution.any_of([stop.requested, ckpt.due_by_clock()]))
        done = step + 1
        log.stepped()
        ckpt.step_s = time.perf_counter() - step_t0
        step_t0 = time.perf_counter()
        is_log = done % cfg.log_every == 0 or done == total
        measured = {}
        if t.observers:
            sctx = _step_context(job, ctx, t, done, is_log)
            for ob in t.observers:
                measured.update(ob.on_step(sctx) or {})
        extra = job.log_extra(ctx, done, t.raw)
        if is_log:
            t.guard.check(ckpt.last_good)
        if is_log or extra:
            log.record(done, measured, t.method.log_metrics(t.raw, t.raw_opt, step) if is_log else {}, extra)
        if stopping and done < total:
            log.close()
            results["phases"] = ctx.phases.gathered(distribution)
            _record_peak(job, ctx, t.peak, results)  # this segment's steps (before the save's copy)
            raise ckpt.preempt(done, total, stop.signal_name, resume_command(job))
        ckpt.after_step(done, total, due)
        log.advance()


def _step_context(job: Job, ctx: LoopContext, t: Training, step: int, is_log: bool) -> StepContext:
    return StepContext(step=step, total_steps=job.total_steps, model=t.raw, is_log_step=is_log, run_dir=ctx.out,
                       is_main=ctx.is_main, cfg=ctx.cfg, evaluator=job.evaluator,
                       masks_fn=lambda: t.method.current_masks(t.raw, t.raw_opt))


def _finish(job: Job, ctx: LoopContext, t: Training, log: MetricsLog, ckpt: Checkpointer, results: dict[str, Any],
            start_step: int) -> dict[str, Any]:
    """The final model (pruned, folded, merged), then the job's export and evaluation. With checkpoints on,
    the last step is saved first, so a failure in the export (a full disk, …) costs no training: --resume
    goes straight here."""
    cfg, distribution, total, out = ctx.cfg, ctx.distribution, job.total_steps, ctx.out
    log.close()
    trained = start_step < total
    if trained:
        _record_peak(job, ctx, t.peak, results)
        if ctx.is_main:  # the figure survives whatever happens in the export
            write_results(out, results)
        ckpt.at_end(total)
    if t.observers:
        end_ctx = _step_context(job, ctx, t, total, False)
        for ob in t.observers:
            ob.on_end(end_ctx)
    merge_results(results, job.before_finalize(ctx, t.raw))
    # training is over: the teacher's memory goes to gathering and evaluating the final model (how it ran is kept)
    if job.teacher_forward is not None:
        results["teacher_forward"] = job.teacher_forward.mode
    job.teacher = job.teacher_forward = None
    t.drop_teacher()
    with ctx.phases("final model: gathered and folded" if cfg.fsdp else "final model: folded"):
        final = distribution.finish(t.raw, t.raw_opt, t.method, cfg, out)
    results.update(t.method.results())
    results["kernels"] = kernels.taken()  # which path each checked kernel took (cast_llm.kernels)
    with distribution.waiting_for_main("exporting and evaluating the final model"):
        merge_results(results, job.finish(ctx, final, results))
        if ctx.is_main:  # a run that dies in the gathering below keeps its export's figures
            write_results(out, results)
    results["phases"] = ctx.phases.gathered(distribution)
    if ctx.is_main:
        write_results(out, results)
        refresh_run_card(out, results)  # the model card again, with what the run measured after writing it
    with distribution.waiting_for_main("removing the run's checkpoints"):
        if ctx.is_main:
            ckpt.drop(keep=cfg.keep_checkpoints_after)
            if drop_previous(out):  # the run an --overwrite replaced: deleted only now that this one is complete
                ctx.say(f"removed the previous run that --overwrite replaced ({out / PREVIOUS})")
    ctx.accelerator.end_training()
    return results


def _record_peak(job: Job, ctx: LoopContext, peak: PeakMemory, results: dict[str, Any]) -> None:
    """The largest per-process peak of the steps (all ranks), beside the plan's, into results.json."""
    measured = peak.read()
    if measured is None:
        return
    framework = peak.framework
    every = ctx.distribution.gather((int(measured), framework))  # (the CPU group: no device sync)
    per_rank = [m for m, _ in every]
    measured = max(per_rank)
    if framework is not None:
        framework = max(f or 0 for _, f in every)
    plan = job.memory_plan
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
