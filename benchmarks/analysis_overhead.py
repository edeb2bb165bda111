"""Per-step cost of the mask-dynamics observers (cast_llm.analysis) next to one CAST training step.

    python benchmarks/analysis_overhead.py [--layers 30] [--batch 4] [--seq 256] [--reps 3]

Builds a randomly initialised model of SmolLM2-135M's shape (LLaMA, 30 blocks, hidden 576, MLP 1536;
no download), wraps it for CAST (weight scaling, AdamS with its default mask storage), takes one real
training step (forward + backward + AdamS) and times, side by side in the same process:

* the training step itself (the reference),
* ``current_masks`` (the masks of every target: paid once per step by whichever observer reads them first;
  MaskStats already pays it on every log step),
* every observer's ``on_step`` on a step where it does nothing, on a check / log step, and
  RatioHistograms on one of its chosen steps,

and prints the amortised overhead per step for the default settings (log_every = mask_interval = 10,
three histogram steps in a run of --total-steps). Results are recorded in docs/analysis.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def timed(fn, reps: int) -> float:
    """Median CPU time of ``fn()`` in ms over ``reps`` calls (after one warm-up call).

    CPU time of this process, not wall time: on a machine shared with other jobs the wall time of every
    call stretches by whatever the neighbours take, while the CPU time (single-threaded by default) is
    what the work costs. Both the training step and the observers are timed the same way.
    """
    fn()
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30, help="decoder blocks (SmolLM2-135M: 30)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--total-steps", type=int, default=1000, help="run length for amortising the histograms")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU time is summed over them)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import LlamaConfig, LlamaForCausalLM

    from cast_llm.analysis.observers import LayerMaskStats, RatioHistograms, WeightTracking
    from cast_llm.train.config import TrainConfig
    from cast_llm.train.methods.cast import CastMethod
    from cast_llm.train.observers import MaskStats, StepContext

    torch.manual_seed(0)
    cfg_model = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                            num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                            max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg_model)
    tcfg = TrainConfig(output_dir="unused", max_steps=args.total_steps, lr=1e-4, l1_decay=1e-6, mask_interval=10,
                       paper_exact=True, progress=False)
    method = CastMethod()
    method.prepare_model(model, tcfg)
    opt = method.build_optimizer(model, tcfg, args.total_steps)
    batch = torch.randint(0, 49152, (args.batch, args.seq))

    def train_step():
        loss = torch.nn.functional.cross_entropy(model(input_ids=batch).logits[:, :-1].flatten(0, 1),
                                                 batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_step = timed(train_step, max(2, args.reps // 2))
    masks = method.current_masks(model, opt)
    n_entries = sum(m.numel() for m in masks.values())
    t_masks = timed(lambda: method.current_masks(model, opt), args.reps)

    run_dir = Path(tempfile.mkdtemp(prefix="analysis-bench-"))

    def ctx(step, is_log):
        return StepContext(step=step, total_steps=args.total_steps, model=model, masks_fn=lambda: masks,
                           is_log_step=is_log, run_dir=run_dir, is_main=True, cfg=tcfg)

    rows = []
    for ob in (MaskStats(), LayerMaskStats(), WeightTracking(10_000, seed=0)):
        ob.on_step(ctx(1, False))  # first step: snapshots / sample chosen
        quiet = timed(lambda ob=ob: ob.on_step(ctx(3, False)), args.reps)
        busy = timed(lambda ob=ob: ob.on_step(ctx(10, True)), args.reps)
        rows.append((type(ob).__name__, quiet, busy, quiet * 0.9 + busy * 0.1))
    hist = RatioHistograms(str(args.total_steps), m=4)
    hist.on_step(ctx(1, False))

    def one_hist():
        hist.hists.clear()
        hist.on_step(ctx(args.total_steps, False))

    t_hist = timed(one_hist, max(2, args.reps // 2))
    rows.append(("RatioHistograms", 0.0, t_hist, 3 * t_hist / args.total_steps))

    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {len(masks)} targets, "
          f"{n_entries / 1e6:.1f}M mask entries; threads {torch.get_num_threads()}")
    print(f"training step (batch {args.batch} x {args.seq}, fwd+bwd+AdamS): {t_step:.1f} ms CPU time")
    print(f"current_masks (shared by all observers of a step): {t_masks:.1f} ms\n")
    print("| observer | quiet step (ms) | check/log/hist step (ms) | amortised per step (ms) | % of a train step |")
    print("|---|---:|---:|---:|---:|")
    for name, quiet, busy, amort in rows:
        print(f"| {name} | {quiet:.3f} | {busy:.1f} | {amort:.2f} | {100 * amort / t_step:.2f} % |")
    ours = sum(r[3] for r in rows[1:])
    print(f"\nnew observers together (LayerMaskStats + WeightTracking + RatioHistograms): {ours:.2f} ms/step = "
          f"{100 * ours / t_step:.2f} % of a training step (log_every = mask_interval = 10, 3 histograms "
          f"in {args.total_steps} steps; the masks of a log step are read once, for all observers)")


if __name__ == "__main__":
    main()
