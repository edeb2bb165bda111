"""Shared pieces of the training-step benchmarks (train_step, mask_update, peak_memory).

One training step here is the trainer's loop step itself (:func:`cast_llm.train.step.train_step`) on one
micro-batch: student forward, the trainer's teacher forward (``TeacherForward``: ``inference_mode``, no KV
cache; KD only), the trainer's own ``lm_loss``
(CE, or Eq. 13 through the chunked KD loss), backward, gradient clipping at 1.0, the optimizer step,
``zero_grad(set_to_none=True)``, with the trainer's finiteness guard (losses checked on the device; a
non-finite step skipped there; read after the rounds, as the trainer reads it once per log interval). Logging,
observers and the LR schedule are left out: plain training pays for them alike. A variant may be restricted
to some candidates of the checked kernel paths (``Variant.paths``: e.g. the compiled AdamS update). Three variants, as in the paper's timing table (method.md §7):

* ``plain``: the dense model, CE only, ``torch.optim.AdamW`` — fused (the fastest torch AdamW); the
  foreach AdamW is timed on the same gradients as a second plain row;
* ``cast_nokd``: CAST without KD — ScaledLinear targets (Eq. 11-12) and AdamS (Eq. 7-8), built by the
  trainer's own ``CastMethod``;
* ``cast_kd``: the same plus the frozen teacher and the KD loss (Eq. 13).

All variants share ONE set of weight tensors (the CAST model is a second module tree over the same
Parameters; only the scales are its own): timing does not depend on the values, and it keeps a 135M model's
three variants within a few GB. Masks are held fixed during the timed steps and recomputed separately
(``refresh_masks``), so that the amortised mask cost can be reported on its own (benchmark 2).
"""

from __future__ import annotations

import contextlib
import copy
import os
import platform
import time
from dataclasses import dataclass, field

import torch

# LLaMA-shaped models with random weights: (hidden, intermediate, layers, heads, kv heads, vocab[, tied])
RANDOM_MODELS = {
    "tiny-llama": (64, 128, 2, 4, 2, 512),  # --quick: a few ms per step
    "tiny-llama-wide": (128, 256, 2, 4, 2, 1024),  # train_step --tiny's stand-in for the 1B row
    # SmolLM2-135M's config exactly (embeddings tied; no checkpoint to load: timing does not depend on values)
    "smollm2-135m-random": (576, 1536, 30, 9, 3, 49152, True),
    "llama-1b": (2048, 5632, 22, 32, 4, 32000),  # TinyLlama-1.1B's shape: the "larger" GPU model
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def machine() -> str:
    """CPU model, threads, torch version and load average (or the GPU), for every printed result."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = "load unknown"
    if hasattr(os, "getloadavg"):
        load = "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}; {os.cpu_count()} logical CPUs ({load}); torch {torch.__version__} with "
            f"{torch.get_num_threads()} intra-op threads; Python {platform.python_version()}; "
            f"{platform.system()} {platform.release()}{gpu}")


def preload() -> None:
    """Import everything a step needs (seconds of imports), e.g. once before forking per-variant processes."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    import cast_llm.distill  # noqa: F401
    import cast_llm.models  # noqa: F401
    import cast_llm.train.methods.cast  # noqa: F401
    import cast_llm.train.trainer  # noqa: F401


def load(name: str, device: torch.device) -> torch.nn.Module:
    """A causal LM in fp32 (master weights, as the trainer loads it): a random LLaMA shape or a real model."""
    if name in RANDOM_MODELS:
        from transformers import LlamaConfig, LlamaForCausalLM

        hidden, inter, layers, heads, kv, vocab, *tied = RANDOM_MODELS[name]
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                          max_position_embeddings=8192, tie_word_embeddings=bool(tied and tied[0]))
        torch.manual_seed(0)
        with torch.device(device):
            return LlamaForCausalLM(cfg).float()
    from cast_llm.models import load_model

    return load_model(name, dtype=torch.float32, device=device)


