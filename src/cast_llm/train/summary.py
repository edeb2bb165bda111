"""The end of a training run in words: the summary printed on the last screen, and its one-line reading.

Pure functions of a run's ``results.json`` (and config), shared by the trainer and ``cast-llm report``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cast_llm.io import RunDir

__all__ = ["options_used", "summary_table", "reading", "mask_movement", "movement_line"]

# Below this share of changed N:M groups a run's mask is called "not moved": it is the starting mask trained
# with (the paper's runs end with 3.4-16 % of the entries flipped, method.md §5)
MOVED_GROUPS = 1e-3


def options_used(cfg) -> str:
    """The method and the options that made this run what it is, in one line (for the summary and README)."""
    if cfg.method != "cast":
        return (f"--method {cfg.method}" + (" with KD" if cfg.use_kd else "")
                + (" and weight scaling" if cfg.use_scaling else "")
                + (f", initial mask from {cfg.mask_file}" if cfg.mask_file else ""))
    if cfg.mask_learner != "adams":
        return f"CAST with the {cfg.mask_learner} mask learner (ablation)"
    parts = ["AdamS", "weight scaling" if cfg.use_scaling else "no weight scaling",
             f"KD η {cfg.eta:.2f}" if cfg.use_kd else "no KD", f"{cfg.lr_schedule} lr {cfg.lr:g}"]
    if cfg.paper_exact:
        return "CAST as the paper defines it (" + ", ".join(parts) + ")"
    extra = []
    if cfg.use_warm_start:
        extra.append(f"warm start from one-shot {cfg.effective_init_mask}")
    if cfg.effective_repair_fraction:
        extra.append(f"masked repair for the last {cfg.effective_repair_fraction:.0%} of the steps")
    extra.append(f"{cfg.effective_final_prune} final prune")
    return "CAST (" + ", ".join(parts) + ") + " + ", ".join(extra)


def summary_table(results: dict[str, Any]) -> str:
    """The last screen of a run: how good the sparse model is against what, is it exactly N:M, where it is,
    where the report is, and what to do next."""
    ppl = results["perplexity"]
    pattern = results.get("pattern", "")
    oneshot = {"sparsegpt": "SparseGPT", "wanda": "Wanda"}.get(results.get("oneshot_method"),
                                                                 results.get("oneshot_method"))
    rows = [("dense", "dense (the original)", "the quality to approach"),
            ("oneshot", f"one-shot {oneshot} {pattern}", "pruning without training (the start)"),
            ("magnitude", f"one-shot magnitude {pattern}", "pruning without training"),
            ("sparse", f"{results.get('method', '')} {pattern} (this run)", "the exported model")]
    head = f"{'model':<34} {'test ppl':>13} {'WikiText-2 ppl':>15}"
    lines = ["", head, "-" * len(head)]
    for key, label, what in rows:
        h, w = ppl["heldout"].get(key), ppl["wikitext2"].get(key)
        if h is None and w is None:
            continue
        lines.append(f"{label:<34} {_num(h):>13} {_num(w):>15}   {what}")
    wl = results.get("eval_seq_len")
    nwin, total = results.get("wikitext_windows"), results.get("wikitext_windows_total")
    scope = f"{nwin} of {total} windows" if nwin != total else f"all {total} windows"
    val = ppl.get("validation", {}).get("sparse")
    digest = (results.get("data_split") or {}).get("sha256")
    where = f"held-out documents of the corpus (split {digest[:12]})" if digest else "held-out documents of the corpus"
    val_part = f"; validation ppl {val:.2f}" if val is not None else ""
    lines.append(f"(test: {results.get('heldout_sequences')} sequences × {results.get('seq_len')} tokens of {where}"
                 f"{val_part}; WikiText-2: {scope} × {wl} tokens = {(nwin or 0) * (wl or 0):,} tokens; "
                 f"{results.get('tokens_trained'):,} training tokens, {results.get('wall_time_s')} s)")
    line = reading(results)
    if line:
        lines.append(line)
    nm = results.get("nm_check")
    if nm:
        lines.append(f"{nm['pattern']} check: all {nm['targets']} target layers exactly {nm['pattern']} "
                     "(verified before the model was written)")
    pruned = results.get("decay", {}).get("final_prune")
    if pruned:
        lines.append(f"decay: sparse-weight ratio S_t {pruned['sparse_weight_ratio']:.4f} at the final prune "
                     f"(step {pruned['step']}, {pruned['how']}): it removed {pruned['removed_fraction']:.2%} of the "
                     "target weights' L1 mass")
    if results.get("options"):
        lines.append(f"options: {results['options']}")
    for t in results.get("threads_resumed") or []:
        lines.append(f"threads: resumed at step {t['step']} with {t['used']} CPU threads, not the {t['recorded']} the "
                     "run computed with before: not bitwise the uninterrupted run (--threads 0 reuses its choice)")
    moved = movement_line(results)
    if moved:
        lines.append(moved)
    if results.get("decode_payoff"):
        lines.append(format_payoff(results["decode_payoff"]))
    out = results.get("output_dir")
    lines.append(f"model:   {out}   (transformers: AutoModelForCausalLM.from_pretrained('{out}'))")
    if results.get("report"):
        lines.append(f"report:  {results['report']}")
    lines += [f"next:    cast-llm eval ppl --model {out}   # WikiText-2, every window (the full protocol)",
              f"         cast-llm generate --model {out} --prompt \"The history of\"   # text through the 2:4 layers, tokens/s",
              f"         cast-llm export {out} --format compressed --dtype bf16 --output-dir {out}-c   # 2:4 on CPU and GPU",
              f"         cast-llm quantize {out} --method awq --bits 4 --output-dir {out}-w4",
              f"         cast-llm finetune {out} --mode lora --data train.jsonl --output-dir {out}-ft"]
    return "\n".join(lines)


def mask_movement(run_dir: str | Path) -> dict[str, float | None]:
    """Whether a run's masks moved, from its own files: the final initial-flip rate i_T (entries that differ from
    the first mask), the share of N:M groups whose kept set changed, the mean flip rate per log record, and the
    share of the tracked weight sample that flipped at least once (method.md §7). None where not logged."""
    run_dir = Path(run_dir)
    records = []
    metrics = RunDir(run_dir).metrics
    if metrics.is_file():
        records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]

    def last(key):
        vals = [r[key] for r in records if r.get(key) is not None]
        return vals[-1] if vals else None

    flips = [r["flip_rate"] for r in records if r.get("flip_rate") is not None]
    out = {"initial_flip_rate": last("initial_flip_rate"), "changed_groups": last("changed_groups"),
           "flip_rate_mean": sum(flips) / len(flips) if flips else None, "flipped_fraction": None}
    dyn = RunDir(run_dir).dynamics
    if dyn.is_file():
        try:
            tracking = json.loads(dyn.read_text()).get("weight_tracking") or {}
        except json.JSONDecodeError:
            tracking = {}
        out["flipped_fraction"] = tracking.get("flipped_fraction")
    return out


def movement_line(results: dict[str, Any]) -> str | None:
    """One line that says whether the masks moved, and so what the run actually was."""
    m = results.get("masks") or {}
    i_t, groups = m.get("initial_flip_rate"), m.get("changed_groups")
    if i_t is None and groups is None:
        return None
    start = {"sparsegpt": "SparseGPT's", "wanda": "Wanda's", "file": "the mask file's"}.get(
        results.get("oneshot_method") or results.get("init_mask"), "the first (Eq. 6) one")
    facts = f"{100 * (i_t or 0):.4f} % of the mask entries differ from the first mask"
    if groups is not None:
        facts += f", {100 * groups:.3f} % of the {results.get('pattern', 'N:M')} groups changed"
    if m.get("flipped_fraction") is not None:
        facts += f", {100 * m['flipped_fraction']:.2f} % of the tracked weights flipped at least once"
    if (groups if groups is not None else i_t) < MOVED_GROUPS:
        verdict = (f"the mask stayed {start}: what this run learned is the weights under a fixed mask, "
                   "not the mask")
    else:
        verdict = "the mask was learned during training"
    return f"masks: {facts} — {verdict}"


def reading(results: dict[str, Any]) -> str | None:
    """One line that says what the figures mean."""
    ppl = results["perplexity"]["wikitext2"]
    split = "WikiText-2"
    if ppl.get("sparse") is None:
        ppl, split = results["perplexity"]["heldout"], "test"
    sparse, dense = ppl.get("sparse"), ppl.get("dense")
    base_key = "oneshot" if ppl.get("oneshot") is not None else "magnitude"
    base = ppl.get(base_key)
    if sparse is None:
        return None
    parts = []
    if base is not None:
        name = "the one-shot start" if base_key == "oneshot" else "one-shot magnitude pruning"
        parts.append(f"{base / sparse:.1f}× lower {split} perplexity than {name}" if sparse < base
                     else f"not better than {name} ({sparse:.1f} vs {base:.1f})")
    if dense is not None:
        parts.append(f"{sparse / dense:.2f}× the dense model's perplexity")
    sentences = []
    if parts:
        sentences.append("the sparse model has " + "; ".join(parts) + (
            " (a longer run closes more of the gap: docs/training.md, 'Budgets')" if dense is not None else ""))
    pruned = results.get("decay", {}).get("final_prune")
    if pruned and pruned["removed_fraction"] > 0.01:
        sentences.append(f"the decay had not finished (S_t {pruned['sparse_weight_ratio']:.3f}): a longer run, or "
                         "the short-budget options, would lose less at the final prune")
    return ("reading: " + "; ".join(sentences)) if sentences else None


def _num(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def format_payoff(p: dict) -> str:
    """The ``speed:`` line of a run's last screen, from :func:`cast_llm.inference.payoff`'s result."""
    d, s = p["dense"], p["sparse24"]
    mib = 1 / 2**20
    return (f"speed:   decode {s['decode_tokens_per_s']:.1f} tokens/s 2:4 against {d['decode_tokens_per_s']:.1f} dense "
            f"(bf16, {s['threads']} thread{'s' if s['threads'] != 1 else ''}, this CPU): {p['decode_ratio']:.2f}x; resident memory "
            f"{s['resident_bytes'] * mib:.0f} MiB against {d['resident_bytes'] * mib:.0f} MiB "
            f"({p['resident_ratio']:.2f}x) — measured now, `cast-llm generate --model <this folder> --prompt ...`")
