"""What would make a run fit: the memory options of ``cast-llm train``, each with what it saves and costs.

:func:`option_effects` applies each option alone to the setup and re-plans; :func:`make_it_fit` adds them
cheapest first (in speed: the free ones before recomputation, a smaller micro-batch last) until the plan
fits, and when nothing fits on the given GPUs, finds how many GPUs FSDP2 needs with all of them on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from cast_llm.plan.memory import MemoryPlan, Setup, plan_memory
from cast_llm.plan.shapes import ModelShape

__all__ = ["Option", "OPTIONS", "option_effects", "make_it_fit", "Fit", "remedy"]


@dataclass(frozen=True)
class Option:
    flag: str  # the cast-llm train flag(s)
    what: str  # what it changes, and its cost
    apply: Callable[[Setup], Setup | None]  # None: not applicable to this setup
    repeat: bool = False  # applied again while the plan does not fit (halving the micro-batch)


def _fsdp(s: Setup):
    return replace(s, strategy="fsdp") if s.world > 1 and s.strategy != "fsdp" else None


def _policy(s: Setup):
    ok = s.strategy == "fsdp" and s.precision == "bf16" and s.fsdp_precision != "policy"
    return replace(s, fsdp_precision="policy") if ok else None


def _half_batch(s: Setup):
    if s.batch_size == 1:
        return None
    half = max(1, s.batch_size // 2)
    return replace(s, batch_size=half, grad_accum=s.grad_accum * s.batch_size // half)


OPTIONS: tuple[Option, ...] = (
    Option("--fsdp", "shard weights, moments, masks, gradients and the teacher over the GPUs (FSDP2)", _fsdp),
    Option("--fused-head", "LM head and loss in token chunks: the full logits of student and teacher never "
           "exist (same FLOPs)", lambda s: replace(s, fused_head=True) if not s.fused_head else None),
    Option("--packed-masks", "N:M masks as bits instead of bytes (1/8)",
           lambda s: replace(s, packed_masks=True) if not s.packed_masks else None),
    Option("--teacher-dtype bf16", "the frozen teacher in bf16",
           lambda s: replace(s, teacher_dtype="bf16") if s.kd and s.teacher_bytes == 4 else None),
    Option("--fsdp-precision policy", "FSDP2's mixed-precision policy: bf16 all-gathers, no autocast cache, "
           "the scaled weights one layer at a time", _policy),
    Option("--activation-checkpointing selective", "keep each block's input and matmul/attention outputs, "
           "recompute the cheap operators (+12% step time on CPU: docs/results/recompute-cpu.md)",
           lambda s: replace(s, activation_checkpointing="selective") if s.recompute == "none" else None),
    Option("--activation-checkpointing full", "keep only each block's input, recompute the block in backward "
           "(one more forward: +30-46% step time on CPU)",
           lambda s: replace(s, activation_checkpointing="full") if s.recompute != "full" else None),
    Option("--kd-chunk-size 256", "a quarter of the loss work space",
           lambda s: replace(s, kd_chunk_size=256) if s.kd_chunk_size > 256 else None),
    Option("--batch-size ÷2 --grad-accum ×2", "half the activations and logits, same global batch (slower "
           "on small micro-batches)", _half_batch, repeat=True),
)


@dataclass
class Fit:
    """What :func:`make_it_fit` found."""

    flags: list[str]  # the options to add, in order
    setup: Setup  # the setup with them
    plan: MemoryPlan
    gpus: int | None  # None: fits on the GPUs given; else the FSDP2 world size needed (0: none up to 4096)


def _drop_unneeded(shape, setup: Setup, flags: list[str], capacity: int):
    """Leave out the options (latest first) that the others make unnecessary; micro-batch halvings stay."""
    by_flag = {o.flag: o for o in OPTIONS}

    def build(chosen):
        s = setup
        for f in chosen:
            s = by_flag[f].apply(s) or s
        while not plan_memory(shape, s).fits(capacity) and _half_batch(s) is not None:
            s = _half_batch(s)
        return s

    chosen = list(flags)
    for f in reversed(flags):
        trial = [x for x in chosen if x != f]
        if plan_memory(shape, build(trial)).fits(capacity):
            chosen = trial
    final = build(chosen)
    return chosen, final, plan_memory(shape, final)


def option_effects(shape: ModelShape, setup: Setup) -> list[tuple[Option, MemoryPlan]]:
    """Each applicable option alone, with the plan it gives."""
    out = []
    for opt in OPTIONS:
        changed = opt.apply(setup)
        if changed is not None:
            out.append((opt, plan_memory(shape, changed)))
    return out


def make_it_fit(shape: ModelShape, setup: Setup, capacity: int) -> Fit:
    """Add the options in :data:`OPTIONS` order until the plan fits ``capacity``; if all of them do not
    suffice, the smallest power-of-two FSDP2 world size that fits with all of them on."""
    flags: list[str] = []
    current, plan = setup, plan_memory(shape, setup)
    halvings = 0
    for opt in OPTIONS:
        while not plan.fits(capacity):
            changed = opt.apply(current)
            if changed is None:
                break
            current, plan = changed, plan_memory(shape, changed)
            if opt.repeat:
                halvings += 1
            else:
                flags.append(opt.flag)
                break
    if plan.fits(capacity):
        flags, current, plan = _drop_unneeded(shape, setup, flags, capacity)
    if halvings:
        flags.append(f"--batch-size {current.batch_size} --grad-accum {current.grad_accum}")
    if plan.fits(capacity):
        return Fit(flags, current, plan, None)
    world = 2
    while world <= 4096:
        if world > setup.world:
            bigger = replace(current, world=world, strategy="fsdp")
            if plan_memory(shape, bigger).fits(capacity):
                base = replace(setup, world=world, strategy="fsdp")
                chosen, final, p = _drop_unneeded(shape, base, [f for f in flags if f != "--fsdp"
                                                                 and not f.startswith("--batch-size")], capacity)
                if final.batch_size != setup.batch_size:
                    chosen.append(f"--batch-size {final.batch_size} --grad-accum {final.grad_accum}")
                return Fit(["--fsdp", *chosen], final, p, world)
        world *= 2
    return Fit(flags, current, plan, 0)


def remedy(term: str, s: Setup) -> str:
    """The option of ``cast-llm train`` that removes (or shrinks most) the memory term named ``term`` of a
    plan for ``s`` — what the advice says when nothing fits — or why none does."""
    more_gpus = "more GPUs under --fsdp (it is divided by their number)"
    shard = "--fsdp (shards it over the GPUs)" if s.strategy != "fsdp" else more_gpus
    if term.startswith("activations"):
        if s.recompute == "none":
            return "--activation-checkpointing selective (or full: each block keeps only its input)"
        if s.recompute == "selective":
            return "--activation-checkpointing full (each block keeps only its input)"
        return ("--batch-size ÷2 --grad-accum ×2" if s.batch_size > 1 else
                "a shorter --seq-len (recomputation is full and the micro-batch 1: nothing else shrinks it)")
    if term.startswith("scaled weights"):
        if s.strategy == "fsdp" and s.precision == "bf16" and not s.policy:
            return "--fsdp-precision policy (the scaled weights formed one layer at a time)"
        if s.recompute == "none":
            return "--activation-checkpointing selective (one block's scaled weights at a time)"
        return "--fsdp in bf16 (its precision policy forms them one layer at a time)"
    if term.startswith("bf16 casts"):
        if s.strategy == "fsdp":
            return "--fsdp-precision policy (no autocast cache)"
        return "--fsdp (its precision policy keeps no autocast cache; it runs on one GPU too under torchrun)"
    if term.startswith("N:M masks (bool)"):
        return "--packed-masks (1/8)"
    if term.startswith(("weights (fp32", "AdamS moments", "gradients", "DDP gradient", "N:M masks")):
        return shard
    if term.startswith("teacher (fp32)"):
        return "--teacher-dtype bf16"
    if term.startswith("teacher (bf16)"):
        return shard if s.strategy != "fsdp" else more_gpus + "; --no-kd drops it (not the paper's CAST)"
    if term.startswith(("student logits", "teacher logits", "loss gradient buffer")):
        return "--fused-head (the loss through the head in token chunks)"
    if term.startswith(("KD loss work space", "loss work space", "logits, one chunk")):
        return "--kd-chunk-size 256" if s.kd_chunk_size > 256 else "a smaller --kd-chunk-size"
    if term.startswith(("teacher forward temporaries", "hidden-state gradient", "teacher hidden states")):
        return "--batch-size ÷2 --grad-accum ×2" if s.batch_size > 1 else "a shorter --seq-len"
    if term.startswith("LM head gradient"):
        return "none of the options: the head's gradient exists whole under --fused-head (drop --fused-head if " \
               "the logits are smaller)"
    if term.startswith("weight scales"):
        return "--no-scaling (not the paper's CAST)"
    if term.startswith("FSDP2"):
        return "none of the options: FSDP2 unshards its units (root, one block) whole; more GPUs do not shrink it"
    return "none of the options"
