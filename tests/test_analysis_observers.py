"""The analysis observers driven by a scripted training sequence (no training loop): brute-force references,
agreement with MaskStats, transposed (Conv1D) layers, and exact resume from a saved state."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny
import torch
from torch import nn

from cast_llm.analysis.files import DYNAMICS_FILE, LAYERS_FILE, RATIO_FILE, load_ratio_histograms, read_layers
from cast_llm.analysis.observers import LayerMaskStats, RatioHistograms, WeightTracking, analysis_observers
from cast_llm.sparsity.mask import nm_mask
from cast_llm.train.config import TrainConfig
from cast_llm.train.observers import MaskStats, StepContext

T = 12  # steps of the scripted run
INTERVAL = 2  # masks recomputed when step % INTERVAL == 0


class Toy(nn.Module):
    """Two targets: an nn.Linear (groups along dim 1) and a GPT-2 Conv1D (stored (in, out): groups along dim 0)."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 6, bias=False)
        self.b = Conv1D(nf=3, nx=8)


def _masks(model, prev=None, step=1):
    if prev is not None and step % INTERVAL:
        return prev
    return {"a": nm_mask(model.a.weight.detach()), "b": nm_mask(model.b.weight.detach().t()).t().contiguous()}


def _script(observers, run_dir, steps=range(1, T + 1), model=None, masks=None, log_every=3):
    """Apply a seeded random walk to the weights and call the observers as the loop would. Returns the
    model, the last masks and the per-step mask history {step: masks}."""
    model = model or Toy()
    cfg = TrainConfig(mask_interval=INTERVAL, track_every=0, m=4, seed=0)
    history = {}
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
        masks = _masks(model, masks, step)
        history[step] = {k: v.clone() for k, v in masks.items()}
        is_log = step % log_every == 0 or step == T
        ctx = StepContext(step=step, total_steps=T, model=model, masks_fn=lambda m=masks: m, is_log_step=is_log,
                          run_dir=run_dir, is_main=True, cfg=cfg)
        for ob in observers:
            ob.on_step(ctx)
    return model, masks, history


def _end(observers, model, masks, run_dir):
    cfg = TrainConfig(mask_interval=INTERVAL, track_every=0, m=4, seed=0)
    ctx = StepContext(step=T, total_steps=T, model=model, masks_fn=lambda: masks, is_log_step=False,
                      run_dir=run_dir, is_main=True, cfg=cfg)
    for ob in observers:
        ob.on_end(ctx)


def test_weight_tracking_matches_a_brute_force_reference(tmp_path):
    ob = WeightTracking(sample_size=10_000, seed=0)  # more than the 72 entries: every entry is tracked
    model, masks, history = _script([ob], tmp_path)
    _end([ob], model, masks, tmp_path)
    got = json.loads((tmp_path / DYNAMICS_FILE).read_text())["weight_tracking"]
    # reference: replay the checks (step 1, every INTERVAL, every log step, the last step) entry by entry
    checks = sorted({1, T, *range(INTERVAL, T + 1, INTERVAL), *range(3, T + 1, 3)})
    flat = lambda ms: torch.cat([ms["a"].reshape(-1), ms["b"].reshape(-1)])  # noqa: E731
    last_step = torch.full((72,), -1)
    for prev, cur in zip(checks, checks[1:]):
        last_step[flat(history[prev]) != flat(history[cur])] = cur
    ever = last_step >= 0
    assert got["sample_size"] == 72 and got["checks"] == len(checks)
    assert got["last_flip_progress"] == pytest.approx(float((last_step[ever] / T).mean()))
    assert got["flipped_fraction"] == pytest.approx(float(ever.float().mean()))
    w_now = torch.cat([model.a.weight.detach().reshape(-1), model.b.weight.detach().reshape(-1)]).abs()
    kept = flat(history[T])
    assert got["kept_mean_abs"] == pytest.approx(float(w_now[kept].mean()), rel=1e-6)
    assert got["pruned_mean_abs"] == pytest.approx(float(w_now[~kept].mean()), rel=1e-6)
    assert 0 < got["last_flip_mean_abs"] < got["kept_mean_abs"] * 10


