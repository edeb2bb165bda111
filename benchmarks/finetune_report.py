"""Collect `cast-llm finetune` runs into the markdown table of docs/results/finetune-smollm2.md.

    python benchmarks/finetune_report.py RUN_DIR [RUN_DIR ...] \
        [--reference-model smollm2-135m --reference-data benchmarks/data/finetune/facts-val.jsonl]

Each RUN_DIR's ``results.json`` gives one row: held-out metrics before and after, the exported model's
target sparsity, whether it is exactly N:M, and how many target entries changed between zero and non-zero.
``--reference-*`` also scores an un-fine-tuned model (e.g. the dense original) on a prompt/completion file
with the same held-out loss and greedy exact match, as a point of comparison.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cast_llm.io import RunDir


def _pct(v) -> str:
    return "–" if v is None else f"{v:.1%}"


def _num(v) -> str:
    return "–" if v is None else f"{v:.3f}"


def row(run: Path) -> str:
    r = json.loads(RunDir(run).results.read_text())
    cfg = json.loads(RunDir(run).marker.read_text())["config"]
    before, after, sp = r.get("before", {}), r.get("after", {}), r["sparsity"]
    metric = "accuracy" if r["task"] == "classification" else "exact_match"
    lr = cfg["lr"]
    extra = "" if r["mode"] != "lora" else f" r={cfg['lora_r']}" + ("" if cfg["lora_masked_forward"] else ", plain fwd")
    unmerged = r.get("after_unmerged")
    after_cell = f"{_pct(after.get(metric))}" + (f" (unmerged {_pct(unmerged.get(metric))})" if unmerged else "")
    loss_cell = f"{_num(after.get('loss'))}" + (f" (unmerged {_num(unmerged.get('loss'))})" if unmerged else "")
    return (f"| {run.name} | {r['mode']}{extra} | {lr:g} | {r['steps']} | {r['trainable_parameters'] / 1e6:.1f}M | "
            f"{_num(before.get('loss'))} → {loss_cell} | {_pct(before.get(metric))} → {after_cell} | "
            f"{sp['after']['target_sparsity']:.2%} | {'yes' if sp['after']['is_nm'] else 'no'} | "
            f"{sp['mask_changed_entries']:,} | {r['wall_time_s'] / 60:.1f} |")


def reference(model_name: str, data: Path, batch_size: int = 8) -> str:
    import torch

    from cast_llm.finetune.data import instruction_examples, read_records
    from cast_llm.finetune.evaluate import evaluate, exact_match
    from cast_llm.models import load_model, load_tokenizer

    tok = load_tokenizer(model_name)
    model = load_model(model_name)
    examples, _, _ = instruction_examples(read_records(data), tok, 64, str(data))
    with torch.no_grad():
        loss = evaluate(model, examples, task="causal-lm", batch_size=batch_size, pad_id=tok.pad_token_id, device="cpu")
        em = exact_match(model, tok, examples, max_new_tokens=32, batch_size=batch_size, device="cpu")
    return (f"| reference: {model_name}, not fine-tuned | – | – | 0 | 0 | {_num(loss['loss'])} | "
            f"{_pct(em['exact_match'])} | – | – | – | – |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--reference-model")
    p.add_argument("--reference-data", type=Path)
    a = p.parse_args()
    print("| run | mode | lr | steps | trainable | held-out loss before → after | accuracy / exact match "
          "before → after | target sparsity after | exactly 2:4 | mask entries changed | minutes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in a.runs:
        print(row(run))
    if a.reference_model:
        print(reference(a.reference_model, a.reference_data))


if __name__ == "__main__":
    main()
