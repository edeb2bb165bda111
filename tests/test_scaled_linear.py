"""ScaledLinear (Eq. 11-12): identity at init, exact folding, gradients, N:M invariance, whole-model wrap/fold."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.pytorch_utils import Conv1D

from cast_llm.errors import CastError
from cast_llm.nn import ScaledLinear, fold_scaling_, wrap_scaling_

IN, OUT = 32, 12


def make_layer(kind: str, bias: bool = True, dtype=torch.float32) -> nn.Module:
    if kind == "linear":
        layer = nn.Linear(IN, OUT, bias=bias, dtype=dtype)
    else:
        layer = Conv1D(OUT, IN).to(dtype)  # weight (in, out)
        nn.init.normal_(layer.bias)
    return layer


def plain_forward(layer: nn.Module, x: torch.Tensor, weight_out_in: torch.Tensor) -> torch.Tensor:
    """Reference: y = x Wᵀ + b with an explicit (out, in) weight, whatever the layer's layout."""
    y = x @ weight_out_in.t()
    return y if layer.bias is None else y + layer.bias


def explicit_scaled(weight_out_in: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Diag(A) W block by block, built column block by column block (independent of the module's code)."""
    out, n_in = weight_out_in.shape
    g = scale.shape[1]
    width = n_in // g
    cols = [weight_out_in[:, b * width : (b + 1) * width] * scale[:, b : b + 1] for b in range(g)]
    return torch.cat(cols, dim=1)


def out_in(layer: nn.Module) -> torch.Tensor:
    return layer.weight.t() if isinstance(layer, Conv1D) else layer.weight


# transformers' Conv1D always has a bias (its forward is addmm(bias, ...)), so no bias-free Conv1D case
GRID = [
    pytest.param(kind, bias, g, id=f"{kind}-{'bias' if bias else 'nobias'}-g{g}")
    for kind, bias in (("linear", True), ("linear", False), ("conv1d", True))
    for g in (1, 2)
]


@pytest.mark.parametrize("kind,bias,g", GRID)
def test_identity_at_init(kind, bias, g):
    layer = make_layer(kind, bias)
    x = torch.randn(3, 5, IN)
    expected = layer(x)
    scaled = ScaledLinear.from_linear(layer, n_groups=g)
    assert scaled.base_layer is layer
    assert scaled.scale.shape == (OUT, g) and bool((scaled.scale == 1).all())
    assert scaled.weight is layer.weight
    assert (scaled.in_features, scaled.out_features, scaled.transposed) == (IN, OUT, kind == "conv1d")
    torch.testing.assert_close(scaled(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind,bias,g", GRID)
def test_forward_matches_explicit_and_to_linear(kind, bias, g, dtype):
    layer = make_layer(kind, bias, dtype)
    scaled = ScaledLinear.from_linear(layer, n_groups=g)
    assert scaled.scale.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    with torch.no_grad():
        scaled.scale.uniform_(0.5, 1.5)  # "trained" scale
    x = torch.randn(4, IN, dtype=dtype)
    y = scaled(x)
    ref = plain_forward(layer, x, explicit_scaled(out_in(layer), scaled.scale))
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)

    folded = scaled.to_linear()
    assert type(folded) is type(layer) and folded is layer  # original type, original object
    torch.testing.assert_close(folded(x), y, rtol=0, atol=1e-6)
    # the wrapper stays equivalent to its (now folded) base layer instead of scaling twice
    assert bool((scaled.scale == 1).all())
    torch.testing.assert_close(scaled(x), y, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind,bias,g", GRID)
def test_to_linear_with_mask_is_exactly_nm(kind, bias, g):
    from cast_llm.sparsity.mask import is_nm, nm_mask

    layer = make_layer(kind, bias, torch.float64)
    scaled = ScaledLinear.from_linear(layer, n_groups=g)
    with torch.no_grad():
        scaled.scale.uniform_(0.5, 1.5)
    w = out_in(layer).detach().clone()
    mask_oi = nm_mask(w)  # (out, in), groups along the input dim
    mask = mask_oi.t() if kind == "conv1d" else mask_oi  # the weight's own layout
    expected_w = explicit_scaled(w * mask_oi, scaled.scale.detach())
    x = torch.randn(6, IN, dtype=torch.float64)
    expected_y = plain_forward(layer, x, expected_w)

    folded = scaled.to_linear(mask)
    w_after = out_in(folded)
    assert is_nm(w_after, 2, 4)
    assert bool((w_after[~mask_oi] == 0).all())
    torch.testing.assert_close(w_after, expected_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(folded(x), expected_y, rtol=0, atol=1e-10)


def test_mask_shape_error_names_layout():
    scaled = ScaledLinear.from_linear(make_layer("conv1d", True))
    with pytest.raises(ValueError, match=r"\(12, 32\).*\(32, 12\).*\(in, out\)"):
        scaled.to_linear(torch.ones(OUT, IN, dtype=torch.bool))


@pytest.mark.parametrize("g", [1, 2, 4])
def test_scale_never_changes_which_entries_nm_mask_keeps(g):
    from cast_llm.sparsity.mask import nm_mask

    gen = torch.Generator().manual_seed(1)
    for _ in range(25):
        w = torch.randn(16, 64, generator=gen)
        scale = torch.exp(torch.randn(16, g, generator=gen) * 2)  # positive, spanning ~e^±4
        layer = nn.Linear(64, 16, bias=False)
        scaled = ScaledLinear.from_linear(layer, n_groups=g)
        with torch.no_grad():
            layer.weight.copy_(w)
            scaled.scale.copy_(scale)
        assert torch.equal(nm_mask(scaled.scaled_weight().detach()), nm_mask(w))


@pytest.mark.parametrize("kind,bias,g", GRID)
def test_gradients_match_float64_reference(kind, bias, g):
    layer = make_layer(kind, bias, torch.float64)
    scaled = ScaledLinear.from_linear(layer, n_groups=g)
    with torch.no_grad():
        scaled.scale.uniform_(0.5, 1.5)
    x = torch.randn(2, 7, IN, dtype=torch.float64)
    upstream = torch.randn(2, 7, OUT, dtype=torch.float64)
    (scaled(x) * upstream).sum().backward()

    # reference: autograd through an explicitly built Diag(A) W on independent leaf copies
    w_ref = out_in(layer).detach().clone().requires_grad_(True)
    a_ref = scaled.scale.detach().clone().requires_grad_(True)
    b_ref = layer.bias.detach().clone().requires_grad_(True) if bias else None
    y_ref = x @ explicit_scaled(w_ref, a_ref).t()
    if bias:
        y_ref = y_ref + b_ref
    (y_ref * upstream).sum().backward()

    grad_w = layer.weight.grad.t() if kind == "conv1d" else layer.weight.grad
    torch.testing.assert_close(grad_w, w_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scaled.scale.grad, a_ref.grad, rtol=1e-12, atol=1e-12)
    if bias:
        torch.testing.assert_close(layer.bias.grad, b_ref.grad, rtol=1e-12, atol=1e-12)


def test_bf16_weight_keeps_fp32_scale_and_autocast_works():
    layer = nn.Linear(IN, OUT).to(torch.bfloat16)
    scaled = ScaledLinear.from_linear(layer)
    assert scaled.scale.dtype == torch.float32
    x = torch.randn(3, IN, dtype=torch.bfloat16)
    y = scaled(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert scaled.scale.grad.dtype == torch.float32

    fp32 = ScaledLinear.from_linear(nn.Linear(IN, OUT))  # fp32 master weights under bf16 autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp32(torch.randn(3, IN))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert fp32.scale.grad.dtype == torch.float32 and fp32.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("in_features,g", [(30, 1), (36, 2), (20, 2)])
def test_incompatible_width_error_names_shape(in_features, g):
    with pytest.raises(ValueError, match=rf"\(16, {in_features}\).*n_groups={g}"):
        ScaledLinear.from_linear(nn.Linear(in_features, 16), n_groups=g)


def test_rejects_non_linear_and_double_wrap():
    with pytest.raises(TypeError):
        ScaledLinear(nn.LayerNorm(8))
    with pytest.raises(TypeError):
        ScaledLinear(ScaledLinear(nn.Linear(8, 8)))


# ------------------------------------------------------------------------------------- whole models


def tiny_llama(**overrides) -> LlamaForCausalLM:
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128)
    kw.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


def test_wrap_and_fold_tiny_llama_identical_logits_and_keys():
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 9))
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(ids).logits
    wrapped = wrap_scaling_(model)
    assert len(wrapped) == 14 and wrapped[0] == "model.layers.0.self_attn.q_proj"
    assert isinstance(model.get_submodule("model.layers.1.mlp.down_proj"), ScaledLinear)
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in model.state_dict()
    assert wrap_scaling_(model) == []  # already wrapped layers are left alone
    with torch.no_grad():
        after_wrap = model(ids).logits
    fold_scaling_(model)
    with torch.no_grad():
        after_fold = model(ids).logits
    torch.testing.assert_close(after_wrap, before, rtol=0, atol=0)
    torch.testing.assert_close(after_fold, before, rtol=0, atol=0)
    assert list(model.state_dict()) == keys
    assert not any(isinstance(m, ScaledLinear) for m in model.modules())


def test_fold_trained_scales_and_masks_by_name_and_parameter():
    from cast_llm.sparsity.mask import is_nm, nm_mask

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 7))
    wrap_scaling_(model)
    wrappers = {n: m for n, m in model.named_modules() if isinstance(m, ScaledLinear)}
    masks = {}
    for i, (name, mod) in enumerate(wrappers.items()):
        with torch.no_grad():
            mod.scale.uniform_(0.8, 1.2)
        mask = nm_mask(mod.weight.detach())
        key = [name, f"{name}.weight", f"{name}.base_layer.weight", mod.weight][i % 4]
        masks[key] = mask
    # expected: the wrapped model's forward with W ⊙ M (the forward is dense, so mask a copy by hand)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for mod in reference.modules():
            if isinstance(mod, ScaledLinear):
                mod.weight.mul_(nm_mask(mod.weight))
        expected = reference(ids).logits
        dense = model(ids).logits
    assert not torch.allclose(dense, expected)
    fold_scaling_(model, masks)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-6)
    for name in wrappers:
        assert is_nm(model.get_submodule(name).weight, 2, 4)


