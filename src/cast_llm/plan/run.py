"""The plan of a run: one path from a training configuration to its plan, for ``cast-llm plan`` and for
``cast-llm train`` itself.

``run`` is a training configuration as ``cast-llm train`` resolves it (a
:class:`cast_llm.train.config.TrainConfig`; read by its attributes and properties, since the plan sits below
training and does not import it). :class:`~cast_llm.plan.config.PlanOptions` holds the only things the plan
asks that a run does not say: the machine and the estimates' assumptions.

* :func:`setup_for_run` — the :class:`~cast_llm.plan.memory.Setup` of the steps (the one builder);
* :func:`startup_work` — what the run does around its steps (the one start-up estimate): whether it evaluates
  the dense model first, whether it warm-starts from the one-shot model, whether SparseGPT calibrates (and on
  how many tokens), what each evaluation scores;
* :func:`plan_run` — the whole :class:`Plan`: memory, the options that make it fit, time, decay, start-up.

The trainer calls the first two for the run it is about to start (:func:`cast_llm.train.memory.plan_for_run`);
``cast-llm plan`` calls :func:`plan_run`, which calls them too.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from cast_llm.data import steps_for_tokens
from cast_llm.errors import CastError
from cast_llm.eval.evaluator import wikitext_windows
from cast_llm.eval.ppl import wikitext2_source
from cast_llm.machine import machine_ram, process_rss
from cast_llm.optim.schedule import TRAIN_WARMUP, schedule_lrs
from cast_llm.plan.advice import Fit, make_it_fit, option_effects, remedy
from cast_llm.plan.batch import split_global_batch
from cast_llm.plan.config import GRAD_RMS_AT_512, WEIGHT_RMS, PlanOptions
from cast_llm.plan.decay import DecayPlan, plan_decay
from cast_llm.plan.memory import MemoryPlan, Setup, plan_memory
from cast_llm.plan.report import precision_text
from cast_llm.plan.shapes import ModelShape, embedded_key, model_shape
from cast_llm.plan.sizes import parse_size
from cast_llm.plan.startup import StartupPlan, StartupWork, plan_startup, startup_fits
from cast_llm.plan.timing import TimePlan, interconnect, plan_time
from cast_llm.prune.oneshot import CALIBRATION_SEQ_LEN

__all__ = ["Plan", "plan_run", "setup_for_run", "startup_work", "calibration_tokens", "evaluation_windows",
           "training_precision", "CHARS_PER_TOKEN"]

# characters per token of English text under a BPE vocabulary: WikiText-2's packaged test text under SmolLM2's
# tokenizer (cast_llm.eval.ppl.tokenize_text) is 1,294,336 characters, 304,986 tokens: 4.24. The plan has no
# tokenizer: it estimates how many WikiText-2 windows the text holds from its length at this ratio.
CHARS_PER_TOKEN = 4.24
DEFAULT_GPU_MEMORY = 80 * 10**9  # an 80 GB card (H100 / A100 80GB), unless --gpu-memory says otherwise


def plan_device(run) -> str:
    """Where the plan puts the run: ``cpu`` for ``--device cpu``, else a GPU (``auto`` plans a GPU run)."""
    return "cpu" if run.device == "cpu" else "cuda"


def training_precision(run, device_type: str) -> str:
    """``bf16`` or ``fp32``: what ``--precision`` means on ``device_type`` (as the training loop resolves it:
    ``auto`` is bf16 autocast on a GPU, fp32 on a CPU)."""
    if run.precision == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return run.precision


def setup_for_run(run, *, world: int, device_type: str, precision: str | None = None, framework: int = 0,
                  batch_size: int | None = None, grad_accum: int | None = None) -> Setup:
    """The :class:`Setup` of ``run`` on ``world`` processes of ``device_type`` (``precision``: the loop's, 'bf16'
    or 'no' / 'fp32'; None: from ``run.precision``). ``batch_size`` / ``grad_accum``: the split the launch
    settled, when it differs from ``run``'s own (``--global-batch``, ``--batch-size 0``)."""
    if precision is None:
        precision = training_precision(run, device_type)
    return Setup(device="cuda" if device_type == "cuda" else "cpu", world=world,
                 strategy="fsdp" if run.fsdp else ("ddp" if world > 1 else "single"),
                 precision="bf16" if precision == "bf16" else "fp32",
                 batch_size=run.batch_size if batch_size is None else batch_size,
                 grad_accum=run.grad_accum if grad_accum is None else grad_accum, seq_len=run.seq_len,
                 kd=run.use_kd, scaling=run.use_scaling, scale_groups=run.scale_groups,
                 activation_checkpointing=run.activation_checkpointing,
                 fsdp_precision="autocast" if run.fsdp_precision == "autocast" else "policy",
                 teacher_dtype=run.teacher_dtype, fused_head=run.fused_head, kd_chunk_size=run.kd_chunk_size,
                 packed_masks=run.packed_masks, framework=framework)


