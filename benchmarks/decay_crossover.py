"""Where the paper's own algorithm pays: the budget at which paper-exact CAST overtakes one-shot SparseGPT and
SparseGPT + KD (fixed mask), predicted from the decay forecast (method.md §10) and checked against runs.

Paper-exact CAST starts from the dense model and ends with a hard prune that removes whatever L1 mass the
decay has not yet taken, a share ``1 − S_T``. The decay forecast (``cast_llm.optim.forecast``) predicts ``S_T``
before a run, from the first gradient and the lr schedule, for any budget. The prediction of the perplexity
is a two-parameter model fitted to the paper-exact runs already measured (the committed ``compare-*.json``)::

    ln ppl_paper(B) = a + c · (1 − S_T(B))             (the prune's cost grows with the mass it removes)

It assumes the run's cost is its prune: the training itself gains nothing beyond the measured budgets — the
model is therefore late, not early, about the crossover (a longer run also trains the kept weights). The
alternatives are fitted from their own runs: one-shot SparseGPT is a constant; SparseGPT + KD follows
``ln ppl = A + B·D^−β`` (the token scaling law of method.md §7, β = 0.2849), fitted to its runs at the
measured budgets. The crossover is the smallest budget of the grid at which the prediction is lower.

    python benchmarks/decay_crossover.py                      # CPU tier settings, SmolLM2-135M
    python benchmarks/decay_crossover.py --verify 384k        # after a paper-exact run at 384k: prediction vs run

Writes ``docs/results/decay-crossover.md`` (+ ``.json``, ``.png``). The forecast needs one forward and backward
of the model with its teacher (~20 s on 2 CPU cores); each budget's forecast ~1 s.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_methods import TIERS, budget_name  # noqa: E402

GRID = ["48k", "96k", "192k", "384k", "768k", "1.5M", "3M", "6M", "12M", "24M", "48M"]
SPLITS = (("heldout", "test"), ("wikitext2", "WikiText-2"))  # "heldout": the test split (its key in the rows)


def forecast_curve(budgets: list[int], tier: dict, seed: int = 0) -> list[dict]:
    """S_T forecast by AdamS for paper-exact CAST at each budget (KD runs get 3/4 of the tokens)."""
    import torch

    from cast_llm.data import prepare, steps_for_tokens
    from cast_llm.models import load_model, load_tokenizer
    from cast_llm.optim.forecast import decay_state, forecast_from_layers
    from cast_llm.optim.schedule import TRAIN_WARMUP, schedule_lrs
    from cast_llm.train.config import TrainConfig
    from cast_llm.train.methods import get_method
    from cast_llm.train.trainer import lm_loss

    cfg = TrainConfig(output_dir="unused", model=tier["model"], data=tier["data"], method="cast", paper_exact=True,
                      tokens=budgets[0] * 3 // 4, seq_len=tier["seq_len"], batch_size=tier["batch_size"],
                      grad_accum=tier["grad_accum"], lr=tier["lr"], l1_decay=tier["l1_decay"], eta=tier["eta"],
                      lr_schedule=tier["lr_schedule"], mask_interval=tier["mask_interval"], seed=seed)
    cfg.validate()
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, dtype=torch.float32)
    data = prepare(cfg.data, tok, cfg.seq_len, train_sequences=cfg.batch_size, calib_samples=cfg.calib_samples)
    teacher = copy.deepcopy(model).eval().requires_grad_(False)
    method = get_method("cast")
    method.prepare_model(model, cfg, data=data)
    per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
    first = steps_for_tokens(budgets[0] * 3 // 4, per_step)
    opt = method.build_optimizer(model, cfg, first)
    batch = data.train[: cfg.batch_size]  # the first gradient sets the noise level σ_g of every layer
    with torch.no_grad():
        t_logits = teacher(input_ids=batch).logits
    loss = lm_loss(model(input_ids=batch).logits, t_logits, batch, cfg)[0]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    group = next(g for g in opt.param_groups if g.get("sparse"))
    out = []
    for budget in budgets:
        steps = steps_for_tokens(budget * 3 // 4, per_step)
        lrs = schedule_lrs(cfg, steps, cfg.lr, default_warmup=TRAIN_WARMUP)
        layers = decay_state(opt, remaining_steps=steps, seed=seed)
        fc = forecast_from_layers(layers, lrs, step=0, total_steps=steps, l1_decay=float(group["l1_decay"]),
                                  betas=tuple(group["betas"]), eps=float(group["eps"]), suggest=False, seed=seed)
        out.append({"budget": budget, "steps": steps, "forecast_s_t": fc.sparse_weight_ratio})
        print(f"  {budget_name(budget):>6}: {steps:>7} steps, forecast S_T {fc.sparse_weight_ratio:.4f}", flush=True)
    return out


def load_rows(docs: Path, model: str) -> dict[int, dict[str, dict]]:
    """``{budget: {row name: row}}`` from the committed comparison tables (compare-<model>-<budget>.json) of the
    fixed protocol: a table without a ``split_sha256`` (scored on a seed-dependent held-out slice) is left out,
    and every table used must be scored on the same split (one digest), so the fit never mixes the two."""
    found, digests = {}, {}
    for path in sorted(docs.glob(f"compare-{model}-*.json")):
        doc = json.loads(path.read_text())
        if not doc.get("split_sha256"):
            print(f"  {path.name}: left out (earlier protocol: no fixed split digest)", flush=True)
            continue
        found_here = doc["split_sha256"]  # the digests of the table's rows (one, or a table that mixes splits)
        found_here = {found_here} if isinstance(found_here, str) else set(found_here)
        if len(found_here) > 1:
            raise SystemExit(f"{path.name}: its rows are scored on different splits: regenerate it first")
        digests[path.name] = found_here.pop()
        found[int(doc["budget"])] = {r["name"]: r for r in doc["rows"] if r.get("status") == "ok"}
    if len(set(digests.values())) > 1:
        raise SystemExit("the comparison tables are scored on different splits ("
                         + ", ".join(f"{k}: {v[:12]}" for k, v in digests.items()) + "): regenerate them first")
    return found


def wikitext_windows(docs: Path, model: str) -> dict[int, int | None]:
    """``{budget: WikiText-2 windows its table was scored on}`` (0 = every window; None where not recorded),
    from each table's settings: a 192k table on every window and a 48k one on 64 do not share a metric."""
    out = {}
    for path in sorted(docs.glob(f"compare-{model}-*.json")):
        doc = json.loads(path.read_text())
        out[int(doc["budget"])] = (doc.get("settings") or {}).get("wikitext_windows")
    return out