def test_fold_rejects_unknown_mask_key_without_touching_the_model():
    model = tiny_llama()
    wrap_scaling_(model)
    with pytest.raises(CastError, match="not.a.layer"):
        fold_scaling_(model, {"not.a.layer": torch.ones(2, 2, dtype=torch.bool)})
    assert isinstance(model.get_submodule("model.layers.0.self_attn.q_proj"), ScaledLinear)


def test_wrap_scaling_incompatible_width_names_layer_and_skip():
    # intermediate 36: down_proj has 36 inputs = 4 * 9, N:M-able but not in 2 blocks of whole 4-groups
    model = tiny_llama(intermediate_size=36)
    with pytest.raises(CastError, match=r"model\.layers\.0\.mlp\.down_proj.*\(64, 36\)"):
        wrap_scaling_(model, n_groups=2)
    assert not any(isinstance(m, ScaledLinear) for m in model.modules())
    wrapped = wrap_scaling_(model, n_groups=2, skip_incompatible=True)
    assert len(wrapped) == 12 and not any("down_proj" in f for f in wrapped)
    assert wrap_scaling_(tiny_llama(intermediate_size=36), n_groups=1)  # row-wise scaling fits


def test_wrap_scaling_filter_fn():
    model = tiny_llama()
    wrapped = wrap_scaling_(model, filter_fn=lambda mod, fqn: fqn.endswith("mlp.up_proj"))
    assert wrapped == ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_cuda_autocast_bf16_with_fp32_master_weights(kind):
    layer = make_layer(kind).cuda()
    scaled = ScaledLinear.from_linear(layer).cuda()
    with torch.no_grad():
        scaled.scale.uniform_(0.5, 1.5)
    x = torch.randn(4, 9, IN, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = scaled(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert scaled.scale.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    ref = plain_forward(layer, x, explicit_scaled(out_in(layer), scaled.scale)).detach()
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_end_to_end_adams_masks_fold_to_exact_nm(arch):
    """wrap -> param_groups -> AdamS steps -> fold_scaling_(masks=opt.masks()): exact N:M, original keys."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from cast_llm.optim import AdamS
    from cast_llm.sparsity.mask import is_nm
    from cast_llm.targets import find_targets, param_groups

    if arch == "llama":
        model = tiny_llama()
    else:
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, bos_token_id=0,
                                           eos_token_id=0))
    keys = list(model.state_dict())
    wrap_scaling_(model)
    opt = AdamS(param_groups(model, l1_decay=1e-3), lr=1e-2, total_steps=4, mask_interval=2)
    ids = torch.randint(0, 128, (2, 12))
    for _ in range(4):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert any(not bool((m.scale == 1).all()) for m in model.modules() if isinstance(m, ScaledLinear))
    fold_scaling_(model, opt.masks())
    assert list(model.state_dict()) == keys
    for t in find_targets(model):
        assert is_nm(t.weight.t() if t.transposed else t.weight, 2, 4), t.fqn
