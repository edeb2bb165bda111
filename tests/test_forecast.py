"""The decay forecast (cast_llm.optim.forecast) against what AdamS actually does.

Stated tolerances (docs/training.md, "Budgets"): on white-noise gradients, where the forecast's model is
exact in distribution, the forecast pruned L1 mass is within 10 % of AdamS's (different noise draws); in a
training run, the forecast made on a log step after the first sixth of the run is within 0.03 of the S_T the
run reaches; the forecast made before the first step is coarse (within 0.3 on tiny random models, whose first
gradients are far larger than later ones; on SmolLM2-135M see docs/results).
"""

from __future__ import annotations

import json

import pytest
import tiny
import torch

from cast_llm.cli import main
from cast_llm.optim import AdamS
from cast_llm.optim.forecast import forecast_decay, simulate_pruned


def _noise_run(steps: int, lr: float, lam: float, sigma: float, *, stop: int | None = None, seed: int = 0):
    """AdamS on one 64×256 weight whose gradients are white noise of rms σ; returns (optimizer, param, lrs)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(64, 256, generator=g, dtype=torch.float64) * 0.05)
    opt = AdamS([{"params": [w], "sparse": True}], lr=lr, l1_decay=lam, total_steps=steps, mask_interval=0)
    lrs = [lr] * steps
    for _ in range(steps if stop is None else stop):
        w.grad = torch.randn(w.shape, generator=g, dtype=torch.float64) * sigma
        opt.step()
    return opt, w, lrs


def _pruned_l1(opt, w) -> float:
    return float(w.detach()[~opt.mask(w)].abs().sum())


@pytest.mark.parametrize("lam, sigma", [(1e-3, 1e-3), (1e-4, 1e-3), (1e-3, 1e-4)])
def test_forecast_matches_adams_on_white_noise(lam, sigma):
    steps, lr = 200, 2e-3
    opt, w, lrs = _noise_run(steps, lr, lam, sigma, stop=0)
    w.grad = torch.randn(w.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) * sigma
    before = forecast_decay(opt, lrs, suggest=False)  # σ from the gradient present before the first step
    ref_opt, ref_w, _ = _noise_run(steps, lr, lam, sigma, seed=0)
    actual = _pruned_l1(ref_opt, ref_w)
    assert before.pruned_l1_end == pytest.approx(actual, rel=0.10)
    mid_opt, mid_w, _ = _noise_run(steps, lr, lam, sigma, stop=60, seed=0)
    mid = forecast_decay(mid_opt, lrs, suggest=False)  # from AdamS's own state after 60 steps
    assert mid.step == 60 and mid.pruned_l1_end == pytest.approx(actual, rel=0.10)


def test_simulation_is_adams_pruned_update_exactly_for_given_gradients():
    """With the noise switched off (σ = 0) the simulation is AdamS's own recursion: same numbers, float64."""
    steps, lr, lam = 50, 1e-3, 1e-3
    w = torch.nn.Parameter(torch.tensor([[0.3, -0.2, 0.01, 0.02]], dtype=torch.float64))
    mask = torch.tensor([[True, True, False, False]])
    opt = AdamS([{"params": [w], "sparse": True}], lr=lr, l1_decay=lam, total_steps=steps, mask_interval=0)
    opt.set_mask(w, mask)
    for _ in range(steps):
        w.grad = torch.zeros_like(w)
        opt.step()
    sim = simulate_pruned(torch.tensor([0.01, 0.02], dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                          torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), [lr] * steps,
                          start_step=0, total_steps=steps, l1_decay=lam)
    torch.testing.assert_close(sim, w.detach()[0, 2:], rtol=1e-12, atol=1e-15)


def test_the_lambda_searches_find_the_finishing_lambda_and_where_a_larger_one_stops_helping():
    """l1_decay_to_finish: the suggestion's λ when the run's own λ does not finish, a smaller one when it does;
    l1_decay_knee: on a run too short for any λ (AdamS moves a pruned weight at most ~lr per step), the λ past
    which S_T hardly rises, below its ceiling."""
    from cast_llm.optim.forecast import l1_decay_knee, l1_decay_to_finish

    steps, lr, lam, sigma = 100, 5e-4, 1e-4, 1e-3
    opt, w, lrs = _noise_run(steps, lr, lam, sigma, stop=0)
    w.grad = torch.randn(w.shape, dtype=torch.float64) * sigma
    fc = forecast_decay(opt, lrs, target=0.99)
    found = l1_decay_to_finish(opt, lrs, target=0.99)
    assert found == pytest.approx(fc.suggestions["l1_decay"], rel=0.1)
    opt.param_groups[0]["l1_decay"] = 10 * found  # already finishes: the search goes down to about the same λ
    assert l1_decay_to_finish(opt, lrs, target=0.99) == pytest.approx(found, rel=0.25)
    short, slr = 10, [5e-4] * 10  # 10 steps of ≤ 5e-4 cannot bring |w| ~0.05 to 0
    opt3, w3, _ = _noise_run(short, 5e-4, lam, sigma, stop=0)
    w3.grad = torch.randn(w3.shape, dtype=torch.float64) * sigma
    assert l1_decay_to_finish(opt3, slr) is None
    knee, at_knee, ceiling = l1_decay_knee(opt3, slr)
    low = forecast_decay(opt3, slr, suggest=False).sparse_weight_ratio
    assert lam < knee < 1e3 * lam and low < at_knee <= ceiling < 0.99
    assert at_knee - low >= 0.9 * (ceiling - low) - 1e-9


