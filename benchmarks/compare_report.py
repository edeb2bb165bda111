"""The report of ``compare_methods.py``: the Markdown table (the paper's Tables 5/6 for one model), the check
of the paper's ordering (method.md §8) and the bar chart."""

from __future__ import annotations

import datetime
import json
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The ordering method.md §8 asks to reproduce: CAST < SR-STE ≲ naive ≪ SparseGPT < Wanda < magnitude.
# (a, b, slack): ppl(a) < ppl(b) · slack; "≲" is read as "at most 5 % worse".
# "cast" stands for the best CAST row of the table (cast-best when present, else paper-exact CAST).
ORDER_CHECK = [("cast", "srste", 1.0), ("srste", "naive", 1.05), ("naive", "sparsegpt", 1.0),
               ("sparsegpt", "wanda", 1.0), ("wanda", "magnitude", 1.0)]
EXTRA_CHECK = [("cast", "ast", 1.0)]  # the paper also has CAST ahead of its predecessor
# What the default CAST configuration must beat at short budgets (a row each, both perplexities)
BEST_CHECK = ["naive", "naive-sgpt", "naive-kd-sgpt", "sparsegpt", "cast"]
# The strongest cheap recipe (SparseGPT + distillation, fixed mask): every CAST variant of the table is held
# against it, seed by seed, to show what learning the mask adds
FIXED_MASK_KD = "naive-kd-sgpt"
NOTES_MARKER = "<!-- notes: kept when the report is regenerated -->"
COLORS = {"dense": "#4d4d4d", "oneshot": "#e39b3b", "train": "#4a78b5", "cast": "#c0392b"}