def calibration_tokens(run) -> int:
    """Tokens the run's SparseGPT calibration reads: ``--calib-samples`` training windows, each cut to the
    one-shot methods' own calibration length (:data:`cast_llm.prune.oneshot.CALIBRATION_SEQ_LEN`) when the
    training sequences are longer (:func:`cast_llm.train.methods.masks.initial_masks`)."""
    return run.calib_samples * min(run.seq_len, CALIBRATION_SEQ_LEN)


@functools.lru_cache(maxsize=8)
def _characters(path: str, size: int, mtime_ns: int) -> int:
    """Characters of the UTF-8 text file ``path`` (read once per size and modification time)."""
    return len(Path(path).read_text(encoding="utf-8"))


def evaluation_windows(run, train_tokens: int) -> int:
    """WikiText-2 windows each evaluation scores, by the evaluator's own rule
    (:func:`cast_llm.eval.evaluator.wikitext_windows`: ``--wikitext-windows``, or scaled to the run's
    ``train_tokens``), of the windows the text holds — which the plan estimates from the text's length
    (:data:`CHARS_PER_TOKEN`; no tokenizer)."""
    eval_len = run.eval_window
    source = wikitext2_source(run.wikitext_file)
    if source.path is None:
        return 0
    stat = source.path.stat()
    total = int(_characters(str(source.path), stat.st_size, stat.st_mtime_ns) / CHARS_PER_TOKEN) // eval_len
    return wikitext_windows(run.wikitext_windows, total, train_tokens, eval_len)


def startup_work(run, *, native_bytes: int, train_tokens: int, batch_size: int | None = None,
                 all_split_windows: int | None = None, gpus_per_node: int = 8,
                 host_memory: int | None = None) -> StartupWork:
    """What ``run`` does around its steps (the part of the plan its :class:`Setup` does not say), as the
    trainer does it (:mod:`cast_llm.train.trainer`): the dense model evaluated first (``--baseline-eval``),
    the one-shot model measured instead of a magnitude mask when the run warm-starts from it, SparseGPT's
    calibration whenever the initial mask is SparseGPT's (any method), and each evaluation's tokens — the
    test split's ``--test-sequences`` windows of ``--seq-len`` and the WikiText-2 windows of
    ``--eval-seq-len``; the final one also the validation split's ``--val-sequences``. ``batch_size``: the
    micro-batch the launch settled (the held-out splits are scored that many windows per forward).
    ``all_split_windows``: what ``--test-sequences 0`` / ``--val-sequences 0`` (all the split holds, unknown
    before the data is read) stand for; None refuses them."""
    counts = {}
    for flag, count in (("--test-sequences", run.test_sequences), ("--val-sequences", run.val_sequences)):
        if count == 0 and all_split_windows is None:
            raise CastError(f"{flag} 0 scores all the split holds, which the plan cannot know without the data; "
                            f"give {flag} N")
        counts[flag] = count or all_split_windows
    eval_len = run.eval_window
    windows = evaluation_windows(run, train_tokens)
    micro = max(1, run.batch_size if batch_size is None else batch_size)
    sparsegpt = run.effective_init_mask == "sparsegpt"
    return StartupWork(baseline_eval=run.baseline_eval, warm_start=run.use_warm_start, sparsegpt=sparsegpt,
                       calib_tokens=calibration_tokens(run) if sparsegpt else 0,
                       eval_tokens=counts["--test-sequences"] * run.seq_len + windows * eval_len,
                       val_tokens=counts["--val-sequences"] * run.seq_len,
                       eval_window=max(eval_len, run.seq_len * micro), native_bytes=native_bytes,
                       gpus_per_node=gpus_per_node, host_memory=host_memory)


@dataclass
class Plan:
    run: object  # the training configuration planned (a TrainConfig)
    options: PlanOptions
    shape: ModelShape
    setup: Setup
    capacity: int  # bytes one process may use
    memory: MemoryPlan
    fit: Fit | None  # None when it fits as given
    effects: list  # [(Option, MemoryPlan)] each option alone
    time: TimePlan
    decay: DecayPlan | None
    work: StartupWork  # what the run does around its steps
    startup: StartupPlan  # around the steps: start-up and end peaks, host per node, timeouts
    fit_time: TimePlan | None = None  # the time with the options of `fit` (they change the FLOPs)

    @property
    def host_memory(self) -> int | None:
        return parse_size(self.options.host_memory, "--host-memory") if self.options.host_memory else None

    def as_dict(self) -> dict:
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
                "startup_work": asdict(self.work),
                "startup": {**self.startup.as_dict(),
                            **startup_fits(self.startup, self.setup, self.capacity, self.host_memory)}}


