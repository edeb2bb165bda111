"""The plan as text: ``cast-llm plan`` prints :func:`plan_lines`; ``cast-llm train`` prints
:func:`memory_lines` of its own configuration at the top of every run."""

from __future__ import annotations

from cast_llm.plan.advice import remedy
from cast_llm.plan.memory import CPU_RETENTION, CUDA_CONTEXT, FRAGMENTATION, MemoryPlan, Setup
from cast_llm.plan.sizes import fmt_size
from cast_llm.plan.startup import startup_fits

__all__ = ["plan_lines", "memory_lines", "startup_lines", "work_line", "setup_line", "precision_text", "duration"]

_STRATEGY = {"single": "one process", "ddp": "DDP", "fsdp": "FSDP2"}


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def precision_text(s: Setup) -> str:
    """What the run computes in: the policy, autocast or fp32."""
    if s.policy:
        return ("bf16 by FSDP2's MixedPrecisionPolicy (fp32 sharded master weights, bf16 all-gather and compute, "
                "fp32 reduce-scatter; no autocast)")
    return "bf16 autocast (fp32 master weights)" if s.precision == "bf16" else "fp32"


def setup_line(s: Setup) -> str:
    unit = "GPU" if s.device == "cuda" else "process"
    return (f"{s.world} {unit}{'s' if s.world > 1 else ''}, {_STRATEGY[s.strategy]}, {precision_text(s)}; "
            f"micro-batch {s.batch_size} × {s.seq_len} tokens, grad-accum {s.grad_accum}; recomputation "
            f"{s.recompute}; KD {'on' if s.kd else 'off'}, weight scaling {'on' if s.scaling else 'off'}")


def memory_lines(plan: MemoryPlan, capacity: int | None, *, indent: str = "  ") -> list[str]:
    """The breakdown, the peak and the verdict (``capacity``: bytes one process may use, or None)."""
    s = plan.setup
    unit = "GPU" if s.device == "cuda" else "process"
    rows = [(k, v) for k, v in plan.persistent.items() if v]
    out = [f"memory per {unit} (persistent):"]
    out += [f"{indent}{k:<52}{fmt_size(v):>11}" for k, v in rows]
    out.append(f"memory per {unit} (during a step, each at its largest):")
    out += [f"{indent}{k:<52}{fmt_size(v):>11}" for k, v in plan.step.items() if v]
    peaks = ", ".join(f"{k} {fmt_size(v)}" for k, v in plan.moments.items())
    out.append(f"{indent}{'peak (' + plan.peak_moment + ')':<52}{fmt_size(plan.peak):>11}   [{peaks}]")
    for note in plan.notes:
        out.append(f"{indent}note: {note}")
    if capacity is not None:
        extra = (f" (+ CUDA context {fmt_size(CUDA_CONTEXT)} and {FRAGMENTATION:.0%} fragmentation: "
                 "reserved/allocated of public GPU runs)"
                 if s.device == "cuda" else f" (+ {CPU_RETENTION:.0%} the heap keeps of freed blocks)")
        verdict = "fits" if plan.fits(capacity) else "DOES NOT FIT"
        out.append(f"{indent}needs {fmt_size(plan.needed())}{extra} of {fmt_size(capacity)}: {verdict}")
    return out


def work_line(work) -> str:
    """What the run does around its steps (a :class:`cast_llm.plan.startup.StartupWork`), in one line."""
    parts = ["baseline evaluation " + (("of the dense model" + ("" if work.warm_start else
                                                                 " and its one-shot magnitude mask"))
                                       if work.baseline_eval else "off (--no-baseline-eval)")]
    parts.append("starts from the one-shot model" if work.warm_start else "starts from the dense weights")
    if work.sparsegpt:
        parts.append(f"SparseGPT calibrates on {work.calib_tokens:,} tokens")
    parts.append(f"an evaluation scores {work.eval_tokens:,} tokens (test split and WikiText-2) in forwards of "
                 f"{work.eval_window:,}, the final one {work.val_tokens:,} validation tokens more")
    return "around the steps: " + "; ".join(parts)


def startup_lines(sp, s: Setup, *, indent: str = "  ") -> list[str]:
    """Around the steps (:mod:`cast_llm.plan.startup`): start-up and end peaks, host memory per node, the
    checkpoint per rank, rank 0's own work and the timeouts derived from it."""
    unit = "GPU" if s.device == "cuda" else "process"
    out = [f"around the steps (per {unit}; estimates at stated rates: cast_llm/plan/startup.py):"]
    out += [f"{indent}{k:<52}{fmt_size(v):>11}" for k, v in sp.memory.items()]
    node = sp.per_node
    out.append(f"host memory per node ({node} process{'es' if node > 1 else ''}):")
    out += [f"{indent}{k:<52}{fmt_size(v):>11}" for k, v in sp.host_per_node.items()]
    out.append("work and waits:")
    out += [f"{indent}{k:<52}{duration(v):>11}" for k, v in sp.seconds.items()]
    t = sp.timeouts
    out.append(f"{indent}{'timeouts: training collectives / waiting for rank 0':<52}"
               f"{duration(t.collective):>11} / {duration(t.wait)}")
    out += [f"{indent}note: {n}" for n in sp.notes]
    return out