def _windows_text(n: int | None) -> str:
    return "every window" if not n else f"{n} windows"


def comparable_rows(rows: dict[int, dict], windows: dict[int, int | None], split: str,
                    fit_budgets: list[int]) -> tuple[dict[int, dict], list[int], list[int]]:
    """The budgets whose ``split`` is the same metric as the paper-exact fit's: every budget for the test split
    (one fixed split); for WikiText-2, the tables scored on the same windows as the fit's, and those on other
    windows whose rows were scored again on the fit's first windows (``compare_methods.py --first-windows``:
    their rows taken with that figure, the rows without it dropped). Returns (the rows, the budgets left out,
    the budgets taken on their first-window figures). The fit's own tables must agree."""
    if split != "wikitext2":
        return rows, [], []
    ref = {windows.get(b) for b in fit_budgets}
    if len(ref) > 1:
        # a fit budget on every window (0) joins the others' subset when its paper-exact row was scored again
        # on those first windows (--first-windows); any other disagreement is two metrics in one fit
        subset = {w for w in ref if w}
        want = subset.pop() if len(subset) == 1 else None
        if want is None or any(windows.get(b) != want and (rows.get(b, {}).get("cast") or {}).get(
                "wikitext2_first_windows") != want for b in fit_budgets):
            raise SystemExit("the paper-exact runs of the fit are scored on different WikiText-2 windows ("
                             + ", ".join(f"{budget_name(b)}: {windows.get(b)}" for b in fit_budgets)
                             + "): regenerate them with one --set wikitext_windows, or score the every-window "
                               "table's rows on the others' first windows (compare_methods.py --first-windows)")
    else:
        want = ref.pop() if ref else None
    keep = {b: r for b, r in rows.items() if windows.get(b) == want}
    via_first = []
    for b in sorted(set(rows) - set(keep)):
        first = {name: on_first_windows(r) for name, r in rows[b].items()
                 if want and r.get("wikitext2_first_windows") == want}
        if first:
            keep[b] = first
            via_first.append(b)
    return keep, sorted(b for b in rows if b not in keep), via_first