def test_suggestions_finish_the_decay_when_followed():
    steps, lr, lam, sigma = 100, 5e-4, 1e-4, 1e-3
    opt, w, lrs = _noise_run(steps, lr, lam, sigma, stop=0)
    w.grad = torch.randn(w.shape, dtype=torch.float64) * sigma
    fc = forecast_decay(opt, lrs, target=0.99)
    assert not fc.finishes
    # noise-dominated (λ ≪ σ): a larger lr moves the noise as far as the decay, so only λ or steps help
    assert fc.suggestions["lr_factor"] is None and fc.suggestions["l1_decay"] and fc.suggestions["total_steps"]
    assert "--l1-decay" in fc.message(lr=lr, l1_decay=lam)
    opt2, w2, _ = _noise_run(steps, lr, fc.suggestions["l1_decay"], sigma)
    kept = float(w2.detach()[opt2.mask(w2)].abs().sum())
    assert kept / (kept + _pruned_l1(opt2, w2)) > 0.975  # the suggested λ gets there (0.99, within 0.015)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("forecast")
    tiny.save_model(d / "llama", "llama")
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 10))
    return d


@pytest.mark.parametrize("schedule, lr, lam", [("cosine", "1e-3", "1e-4"), ("constant", "1e-3", "3e-4")])
def test_forecast_during_a_run_matches_the_sparse_weight_ratio_it_reaches(workdir, tmp_path, schedule, lr, lam):
    out = tmp_path / "run"
    steps = 120
    assert main(["train", "--model", str(workdir / "llama"), "--data", str(workdir / "corpus.jsonl"), "--output-dir",
                 str(out), "--wikitext-file", str(workdir / "eval.txt"), "--max-steps", str(steps), "--batch-size",
                 "2", "--seq-len", "32", "--log-every", "10", "--val-sequences", "1", "--wikitext-windows", "1",
                 "--no-progress", "--no-report", "--mask-interval", "10", "--no-baseline-eval", "--paper-exact", "--lr-schedule",
                 schedule, "--lr", lr, "--l1-decay", lam]) == 0
    res = json.loads((out / "results.json").read_text())["decay"]
    actual = res["final_prune"]["sparse_weight_ratio"]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    later = [r["forecast_sparse_weight_ratio"] for r in recs if steps // 6 <= r["step"] < steps]
    # Each log step's forecast rests on one 2-sequence batch's gradient noise: measured on this corpus over seeds
    # 0-2 (the seed-independent split of issue 30), most forecasts after 1/6 of the run lie within 0.02 of the
    # end value, single ones up to 0.075 (cosine); the forecast before the first step underestimates S_T by
    # 0.29-0.32 with cosine, 0.09-0.10 constant.
    errors = sorted(abs(f - actual) for f in later)
    assert later and errors[len(errors) // 2] <= 0.03 and errors[-1] <= 0.08, (later, actual)
    assert abs(res["forecast_at_start"]["sparse_weight_ratio"] - actual) <= 0.35


def test_forecasts_are_logged_on_at_most_20_evenly_spread_log_steps():
    from cast_llm.train.methods.cast import MAX_FORECASTS, forecast_due

    assert MAX_FORECASTS == 20
    # a short run (12 log steps): every log step, as before
    assert [d for d in range(1, 121) if forecast_due(d, 120, 10)] == list(range(10, 121, 10))
    # a GPU-length run (1,000 log steps): every 50th log step, 20 in all, the same steps after a resume
    due = [d for d in range(1, 10_001) if d % 10 == 0 and forecast_due(d, 10_000, 10)]
    assert due == list(range(500, 10_001, 500))
    assert not forecast_due(7, 10_000, 1) and forecast_due(500, 10_000, 1)
