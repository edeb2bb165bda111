"""The training baselines (method.md §6) as units on tiny random models: naive, SR-STE, AST, MaskLLM.

Each test drives the method hooks directly (prepare_model → build_optimizer → begin_step / step), the way
the training loop does, and checks what the method promises; ``test_train_methods.py`` runs them end to end.
"""

from __future__ import annotations

import copy

import pytest
import tiny
import torch

from cast_llm.sparsity.mask import is_nm, nm_mask
from cast_llm.train.config import TrainConfig
from cast_llm.train.methods import get_method


def _cfg(**kw) -> TrainConfig:
    base = dict(output_dir="unused", max_steps=6, lr=1e-2, mask_interval=2, weight_decay=0.1)
    cfg = TrainConfig(**{**base, **kw})
    cfg.validate()
    return cfg


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (2, 16), generator=g)


def _train(method, model, cfg, steps, each_step=None):
    model.train()
    method.prepare_model(model, cfg)
    opt = method.build_optimizer(model, cfg, steps)
    for s in range(steps):
        method.begin_step(model, opt, s)
        batch = _batch(s)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if each_step is not None:
            each_step(s, opt)
    return opt


def _rows(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return w.t() if transposed else w


# ---------------------------------------------------------------------------------------------------- naive
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_naive_pruned_weights_and_their_optimizer_state_stay_exactly_zero(arch):
    model = tiny.model(arch)
    method = get_method("naive")
    cfg = _cfg(method="naive")
    start = {}

    def check(step, opt):
        for fqn, w in method.wrappers.items():
            weight, mask = w.weight, w.mask
            assert torch.equal(mask, start[fqn]), f"{fqn}: the mask moved at step {step + 1}"
            assert bool((weight[~mask] == 0).all()), f"{fqn}: a pruned weight moved at step {step + 1}"
            state = opt.state[weight]
            assert bool((state["exp_avg"][~mask] == 0).all()) and bool((state["exp_avg_sq"][~mask] == 0).all())

    method.prepare_model(model, cfg)
    start = {fqn: w.mask.clone() for fqn, w in method.wrappers.items()}
    kept_before = {fqn: w.weight.detach()[w.mask].clone() for fqn, w in method.wrappers.items()}
    opt = method.build_optimizer(model, cfg, 6)
    model.train()
    for s in range(6):
        method.begin_step(model, opt, s)
        batch = _batch(s)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        check(s, opt)
    moved = [not torch.equal(w.weight.detach()[w.mask], kept_before[f]) for f, w in method.wrappers.items()]
    assert all(moved), "the kept weights must train"
    method.finalize(model, opt)
    from cast_llm.targets import find_targets

    for t in find_targets(model):
        assert is_nm(_rows(t.weight.detach(), t.transposed), 2, 4), t.fqn


# --------------------------------------------------------------------------------------------------- SR-STE
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_ste_forward_uses_masked_weight_and_gradient_reaches_pruned_entries(layout):
    from transformers.pytorch_utils import Conv1D

    from cast_llm.nn import SparseForwardLinear

    torch.manual_seed(0)
    if layout == "linear":
        layer = torch.nn.Linear(16, 8)
        mask = nm_mask(layer.weight.detach())
    else:
        layer = Conv1D(8, 16)  # weight (in, out) = (16, 8), N:M groups along dim 0
        torch.nn.init.normal_(layer.weight)
        mask = nm_mask(layer.weight.detach().t()).t()
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        reference.weight.mul_(mask)  # the explicitly masked model
    x = torch.randn(3, 5, 16)
    upstream = torch.randn(3, 5, 8)
    for ste in (True, False):
        wrapped = SparseForwardLinear(copy.deepcopy(layer), mask, ste=ste)
        y, y_ref = wrapped(x), reference(x)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)  # Conv1D's own forward may fuse the bias add
        (y * upstream).sum().backward()
        reference.weight.grad = None
        (y_ref * upstream).sum().backward()
        if ste:  # straight through: the gradient of W⊙M, unmasked, on every entry of W
            torch.testing.assert_close(wrapped.weight.grad, reference.weight.grad, rtol=0, atol=1e-5)
            assert bool((wrapped.weight.grad[~mask] != 0).any())
        else:  # naive: pruned entries get exactly nothing
            torch.testing.assert_close(wrapped.weight.grad, reference.weight.grad * mask, rtol=0, atol=1e-5)
            assert bool((wrapped.weight.grad[~mask] == 0).all())