def test_layer_stats_sum_to_mask_stats_and_ratio_histograms_use_the_group_dim(tmp_path):
    agg = MaskStats()
    layer = LayerMaskStats()
    hist = RatioHistograms("0.5,1.0", m=4)
    model = Toy()
    cfg = TrainConfig(mask_interval=INTERVAL, m=4)
    masks, from_mask_stats = None, {}
    for step in range(1, T + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn(p.shape))
        masks = _masks(model, masks, step)
        ctx = StepContext(step=step, total_steps=T, model=model, masks_fn=lambda m=masks: m,
                          is_log_step=step % 3 == 0, run_dir=tmp_path, is_main=True, cfg=cfg)
        out = agg.on_step(ctx)
        layer.on_step(ctx)
        hist.on_step(ctx)
        if out:
            from_mask_stats[step] = out
    lay = read_layers(tmp_path / LAYERS_FILE)
    assert lay["steps"].tolist() == [3, 6, 9, 12] and lay["names"] == ["a", "b"]
    sizes = np.array([48, 24])
    for i, step in enumerate(lay["steps"]):
        for key in ("flip_rate", "initial_flip_rate"):
            assert (lay[key][i] * sizes).sum() / sizes.sum() == pytest.approx(from_mask_stats[step][key], abs=1e-6)
    z = load_ratio_histograms(tmp_path / RATIO_FILE)
    assert z["steps"].tolist() == [6, 12] and z["groups"].tolist() == [18, 18]  # (6·8 + 8·3) / 4 groups
    # step 12 recomputed the mask from these very weights: every group obeys ρ ≤ 1 only if the
    # Conv1D's groups were taken along dim 0, as its mask was
    assert z["lin_overflow"][1] == 0 and z["lin_counts"][1][z["lin_edges"][:-1] >= 1.0].sum() == 0


def _run_files(d):
    z = load_ratio_histograms(d / RATIO_FILE)
    return ((d / LAYERS_FILE).read_text(), json.loads((d / DYNAMICS_FILE).read_text()),
            {k: v.tolist() for k, v in z.items()})


def test_resume_from_saved_state_writes_the_same_files(tmp_path):
    cfg = TrainConfig(layer_stats=True, track_weights=40, ratio_hist_steps="0.25,0.5,1.0", m=4, seed=7)
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    ref_dir.mkdir(), cut_dir.mkdir()
    ref = analysis_observers(cfg)
    model, masks, _ = _script(ref, ref_dir)
    _end(ref, model, masks, ref_dir)

    # the killed run: a checkpoint at step 6, records up to step 9 written, then killed
    first = analysis_observers(cfg)
    model, masks, _ = _script(first, cut_dir, steps=range(1, 7))
    torch.save({ob.name: ob.state_dict() for ob in first}, tmp_path / "ckpt.pt")
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    _script(first, cut_dir, steps=range(7, 10), model=model, masks=masks)
    # resume: fresh observers, state from the checkpoint, the weights of step 6
    model.load_state_dict(saved_model)
    resumed = analysis_observers(cfg)
    states = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    for ob in resumed:
        ob.load_state_dict(states[ob.name])
    model, masks, _ = _script(resumed, cut_dir, steps=range(7, T + 1), model=model, masks=masks)
    _end(resumed, model, masks, cut_dir)
    assert _run_files(cut_dir) == _run_files(ref_dir)


def test_fresh_run_drops_files_of_a_replaced_run(tmp_path):
    (tmp_path / LAYERS_FILE).write_text(json.dumps({"step": 5, "flip_rate": {}}) + "\n")
    (tmp_path / DYNAMICS_FILE).write_text(json.dumps({"weight_tracking": {"old": 1}, "ratio_histograms": {}}))
    (tmp_path / RATIO_FILE).write_bytes(b"stale")
    obs = analysis_observers(TrainConfig(track_weights=5, ratio_hist_steps="1.0", m=4))
    _script(obs, tmp_path, steps=range(1, 3))
    assert read_layers(tmp_path / LAYERS_FILE) is None  # no log step yet, the old record gone
    assert json.loads((tmp_path / DYNAMICS_FILE).read_text()) == {}
    assert not (tmp_path / RATIO_FILE).exists()


