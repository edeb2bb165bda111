"""The report's figures: one function per figure, several runs overlaid on the same axes.

Each function takes loaded :class:`~cast_llm.report.runs.Run` objects and returns a matplotlib
``Figure`` (Agg canvas, no pyplot: no global state, no GUI), or None when no run recorded the data.
Curves over training use *training tokens* on the x axis, so runs with different batch sizes line up
(method.md §4: methods are compared at equal budgets). One colour per run, the same in every figure.
"""

from __future__ import annotations

import math

import numpy as np

from cast_llm.io import atomic_write
from cast_llm.report.runs import Run

WIDTH = 11.0  # inches; at DPI 110 about 1200 px: legible on a laptop screen and in a PDF page
PANEL_H = 3.6
DPI = 110


def color(i: int) -> str:
    return f"C{i % 10}"


def _figure(ncols: int, nrows: int = 1, height: float | None = None):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH, height or PANEL_H * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def save(fig, path) -> None:
    """``fig`` as a PNG at ``path``, written atomically (a fresh temporary file renamed over it: a link planted
    at ``path`` in a received run folder is replaced, its target never written)."""
    atomic_write(path, lambda f: fig.savefig(f, dpi=DPI, format="png"))


def _tokens_axis(ax) -> None:
    from matplotlib.ticker import EngFormatter

    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_xlabel("training tokens")
    ax.grid(alpha=0.3)


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, **kw)


def _line_panels(runs: list[Run], panels: list[tuple[str, str, str]], *, logy=()):
    """One panel per (metric key, title, y label), every run that logged the key overlaid."""
    panels = [p for p in panels if any(r.has(p[0]) for r in runs)]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, (key, title, ylabel) in zip(axes[0], panels):
        for i, run in enumerate(runs):
            x, y = run.series(key)
            if key in logy:
                x, y = x[y > 0], y[y > 0]  # zeros have no place on a log axis
            if x.size:
                ax.plot(x, y, color=color(i), lw=1.4, marker="." if x.size < 30 else None, label=run.label)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        if key in logy:
            ax.set_yscale("log")
        _tokens_axis(ax)
    # the run legend goes where most runs drew a line (a run with r_t = 0 throughout draws none on a log axis)
    _legend(max(axes[0], key=lambda a: len(a.get_legend_handles_labels()[0])))
    return fig


def plot_loss(runs: list[Run]):
    has_kd = any(np.any(run.series("kd")[1] > 0) for run in runs)
    panels = [("loss", "total training loss (Eq. 13)", "loss (nats / token)"),
              ("ce", "cross-entropy on the labels", "CE (nats / token)")]
    if has_kd:
        panels.append(("kd", "distillation KL(teacher ‖ student)", "KL (nats / token)"))
    return _line_panels(runs, panels)


def plot_schedule(runs: list[Run]):
    return _line_panels(runs, [("lr", "learning rate", "lr"), ("tokens_per_s", "throughput", "tokens / s")])


def plot_validation(runs: list[Run]):
    """Held-out perplexity of the dense in-training model vs the same model hard-masked (Fig. 4), with the
    start (dense model, one-shot magnitude mask) and the end (the exported sparse model) from results.json."""
    fig, axes = _figure(1)
    ax = axes[0][0]
    if not any(run.has("val_ppl_dense") or run.has("val_ppl_masked") for run in runs):
        return None  # only the start and the end: the evaluation table says them better than two dots
    drawn = False
    for i, run in enumerate(runs):
        ppl = (run.results.get("perplexity") or {}).get("heldout") or {}
        xd, yd = run.series("val_ppl_dense")
        xm, ym = run.series("val_ppl_masked")
        if ppl.get("dense") is not None:
            xd, yd = np.r_[0.0, xd], np.r_[ppl["dense"], yd]
        if ppl.get("magnitude") is not None:
            xm, ym = np.r_[0.0, xm], np.r_[ppl["magnitude"], ym]
        if ppl.get("sparse") is not None and run.total_tokens is not None:
            xm, ym = np.r_[xm, run.total_tokens], np.r_[ym, ppl["sparse"]]
        if xd.size:
            ax.plot(xd, yd, color=color(i), marker="o", ms=4, lw=1.4, label=run.label)
        if xm.size:
            ax.plot(xm, ym, color=color(i), marker="x", ms=5, lw=1.4, ls="--",
                    label=None if xd.size else run.label)
        drawn = drawn or bool(xd.size or xm.size)
    if not drawn:
        return None
    ax.set_yscale("log")
    ax.set_ylabel("held-out perplexity")
    # line styles are explained in the title, not in a second legend box that could cover a curve
    ax.set_title("dense forward (solid, o) vs hard-masked W⊙M (dashed, x); step 0: dense and one-shot "
                 "magnitude; last x: the exported model", fontsize=10)
    _tokens_axis(ax)
    _legend(ax, loc="best")
    return fig