def train_config(**overrides):
    """The trainer's config with the defaults a CAST run uses (masks fixed: see ``refresh_masks``)."""
    from cast_llm.train.config import TrainConfig

    # the paper's algorithm: what a CAST step costs (a warm start or a masked repair changes the start and
    # the end of a run, not the step)
    kw = dict(method="cast", mask_interval=0, progress=False, paper_exact=True)
    kw.update(overrides)
    return TrainConfig(**kw)


@dataclass
class Variant:
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    teacher: torch.nn.Module | None = None
    extra_optimizer: torch.optim.Optimizer | None = None  # stepped on the same gradients, timed apart
    times: dict[str, list[float]] = field(default_factory=dict)
    teacher_forward: object = None  # the trainer's TeacherForward over ``teacher``
    paths: dict = field(default_factory=dict)  # checked kernel path -> the candidates this variant may take
    guard: object = None  # the trainer's FiniteGuard: losses checked on the device, read after the rounds


def build_variants(base: torch.nn.Module, cfg, names: list[str], dtype: torch.dtype, *,
                   foreach_baseline: bool = True) -> dict[str, Variant]:
    """The variants of the module docstring over ``base``'s weights (``base`` becomes the plain model).
    ``foreach_baseline=False``: no second (foreach) AdamW on the plain variant (on a GPU it would hold a
    second set of moments)."""
    from cast_llm.train.methods import get_method

    base.train()
    out: dict[str, Variant] = {}
    teacher = None
    if any(n.startswith("cast_kd") for n in names):
        # the trainer's teacher: a frozen copy of the dense start, in the training dtype (bf16 under autocast)
        teacher = copy.deepcopy(base).eval().requires_grad_(False)
        if dtype != torch.float32:
            teacher.to(dtype)
    if "plain" in names:
        params = list(base.parameters())
        fused = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
        foreach = None
        if foreach_baseline:
            foreach = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
            if base.device.type == "cpu":  # share the moments: timing needs no second 1 GB of state on a small box
                foreach.state = fused.state
        out["plain"] = Variant("plain", base, fused, extra_optimizer=foreach, paths=HAND_WRITTEN_PATHS)
        if "plain_compiled" in names:  # the same, its CE through the compiled loss: the compiled rows' baseline
            out["plain_compiled"] = Variant("plain_compiled", base, fused, paths=COMPILED_PATHS)
    if any(name.startswith("cast") for name in names):
        # a second module tree over the SAME Parameters (deepcopy's memo maps every Parameter to itself)
        student = copy.deepcopy(base, memo={id(p): p for p in base.parameters()})
        method = get_method("cast")
        method.prepare_model(student, cfg)  # wraps the targets in ScaledLinear, as the trainer does
        opt = method.build_optimizer(student, cfg, 100_000)  # AdamS with the trainer's param groups
        from cast_llm.distill.teacher import TeacherForward

        for name in CAST_VARIANTS:  # cast_kd_graph: the teacher as a CUDA graph
            if name in names:
                kd = name != "cast_nokd" and name != "cast_nokd_compiled"
                out[name] = Variant(name, student, opt, teacher=teacher if kd else None,
                                    paths=COMPILED_PATHS if name.endswith("_compiled") else HAND_WRITTEN_PATHS)
                if kd:
                    graph = cfg.teacher_cuda_graph if name != "cast_kd_graph" else True  # the trainer's default
                    out[name].teacher_forward = TeacherForward(teacher, cuda_graph=graph, say=print)
    return out


CAST_VARIANTS = ("cast_nokd", "cast_kd", "cast_kd_graph", "cast_nokd_compiled", "cast_kd_compiled")
# the CAST rows time the hand-written fast paths (Triton on a GPU, the block-wise AdamS on a CPU; the KD loss's
# torch reference there); the "_compiled" rows the torch.compile candidates of the same checked paths
HAND_WRITTEN_PATHS = {"adams.update": ("triton", "blockwise"), "kd.loss": ("triton",)}
COMPILED_PATHS = {"adams.update": ("compiled",), "kd.loss": ("compiled",)}


