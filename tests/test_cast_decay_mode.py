"""``cast-llm train --method cast --decay-mode additive``: the paper's ablation of CAST's proportional decay
(Eq. 7) by an additive one (AST's), on a tiny random LLaMA — the optimizer CAST builds decays additively, the
decay forecast (a model of Eq. 7) is not made for it, and the option is refused where AdamS is not the
optimizer."""

from __future__ import annotations

import copy

import pytest
import tiny
import torch

from cast_llm.errors import CastError
from cast_llm.optim import AdamS
from cast_llm.optim.forecast import forecast_decay
from cast_llm.optim.functional import DECAY_MODES
from cast_llm.train import config
from cast_llm.train.config import TrainConfig
from cast_llm.train.methods import get_method


def _cfg(**kw) -> TrainConfig:
    base = dict(output_dir="unused", max_steps=6, lr=1e-2, l1_decay=1e-2, mask_interval=2, method="cast",
                paper_exact=True, kd=False, log_every=1)
    cfg = TrainConfig(**{**base, **kw})
    cfg.validate()
    return cfg


class _Ctx:
    def __init__(self):
        self.said = []

    def say(self, msg: str) -> None:
        self.said.append(msg)


def _run(cfg, base, batches):
    model = copy.deepcopy(base)
    method = get_method("cast")
    method.prepare_model(model, cfg)
    opt = method.build_optimizer(model, cfg, cfg.max_steps)
    ctx, logged = _Ctx(), []
    for step, batch in enumerate(batches):
        method.begin_step(model, opt, step)
        model(input_ids=batch, labels=batch).loss.backward()
        method.before_update(model, opt, step, ctx)
        opt.step()
        opt.zero_grad(set_to_none=True)
        method.end_step(model, opt, step)
        logged.append(method.log_metrics(model, opt, step))
    return model, opt, ctx, logged


def test_additive_decay_mode_reaches_adams_and_skips_the_proportional_forecast():
    torch.manual_seed(0)
    base = tiny.model("llama")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 500, (2, 16), generator=g) for _ in range(4)]
    runs = {mode: _run(_cfg(decay_mode=mode), base, batches) for mode in DECAY_MODES}
    _, opt_p, ctx_p, logged_p = runs["proportional"]
    _, opt_a, ctx_a, logged_a = runs["additive"]
    assert all(g["decay_mode"] == "additive" for g in opt_a.param_groups if g["sparse"])
    assert all(g["decay_mode"] == "proportional" for g in opt_p.param_groups if g["sparse"])
    assert any("decay forecast: sparse-weight ratio" in m for m in ctx_p.said)  # Eq. 7's forecast, for the proportional run
    assert ctx_a.said == ["decay forecast: not made (it models Eq. 7's proportional decay; this run decays "
                          "additively)"]
    assert any(x.get("forecast_sparse_weight_ratio") for x in logged_p) and not any(logged_a)
    with pytest.raises(ValueError, match="proportional decay"):
        forecast_decay(opt_a, [1e-2] * 6)
    # the two decays move the weights differently (the decay is strong enough here to show in 4 steps)
    wp = [p for g in opt_p.param_groups if g["sparse"] for p in g["params"]]
    wa = [p for g in opt_a.param_groups if g["sparse"] for p in g["params"]]
    assert any(not torch.equal(p, a) for p, a in zip(wp, wa))


def test_decay_modes_are_the_optimizers_and_the_option_is_adams_only():
    assert config.DECAY_MODES == DECAY_MODES  # config keeps a torch-free copy for the CLI
    AdamS([{"params": [torch.nn.Parameter(torch.ones(4, 4))], "sparse": True}], total_steps=2,
          decay_mode=config.DECAY_MODES[-1])
    for kw, message in ((dict(method="naive", paper_exact=False), "--decay-mode is AdamS's"),
                        (dict(mask_learner="srste"), "--mask-learner srste")):
        with pytest.raises(CastError, match=message):
            _cfg(decay_mode="additive", **kw)


def test_sparse_update_adam_reaches_adams_keeps_the_masks_and_skips_the_forecast():
    """`--sparse-update adam` (AdamW on the dense forward, issue 50's ablation of AdamS itself): CAST's optimizer
    groups take Adam's update, the forecast (a model of Eq. 7) is not made, the masks still exist for the prune,
    and the option is refused where AdamS is not the optimizer or with another decay."""
    from cast_llm.optim.adams import UPDATES

    assert config.SPARSE_UPDATES == UPDATES  # config keeps a torch-free copy for the CLI
    torch.manual_seed(0)
    base = tiny.model("llama")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 500, (2, 16), generator=g) for _ in range(4)]
    _, opt, ctx, logged = _run(_cfg(sparse_update="adam"), base, batches)
    assert all(gr["update"] == "adam" for gr in opt.param_groups if gr["sparse"])
    assert ctx.said == ["decay forecast: not made (it models Eq. 7's proportional decay; this run takes Adam's "
                        "update, with no decay)"]
    assert not any(logged)
    with pytest.raises(ValueError, match="Adam's update"):
        forecast_decay(opt, [1e-2] * 6)
    masks = opt.masks()
    assert masks and all(m.float().mean() == 0.5 for m in masks.values())
    for kw, message in ((dict(method="naive", paper_exact=False), "--sparse-update is AdamS's"),
                        (dict(mask_learner="srste"), "--mask-learner srste"),
                        (dict(decay_mode="additive"), "takes no decay")):
        with pytest.raises(CastError, match=message):
            _cfg(sparse_update="adam", **kw)