def test_srste_model_forward_equals_the_explicitly_masked_model():
    model = tiny.model("llama")
    reference = copy.deepcopy(model)
    method = get_method("srste")
    method.prepare_model(model, _cfg(method="srste"))
    with torch.no_grad():
        for fqn, w in method.wrappers.items():
            reference.get_submodule(fqn).weight.mul_(w.mask)
    batch = _batch()
    torch.testing.assert_close(model(input_ids=batch).logits, reference(input_ids=batch).logits, rtol=0, atol=1e-6)


def test_srste_decay_is_added_to_pruned_gradients_then_plain_adamw():
    from cast_llm.optim import SRSTEAdamW

    torch.manual_seed(0)
    w0 = torch.randn(6, 8, dtype=torch.float64)
    mask = nm_mask(w0)
    lam, hp = 0.3, dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    opt_a = SRSTEAdamW([a], {a: mask}, srste_decay=lam, **hp)
    opt_b = torch.optim.AdamW([b], **hp)
    for _ in range(4):
        g = torch.randn(6, 8, dtype=torch.float64)
        a.grad = g.clone()
        b.grad = g + lam * (~mask).double() * b.detach()  # g + λ_W (1 − M) ⊙ W by hand
        opt_a.step()
        opt_b.step()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="srste_decay"):
        SRSTEAdamW([a], {a: mask}, srste_decay=-1.0)


def test_srste_reads_the_mask_buffers_the_model_holds_after_a_move():
    """accelerate moves the model after the optimizer is built: a move replaces every buffer, so SR-STE must
    read the wrappers' current mask, not a tensor captured at construction (it was on the CPU while the
    weights were on the GPU, and its in-place mask updates were never seen)."""
    model = tiny.model("llama")
    method = get_method("srste")
    cfg = _cfg(method="srste", srste_decay=0.5)
    method.prepare_model(model, cfg)
    opt = method.build_optimizer(model, cfg, 4)
    before = {fqn: w.mask for fqn, w in method.wrappers.items()}
    model._apply(lambda t: t.clone())  # what .to(device) does: new buffers, parameters keep their identity
    fqn, w = next(iter(method.wrappers.items()))
    assert w.mask is not before[fqn]
    new_mask = ~w.mask  # the other two of each group: still 2:4, and a different mask
    assert not torch.equal(new_mask, w.mask)
    w.mask.copy_(new_mask)  # an in-place mask update on the moved buffer
    for p in (x for g in opt.param_groups for x in g["params"]):
        p.grad = torch.zeros_like(p)
    opt.add_srste_decay_()
    expected = torch.where(new_mask, 0.0, w.weight.detach()) * 0.5
    torch.testing.assert_close(w.weight.grad, expected, rtol=0, atol=0)
    assert torch.equal(opt.masks()[w.weight], new_mask)


def test_srste_recomputes_masks_from_weights_every_interval():
    model = tiny.model("llama")
    method = get_method("srste")
    cfg = _cfg(method="srste", mask_interval=2, lr=3e-2)
    seen = []

    def check(step, opt):
        w = next(iter(method.wrappers.values()))
        seen.append(w.mask.clone())

    _train(method, model, cfg, 6, check)
    # seen[i] is the mask used at step t = i + 1: it may only change when t mod T1 == 0 (before the forward)
    changes = [i for i in range(1, 6) if not torch.equal(seen[i - 1], seen[i])]
    assert changes and all((i + 1) % 2 == 0 for i in changes), changes