def plot_flips(runs: list[Run]):
    from matplotlib.ticker import FuncFormatter

    fig = _line_panels(runs, [("flip_rate", "flip rate r_t (since the previous record)", "entries flipped"),
                              ("initial_flip_rate", "initial flip rate i_t (vs the first mask M_0)",
                               "entries differing from M_0")], logy=("flip_rate",))
    if fig is not None:
        for ax in fig.axes:
            # "%g" keeps 0.01 % legible on the log axis, where a fixed number of decimals would print 0 %
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:g}%"))
    return fig


def plot_weights(runs: list[Run]):
    """Sparse-weight ratio S_t, and the tracked sample's mean |w| of kept vs pruned entries."""
    has_swr = any(r.has("sparse_weight_ratio") for r in runs)
    has_tracked = any(r.has("tracked_kept_abs") for r in runs)
    if not (has_swr or has_tracked):
        return None
    fig, axes = _figure(int(has_swr) + int(has_tracked))
    panels = list(axes[0])
    if has_swr:
        ax = panels.pop(0)
        for i, run in enumerate(runs):
            x, y = run.series("sparse_weight_ratio")
            ax.plot(x, y, color=color(i), lw=1.4, label=run.label)
        ax.set_title("sparse-weight ratio S_t = ‖W⊙M‖₁ / ‖W‖₁", fontsize=10)
        ax.set_ylabel("share of |W| mass kept")
        _tokens_axis(ax)
        _legend(ax)
    if has_tracked:
        ax = panels.pop(0)
        for i, run in enumerate(runs):
            for key, ls in (("tracked_kept_abs", "-"), ("tracked_pruned_abs", "--")):
                x, y = run.series(key)
                x, y = x[y > 0], y[y > 0]
                # the run legend lives in the S_t panel; without one, name the runs here
                label = run.label if key == "tracked_kept_abs" and not has_swr else None
                ax.plot(x, y, color=color(i), ls=ls, lw=1.4, label=label)
        ax.set_yscale("log")
        ax.set_title("tracked sample: kept (solid) and pruned (dashed)", fontsize=10)
        ax.set_ylabel("mean |w|  (zeros not drawn)")
        _tokens_axis(ax)
        if not has_swr:
            _legend(ax, loc="upper right")
    return fig


def plot_ratio_histograms(runs: list[Run]):
    """ρ = max|pruned| / min|kept| per N:M group (Fig. 3): one row per run, linear and log10 bins."""
    runs = [(i, r) for i, r in enumerate(runs) if r.ratio is not None]
    if not runs:
        return None
    fig, axes = _figure(2, nrows=len(runs), height=3.2 * len(runs) + 0.3)
    from matplotlib import colormaps

    for row, (_, run) in zip(axes, runs):
        z = run.ratio
        k = len(z["steps"])
        shades = colormaps["viridis"](np.linspace(0.0, 0.85, k))
        beyond_one = (z["lin_counts"][:, z["lin_edges"][:-1] >= 1.0].sum(1) + z["lin_overflow"]) / np.maximum(z["groups"], 1)
        xmax = 2.0 if np.max(beyond_one) > 0.005 else 1.0
        for j in range(k):
            n = max(int(z["groups"][j]), 1)
            label = f"step {int(z['steps'][j])} ({z['progress'][j]:.0%})"
            under = z["log_underflow"][j] / n  # ρ < 1e-6 (exact zeros: a fixed mask) has no log bin
            row[0].stairs(z["lin_counts"][j] / n, z["lin_edges"], color=shades[j], lw=1.3, label=label)
            row[1].stairs(z["log_counts"][j] / n, z["log10_edges"], color=shades[j], lw=1.3,
                          label=f"{label}: {under:.1%} below 1e-6")
        row[0].set_xlim(0, xmax)
        row[0].set_xlabel("ρ = max |pruned| / min |kept| in the group")
        row[1].set_xlabel("log10 ρ")
        for ax in row:
            ax.set_ylabel("share of groups per bin")
            ax.grid(alpha=0.3)
        row[0].set_title(f"{run.label}: linear bins (0.01)", fontsize=10)
        row[1].set_title(f"{run.label}: log bins (0.05 decade)", fontsize=10)
        row[1].set_ylim(bottom=0, top=max(row[1].get_ylim()[1], 0.01))
        _legend(row[0], loc="upper right")
        _legend(row[1], loc="best")
    return fig