def refresh_masks(opt) -> None:
    """Recompute and store every N:M mask of an AdamS (Eq. 6) — exactly what a ``t % T1 == 0`` step does."""
    for group in opt.param_groups:
        if group["sparse"]:
            for p in group["params"]:
                opt.state[p]["mask"] = opt._encode(opt._compute_mask(p, group))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Clock:
    """Wall time, and on CPU also the process's CPU time: on a machine shared with other jobs the CPU time
    of a single-threaded process is what the work cost, the wall time adds however long it waited for a
    core. Every reading is ``(wall, cpu)`` seconds."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self) -> tuple[float, float]:
        sync(self.device)
        return time.perf_counter(), time.process_time()


def elapsed(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return b[0] - a[0], b[1] - a[1]


def train_step(v: Variant, batch: torch.Tensor, cfg, autocast_dtype: torch.dtype | None, *,
               phases: bool = True, extra: bool = True) -> dict[str, tuple]:
    """One step of the trainer's loop (:func:`cast_llm.train.step.train_step`, the loop's own, on one
    micro-batch); returns ``(wall, cpu)`` seconds of each phase.

    ``phases=False``: the clock is read (and the device synchronised) only before and after the whole step,
    as the trainer runs it (the phase boundaries' synchronisations would keep the host from running ahead of
    the GPU); the result is ``{"step": ...}``. ``extra=False``: the second (foreach) plain optimizer is not
    stepped.
    """
    from cast_llm import kernels
    from cast_llm.train.finite import FiniteGuard

    if v.guard is None:
        v.guard = FiniteGuard(batch.device)
    restrictions = contextlib.ExitStack()
    for name, candidates in v.paths.items():
        restrictions.enter_context(kernels.restricted(name, candidates))
    with restrictions:
        return _train_step(v, batch, cfg, autocast_dtype, phases, extra)


def _train_step(v, batch, cfg, autocast_dtype, phases, extra):
    from cast_llm.train.step import StepSetup
    from cast_llm.train.step import train_step as loop_step
    from cast_llm.train.trainer import lm_loss

    device = batch.device
    clock = Clock(device)

    def loss(model, teacher, b):
        logits = model(input_ids=b).logits
        # the trainer's teacher call: inference_mode, no KV cache (cast_kd_graph: a CUDA graph replay)
        t_logits = v.teacher_forward(b) if teacher is not None else None
        out, _, _ = lm_loss(logits, t_logits, b, cfg)  # CE without a teacher, Eq. 13 with one
        return out, {}, b.numel()

    setup = StepSetup(v.model, v.optimizer, loss, teacher=v.teacher, guard=v.guard, grad_clip=cfg.grad_clip,
                      autocast=lambda: (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                                        else torch.autocast(device.type, enabled=False)))
    marks = {}

    def mark(phase: str) -> None:
        if phases or phase == "optimizer":
            marks[phase] = clock()
        if phase == "optimizer" and extra and v.extra_optimizer is not None:  # stepped on the same gradients
            v.extra_optimizer.step()
            marks["extra"] = clock()

    t0 = clock()
    loop_step(setup, 0, lambda micro: batch, 1, mark=mark)
    t4 = marks["optimizer"]
    if phases:
        times = dict(forward=elapsed(t0, marks["forward"]), backward=elapsed(marks["forward"], marks["backward"]),
                     clip=elapsed(marks["backward"], marks["clip"]), optimizer=elapsed(marks["clip"], t4))
    else:
        times = dict(step=elapsed(t0, t4))
    if "extra" in marks:
        times["optimizer_extra"] = elapsed(t4, marks["extra"])
    return times


def check_finite(variants) -> None:
    """After the timed rounds: every variant's losses were finite (one host read per variant)."""
    for v in variants:
        if v.guard is not None:
            try:
                v.guard.check(None)
            except Exception as e:
                raise RuntimeError(f"{v.name}: {e}") from None


def random_batch(batch: int, seq: int, vocab: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)
