"""``recomputed_scaled_linear`` (cast_llm/nn/recomputed_linear.py) against ScaledLinear's ordinary path
(scaled weight, then the matmul): the same output and gradients bit for bit, and no scaled weight kept."""

from __future__ import annotations

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from cast_llm.nn import ScaledLinear


def _layer(kind: str, dtype: torch.dtype, seed: int = 0) -> ScaledLinear:
    torch.manual_seed(seed)
    base = torch.nn.Linear(32, 24, bias=kind == "linear+bias") if kind != "conv1d" else Conv1D(24, 32)
    base.to(dtype)
    layer = ScaledLinear(base, n_groups=2, m=4)
    with torch.no_grad():
        layer.scale.copy_(1 + 0.3 * torch.randn(layer.scale.shape))  # fp32, as trained
    return layer


def _run(layer, x, autocast: bool):
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y, x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("kind", ["linear", "linear+bias", "conv1d"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-weights", "autocast"])
def test_equal_to_the_ordinary_path_bit_for_bit(kind, precision):
    """fp32; bf16 weights with fp32 scales and no autocast (FSDP2's policy); fp32 weights under bf16
    autocast. Both layouts, with and without a bias."""
    dtype = torch.bfloat16 if precision == "bf16-weights" else torch.float32
    layer = _layer(kind, dtype)
    x = torch.randn(3, 5, 32, dtype=dtype)
    want = _run(layer, x, precision == "autocast")
    layer.recompute_weight = True
    got = _run(layer, x, precision == "autocast")
    assert len(got) == len(want) >= 4
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _saved(layer, x) -> dict[str, int]:
    """Bytes autograd saves for the layer's backward, by what they are: parameters, the input, other."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kinds = {"param": 0, "input": 0, "other": 0}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        kind = "param" if ptr in params else "input" if ptr == x.untyped_storage().data_ptr() else "other"
        kinds[kind] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return kinds


def test_keeps_the_input_weight_and_scale_not_the_scaled_weight():
    layer = _layer("linear", torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    ordinary = _saved(layer, x)
    assert ordinary["other"] == 24 * 32 * 2  # Diag(A)·W in bf16, kept by the matmul
    layer.recompute_weight = True
    recomputing = _saved(layer, x)
    assert recomputing["other"] == 0 and recomputing["input"] == x.numel() * 2
    assert recomputing["param"] == layer.weight.numel() * 2 + layer.scale.numel() * 4