# ------------------------------------------------------------------------------------------------- MaskLLM
def test_maskllm_patterns_soft_mask_and_prior():
    from cast_llm.nn import MaskLLMLinear
    from cast_llm.nn.maskllm_linear import nm_patterns, pattern_index

    p = nm_patterns(2, 4)
    assert p.shape == (6, 4) and bool((p.sum(1) == 2).all()) and len({tuple(r.tolist()) for r in p}) == 6
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    prior = nm_mask(layer.weight.detach())
    assert torch.equal(p[pattern_index(prior, p)].flatten(-2), prior)
    wrapped = MaskLLMLinear(layer.requires_grad_(False), prior, prior_bonus=3.0, tau=4.0, kappa=100.0)
    assert torch.equal(wrapped.hard_mask(), prior)  # the prior pattern is the argmax at the start
    wrapped.train()
    soft = wrapped.soft_mask()
    # every group's soft mask is a convex mix of patterns that each keep 2: it sums to exactly 2
    torch.testing.assert_close(soft.unflatten(-1, (-1, 4)).sum(-1), torch.full((8, 4), 2.0))
    wrapped(torch.randn(2, 16)).sum().backward()
    assert wrapped.logits.grad is not None and bool(wrapped.logits.grad.abs().sum() > 0)
    wrapped.eval()
    torch.testing.assert_close(wrapped(torch.ones(1, 16)), torch.nn.functional.linear(
        torch.ones(1, 16), layer.weight * prior, layer.bias))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_maskllm_leaves_weights_bit_identical_and_ends_exactly_24(arch):
    model = tiny.model(arch)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    method = get_method("maskllm")
    cfg = _cfg(method="maskllm", lr=5e-2, maskllm_prior=0.5)
    start = {}

    def remember(step, opt):
        if step == 0:
            start.update({f: w.hard_mask() for f, w in method.wrappers.items()})

    opt = _train(method, model, cfg, 6, remember)
    final = {f: w.hard_mask() for f, w in method.wrappers.items()}
    assert any(not torch.equal(start[f], final[f]) for f in final), "the masks must learn something"
    method.finalize(model, opt)
    from cast_llm.targets import find_targets

    targets = {t.fqn: t for t in find_targets(model)}
    for key, value in model.state_dict().items():
        fqn = key.removesuffix(".weight")
        if fqn in targets:
            kept = value != 0
            assert is_nm(_rows(value, targets[fqn].transposed), 2, 4) and float(kept.float().mean()) == 0.5
            assert torch.equal(value[kept], original[key][kept]), f"{key}: kept weights must be bit-identical"
        else:
            assert torch.equal(value, original[key]), f"{key} changed"


# ------------------------------------------------------------------------------------------------------ AST
def test_ast_forward_and_optimizer_share_the_mask():
    model = tiny.model("llama")
    method = get_method("ast")
    cfg = _cfg(method="ast", mask_interval=2, lr=3e-2, srste_decay=1e-2)

    def check(step, opt):
        for w in method.wrappers.values():
            assert torch.equal(opt.mask(w.weight), w.mask)
        assert all(g["decay_mode"] == "additive" for g in opt.param_groups if g["sparse"])

    _train(method, model, cfg, 6, check)


# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw, message", [
    (dict(method="naive", mask_learner="srste"), "mask-learner"),
    (dict(method="maskllm", scaling=True), "scaling"),
    (dict(method="maskllm", fixed_mask=True), "fixed-mask"),
    (dict(method="maskllm", maskllm_tau="4"), "maskllm-tau"),
    (dict(method="srste", srste_decay=-1.0), "srste-decay"),
])
def test_config_refuses_combinations_that_mean_nothing(kw, message):
    from cast_llm.errors import CastError

    with pytest.raises(CastError, match=message):
        _cfg(**kw)


def test_method_defaults_for_kd_and_scaling():
    assert [_cfg(method=m).use_kd for m in ("cast", "ast", "naive", "srste", "maskllm")] == [True, True, False,
                                                                                            False, False]
    assert [_cfg(method=m).use_scaling for m in ("cast", "ast", "naive")] == [True, False, False]
    assert _cfg(method="naive", kd=True).use_kd and not _cfg(method="cast", kd=False).use_kd
    assert _cfg(fixed_mask=True).effective_mask_interval == 0
