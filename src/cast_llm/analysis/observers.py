"""Training-loop observers for the mask-learning dynamics of method.md §7 (see docs/analysis.md).

They only read the current masks (``ctx.masks``, whatever the training method) and the target weights, so
they work for CAST, SR-STE, naive retraining, … alike. Each owns its own file in the run folder
(:mod:`cast_llm.analysis.files`) and its own key of ``dynamics.json``; each keeps its state in
``state_dict`` so that a resumed run writes exactly what an uninterrupted one would. On the first step a
process sees, an observer drops what a previous life of the folder wrote at or after that step (records
of a killed run past its checkpoint, or the files of a run replaced by ``--overwrite``).
"""

from __future__ import annotations

from typing import Any

import torch

from cast_llm.analysis.base import Observer, StepContext, groups_transposed, target_weight
from cast_llm.analysis.files import (
    DYNAMICS_FILE,
    LAYER_METRICS,
    LAYERS_FILE,
    RATIO_FILE,
    save_ratio_histograms,
    set_json_key,
)
from cast_llm.analysis.layers import count_tensor, gather_counts
from cast_llm.analysis.ratios import RatioHistogram, group_ratios, resolve_hist_steps
from cast_llm.analysis.tracking import TrackerState, sample_positions
from cast_llm.io import append_jsonl, truncate_jsonl
from cast_llm.sparsity.mask import pack_mask

__all__ = ["LayerMaskStats", "WeightTracking", "RatioHistograms", "analysis_observers"]


def _sig(v: float) -> float:
    return float(f"{v:.6g}")  # 6 significant digits: keeps layers.jsonl ~3x smaller than full repr


class LayerMaskStats(Observer):
    """Per-layer flip rate, initial flip rate and sparse-weight ratio on every log step → ``layers.jsonl``.

    The per-layer versions of :class:`~cast_llm.train.observers.MaskStats` (same reference points: the
    flip rate counts changes since the previous record, the initial flip rate since the masks of the first
    step). Snapshots are bit-packed and compared without unpacking (:mod:`cast_llm.analysis.layers`).
    """

    name = "layer_stats"

    def __init__(self):
        self.initial: dict[str, torch.Tensor] | None = None
        self.prev: dict[str, torch.Tensor] | None = None
        self._started = False

    def on_step(self, ctx: StepContext):
        if not self._started:
            self._started = True
            if ctx.is_main:
                truncate_jsonl(ctx.run_dir / LAYERS_FILE, ctx.step - 1)  # this step on is written again
        if self.initial is None:
            self.initial = {k: pack_mask(v) for k, v in ctx.masks.items()}
            self.prev = dict(self.initial)
        if not ctx.is_log_step:
            return None
        params = dict(ctx.model.named_parameters())
        rec: dict[str, Any] = {"step": ctx.step, **{key: {} for key in LAYER_METRICS}}
        current, counts, numels = {}, [], []
        for fqn, mask in ctx.masks.items():
            current[fqn] = pack_mask(mask)
            counts.append(count_tensor(target_weight(params, fqn), current[fqn], mask, self.prev[fqn],
                                       self.initial[fqn]))
            numels.append(mask.numel())
        for fqn, c in zip(current, gather_counts(numels, counts)):  # one host sync for every layer
            rec["flip_rate"][fqn] = _sig(c.flip_rate)
            rec["initial_flip_rate"][fqn] = _sig(c.initial_flip_rate)
            rec["sparse_weight_ratio"][fqn] = _sig(c.sparse_weight_ratio)
        self.prev = current
        if ctx.is_main:
            append_jsonl(ctx.run_dir / LAYERS_FILE, rec)
        return None

    def state_dict(self):
        return {"initial": self.initial, "prev": self.prev}

    def load_state_dict(self, state):
        self.initial, self.prev = state.get("initial"), state.get("prev")


