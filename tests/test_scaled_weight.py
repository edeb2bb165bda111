"""The hand-written W_scale = Diag(A) W (Eq. 11-12) of ScaledLinear equals autograd through the same product."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import cast_llm.nn.scaled_weight as sw
from cast_llm.nn import ScaledLinear


def _pair(kind, g, dtype=torch.float32, out=24, inp=32):
    """Two identical ScaledLinear layers with a non-trivial scale."""
    torch.manual_seed(0)
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        base = nn.Linear(inp, out).to(dtype) if kind == "linear" else Conv1D(out, inp).to(dtype)
        layer = ScaledLinear.from_linear(base, n_groups=g)
        with torch.no_grad():
            layer.scale.copy_(torch.linspace(0.5, 1.5, layer.scale.numel()).view_as(layer.scale))
        layers.append(layer)
    return layers


def _run(layer, x, upstream, reference: bool, autocast: bool = False):
    if reference:  # the plain autograd product: what ScaledLinear.forward did before the custom function
        layer.forward = lambda inp: _autograd_forward(layer, inp)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    (y.float() * upstream).sum().backward()
    return y.detach(), layer.weight.grad, layer.scale.grad


def _autograd_forward(layer, x):
    w = layer.scaled_weight()
    if not layer.transposed:
        return nn.functional.linear(x, w, layer.bias)
    return torch.addmm(layer.bias, x.reshape(-1, layer.in_features), w).view(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("setting", ["fp32", "bf16-weight", "autocast-bf16"])
def test_custom_backward_equals_autograd(monkeypatch, kind, g, setting):
    monkeypatch.setattr(sw, "_BLOCK", 40)  # several cache blocks per weight, a ragged last one
    dtype = torch.bfloat16 if setting == "bf16-weight" else torch.float32
    ours, ref = _pair(kind, g, dtype)
    x = torch.randn(3, 5, 32).to(dtype)
    upstream = torch.randn(3, 5, 24)
    autocast = setting == "autocast-bf16"
    y1, gw1, ga1 = _run(ours, x, upstream, reference=False, autocast=autocast)
    y2, gw2, ga2 = _run(ref, x, upstream, reference=True, autocast=autocast)
    assert y1.dtype == y2.dtype and gw1.dtype == gw2.dtype == dtype and ga1.dtype == ga2.dtype == torch.float32
    assert torch.equal(y1, y2) and torch.equal(gw1, gw2)
    if kind == "linear":  # rows reduced whole, as autograd does: bitwise
        assert torch.equal(ga1, ga2)
    else:  # Conv1D layout: the CPU sums each block's entries slice by slice
        torch.testing.assert_close(ga1, ga2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("g", [1, 2])
def test_gradcheck_float64(monkeypatch, transposed, g):
    monkeypatch.setattr(sw, "_BLOCK", 24)
    w = torch.randn((16, 6) if transposed else (6, 16), dtype=torch.float64, requires_grad=True)
    a = torch.rand(6, g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w, a: sw.scaled_weight(w, a, g, transposed, torch.float64), (w, a))


def test_only_the_needed_gradients_are_formed():
    w = torch.randn(4, 8, requires_grad=True)
    a = torch.ones(4, 2)  # frozen scale
    sw.scaled_weight(w, a, 2, False, torch.float32).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(4, 8))


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("setting,tol", [("float64", 1e-12), ("fp32", 1e-5), ("autocast-bf16", 3e-2)])
def test_forward_and_backward_match_the_diag_a_w_formula_in_float64(kind, g, setting, tol):
    """ScaledLinear (the CPU path) against ``y = x (Diag(A) W)^T + b`` written out in float64 (the scale
    repeated over each block's columns), outputs and both gradients; autocast bf16: the bf16 matmuls'
    rounding."""
    from step_kernel_checks import _reference_scaled

    dtype = torch.float64 if setting == "float64" else torch.float32
    torch.manual_seed(0)
    base = (nn.Linear(96, 40) if kind == "linear" else Conv1D(40, 96)).to(dtype)
    layer = ScaledLinear.from_linear(base, n_groups=g)
    with torch.no_grad():
        layer.scale.copy_(0.5 + torch.rand(layer.scale.shape))
    x = torch.randn(3, 7, 96, dtype=dtype)
    upstream = torch.randn(3, 7, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "autocast-bf16"):
        y = layer(x)
    (y.double() * upstream.double()).sum().backward()
    ry, rgw, rga = _reference_scaled(kind, layer.weight, layer.scale, layer.bias, x, upstream)
    for got, ref in ((y, ry), (layer.weight.grad, rgw), (layer.scale.grad, rga)):
        assert float((got.detach().double() - ref).abs().max() / ref.abs().max()) <= tol