def on_first_windows(row: dict) -> dict:
    """A row (and its seeds) with its first-window WikiText-2 figure in the place of its own."""
    seeds = [{**x, "wikitext2": x["wikitext2_first"]} for x in row.get("seeds") or []
             if x.get("wikitext2_first") is not None]
    return {**row, "wikitext2": row["wikitext2_first"], "seeds": seeds}


def s_t_for_fit(forecast: dict[int, float], measured: dict[int, float | None], source: str) -> dict[int, float]:
    """S_T per budget for the fit and its predictions: ``forecast`` everywhere, or (``source`` "measured") what the
    fitted budgets' runs recorded in place of the forecast there; a fitted budget without a record is refused."""
    if source == "forecast":
        return dict(forecast)
    missing = [budget_name(b) for b, v in measured.items() if v is None]
    if missing:
        raise SystemExit(f"--s-t measured: the paper-exact rows at {', '.join(missing)} recorded no S_T; use "
                         "--s-t forecast")
    return {**forecast, **measured}


def fit_prune_cost(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, c) of ln ppl = a + c·(1 − S_T), least squares over ``(S_T, ppl)`` points (exact with two)."""
    xs = [1 - s for s, _ in points]
    ys = [math.log(p) for _, p in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        raise SystemExit("need paper-exact runs at two budgets with different S_T to fit the prune cost")
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - c * mx, c


def fit_residuals(budgets: list[int], points: list[tuple[float, float]], a: float, c: float) -> list[dict]:
    """Each fit point's measured perplexity against the fitted one and the leave-one-out prediction (the fit
    through the other points; None with fewer than two other points at distinct S_T): with three or more
    budgets the one-term model can miss, and this is where it shows."""
    out = []
    for i, (b, (s, ppl)) in enumerate(zip(budgets, points)):
        rest = points[:i] + points[i + 1:]
        loo = None
        if len(rest) >= 2 and len({x for x, _ in rest}) >= 2:
            a_, c_ = fit_prune_cost(rest)
            loo = math.exp(a_ + c_ * (1 - s))
        out.append({"budget": b, "measured": ppl, "fitted": math.exp(a + c * (1 - s)), "leave_one_out": loo,
                    "log_residual": math.log(ppl) - (a + c * (1 - s))})
    return out


def fit_scaling(points: list[tuple[int, float]]):
    """ln ppl = A + B·D^−β over (tokens, ppl) points (cast_llm.scaling, β fixed)."""
    from cast_llm.scaling import fit_token_scaling

    return fit_token_scaling([d / 1e9 for d, _ in points], [p for _, p in points])


def seed_values(row: dict, split: str) -> list[float]:
    """The per-seed perplexities of a row (its mean when it recorded no seeds)."""
    vals = [x.get(split, x.get("heldout") if split == "test" else None) for x in row.get("seeds") or []
            if x.get("status", "ok") == "ok"]
    vals = [v for v in vals if v is not None]
    return vals or [row[split]]


def pooled_log_sd(groups: list[list[float]]) -> float:
    """The seed-to-seed standard deviation of ln ppl, pooled over every group of two or more seeds."""
    ss = dof = 0.0
    for g in groups:
        if len(g) >= 2:
            logs = [math.log(v) for v in g]
            m = sum(logs) / len(logs)
            ss += sum((x - m) ** 2 for x in logs)
            dof += len(logs) - 1
    return (ss / dof) ** 0.5 if dof else 0.0


def bootstrap_crossover(s_t: dict[int, float], grid: list[int], paper: dict[int, list[float]],
                        sgpt: list[float] | None, kd: dict[int, list[float]], *, sd: float, draws: int = 2000,
                        seed: int = 0) -> dict[str, dict]:
    """The crossover budgets under the seed spread: every draw resamples each budget's seeds with replacement
    (a budget measured with one seed: its value × exp(N(0, ``sd``)), the pooled seed spread), refits both
    models and finds the first budget of ``grid`` at which paper-exact CAST is predicted lower. Returns, per
    comparator, the share of draws that cross within the grid and the 5th / 50th / 95th percentile budget
    among them."""
    import random

    rng = random.Random(seed)

    def resample(vals: list[float]) -> list[float]:
        if len(vals) >= 2:
            return [rng.choice(vals) for _ in vals]
        return [vals[0] * math.exp(rng.gauss(0.0, sd))]

    found: dict[str, list[int | None]] = {"sparsegpt": [], "sparsegpt_kd": []}
    for _ in range(draws):
        pts = [(s_t[b], math.exp(sum(math.log(v) for v in r) / len(r))) for b, vals in sorted(paper.items())
               for r in [resample(vals)]]
        if len({x for x, _ in pts}) < 2:
            continue
        a, c = fit_prune_cost(pts)
        base = math.exp(sum(math.log(v) for v in resample(sgpt)) / len(sgpt)) if sgpt else None
        kd_pts = [(b * 3 // 4, v) for b, vals in sorted(kd.items()) for v in resample(vals)]
        kd_fit = fit_scaling(kd_pts) if len(kd) >= 2 and len(kd_pts) >= 3 else None
        comparators = {"sparsegpt": None if base is None else {b: base for b in grid},
                       "sparsegpt_kd": None if kd_fit is None else
                       {b: float(kd_fit.predict_ppl(b * 3 // 4 / 1e9)) for b in grid}}
        for name, against in comparators.items():
            if against is not None:
                found[name].append(next((b for b in grid if math.exp(a + c * (1 - s_t[b])) < against[b]), None))
    out = {}
    for name, hits in found.items():
        if not hits:
            continue
        crossed = sorted(h for h in hits if h is not None)
        pct = {f"p{round(100 * f)}": crossed[min(len(crossed) - 1, int(f * len(crossed)))] if crossed else None
               for f in (0.05, 0.5, 0.95)}
        out[name] = {"draws": len(hits), "crossed_share": len(crossed) / len(hits), **pct, "grid_max": grid[-1]}
    return out


def describe_interval(b: dict | None) -> str:
    """'at 3M (90 % of the crossing draws 1.5M–12M; no crossover up to 48M in 240 of the 2,000 draws)': counts,
    not a percentage, which would round 1,998 of 2,000 to "100 %" beside a crossing budget."""
    if not b:
        return "not estimated (too few measured points)"
    if b["p50"] is None:
        return f"no crossover up to {budget_name(b['grid_max'])} in any of {b['draws']:,} draws"
    text = (f"at {budget_name(b['p50'])} (90 % of the crossing draws {budget_name(b['p5'])}–{budget_name(b['p95'])}")
    if b["crossed_share"] < 1:
        never = round(b["draws"] * (1 - b["crossed_share"]))
        text += f"; no crossover up to {budget_name(b['grid_max'])} in {never:,} of the {b['draws']:,} draws"
    return text + ")"


def main(argv=None) -> int:
    from cast_llm.config import parse_count

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default=",".join(GRID), help="budgets to forecast (tokens of runs without KD)")
    p.add_argument("--verify", default="", help="budgets with a measured paper-exact run NOT used in the fit "
                                                 "(prediction vs run), e.g. 384k")
    p.add_argument("--s-t", choices=("measured", "forecast"), default="measured",
                   help="S_T of the fitted budgets: what their runs recorded just before the final prune (the "
                        "mean of the seeds), or the forecast at the tier's settings; unmeasured budgets always "
                        "take the forecast")
    p.add_argument("--noise", choices=("paper", "pooled"), default="paper",
                   help="the seed spread of a one-seed budget in the resampled fits: paper-exact's own seeds, "
                        "or pooled over the stable rows too (paper-exact, SparseGPT + KD, the defaults, SparseGPT)")
    p.add_argument("--docs-dir", default=str(REPO / "docs" / "results"))
    p.add_argument("--threads", type=int, default=0)
    opts = p.parse_args(argv)
    import torch

    if opts.threads:
        torch.set_num_threads(opts.threads)
    tier = dict(TIERS["cpu"])
    docs = Path(opts.docs_dir)
    verify = {parse_count(x) for x in opts.verify.split(",") if x}
    rows = load_rows(docs, tier["model"])
    measured = sorted(b for b, r in rows.items() if "cast" in r)
    grid = sorted({parse_count(x) for x in opts.budgets.split(",")} | set(measured) | verify)
    t0 = time.perf_counter()
    print(f"decay forecast of paper-exact CAST ({tier['model']}, lr {tier['lr']:g} {tier['lr_schedule']}, "
          f"λ {tier['l1_decay']:g}):", flush=True)
    curve = forecast_curve(grid, tier)
    s_t = {c["budget"]: c["forecast_s_t"] for c in curve}
    fit_budgets = [b for b in measured if b not in verify]
    measured_s_t = {b: rows[b]["cast"].get("sparse_weight_ratio") for b in fit_budgets}
    s_t = s_t_for_fit(s_t, measured_s_t, opts.s_t)
    for cv in curve:
        cv["measured_s_t"] = measured_s_t.get(cv["budget"])
        cv["s_t"] = s_t[cv["budget"]]
    result = {"settings": {k: tier[k] for k in ("model", "lr", "lr_schedule", "l1_decay", "eta", "seq_len",
                                                 "batch_size")},
              "s_t": opts.s_t, "noise": opts.noise,
              "curve": curve, "fit_budgets": fit_budgets, "verify": [], "splits": {}}
    windows = wikitext_windows(docs, tier["model"])
    all_rows = rows
    for split, _ in SPLITS:
        rows, left_out, via_first = comparable_rows(all_rows, windows, split, fit_budgets)
        for b in left_out:
            print(f"  {split}: the {budget_name(b)} table is left out (WikiText-2 on {_windows_text(windows[b])}, "
                  f"not the fit's {_windows_text(windows[fit_budgets[0]])})", flush=True)
        for b in via_first:
            print(f"  {split}: the {budget_name(b)} table's rows {', '.join(sorted(rows[b]))} on their models' "
                  f"first {windows[fit_budgets[0]]} windows (--first-windows)", flush=True)
        pts = [(s_t[b], rows[b]["cast"][split]) for b in fit_budgets]
        a, c = fit_prune_cost(pts)
        residuals = fit_residuals(fit_budgets, pts, a, c)
        sgpt = next((r["sparsegpt"][split] for r in rows.values() if "sparsegpt" in r), None)
        kd_pts = [(x["tokens"], x[split]) for b in sorted(rows) if "naive-kd-sgpt" in rows[b]
                  for x in rows[b]["naive-kd-sgpt"]["seeds"]]  # (KD training tokens, ppl)
        kd_fit = fit_scaling(kd_pts) if len({d for d, _ in kd_pts}) >= 2 and len(kd_pts) >= 3 else None
        preds = []
        for cv in curve:
            b = cv["budget"]
            pred = math.exp(a + c * (1 - cv["s_t"]))
            kd = float(kd_fit.predict_ppl(b * 3 // 4 / 1e9)) if kd_fit else None  # a KD run gets 3/4 of b
            preds.append({"budget": b, "paper_exact": pred, "sparsegpt": sgpt, "sparsegpt_kd": kd})
        cross = {k: next((x["budget"] for x in preds if x[k] is not None and x["paper_exact"] < x[k]), None)
                 for k in ("sparsegpt", "sparsegpt_kd")}
        # the same crossover under the seed spread (no "never" that two seeds cannot carry)
        paper_seeds = {b: seed_values(rows[b]["cast"], split) for b in fit_budgets}
        sgpt_seeds = next((seed_values(r["sparsegpt"], split) for r in rows.values() if "sparsegpt" in r), None)
        kd_seeds = {b: seed_values(rows[b]["naive-kd-sgpt"], split) for b in sorted(rows) if "naive-kd-sgpt" in rows[b]}
        noisy = ("cast",) if opts.noise == "paper" else ("cast", "naive-kd-sgpt", "cast-best", "sparsegpt")
        sd = pooled_log_sd([seed_values(r[k], split) for r in rows.values() for k in noisy if k in r])
        interval = bootstrap_crossover(s_t, [cv["budget"] for cv in curve], paper_seeds, sgpt_seeds, kd_seeds, sd=sd)
        result["splits"][split] = {"a": a, "c": c, "floor": math.exp(a), "fit_points": pts, "predictions": preds,
                                   "left_out": [{"budget": b, "wikitext_windows": windows[b]} for b in left_out],
                                   "first_windows": [{"budget": b, "rows": sorted(rows[b])} for b in via_first],
                                   "crossover": cross, "seed_sd_log": sd, "crossover_interval": interval,
                                   "residuals": residuals,
                                   "sparsegpt_kd_fit": None if kd_fit is None else {"A": kd_fit.A, "B": kd_fit.B,
                                                                                    "beta": kd_fit.beta}}
        for b in sorted(verify):
            if b in rows and "cast" in rows[b]:
                got = rows[b]["cast"][split]
                want = math.exp(a + c * (1 - s_t[b]))
                result["verify"].append({"split": split, "budget": b, "predicted": want, "measured": got,
                                         "forecast_s_t": s_t[b], "measured_s_t": rows[b]["cast"].get(
                                             "sparse_weight_ratio")})
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    write_report(result, all_rows, docs, tier)
    return 0


def _at(cross: dict, split: dict, name: str) -> str:
    """'at 384k', 'at no budget of the grid', or 'not estimated' where the comparator has no prediction."""
    if all(p[name] is None for p in split["predictions"]):
        return "not estimated (measured at fewer than two budgets)"
    return f"at {budget_name(cross[name])}" if cross[name] else "at no budget of the grid"


def write_report(result: dict, rows: dict, docs: Path, tier: dict) -> None:
    stem = docs / f"decay-crossover-{tier['model']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Where paper-exact CAST pays: the crossover budget ({tier['model']}, CPU tier)", "",
          "Generated by `python benchmarks/decay_crossover.py" + (" --verify " + ",".join(
              budget_name(v["budget"]) for v in result["verify"][:1]) if result["verify"] else "")
          + (" --s-t forecast" if result["s_t"] == "forecast" else "")
          + (" --noise pooled" if result["noise"] == "pooled" else "") + "` "
          f"({result['wall_s']:.0f} s). Paper-exact CAST: dense start, hard final prune, lr {tier['lr']:g} "
          f"{tier['lr_schedule']}, λ {tier['l1_decay']:g}, KD η {tier['eta']:g} with 3/4 of the tokens (the "
          "forecast's settings; a fitted budget's run may have been tuned to others: its table says). S_T: "
          + ("at a fitted budget what its runs measured just before the final prune (the mean of the seeds), "
             "elsewhere the decay forecast made before a run (cast_llm.optim.forecast)" if result["s_t"] ==
             "measured" else "the decay forecast made before the run (cast_llm.optim.forecast)")
          + ". Seed spread of a one-seed budget in the resampled fits: "
          + ("paper-exact's own seeds" if result["noise"] == "paper" else "pooled over the stable rows too")
          + ". Prediction: ln ppl = a + c·(1 − S_T), "
          f"fitted to the paper-exact runs at {', '.join(budget_name(b) for b in result['fit_budgets'])} "
          "(it gives the training no gain beyond the measured budgets: a late estimate of the crossover). "
          "SparseGPT + KD: the token scaling law fitted to its runs.", "",
          "| budget | steps | forecast S_T | measured S_T | " + " | ".join(
              f"{n} paper-exact (pred.) | {n} SparseGPT | {n} SparseGPT + KD (fit)" for _, n in SPLITS) + " |",
          "|---:|---:|---:|---:|" + "---:|---:|---:|" * len(SPLITS)]
    for i, cv in enumerate(result["curve"]):
        cells = []
        for split, _ in SPLITS:
            pr = result["splits"][split]["predictions"][i]
            cells += [f"{pr['paper_exact']:.1f}", "—" if pr["sparsegpt"] is None else f"{pr['sparsegpt']:.1f}",
                      "—" if pr["sparsegpt_kd"] is None else f"{pr['sparsegpt_kd']:.1f}"]
        got = "—" if cv.get("measured_s_t") is None else f"{cv['measured_s_t']:.4f}"
        md.append(f"| {budget_name(cv['budget'])} | {cv['steps']:,} | {cv['forecast_s_t']:.4f} | {got} | "
                  + " | ".join(cells) + " |")
    md += ["", "## Crossover", ""]
    for split, name in SPLITS:
        sp = result["splits"][split]
        cr = sp["crossover"]
        iv = sp.get("crossover_interval") or {}
        md.append(f"- **{name}**: fit a = {sp['a']:.3f}, c = {sp['c']:.2f} (a fully decayed run's floor: "
                  f"{sp['floor']:.1f}); on the means it overtakes one-shot SparseGPT "
                  f"{_at(cr, sp, 'sparsegpt')}, SparseGPT + KD {_at(cr, sp, 'sparsegpt_kd')}. Under "
                  f"the seed spread (σ of ln ppl between seeds {sp.get('seed_sd_log', 0):.3f}; 2,000 draws "
                  f"resampling the seeds of every measured budget): one-shot SparseGPT "
                  f"{describe_interval(iv.get('sparsegpt'))}; SparseGPT + KD {describe_interval(iv.get('sparsegpt_kd'))}."
                  + "".join(f" The {budget_name(x['budget'])} table is left out of this fit: its WikiText-2 is "
                            f"{_windows_text(x['wikitext_windows'])}, "
                            "another metric than the other budgets'." for x in sp.get("left_out", []))
                  + "".join(f" The {budget_name(x['budget'])} table's rows ({', '.join(x['rows'])}) enter it "
                            "with their models scored again on the same first windows as the other budgets "
                            "(`compare_methods.py --first-windows`)." for x in sp.get("first_windows", [])))
    if len(result["fit_budgets"]) >= 3:
        md += ["", "## How well the one-term model fits", "",
               "Each fitted budget: measured (the mean of its seeds), the fit through every budget, and the "
               "fit through the other budgets only (leave-one-out: a prediction the point did not shape). "
               "A residual beyond the seed spread (σ above) is a cost the prune-only model does not carry.", ""]
        for split, name in SPLITS:
            for r in result["splits"][split].get("residuals", []):
                loo = "—" if r["leave_one_out"] is None else f"{r['leave_one_out']:.1f}"
                md.append(f"- {name}, {budget_name(r['budget'])}: measured {r['measured']:.1f}, fitted "
                          f"{r['fitted']:.1f} (ln residual {r['log_residual']:+.3f}), leave-one-out {loo}")
    if result["verify"]:
        md += ["", "## Prediction against a run not used in the fit", ""]
        for v in result["verify"]:
            md.append(f"- {budget_name(v['budget'])}, {v['split']}: predicted {v['predicted']:.1f}, measured "
                      f"{v['measured']:.1f} (S_T forecast {v['forecast_s_t']:.4f}, measured "
                      f"{v['measured_s_t'] if v['measured_s_t'] is None else round(v['measured_s_t'], 4)})")
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(SPLITS), figsize=(11, 4))
    xs = [cv["budget"] for cv in result["curve"]]
    for ax, (split, name) in zip(axes, SPLITS):
        pr = result["splits"][split]["predictions"]
        ax.plot(xs, [x["paper_exact"] for x in pr], "o-", color="#c0392b", label="paper-exact CAST (predicted)")
        if pr[0]["sparsegpt"] is not None:
            ax.axhline(pr[0]["sparsegpt"], color="#e39b3b", linestyle="--", label="one-shot SparseGPT")
        if pr[0]["sparsegpt_kd"] is not None:
            ax.plot(xs, [x["sparsegpt_kd"] for x in pr], "s-", color="#4a78b5", label="SparseGPT + KD (fit)")
        for b, r in rows.items():
            if "cast" in r:
                ax.plot([b], [r["cast"][split]], "kx", markersize=9)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training tokens (runs without KD; KD runs 3/4)")
        ax.set_ylabel(f"{name} perplexity")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle("Paper-exact CAST against SparseGPT: prediction from the decay forecast (× = measured runs)")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