def _short_names(names: list[str]) -> list[str]:
    """Drop the dotted prefix every name shares (``model.layers.``) so labels read ``3.mlp.up_proj``."""
    parts = [n.split(".") for n in names]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return [".".join(p[common:]) for p in parts]


def _layer_ticks(names: list[str], most: int = 40) -> tuple[list[int], list[str], str]:
    """Y ticks for a heat map with one row per layer: every name when they fit, else one tick per
    decoder block (``3`` of ``3.mlp.up_proj``), thinned to at most ``most`` labels so none overlap."""
    if len(names) <= most:
        return list(range(len(names))), names, "target layer"
    blocks = [n.split(".", 1)[0] for n in names]
    if all(b.isdigit() for b in blocks):
        starts = [i for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1]]
        every = max(1, math.ceil(len(starts) / most))
        starts = starts[::every]
        return starts, [f"block {blocks[i]}" for i in starts], "target layers in module order, by block"
    every = math.ceil(len(names) / most)
    return list(range(0, len(names), every)), names[::every], f"target layer (every {every}th labelled)"


def plot_layer_heatmap(run: Run):
    """Per-layer flip rate (log colour) and initial flip rate over training, one row per target layer."""
    lay = run.layers
    if lay is None or len(lay["steps"]) == 0:
        return None
    from matplotlib.colors import LogNorm, Normalize

    names = _short_names(lay["names"])
    n_layers = len(names)
    height = min(max(3.0, 0.16 * n_layers + 1.4), 14.0)
    fig, axes = _figure(2, height=height)
    steps = lay["steps"]
    extent = (steps[0] - 0.5, steps[-1] + 0.5, n_layers - 0.5, -0.5)
    fr = lay["flip_rate"].T  # (layers, records)
    positive = fr[fr > 0]
    norm = LogNorm(vmin=max(positive.min(), 1e-6), vmax=max(positive.max(), 2e-6)) if positive.size else None
    ifr = lay["initial_flip_rate"].T
    moved = ifr[ifr > 0]  # i_t spans decades too (1e-6 … 0.1): a linear scale shows all but one layer black
    inorm = (LogNorm(vmin=max(moved.min(), 1e-6), vmax=max(moved.max(), 2e-6)) if moved.size
             else Normalize(vmin=0.0, vmax=1e-3))
    panels = ((axes[0][0], np.where(fr > 0, fr, np.nan), norm, "flip rate r_t per layer (log colour)"),
              (axes[0][1], np.where(ifr > 0, ifr, np.nan), inorm, "initial flip rate i_t per layer (log colour)"))
    ticks, labels, ylabel = _layer_ticks(names)
    for ax, data, nrm, title in panels:
        im = ax.imshow(data, aspect="auto", interpolation="nearest", extent=extent, norm=nrm, cmap="magma")
        cb = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02, aspect=30)
        cb.set_label("share of the layer's entries", fontsize=8)
        ax.set_yticks(ticks, labels, fontsize=7 if len(ticks) > 14 else 8)
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10)
    axes[0][0].set_ylabel(ylabel)
    if not positive.size:
        axes[0][0].text(0.5, 0.5, "no mask entry flipped", transform=axes[0][0].transAxes, ha="center",
                        va="center", fontsize=10, color="0.3")
    axes[0][1].tick_params(labelleft=False)  # same rows as the left panel: one set of labels is enough
    fig.suptitle(f"{run.label}: per-layer mask dynamics (white = no flip in that interval)", fontsize=10)
    return fig