def test_analysis_observers_follow_the_config(tmp_path):
    names = lambda cfg: [ob.name for ob in analysis_observers(cfg)]  # noqa: E731
    full = TrainConfig(layer_stats=True, track_weights=10, ratio_hist_steps="1.0", m=4)
    assert names(full) == ["layer_stats", "weight_tracking", "ratio_hist"]
    off = TrainConfig(layer_stats=False, track_weights=0, ratio_hist_steps="")
    assert names(off) == ["analysis_cleanup"]
    # a fresh run with everything off drops what an earlier run of the folder wrote
    (tmp_path / LAYERS_FILE).write_text("{}\n")
    (tmp_path / RATIO_FILE).write_bytes(b"old")
    (tmp_path / DYNAMICS_FILE).write_text(json.dumps({"weight_tracking": {}, "ratio_histograms": {}, "x": 1}))
    _script(analysis_observers(off), tmp_path, steps=range(1, 3))
    assert not (tmp_path / LAYERS_FILE).exists() and not (tmp_path / RATIO_FILE).exists()
    assert json.loads((tmp_path / DYNAMICS_FILE).read_text()) == {"x": 1}


def test_ratio_histograms_read_the_orientation_of_wrapped_conv1d_layers():
    """GPT-2 Conv1D weights are (in, out) even inside a training method's wrapper (naive, SR-STE, AST, MaskLLM),
    whatever their output width: the groups of m run along dim 0."""
    from cast_llm.analysis.observers import RatioHistograms
    from cast_llm.nn.sparse_forward import wrap_sparse_forward_
    from cast_llm.sparsity.mask import magnitude_mask
    from cast_llm.targets import find_targets

    model = tiny.model("gpt2")  # every width a multiple of 4: the shape alone cannot tell
    targets = find_targets(model)
    masks = {t.fqn: magnitude_mask(t.weight, t.transposed, 2, 4) for t in targets}
    wrap_sparse_forward_(model, masks, ste=False)
    ob = RatioHistograms("1.0", 4)
    assert all(ob._is_transposed(model, t.fqn, masks[t.fqn]) for t in targets)


def test_log_step_statistics_equal_the_reference_functions_with_no_per_layer_host_reads(tmp_path):
    """MaskStats and LayerMaskStats on a log step: the §7 numbers of sparsity.stats exactly (flips counted on
    the packed snapshots, S_t's sums in float64), and no ``.item()``-style read per layer — every layer's
    counts reach the host in one transfer (on a GPU each such read would be a sync)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cast_llm.sparsity.stats import changed_group_rate, flip_rate, initial_flip_rate, sparse_weight_ratio

    class CountScalarReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                CountScalarReads.reads += 1
            return func(*args, **(kwargs or {}))

    model = Toy()
    agg, layer = MaskStats(), LayerMaskStats()
    cfg = TrainConfig(mask_interval=INTERVAL, m=4)
    first = _masks(model)
    ctx = StepContext(step=1, total_steps=T, model=model, masks_fn=lambda: first, is_log_step=False,
                      run_dir=tmp_path, is_main=True, cfg=cfg)
    agg.on_step(ctx)
    layer.on_step(ctx)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape))
    now = _masks(model)
    assert not all(torch.equal(now[k], first[k]) for k in now)  # some flips to count
    ctx = StepContext(step=2, total_steps=T, model=model, masks_fn=lambda: now, is_log_step=True,
                      run_dir=tmp_path, is_main=True, cfg=cfg)
    with CountScalarReads():
        out = agg.on_step(ctx)
        layer.on_step(ctx)
    assert CountScalarReads.reads == 0
    weights = [model.a.weight, model.b.weight]
    cur, old = [now["a"], now["b"]], [first["a"], first["b"]]
    assert out == {"flip_rate": flip_rate(old, cur), "initial_flip_rate": initial_flip_rate(old, cur),
                   "changed_groups": changed_group_rate(old, cur, 4, [False, True]),  # b is a Conv1D
                   "sparse_weight_ratio": sparse_weight_ratio(weights, cur)}
    lay = read_layers(tmp_path / LAYERS_FILE)
    for i, (k, w) in enumerate(zip("ab", weights)):
        assert lay["flip_rate"][0][i] == pytest.approx(flip_rate(first[k], now[k]), rel=1e-5)
        assert lay["sparse_weight_ratio"][0][i] == pytest.approx(sparse_weight_ratio(w, now[k]), rel=1e-5)
