"""CAST's options that let a warm-started mask move (--warm-start-mix, --regrow-factor/--regrow-fraction):
what each changes, and what it must leave alone, on a tiny random LLaMA."""

from __future__ import annotations

import copy

import pytest
import tiny
import torch

from cast_llm.errors import CastError
from cast_llm.targets import find_targets
from cast_llm.train.config import TrainConfig
from cast_llm.train.methods import get_method


def _cfg(**kw) -> TrainConfig:
    base = dict(output_dir="unused", max_steps=6, lr=1e-2, l1_decay=1e-3, mask_interval=2, method="cast",
                init_mask="magnitude", warm_start=True, kd=False, repair_fraction=0.0)
    cfg = TrainConfig(**{**base, **kw})
    cfg.validate()
    return cfg


def _weights(model) -> dict[str, torch.Tensor]:
    return {t.fqn: t.weight.detach().clone() for t in find_targets(model)}


@pytest.mark.parametrize("mix", [0.0, 0.25, 1.0])
def test_warm_start_mix_starts_pruned_entries_at_that_fraction_of_their_dense_value(mix):
    model = tiny.model("llama")
    dense = _weights(model)
    method = get_method("cast")
    method.prepare_model(model, _cfg(warm_start_mix=mix, scaling=False))
    start = _weights(model)
    for fqn, w in start.items():
        mask = method._init_masks[fqn]
        # magnitude one-shot keeps the kept entries as they are: (1-f)·w + f·w = w (to rounding)
        torch.testing.assert_close(w[mask], dense[fqn][mask], rtol=0, atol=1e-7)
        torch.testing.assert_close(w[~mask], mix * dense[fqn][~mask], rtol=0, atol=1e-7)
    # non-target parameters are untouched
    ref = tiny.model("llama")
    names = {f"{fqn}.weight" for fqn in start}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if name not in names:
            assert torch.equal(p, q), name


class _Ctx:
    def say(self, msg: str) -> None:  # the decay forecast of step 0 reports through the loop's context
        pass


def _one_step(model, method, cfg, batch, step=0):
    opt = method.build_optimizer(model, cfg, cfg.max_steps)
    method.begin_step(model, opt, step)
    model(input_ids=batch, labels=batch).loss.backward()
    method.before_update(model, opt, step, _Ctx())
    opt.step()
    method.end_step(model, opt, step)
    return opt


def test_regrow_scales_only_the_pruned_entries_updates_and_only_in_its_phase():
    torch.manual_seed(0)
    base = tiny.model("llama")
    batch = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = {}
    for k in (1.0, 5.0):
        model = copy.deepcopy(base)
        cfg = _cfg(regrow_factor=k, regrow_fraction=0.5) if k > 1 else _cfg()
        method = get_method("cast")
        method.prepare_model(model, cfg)
        before = _weights(model)
        opt = _one_step(model, method, cfg, batch)
        masks = {method._names[id(p)]: m for p, m in opt.masks().items()}
        runs[k] = (before, _weights(model), masks, method)
    (b1, a1, m1, _), (b5, a5, m5, method5) = runs[1.0], runs[5.0]
    moved = 0
    for fqn in a1:
        assert torch.equal(m1[fqn], m5[fqn])
        kept = m1[fqn]
        assert torch.equal(a5[fqn][kept], a1[fqn][kept]), f"{fqn}: a kept entry's update changed"
        d1, d5 = (a1[fqn] - b1[fqn])[~kept], (a5[fqn] - b5[fqn])[~kept]
        torch.testing.assert_close(d5, 5.0 * d1, rtol=1e-5, atol=1e-9)
        moved += int((d1 != 0).sum())
    assert moved > 0, "no pruned entry moved: the test would prove nothing"
    # the phase: 6 steps × 0.5 = steps 0-2 scale, step 3 on does not
    assert [method5.in_regrow(s) for s in range(6)] == [True, True, True, False, False, False]


@pytest.mark.parametrize("kw, message", [
    (dict(warm_start=False, warm_start_mix=0.5), "needs --warm-start"),
    (dict(regrow_factor=3.0), "go together"),
    (dict(regrow_fraction=0.3), "go together"),
    (dict(paper_exact=True, warm_start=None, init_mask=None, repair_fraction=None, warm_start_mix=0.5),
     "excludes --warm-start-mix"),
])
def test_refused_combinations(kw, message):
    with pytest.raises(CastError, match=message):
        _cfg(**kw)


def test_start_masks_are_freed_once_adams_holds_them_and_a_resume_computes_no_start():
    """The one-shot start's masks live on in AdamS alone (the method's copy is dropped: 1 byte per target
    weight for the whole run otherwise); start="skip" (a resume) computes no start and leaves the weights."""
    model = tiny.model("llama")
    cfg = _cfg()
    method = get_method("cast")
    method.prepare_model(model, cfg)
    started = {k: v.clone() for k, v in method._init_masks.items()}
    opt = method.build_optimizer(model, cfg, cfg.max_steps)
    assert method._init_masks is None
    held = {method._names[id(p)]: m for p, m in opt.masks().items()}
    assert held.keys() == started.keys() and all(torch.equal(held[k], m) for k, m in started.items())
    fresh = tiny.model("llama")
    before = _weights(fresh)
    resumed = get_method("cast")
    resumed.prepare_model(fresh, cfg, start="skip")
    assert resumed._init_masks is None
    assert all(torch.equal(before[k], w) for k, w in _weights(fresh).items())