def _num(v, fmt="{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def portable(text: str) -> str:
    """``text`` with this checkout's absolute path removed (commands and folders read from the repository root;
    a ``…/runs/compare/`` folder of another checkout becomes ``runs/compare/``),
    and an explicit ``--wikitext-file`` of the packaged WikiText-2 copy (what earlier versions passed) dropped:
    every run resolves that same copy by itself."""
    from cast_llm.eval.ppl import wikitext2_source

    text = text.replace(str(REPO) + "/", "")
    # a run made in another checkout of the repository (a worktree) names its runs folder absolutely
    text = re.sub(r"(?<![\w./-])/[^\s'\"]*?/(runs/compare/)", r"\1", text)
    try:
        packaged = str(wikitext2_source().path)
    except Exception:
        return text
    return text.replace(f" --wikitext-file {packaged}", "").replace(f" --wikitext-file {shlex.quote(packaged)}", "")


def wikitext2_description(tier: dict) -> str:
    from cast_llm.eval.ppl import wikitext2_source

    if tier.get("wikitext_file"):
        return portable(tier["wikitext_file"])
    return wikitext2_source().description


def _ppl(r: dict, split: str) -> str:
    rng = r.get(f"{split}_range")
    if not rng:
        return _num(r.get(split)) + ("<br>(1 seed)" if len(r.get("seeds", [])) == 1 else "")
    return f"{r[split]:.2f}<br>({rng[0]:.2f}–{rng[1]:.2f}, {len(r['seeds'])} seeds)"


def movement(r: dict) -> str:
    """'i_T / groups changed' of a row: whether its masks moved (— where the run did not record it)."""
    if r.get("kind") != "train":
        return "—"
    i, g = r.get("initial_flip_rate"), r.get("changed_groups")
    if str(r.get("mask", "")).startswith("fixed") and not (i or g):
        return "fixed"
    if i is None and g is None:
        return "—"

    def pct(v):  # two significant digits: 7.2e-6 reads 0.00072 %, not 0.000 %
        return "—" if v is None else f"{100 * v:.2g} %"

    return f"{pct(i)} / {pct(g)}"


def against_fixed_mask(rows: list[dict]) -> list[str]:
    """Every CAST row against naive + KD from SparseGPT (fixed mask): Δ per split, seed by seed, and the
    masks' movement, so that what the mask learning adds (or costs) is read off one list."""
    by = {r["key"]: r for r in rows if r.get("status") == "ok"}
    base = by.get(FIXED_MASK_KD)
    if base is None:
        return []
    out = []
    for r in rows:
        if r is base or r.get("status") != "ok" or not r["key"].startswith("cast"):
            continue
        parts = []
        for split, name in (("heldout", "held-out"), ("wikitext2", "WikiText-2")):
            a, b = r[split], base[split]
            parts.append(f"{name} {'✓' if a < b else '✗'} {a:.2f} vs {b:.2f} ({(a / b - 1) * 100:+.1f} %)"
                         f"{_paired(r, base, split)}")
        out.append(f"- {r['label']}: " + "; ".join(parts) + f"; masks moved (i_T / groups changed): {movement(r)}")
    return out


def write_json(rows: list[dict], meta: dict, path: Path) -> Path:
    """The table as data: per row its name, label, every seed's run (held-out, WikiText-2, S_T, mask movement,
    command) and the mean and range — what a script checks, and what a fresh checkout regenerates from."""
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return portable(x) if isinstance(x, str) and "/" in x else x

    out_rows = []
    for r in rows:
        seeds = r.get("seeds") or [r]
        row = {"name": r["key"], "label": r.get("label"), "status": r.get("status"), "kind": r.get("kind"),
               "kd": r.get("kd"), "lr": r.get("lr"), "tokens": r.get("tokens"),
               "seeds": [clean({k: v for k, v in x.items() if k != "seeds"}) for x in seeds]}
        for split in ("heldout", "wikitext2"):
            row[split] = r.get(split)
            row[f"{split}_range"] = r.get(f"{split}_range")
        for key in ("sparse_weight_ratio", "initial_flip_rate", "changed_groups", "flip_rate_mean",
                    "flipped_fraction"):
            row[key] = r.get(key)
        out_rows.append(row)
    doc = {"generated": datetime.date.today().isoformat(), "command": meta.get("command"),
           "regenerate": meta.get("regenerate"), "tier": meta.get("tier"), "model": meta.get("model"),
           "budget": meta.get("budget"), "settings": clean(meta.get("settings")), "wikitext2": meta.get("wikitext2"),
           "rows": out_rows}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def best_check(rows: list[dict]) -> list[str]:
    """Lines saying, per split, whether the best CAST row beats each row of :data:`BEST_CHECK`, and by how much."""
    by = {r["key"]: r for r in rows if r.get("status") == "ok"}
    best = by.get("cast-best")
    if best is None:
        return []
    out = []
    for split, name in (("heldout", "held-out"), ("wikitext2", "WikiText-2")):
        for key in BEST_CHECK:
            if key not in by:
                continue
            a, b = best[split], by[key][split]
            out.append(f"- {'✓' if a < b else '✗'} {name}: {best['label']} {a:.2f} vs {by[key]['label']} {b:.2f} "
                       f"({(a / b - 1) * 100:+.1f} %){_paired(best, by[key], split)}")
    return out


def _paired(a: dict, b: dict, split: str) -> str:
    """'; seed by seed 2/2 (...)' when both rows ran the same two or more seeds (same data order: paired); the
    one seed they share when only one is; a warning when they share none."""
    sa = {r["seed"]: r[split] for r in a.get("seeds", []) if r.get("status") == "ok"}
    sb = {r["seed"]: r[split] for r in b.get("seeds", []) if r.get("status") == "ok"}
    common = sorted(set(sa) & set(sb))
    if not common and sa and sb:  # the means come from different data orders: say so, they are not paired
        return f"; no seed in common (seeds {', '.join(map(str, sorted(sa)))} against " \
               f"{', '.join(map(str, sorted(sb)))}): not paired"
    if len(common) == 1 and (len(sa) > 1 or len(sb) > 1):
        x = common[0]
        return f"; same seed alone (seed {x}): {sa[x]:.2f} vs {sb[x]:.2f}"
    if len(common) < 2:
        return ""
    wins = sum(sa[x] < sb[x] for x in common)
    pairs = ", ".join(f"seed {x}: {sa[x]:.2f} vs {sb[x]:.2f}" for x in common)
    return f"; seed by seed {wins}/{len(common)} ({pairs})"


def _lr_note(s: dict) -> str:
    adams = s.get("adams", {}).get("lr")
    own = {k: v["lr"] for k, v in s.get("row_lr", {}).items() if "lr" in v and v["lr"] != s["lr"]}
    if adams is not None and adams != s["lr"]:
        note = (f"{s['lr']:g} for the baselines, {adams:g} for the runs where AdamS must decay pruned weights to "
                "~0 during training: lr·T/2 has to exceed the typical pruned |w|, method.md §2")
    else:
        note = f"{s['lr']:g} " + ("unless the row has its own" if own else "for every method")
    if own:  # rows that start from a one-shot model have their own measured lr
        note += "; " + ", ".join(f"{k} {v:g}" for k, v in sorted(own.items())) + " (each row at its measured best lr)"
    return note


def ordering(rows: list[dict], split: str) -> list[tuple[str, str, bool | None, str]]:
    """``(a, b, holds, detail)`` for every pair of :data:`ORDER_CHECK` + :data:`EXTRA_CHECK` with both rows."""
    by = {r["key"]: r for r in rows if r.get("status") == "ok"}
    if "cast-best" in by:
        by["cast"] = by["cast-best"]
    out = []
    for a, b, slack in ORDER_CHECK + EXTRA_CHECK:
        if a not in by or b not in by:
            continue
        pa, pb = by[a][split], by[b][split]
        sign = "≲" if slack > 1 else "<"
        out.append((a, b, pa < pb * slack, f"{by[a]['label']} {pa:.2f} {sign} {by[b]['label']} {pb:.2f}"))
    return out


def write_report(rows: list[dict], meta: dict, path: Path, png: Path | None) -> Path:
    s = meta["settings"]
    lines = [
        f"# 2:4 methods compared on {meta['model']} at equal compute ({meta['tier']} tier)",
        "",
        f"Generated {datetime.date.today().isoformat()} by `{meta['command']}` "
        f"({meta['total_wall_s']:.0f} s in all, runs in `{meta['runs_dir']}`)"
        + ("; rows finished by earlier invocations were reused (each row's own command is listed under "
           "Commands, its wall time in the table). The one command that runs every row of this table from "
           f"scratch: `{meta['regenerate']}`." if ("--only" in meta["command"] or "--report-only" in meta["command"]) and meta.get("regenerate")
           else "."),
        "",
        f"Model `{meta['model']}`, data `{meta['data']}`, training sequences of {s['seq_len']} tokens, "
        f"{s['batch_size'] * s['grad_accum']} sequences per step, {s.get('lr_schedule', 'cosine')} schedule after a "
        f"2 % warm-up, peak lr as in the table ({_lr_note(s)}), AdamS λ {s['l1_decay']:g}, SR-STE/AST λ_W 2e-4 "
        f"unless the row says otherwise, KD η {s['eta']:.2f}, masks "
        f"recomputed every {s['mask_interval']} "
        f"steps, device {s['device']}, precision {s['precision']}. **Equal compute**: runs without a teacher get "
        f"{meta['budget']:,} tokens, runs with KD get 3/4 of that (KD costs ~4/3, method.md §4). One-shot "
        f"methods calibrate on {s['calib_samples']} training sequences of {s['seq_len']} tokens. Perplexity: "
        f"held-out = {s['val_sequences']} held-out sequences of the training data; WikiText-2 = raw test split "
        f"({meta.get('wikitext2', 'the packaged copy')}), "
        f"windows of {s['eval_seq_len']}, {s['wikitext_windows'] or 'all'} windows. Lower is better.",
        "",
        "Rows with several seeds show the mean and, below it, the range. S_T: the sparse-weight ratio just "
        "before the final prune (1 = nothing left to cut; method.md §7). Masks moved: the final initial-flip "
        "rate i_T (share of mask entries that differ from the run's first mask) / the share of 2:4 groups whose "
        "kept pair changed. tok/s: median training throughput. The same rows as data: "
        f"`{path.with_suffix('.json').name}`.",
        "",
        "| Method | Type | Weight update | Mask | KD | lr | Training tokens | Held-out ppl | WikiText-2 ppl "
        "| S_T | Masks moved | tok/s | Wall time |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    earlier = set()
    for r in rows:
        kind = {"dense": "—", "oneshot": "one-shot", "train": "training"}[r["kind"]]
        tokens = f"{r['tokens']:,}" if r["kind"] == "train" and r.get("tokens") else "—"
        head = (f"| {r['label']} | {kind} | {r['weight_update']} | {r['mask']} | {'yes' if r['kd'] else 'no'} "
                f"| {_num(r.get('lr'), '{:g}')} | {tokens} ")
        if r.get("status") != "ok":
            lines.append(head + "| failed | failed | — | — | — | — |")
            continue
        src = {x.get("recovered_from") or x.get("recorded_in") for x in (r.get("seeds") or [r])} - {None}
        mark = ""
        if src:
            earlier |= src
            mark = " †"
        lines.append(head + f"| {_ppl(r, 'heldout')}{mark} | {_ppl(r, 'wikitext2')}{mark} "
                     f"| {_num(r.get('sparse_weight_ratio'), '{:.3f}')} | {movement(r)} "
                     f"| {_num(r.get('tokens_per_s'), '{:.0f}')} | {r['wall_s']:.0f} s |")
    if earlier:
        lines += ["", "† run by an earlier invocation whose run folder is not here; taken from "
                  + "; ".join(f"`{x}`" for x in sorted(earlier))
                  + " (the same command with `--fresh` runs it again; runs are deterministic per seed and thread count; another thread count moves the last digits)."]
    if png is not None:
        lines += ["", f"![perplexities]({png.name})"]
    lines += ["", "## The paper's ordering", "",
              "method.md §8: CAST < SR-STE ≲ naive retraining ≪ SparseGPT < Wanda < magnitude "
              "(≲: at most 5 % worse), and CAST < AST.", ""]
    for split, name in (("wikitext2", "WikiText-2"), ("heldout", "held-out")):
        checks = ordering(rows, split)
        held = sum(1 for c in checks if c[2])
        if not checks:
            lines.append(f"- **{name}**: no pair of the ordering has both of its rows in this table.")
            continue
        lines.append(f"- **{name}**: {held}/{len(checks)} pairs hold.")
        lines += [f"  - {'✓' if ok else '✗'} {detail}" for _, _, ok, detail in checks]
    checks = best_check(rows)
    if checks:
        lines += ["", "## The default CAST configuration against the strongest alternatives", ""] + checks
    checks = against_fixed_mask(rows)
    if checks:
        lines += ["", "## What learning the mask adds: every CAST row against naive + KD from SparseGPT (fixed mask)",
                  ""] + checks
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        lines += ["", "## Failed runs", ""] + [f"- {r['label']}: {r.get('error', '')}" for r in failed]
    lines += ["", "## Commands", "", "Every row, as run (from the repository root):", ""]
    lines += [f"- {r['label']}: `{portable(r.get('command', ''))}`" for r in rows]
    # hand-written discussion below the marker survives a regeneration (e.g. --only adding rows)
    old = path.read_text() if path.is_file() else ""
    notes = old[old.index(NOTES_MARKER):] if NOTES_MARKER in old else ""
    path.write_text("\n".join(lines) + "\n" + ("\n" + notes if notes else ""))
    return path


def write_chart(rows: list[dict], meta: dict, path: Path) -> Path | None:
    """Horizontal bars (log scale) of both perplexities per method; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return None
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return None
    labels = [r["label"] for r in ok]
    colors = [COLORS["cast"] if r["key"].startswith("cast") else COLORS[r["kind"]] for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(ok) + 1.8), sharey=True)
    for ax, (split, name) in zip(axes, (("heldout", "held-out"), ("wikitext2", "WikiText-2"))):
        vals = [r[split] for r in ok]
        y = range(len(ok))
        ax.barh(list(y), vals, color=colors)
        for yi, r in zip(y, ok):  # rows with several seeds: their range as a whisker
            if r.get(f"{split}_range"):
                lo, hi = r[f"{split}_range"]
                ax.errorbar(r[split], yi, xerr=[[r[split] - lo], [hi - r[split]]], color="black", capsize=3,
                            linewidth=1)
        ax.set_xscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 300, not 3×10²
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
        ax.tick_params(axis="x", which="minor", labelsize=8)
        ax.set_xlim(min(vals) / 1.3, max(vals) * 4)  # room on the right for the value labels
        for yi, v, r in zip(y, vals, ok):
            ax.text(max(v, r.get(f"{split}_range", [v, v])[1]) * 1.06, yi, f"{v:.1f}", va="center", fontsize=9)
        dense = next((r[split] for r in ok if r["kind"] == "dense"), None)
        if dense is not None:
            ax.axvline(dense, color=COLORS["dense"], linestyle="--", linewidth=1)
        ax.set_xlabel(f"{name} perplexity (log scale, lower is better)")
        ax.grid(axis="x", which="both", alpha=0.2)
    axes[0].set_yticks(list(range(len(ok))))
    axes[0].set_yticklabels(labels)
    axes[0].invert_yaxis()  # once: the axes share y, so the first row (dense) is on top in both
    legend = [Patch(color=COLORS[k], label=name) for k, name in (("dense", "dense"), ("oneshot", "one-shot"),
                                                                  ("train", "retraining baselines"),
                                                                  ("cast", "CAST and its ablations"))]
    fig.legend(handles=legend, loc="lower center", ncol=4, frameon=False, fontsize=9)
    seeded = any(r.get("heldout_range") for r in ok)
    fig.suptitle(f"2:4 sparse {Path(meta['model']).name}: {meta['budget']:,} training tokens "
                 f"(KD runs 3/4 of it), {meta['tier']} tier"
                 + ("; bars: mean over seeds, whiskers: their range" if seeded else ""), fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