def plan_lines(p) -> list[str]:
    """All of ``cast-llm plan``'s report for a :class:`cast_llm.plan.Plan`."""
    sh, s = p.shape, p.setup
    unit = "GPU" if s.device == "cuda" else "process"
    lines = [
        f"model {sh.name} ({sh.source}): {sh.params / 1e9:.2f}B parameters, {sh.target_params / 1e9:.2f}B of them "
        f"in the {p.run.n}:{p.run.m} targets; {sh.layers} blocks, hidden {sh.hidden}, vocabulary {sh.vocab}, LM head "
        f"{'tied' if sh.tied else 'untied'}",
        f"run: {setup_line(s)}; {fmt_size(p.capacity)} per {unit}",
        "",
        *memory_lines(p.memory, p.capacity),
    ]
    if not p.memory.fits(p.capacity):
        name, size = p.memory.largest_term()
        lines.append(f"  the largest term: {name} ({fmt_size(size)}); what removes it: {remedy(name, s)}")
    if p.fit is not None:
        f = p.fit
        if f.gpus == 0:
            lines.append(f"to make it fit: nothing up to 4096 GPUs with {' '.join(f.flags) or 'every option'}")
            name, size = f.plan.largest_term()
            lines.append(f"  the largest term then: {name} ({fmt_size(size)}); what removes it: "
                         f"{remedy(name, f.setup)}")
        else:
            more = f" on {f.gpus} GPUs" if f.gpus else ""
            lines.append(f"to make it fit: {' '.join(f.flags)}{more} → needs {fmt_size(f.plan.needed())} per {unit}")
    if p.effects:
        lines.append("each memory option alone:")
        for opt, mp in p.effects:
            ok = "fits" if mp.fits(p.capacity) else "does not fit"
            lines.append(f"  {opt.flag:<38}{fmt_size(mp.needed()):>11}  {ok:<13} {opt.what}")
    lines += ["", work_line(p.work), *startup_lines(p.startup, s)]
    host = p.host_memory
    f = startup_fits(p.startup, s, p.capacity, host)
    verdict = "fits" if f["device_fits"] else "DOES NOT FIT (--no-baseline-eval, or more memory per GPU)"
    lines.append(f"  start-up and end: needs {fmt_size(f['device_needed'])} of {fmt_size(p.capacity)} per {unit}: "
                 f"{verdict}")
    if f["host_fits"] is not None:
        lines.append(f"  host per node: {fmt_size(p.startup.host_peak_per_node)} of {fmt_size(host)}: "
                     + ("fits" if f["host_fits"] else "DOES NOT FIT"))
    lines += ["", _time_line(p)]
    if p.fit_time is not None:
        lines.append(f"  with the options above: {duration(p.fit_time.seconds)} "
                     f"({p.fit_time.tokens_per_s:,.0f} tokens/s, estimated)")
    if p.decay is not None:
        lines += _decay_lines(p)
    return lines


def tokens_text(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _time_line(p) -> str:
    t, opts, run = p.time, p.options, p.run
    if t.tokens_per_s != t.tokens_per_s:  # NaN: a CPU without a measured throughput
        return (f"time: {tokens_text(t.tokens)} tokens = {t.steps:,} steps; give --tokens-per-s (a short run's "
                "tokens_per_s in metrics.jsonl) for the time: there is no FLOP rate to assume for a CPU")
    if t.measured:
        how = "measured throughput (--tokens-per-s)"
    else:
        how = (f"estimated: {t.flops_per_token / 1e9:.1f} GFLOP per token at {opts.gpu_tflops:g} TFLOP/s × "
               f"{opts.mfu:.0%} MFU per GPU; --tokens-per-s from a short run replaces it")
    budget = f" (--tokens {tokens_text(run.tokens)})" if run.tokens else f" (--max-steps {run.max_steps:,})"
    line = (f"time: {tokens_text(t.tokens)} tokens{budget} = {t.steps:,} steps at {t.tokens_per_s:,.0f} tokens/s "
            f"→ {duration(t.seconds)} ({how})")
    if t.comm and not t.measured:
        line += (f"\n  per step: compute {t.compute_s:.2f} s; communication {fmt_size(t.comm_bytes)} per GPU over "
                 f"{t.interconnect} at {t.bandwidth / 1e9:g} GB/s = {t.comm_s:.2f} s, overlapped with the compute "
                 f"but for {t.exposed_s:.3f} s ({'communication' if t.comm_s > t.compute_s else 'compute'}-bound)")
    return line


def _decay_lines(p) -> list[str]:
    d = p.decay
    start = "warm start (pruned weights start at 0)" if d.warm_start else "dense start"
    where = "the last step" if d.prune_step == d.total_steps else f"step {d.prune_step:,} (the masked repair starts)"
    verdict = "reaches" if d.finishes else "does NOT reach"
    lines = [f"decay: S_t at the final prune ({where}; {start}) forecast {d.ratio:.4f}: {verdict} {d.target}"]
    cap = ("any noise level" if d.max_grad_rms == float("inf") else
           f"gradient noise ≤ {d.max_grad_rms:.2g}" if d.max_grad_rms else "no noise level ≤ 1000× smaller")
    lines.append(f"  assumed: target-weight rms {d.weight_rms:g}, pruned-entry gradient noise {d.grad_rms:.2g} "
                 f"(--weight-rms, --grad-rms); it reaches {d.target} with {cap}. The decay can move a pruned "
                 f"weight {d.drift:.2g} in all; the noise spreads it by {d.spread:.2g}.")
    if not d.finishes:
        tips = []
        if d.lr_factor:
            tips.append(f"--lr {p.run.lr * d.lr_factor:.3g}")
        if d.l1_factor:
            tips.append(f"--l1-decay {p.run.l1_decay * d.l1_factor:.3g}")
        if tips:
            lines.append(f"  forecast to reach it with {' or '.join(tips)}; the trainer's own forecast after the "
                         "first backward (measured noise) supersedes this one")
    return lines