class WeightTracking(Observer):
    """The paper's Table 2 on a fixed seeded sample of target weights (:mod:`cast_llm.analysis.tracking`).

    Checked at every step where masks can change — the first step seen, every ``t % mask_interval == 0``
    (when AdamS-based methods recompute masks, Algorithm 1), every log step and the last step — so no
    flip between two checks is missed (``track_every`` overrides the interval for methods whose masks
    move at other times). Log records gain ``tracked_kept_abs`` / ``tracked_pruned_abs``;
    the final summary goes to ``dynamics.json["weight_tracking"]``. Cost per check: one gather of ``k``
    entries from the weights and masks; the masks themselves are shared with the other observers.
    """

    name = "weight_tracking"

    def __init__(self, sample_size: int = 10_000, seed: int = 0):
        if sample_size < 1:
            raise ValueError(f"sample_size must be ≥ 1, got {sample_size}")
        self.sample_size, self.seed = int(sample_size), int(seed)
        self.names: list[str] | None = None
        self.positions: list[torch.Tensor] | None = None  # per layer: sorted flat indices (CPU, int64)
        self.tracker = TrackerState()
        self._on_device: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._started = False

    def _is_check(self, ctx: StepContext) -> bool:
        cfg = ctx.cfg
        interval = cfg.track_every or cfg.effective_mask_interval
        return (self.tracker.mask is None or ctx.is_log_step or ctx.step >= ctx.total_steps
                or bool(interval and ctx.step % interval == 0))

    def _check(self, ctx: StepContext) -> None:
        masks = ctx.masks
        if self.positions is None:  # chosen once, at the first check, from the layer sizes alone
            self.names = list(masks)
            self.positions = sample_positions([masks[n].numel() for n in self.names], self.sample_size, self.seed)
        params = dict(ctx.model.named_parameters())
        ws, ms = [], []
        for i, (fqn, pos) in enumerate(zip(self.names, self.positions)):
            if pos.numel() == 0:
                continue
            w = target_weight(params, fqn).detach()
            key = (i, w.device)
            if key not in self._on_device:  # copy the indices to the device once, not every check
                self._on_device[key] = pos.to(w.device)
            idx = self._on_device[key]
            ws.append(w.reshape(-1)[idx].abs().float())
            ms.append(masks[fqn].reshape(-1).to(w.device)[idx])
        self.tracker.update(ctx.step, torch.cat(ws), torch.cat(ms))

    def on_step(self, ctx: StepContext):
        if not self._started:
            self._started = True
            if ctx.is_main and self.tracker.mask is None:  # a fresh run: forget a replaced run's summary
                set_json_key(ctx.run_dir / DYNAMICS_FILE, self.name, None)
        if not self._is_check(ctx):
            return None
        self._check(ctx)
        if not ctx.is_log_step:
            return None
        kept, pruned = self.tracker.current_means()
        return {"tracked_kept_abs": kept, "tracked_pruned_abs": pruned}

    def summary(self, total_steps: int) -> dict[str, Any]:
        return {**self.tracker.summary(total_steps), "seed": self.seed, "total_steps": total_steps}

    def on_end(self, ctx: StepContext) -> None:
        if self.tracker.last_step != ctx.step:
            self._check(ctx)
        if ctx.is_main:
            set_json_key(ctx.run_dir / DYNAMICS_FILE, self.name, self.summary(ctx.total_steps))

    def state_dict(self):
        return {"names": self.names, "positions": self.positions, "tracker": self.tracker.state_dict(),
                "sample_size": self.sample_size, "seed": self.seed}

    def load_state_dict(self, state):
        if not state:
            return
        self.names, self.positions = state["names"], state["positions"]
        self.tracker.load_state_dict(state["tracker"])
        self._on_device.clear()


