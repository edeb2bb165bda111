"""``--activation-checkpointing none | selective | full`` on CPU: peak memory and step time, side by side.

Each mode runs in a fresh child process (its own heap): a random-weight LLaMA-shaped CAST student (every
decoder linear a :class:`~cast_llm.nn.ScaledLinear`, as ``cast-llm train`` builds it) with the trainer's own
:func:`~cast_llm.train.memory_options.enable_activation_checkpointing`, forward + CE loss + backward on one
micro-batch, ``zero_grad(set_to_none=True)``, repeated. After one warm-up step the process's peak resident
memory is reset (Linux ``clear_refs``), so the figure is what a step adds on top of what the process holds
between steps (weights, scales and the allocator's pages): the activations autograd keeps, the scaled
weights, and the gradients. The children run with ``MALLOC_MMAP_THRESHOLD_=131072`` (freed blocks from
128 KiB go back to the system: the resident set follows the live tensors; see plan-vs-measured.md). The
gradients of the three modes must be equal bit for bit (the recomputation repeats the forward exactly): the
script checks a digest of them.

    python benchmarks/recompute.py                         # SmolLM2's block, 8 layers, 1 × 1024 tokens, fp32
    python benchmarks/recompute.py --layers 4 --seq 256 --steps 2 --md /tmp/r.md

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


def child(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cast_llm.nn import wrap_scaling_
    from cast_llm.train.memory_options import enable_activation_checkpointing

    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=max(2048, args.seq), tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().train()
    wrap_scaling_(model, n_groups=2, m=4)
    enable_activation_checkpointing(model, args.child)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    autocast = args.precision == "bf16"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return loss

    step()  # warm-up: first-use allocations, lazily built state
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.grad.float().numpy().tobytes())
    model.zero_grad(set_to_none=True)
    base = _reset_peak()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return {"mode": args.child, "peak_growth": _status("VmHWM") - base, "base_rss": base,
            "step_s": statistics.median(times), "times": times, "grad_sha256": digest.hexdigest()[:16]}


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
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--md", default=str(ROOT / "docs" / "results" / "recompute-cpu.md"))
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "recompute-cpu.json"))
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import machine

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    load_before = _load()
    rows = []
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", mode], env=env,
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{mode:>9}: +{rows[-1]['peak_growth'] / 2**20:7.1f} MiB per step, {rows[-1]['step_s']:.2f} s/step",
              flush=True)
    load_after = _load()
    if len({r["grad_sha256"] for r in rows}) != 1:
        raise SystemExit(f"the modes' gradients differ: {[r['grad_sha256'] for r in rows]}")
    none = rows[0]
    command = "python benchmarks/recompute.py " + " ".join(a for a in sys.argv[1:])
    shape = (f"hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} heads ({args.kv_heads} KV), "
             f"{args.layers} layers, vocabulary {args.vocab}; micro-batch {args.batch} × {args.seq} tokens; "
             f"{args.precision}{' autocast' if args.precision == 'bf16' else ''}; {args.threads} thread(s)")
    lines = ["# Selective activation recomputation on CPU: memory and step time", "",
             f"`{command.strip()}` — {time.strftime('%Y-%m-%d')}", "",
             f"Machine: {machine()}.", f"Load average (1, 5, 15 min) before: {load_before}; after: {load_after}.", "",
             f"Model: a random-weight LLaMA CAST student (every decoder linear weight-scaled), {shape}. Median of "
             f"{args.steps} steps after a warm-up; the peak is the resident set a step adds over what the process "
             "holds between steps (benchmarks/recompute.py's docstring). The three modes' gradients are equal "
             f"bit for bit (digest {none['grad_sha256']}).", "",
             "| --activation-checkpointing | peak per step (MiB) | vs none | step (s) | vs none |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['peak_growth'] / 2**20:.1f} | {r['peak_growth'] / none['peak_growth']:.2f} "
                     f"| {r['step_s']:.2f} | {r['step_s'] / none['step_s']:.2f} |")
    lines += ["", "Step times are medians of a few steps on a machine shared with other jobs (the load above): "
              "their ratios, measured in one run, are the figure; the absolute seconds are not."]
    Path(args.md).write_text("\n".join(lines) + "\n")
    Path(args.json).write_text(json.dumps({"command": command.strip(), "machine": machine(), "load_before": load_before,
                                           "load_after": load_after, "shape": shape, "rows": rows}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
