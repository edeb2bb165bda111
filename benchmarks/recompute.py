"""``--activation-checkpointing none | selective | full`` on CPU: peak memory and step time, side by side.

The model: a random-weight LLaMA-shaped CAST student (every decoder linear a :class:`~cast_llm.nn.ScaledLinear`,
as ``cast-llm train`` builds it) with the trainer's own
:func:`~cast_llm.train.memory_options.enable_activation_checkpointing`; a step is forward + CE loss +
backward on one micro-batch (the trainer's chunked CE loss, no teacher), then ``zero_grad(set_to_none=True)``.

* Memory: each mode in a fresh child process (its own heap). After one warm-up step the process's peak
  resident memory is reset (Linux ``clear_refs``): the figure is what a step adds on top of what the
  process holds between steps (weights, scales, the allocator's pages) — the activations autograd keeps,
  the scaled weights, the logits, the gradients. Beside it, the plan's prediction of the same quantity
  (``cast-llm plan``'s peak less its persistent terms, :mod:`cast_llm.plan.memory`). The children run with
  ``MALLOC_MMAP_THRESHOLD_=131072`` (freed blocks from 128 KiB go back to the system: the resident set
  follows the live tensors; see plan-vs-measured.md). The gradients of the three modes must be equal bit
  for bit (the recomputation repeats the forward exactly): the script checks a digest of them.
* Time: one more child runs the three modes in turn, one step each, for ``--rounds`` rounds, on the same
  model (the mode switched between steps), and takes each mode's median: on a machine shared with other
  jobs the load drifts, and interleaving gives every mode the same drift.

    python benchmarks/recompute.py                         # SmolLM2's block, 8 layers, 1 × 1024 tokens, fp32
    python benchmarks/recompute.py --layers 2 --seq 128 --rounds 2 --md /tmp/r.md --json /tmp/r.json

Writes docs/results/recompute-cpu.md (--md) and .json (--json) with the command, the machine and its load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "selective", "full")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _model(args, mode: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cast_llm.nn import wrap_scaling_
    from cast_llm.train.memory_options import enable_activation_checkpointing

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=max(2048, args.seq), tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().train()
    wrap_scaling_(model, n_groups=2, m=4)
    enable_activation_checkpointing(model, mode)
    return model


def _step(model, ids, autocast: bool) -> None:
    """The trainer's step without a teacher: its chunked CE (``lm_loss`` at η = 0), not HF's loss."""
    import torch

    from cast_llm.distill import causal_kd_loss

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
        causal_kd_loss(logits, None, ids, eta=0.0, temperature=1.0, chunk_size=1024).loss.backward()


def _ids(args):
    import torch

    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))


def child_memory(args, mode: str) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    model, ids, autocast = _model(args, mode), _ids(args), args.precision == "bf16"
    _step(model, ids, autocast)  # warm-up: first-use allocations, lazily built state
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.grad.float().numpy().tobytes())
    model.zero_grad(set_to_none=True)
    base = _reset_peak()
    _step(model, ids, autocast)
    return {"mode": mode, "peak_growth": _status("VmHWM") - base, "grad_sha256": digest.hexdigest()[:16],
            "planned": _planned(args, model, mode)}


def _planned(args, model, mode: str) -> dict:
    """The plan's step peak (its peak less its persistent terms) for this model and micro-batch."""
    from cast_llm.plan import Setup, plan_memory, shape_of

    setup = Setup(device="cpu", world=1, strategy="single", precision=args.precision, batch_size=args.batch,
                  seq_len=args.seq, kd=False, scaling=True, activation_checkpointing=mode)
    plan = plan_memory(shape_of(model), setup)
    return {"step_peak": plan.peak - sum(plan.persistent.values()), "moment": plan.peak_moment,
            "activations": next(v for k, v in plan.step.items() if k.startswith("activations"))}