class RatioHistograms(Observer):
    """At the chosen steps: histogram of ρ_g = max|pruned| / min|kept| over every N:M group of every target
    (:mod:`cast_llm.analysis.ratios`) → ``ratio_hist.npz`` and ``dynamics.json["ratio_histograms"]``.

    One full pass over the target weights per chosen step, so only at the few steps asked for.
    """

    name = "ratio_hist"

    def __init__(self, steps: str, m: int):
        self.spec, self.m = steps, int(m)
        self.hists: list[RatioHistogram] = []
        self._steps: set[int] | None = None
        self._transposed: dict[str, bool] = {}
        self._started = False

    def _is_transposed(self, model, fqn: str, mask: torch.Tensor) -> bool:
        if fqn not in self._transposed:
            self._transposed[fqn] = groups_transposed(model, fqn, mask, self.m)
        return self._transposed[fqn]

    def on_step(self, ctx: StepContext):
        if self._steps is None:
            self._steps = set(resolve_hist_steps(self.spec, ctx.total_steps))
        if not self._started:
            self._started = True
            self.hists = [h for h in self.hists if h.step < ctx.step]
            if ctx.is_main:
                self._write(ctx)
        if ctx.step not in self._steps or any(h.step == ctx.step for h in self.hists):
            return None
        hist = RatioHistogram(step=ctx.step, progress=ctx.step / ctx.total_steps)
        params = dict(ctx.model.named_parameters())
        for fqn, mask in ctx.masks.items():
            w = target_weight(params, fqn)
            hist.add(group_ratios(w, mask, self.m, transposed=self._is_transposed(ctx.model, fqn, mask)))
        self.hists.append(hist)
        if ctx.is_main:
            self._write(ctx)
        return None

    def _write(self, ctx: StepContext) -> None:
        path = ctx.run_dir / RATIO_FILE
        if self.hists:
            save_ratio_histograms(path, self.hists)
        else:
            path.unlink(missing_ok=True)
        summary = {"definition": "rho_g = max |pruned w| / min |kept w| per N:M group", "file": RATIO_FILE,
                   "steps": [h.summary() for h in self.hists]} if self.hists else None
        set_json_key(ctx.run_dir / DYNAMICS_FILE, "ratio_histograms", summary)

    def state_dict(self):
        return {"hists": [h.state_dict() for h in self.hists]}

    def load_state_dict(self, state):
        self.hists = [RatioHistogram.from_state_dict(h) for h in state.get("hists", [])]


class _DisabledOutputs(Observer):
    """Removes, at the first step of a fresh run, what the *disabled* analysis observers wrote in an earlier
    run of the same folder (``--overwrite`` only clears the trainer's own files), so a report never mixes
    a replaced run's per-layer statistics or histograms into this one."""

    name = "analysis_cleanup"

    def __init__(self, files: list[str], keys: list[str]):
        self.files, self.keys = files, keys

    def on_step(self, ctx: StepContext):
        if ctx.step == 1 and ctx.is_main and (self.files or self.keys):
            for name in self.files:
                (ctx.run_dir / name).unlink(missing_ok=True)
            for key in self.keys:
                set_json_key(ctx.run_dir / DYNAMICS_FILE, key, None)
            self.files, self.keys = [], []
        return None


def analysis_observers(cfg) -> list[Observer]:
    """The observers the config asks for (``layer_stats``, ``track_weights``, ``ratio_hist_steps``)."""
    out: list[Observer] = []
    stale_files, stale_keys = [], []
    if cfg.layer_stats:
        out.append(LayerMaskStats())
    else:
        stale_files.append(LAYERS_FILE)
    k = cfg.track_weights
    if k:
        out.append(WeightTracking(k, seed=cfg.seed))
    else:
        stale_keys.append(WeightTracking.name)
    steps = cfg.ratio_hist_steps
    if steps:
        out.append(RatioHistograms(steps, m=cfg.m))
    else:
        stale_files.append(RATIO_FILE)
        stale_keys.append("ratio_histograms")
    if stale_files or stale_keys:
        out.append(_DisabledOutputs(stale_files, stale_keys))
    return out
