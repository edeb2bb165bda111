"""cast_llm.layers (what a linear layer is, without importing the wrappers) and the wrappers' one API:
``from_linear`` / ``to_linear`` on ScaledLinear, SparseForwardLinear and MaskLLMLinear."""

from __future__ import annotations

import pytest
import tiny
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from cast_llm.layers import is_linear_like, is_scaled_linear, linear_features, set_submodule
from cast_llm.nn import MaskLLMLinear, ScaledLinear, SparseForwardLinear, wrap_scaling_, wrap_sparse_forward_
from cast_llm.sparsity.mask import is_nm, magnitude_mask
from cast_llm.targets import find_targets


def _layers():
    torch.manual_seed(0)
    return nn.Linear(16, 8), Conv1D(8, 16)  # Conv1D(nf=out, nx=in): weight (16, 8) = (in, out)


def test_layer_kinds_are_recognised_by_what_they_are():
    lin, conv = _layers()
    assert is_linear_like(lin) and is_linear_like(conv)
    assert linear_features(lin) == (16, 8, False) and linear_features(conv) == (16, 8, True)
    scaled = ScaledLinear.from_linear(conv, n_groups=2, m=4)
    assert is_scaled_linear(scaled) and not is_linear_like(scaled) and linear_features(scaled) == (16, 8, True)
    mask = magnitude_mask(lin.weight, False, 2, 4)
    for wrapper in (SparseForwardLinear.from_linear(lin, mask, ste=True), MaskLLMLinear.from_linear(lin, mask)):
        assert not is_scaled_linear(wrapper) and not is_linear_like(wrapper)  # masks, not a dense linear map
    assert not is_scaled_linear(lin) and not is_scaled_linear(nn.LayerNorm(4))


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_every_wrapper_goes_back_to_the_same_layer_with_to_linear(kind):
    lin, conv = _layers()
    layer = lin if kind == "linear" else conv
    transposed = kind == "conv1d"
    x = torch.randn(3, 16)
    mask = magnitude_mask(layer.weight, transposed, 2, 4)

    sparse = SparseForwardLinear.from_linear(layer, mask, ste=False)
    expected = sparse(x)
    back = sparse.to_linear()
    assert back is layer and torch.equal(back(x), expected) and not back.weight[~mask].any()  # pruned: exactly 0

    _, conv2 = _layers()
    layer2 = nn.Linear(16, 8) if kind == "linear" else conv2
    kept = layer2.weight.detach().clone()
    prior = magnitude_mask(layer2.weight, transposed, 2, 4)
    learned = MaskLLMLinear.from_linear(layer2, prior, n=2, m=4).eval()
    back = learned.to_linear()
    assert back is layer2
    rows = back.weight.t() if transposed else back.weight
    assert is_nm(rows, 2, 4) and torch.equal(back.weight[prior], kept[prior])  # the prior wins at start


def test_targets_report_scaling_wrappers_and_look_inside_masking_ones():
    model = tiny.model("llama")
    plain = find_targets(model)
    wrap_scaling_(model, n_groups=1)
    scaled = find_targets(model)
    assert [t.fqn for t in scaled] == [t.fqn for t in plain] and all(isinstance(t.module, ScaledLinear) for t in scaled)
    masks = {t.fqn: magnitude_mask(t.weight, t.transposed, 2, 4) for t in scaled}
    wrap_sparse_forward_(model, masks, ste=True)
    inner = find_targets(model)  # the sparse-forward wrappers are looked into: the ScaledLinears inside
    assert [t.fqn for t in inner] == [f"{t.fqn}.base_layer" for t in plain]
    assert [t.weight for t in inner] == [t.weight for t in scaled]


def test_set_submodule_replaces_by_name():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.ReLU())
    new = nn.Linear(2, 2)
    set_submodule(model, "0.0", new)
    set_submodule(model, "1", nn.Tanh())
    assert model[0][0] is new and isinstance(model[1], nn.Tanh)