def child_time(args) -> dict:
    import torch

    from cast_llm.train.memory_options import (
        disable_activation_checkpointing,
        enable_activation_checkpointing,
    )

    torch.set_num_threads(args.threads)
    model, ids, autocast = _model(args, "none"), _ids(args), args.precision == "bf16"
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds + 1):  # round 0 warms every mode up
        for mode in MODES:
            disable_activation_checkpointing(model)
            enable_activation_checkpointing(model, mode)
            t0 = time.perf_counter()
            _step(model, ids, autocast)
            dt = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            if r:
                times[mode].append(dt)
    return {"times": times, "median": {m: statistics.median(t) for m, t in times.items()}}


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=576)  # SmolLM2-135M's block
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)  # smaller than SmolLM2's 49,152: the blocks dominate
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--md", default=str(ROOT / "docs" / "results" / "recompute-cpu.md"))
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "recompute-cpu.json"))
    ap.add_argument("--child", choices=(*MODES, "time"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child_time(args) if args.child == "time" else child_memory(args, args.child)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from _common import machine

    torch.set_num_threads(args.threads)  # as the children run (machine() reports it)

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    load_before = _load()

    def run(child: str) -> dict:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", child], env=env,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows = []
    for mode in MODES:
        rows.append(run(mode))
        print(f"{mode:>9}: +{rows[-1]['peak_growth'] / 2**20:7.1f} MiB per step "
              f"(planned {rows[-1]['planned']['step_peak'] / 2**20:.1f})", flush=True)
    timing = run("time")
    print("step time (s, medians):", timing["median"], flush=True)
    load_after = _load()
    if len({r["grad_sha256"] for r in rows}) != 1:
        raise SystemExit(f"the modes' gradients differ: {[r['grad_sha256'] for r in rows]}")
    none, t_none = rows[0], timing["median"]["none"]
    command = "python benchmarks/recompute.py " + " ".join(a for a in sys.argv[1:])
    shape = (f"hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} heads ({args.kv_heads} KV), "
             f"{args.layers} layers, vocabulary {args.vocab} (tied); micro-batch {args.batch} × {args.seq} tokens; "
             f"{args.precision}{' autocast' if args.precision == 'bf16' else ''}; {args.threads} thread(s)")
    lines = ["# Selective activation recomputation on CPU: memory and step time", "",
             f"`{command.strip()}` — {time.strftime('%Y-%m-%d')}", "",
             f"Machine: {machine()}. The machine was shared with other jobs (two experiment-queue workers) during "
             f"the run. Load average (1, 5, 15 min) before: {load_before}; after: {load_after}.", "",
             f"Model: a random-weight LLaMA CAST student (every decoder linear weight-scaled), {shape}. Memory: "
             "the resident set one step adds over what the process holds between steps, each mode in its own "
             "process, beside the plan's step peak (its peak less its persistent terms). Time: the median of "
             f"{args.rounds} steps per mode, the modes interleaved step by step in one process "
             "(benchmarks/recompute.py's docstring). The three modes' gradients are equal bit for bit "
             f"(digest {none['grad_sha256']}).", "",
             "| --activation-checkpointing | step peak (MiB) | vs none | planned (MiB) | measured / planned "
             "| step (s) | vs none |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = timing["median"][r["mode"]]
        planned = r["planned"]["step_peak"]
        lines.append(f"| {r['mode']} | {r['peak_growth'] / 2**20:.1f} | {r['peak_growth'] / none['peak_growth']:.2f} "
                     f"| {planned / 2**20:.1f} | {r['peak_growth'] / planned:.2f} | {t:.2f} | {t / t_none:.2f} |")
    lines += ["", "Each step time is a median over the rounds; the ratios to none within a round are the figure "
              "(every mode saw the same load drift); the absolute seconds belong to this loaded 2-CPU machine."]
    Path(args.md).write_text("\n".join(lines) + "\n")
    Path(args.json).write_text(json.dumps({"command": command.strip(), "machine": machine(), "load_before": load_before,
                                           "load_after": load_after, "shape": shape, "memory": rows,
                                           "time": timing}, indent=1) + "\n")
    print("\n".join(lines))

if __name__ == "__main__":
    main()
