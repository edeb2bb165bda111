"""Block-grouped weight scaling (nn/scaled_group.py): the hooks, the one-node autograd function and the
fallbacks, on CPU — the kernels replaced by torch ops (the Triton kernels themselves: test_step_kernels.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from step_kernel_checks import _tiny_llama

import cast_llm.nn.scaled_group as sg
from cast_llm.kernels.registry import probing
from cast_llm.nn import ScaledLinear, fold_scaling_, wrap_scaling_


def _torch_kernel(calls: list):
    """The grouped kernels' contract in torch ops (the per-layer formulas)."""

    def expand(a, w, g, transposed):
        return a.t().repeat_interleave(w.shape[0] // g, 0) if transposed else a.repeat_interleave(w.shape[1] // g, 1)

    def fwd(weights, scales, g, transposed, out_dtype):
        if not probing():  # the check before first use (cast_llm.kernels) does not count
            calls.append("fwd")
        return [(w.float() * expand(a, w, g, transposed)).to(out_dtype) for w, a in zip(weights, scales)]

    def bwd(grads, weights, scales, g, transposed, need_w, need_a):
        if not probing():
            calls.append(("bwd", len(grads)))
        gws = [(gr.float() * expand(a, w, g, transposed)).to(w.dtype) for gr, w, a in zip(grads, weights, scales)]
        gas = []
        for gr, w, a in zip(grads, weights, scales):
            prod = gr.float() * w.float()
            gas.append((prod.t() if transposed else prod).reshape(a.shape[0], g, -1).sum(-1))
        return (gws if need_w else [None] * len(grads)), (gas if need_a else [None] * len(grads))

    return SimpleNamespace(grouped_scaled_weights=fwd, grouped_scaled_weight_grads=bwd,
                           grouped_unsupported_reason=lambda *a: None)


def _pair():
    base = _tiny_llama("cpu")
    grouped, single = copy.deepcopy(base), copy.deepcopy(base)
    wrap_scaling_(grouped, n_groups=2)
    wrap_scaling_(single, n_groups=2, group_blocks=False)
    gen = torch.Generator().manual_seed(0)
    for a, b in zip(grouped.parameters(), single.parameters()):
        if a.dim() == 2 and a.shape[1] == 2:  # the scales
            with torch.no_grad():
                value = 0.5 + torch.rand(a.shape, generator=gen)
                a.copy_(value)
                b.copy_(value)
    return grouped, single


def _step(model, ids, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad for p in model.parameters()]


def test_blocks_are_grouped_and_the_cpu_takes_the_per_layer_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    grouped, single = _pair()
    block = grouped.model.layers[0]
    assert len(block.__dict__[sg.MEMBERS]) == 7 and all(isinstance(m, ScaledLinear) for m in block.__dict__[sg.MEMBERS])
    ids = torch.randint(0, 128, (2, 7))
    (l0, g0), (l1, g1) = _step(grouped, ids), _step(single, ids)
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    # a copy's groups are its own layers; the fold removes hooks and groups
    twin = copy.deepcopy(grouped)
    members = twin.model.layers[0].__dict__[sg.MEMBERS]
    assert all(any(m is x for x in twin.modules()) for m in members)
    fold_scaling_(grouped)
    assert sg.MEMBERS not in block.__dict__ and not block._forward_pre_hooks and not block._forward_hooks


@pytest.mark.parametrize("autocast", [False, True])
def test_grouped_node_gives_the_per_layer_numbers(monkeypatch, autocast):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors count as kernel tensors: the group path runs
    calls = []
    monkeypatch.setattr(sg, "_kernel", lambda: _torch_kernel(calls))
    grouped, single = _pair()
    monkeypatch.setattr("cast_llm.nn.scaled_weight._kernel", lambda: None)  # per-layer: the torch path
    ids = torch.randint(0, 128, (2, 7))
    (l0, g0), (l1, g1) = _step(grouped, ids, autocast), _step(single, ids, autocast)
    assert calls == ["fwd", ("bwd", 7)]  # one node for the block's seven layers, each way
    torch.testing.assert_close(l0, l1, rtol=0, atol=0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the weights are handed back after the block: a layer called on its own takes the per-layer path
    assert all(m.__dict__.get("_grouped") is None for m in grouped.modules() if isinstance(m, ScaledLinear))


def test_a_member_the_forward_skips_gets_no_gradient_and_exceptions_hand_weights_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(sg, "_kernel", lambda: _torch_kernel(calls))
    model, _ = _pair()
    block = model.model.layers[0]
    down = block.mlp.down_proj
    real = block.mlp.forward
    block.mlp.forward = lambda x: block.mlp.up_proj(x)[..., :32]  # gate and down never called
    _step(model, torch.randint(0, 128, (1, 5)))
    assert calls[-1] == ("bwd", 5)
    assert down.weight.grad is None and down.scale.grad is None and block.mlp.up_proj.weight.grad is not None

    def boom(x):
        raise RuntimeError("boom")

    block.mlp.forward = boom
    with pytest.raises(RuntimeError, match="boom"):
        model(input_ids=torch.randint(0, 128, (1, 5)))
    assert all(m.__dict__.get("_grouped") is None for m in block.__dict__[sg.MEMBERS])
    block.mlp.forward = real
    with torch.no_grad():  # no autograd: the per-layer path, no group node
        model(input_ids=torch.randint(0, 128, (1, 5)))
    assert calls.count("fwd") == 2