def _decay(run, steps: int, tokens_per_step: int, options: PlanOptions) -> DecayPlan | None:
    """AdamS's decay forecast (CAST with AdamS and λ > 0 only), on the learning rates the run's own schedule
    code gives and with the run's own masked-repair fraction."""
    if run.method != "cast" or run.mask_learner != "adams" or run.l1_decay <= 0:
        return None
    lrs = schedule_lrs(run, steps, run.lr, default_warmup=TRAIN_WARMUP)
    repair = run.effective_repair_fraction
    prune_step = steps - round(repair * steps) if repair > 0 else steps
    weight_rms = options.weight_rms or WEIGHT_RMS.get(embedded_key(run.model) or "", 0.02)
    grad_rms = options.grad_rms or GRAD_RMS_AT_512 * math.sqrt(512 / tokens_per_step)
    return plan_decay(lrs, total_steps=steps, l1_decay=run.l1_decay, grad_rms=grad_rms, weight_rms=weight_rms,
                      warm_start=run.use_warm_start, prune_step=prune_step, target=run.forecast_target, n=run.n,
                      m=run.m)


def plan_run(run, options: PlanOptions | None = None, *, shape: ModelShape | None = None,
             framework: int | None = None) -> Plan:
    """The whole plan of the training configuration ``run`` on the machine ``options`` describe (``shape``:
    already known, e.g. from a loaded model). ``--batch-size 0`` and ``--global-batch`` are split over the
    GPUs as the trainer splits them (:func:`cast_llm.plan.batch.split_global_batch`, the micro-batch the
    largest that the memory plan fits). ``framework``: on a CPU, the bytes the process holds before any model
    (default: this process's resident set now)."""
    options = options or PlanOptions()
    if not run.model:
        raise CastError("--model is required (a folder, config.json, hub id or embedded config name)")
    shape = shape or model_shape(run.model, n=run.n, m=run.m)
    device = plan_device(run)
    cpu = device == "cpu"
    world = options.gpus
    total = parse_size(options.gpu_memory, "--gpu-memory") if options.gpu_memory else (
        machine_ram() if cpu else DEFAULT_GPU_MEMORY)
    capacity = total // world if cpu else total  # CPU processes share the machine's RAM
    if framework is None:
        framework = process_rss() if cpu else 0

    def setup(batch: int, accum: int) -> Setup:
        return setup_for_run(run, world=world, device_type=device, framework=framework, batch_size=batch,
                             grad_accum=accum)

    batch, accum = split_global_batch(run.global_batch, world, batch_size=run.batch_size, grad_accum=run.grad_accum,
                                      fits=lambda b, a: plan_memory(shape, setup(b, a)).fits(capacity))
    s = setup(batch, accum)
    memory = plan_memory(shape, s)
    fit = None if memory.fits(capacity) else make_it_fit(shape, s, capacity)
    effects = option_effects(shape, s)
    per_step = batch * run.seq_len * accum * world
    steps = run.max_steps or steps_for_tokens(run.tokens, per_step)
    tokens = steps * per_step
    link = interconnect(options.interconnect, world, options.gpus_per_node)
    bandwidth = options.link_bandwidth * 1e9 if options.link_bandwidth else None
    time = plan_time(shape, s, tokens, tokens_per_s=options.tokens_per_s, gpu_tflops=options.gpu_tflops,
                     mfu=options.mfu, link=link, bandwidth=bandwidth)
    if cpu and options.tokens_per_s is None:  # no FLOP rate to assume for a CPU: only a measured throughput
        time.tokens_per_s = float("nan")
    fit_time = None
    if fit is not None and fit.gpus != 0 and options.tokens_per_s is None and not cpu:  # options change the FLOPs
        gpus = fit.gpus or world
        name = "auto" if options.interconnect == "nvlink" and gpus > options.gpus_per_node else options.interconnect
        fit_link = interconnect(name, gpus, options.gpus_per_node)
        fit_time = plan_time(shape, fit.setup, tokens, gpu_tflops=options.gpu_tflops, mfu=options.mfu,
                             link=fit_link, bandwidth=bandwidth)
    decay = _decay(run, time.steps, per_step, options)
    host = parse_size(options.host_memory, "--host-memory") if options.host_memory else None
    work = startup_work(run, native_bytes=shape.native_bytes, train_tokens=tokens, batch_size=batch,
                        gpus_per_node=options.gpus_per_node, host_memory=host)
    startup = plan_startup(shape, s, work)
    return Plan(run, options, shape, s, capacity, memory, fit, effects, time, decay, work, startup, fit_time)
