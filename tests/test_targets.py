"""Target selection (method.md §1) and AdamS param groups on tiny random LLaMA / GPT-2 / OPT models."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    OPTConfig,
    OPTForCausalLM,
)

from cast_llm.errors import CastError
from cast_llm.nn import ScaledLinear, wrap_scaling_
from cast_llm.targets import (
    Target,
    block_filter,
    find_block_list,
    find_targets,
    param_groups,
    target_names,
)


def llama_config(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128)
    return LlamaConfig(**{**base, **kw})


def llama(**kw):
    return LlamaForCausalLM(llama_config(**kw))


def gpt2(**kw):
    base = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(GPT2Config(**{**base, **kw}))


def opt(**kw):
    base = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                word_embed_proj_dim=64)
    return OPTForCausalLM(OPTConfig(**{**base, **kw}))


def per_layer(prefix: str, names: list[str], layers: int = 2) -> list[str]:
    return [f"{prefix}.{i}.{n}" for i in range(layers) for n in names]


LLAMA = per_layer("model.layers", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
GPT2 = per_layer("transformer.h", ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"])
OPT = per_layer("model.decoder.layers", ["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj",
                                         "self_attn.out_proj", "fc1", "fc2"])


@pytest.mark.parametrize(
    "build,expected,transposed",
    [(llama, LLAMA, False), (gpt2, GPT2, True), (opt, OPT, False)],
    ids=["llama", "gpt2", "opt"],
)
def test_expected_linears_found(build, expected, transposed):
    model = build()
    targets = find_targets(model)
    assert [t.fqn for t in targets] == expected
    assert target_names(model) == expected
    assert targets.skipped == []
    for t in targets:
        assert isinstance(t, Target)
        assert t.module is model.get_submodule(t.fqn)
        assert t.weight is t.module.weight
        assert t.transposed is transposed and t.nm_dim == (0 if transposed else 1)
        rows_cols = (t.in_features, t.out_features) if transposed else (t.out_features, t.in_features)
        assert t.shape == rows_cols
    names = " ".join(expected)
    for excluded in ("embed", "wte", "wpe", "lm_head", "norm", "ln_"):
        assert excluded not in names


def test_gpt2_shapes_and_conv1d_transposed():
    targets = {t.fqn: t for t in find_targets(gpt2())}
    c_attn = targets["transformer.h.0.attn.c_attn"]
    assert (c_attn.in_features, c_attn.out_features, c_attn.shape) == (64, 192, (64, 192))
    c_proj = targets["transformer.h.1.mlp.c_proj"]
    assert (c_proj.in_features, c_proj.out_features) == (256, 64)


def test_bare_base_model_and_block_list():
    torch.manual_seed(0)
    base = LlamaModel(llama_config())
    assert [t.fqn for t in find_targets(base)] == [f[len("model."):] for f in LLAMA]
    fqn, blocks = find_block_list(llama())
    assert fqn == "model.layers" and isinstance(blocks, nn.ModuleList) and len(blocks) == 2
    assert find_block_list(gpt2())[0] == "transformer.h"
    assert find_block_list(opt())[0] == "model.decoder.layers"
    assert find_block_list(llama(num_hidden_layers=1))[0] == "model.layers"


def test_wrapped_layers_are_targets_with_their_base_weight():
    model = llama()
    wrap_scaling_(model)
    targets = find_targets(model)
    assert [t.fqn for t in targets] == LLAMA  # the wrapper, never its base_layer
    for t in targets:
        assert isinstance(t.module, ScaledLinear) and t.weight is t.module.base_layer.weight


def test_incompatible_width_error_names_layer_and_skip_incompatible():
    model = llama(intermediate_size=130)  # down_proj: 130 inputs, not a multiple of 4
    with pytest.raises(CastError, match=r"model\.layers\.0\.mlp\.down_proj.*\(64, 130\).*skip_incompatible=True"):
        find_targets(model)
    targets = find_targets(model, skip_incompatible=True)
    down = [f for f in LLAMA if f.endswith("down_proj")]
    assert [t.fqn for t in targets] == [f for f in LLAMA if f not in down]
    assert [t.fqn for t in targets.skipped] == down
    # 132 inputs: a multiple of 4 (fine for 2:4) but not of 8 (refused for 4:8)
    assert len(find_targets(llama(intermediate_size=132))) == 14
    with pytest.raises(CastError, match="down_proj"):
        find_targets(llama(intermediate_size=132), n=4, m=8)


def test_no_eligible_layers_errors():
    with pytest.raises(CastError, match="no decoder block list"):
        find_targets(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
    with pytest.raises(CastError, match="no layer"):
        find_targets(llama(), filter_fn=lambda mod, fqn: False)
    with pytest.raises(CastError, match="every candidate layer was skipped"):
        find_targets(llama(), filter_fn=lambda mod, fqn: fqn == "model.layers.0.mlp.down_proj", m=3,
                     n=1, skip_incompatible=True)
    with pytest.raises(ValueError, match="0 < n < m"):
        find_targets(llama(), n=4, m=4)


def test_filter_fn_replaces_default_and_block_filter_narrows_it():
    model = llama()
    everything = find_targets(model, filter_fn=lambda mod, fqn: True)
    assert [t.fqn for t in everything] == LLAMA + ["lm_head"]  # torchao-style: the filter decides
    inside = block_filter(model)
    mlp = find_targets(model, filter_fn=lambda mod, fqn: inside(mod, fqn) and ".mlp." in fqn)
    assert [t.fqn for t in mlp] == [f for f in LLAMA if ".mlp." in f]
    toy = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert [t.fqn for t in find_targets(toy, filter_fn=lambda mod, fqn: fqn == "0")] == ["0"]


def _check_groups(model, groups):
    trainable = [p for p in model.parameters() if p.requires_grad]  # tied weights listed once
    listed = [p for g in groups for p in g["params"]]
    assert len(listed) == len(trainable) == len({id(p) for p in listed})
    assert {id(p) for p in listed} == {id(p) for p in trainable}
    torch.optim.Adam(groups)  # torch accepts them (no duplicates, no empty list)


@pytest.mark.parametrize("build", [llama, gpt2, opt], ids=["llama", "gpt2", "opt"])
def test_param_groups_cover_every_trainable_param_once(build):
    model = build()
    groups = param_groups(model, l1_decay=1e-6, weight_decay=0.1, lr=3e-4)
    _check_groups(model, groups)
    by_name = {g["name"]: g for g in groups}
    targets = find_targets(model)
    sparse_key = "sparse_transposed" if build is gpt2 else "sparse"
    assert set(by_name) == {sparse_key, "dense", "dense_no_decay"}
    sparse = by_name[sparse_key]
    assert sparse["sparse"] is True and sparse["transposed"] is (build is gpt2)
    assert [id(p) for p in sparse["params"]] == [id(t.weight) for t in targets]
    assert sparse["l1_decay"] == 1e-6 and sparse["weight_decay"] == 0.1
    assert by_name["dense"]["sparse"] is False and by_name["dense"]["weight_decay"] == 0.1
    assert by_name["dense_no_decay"]["weight_decay"] == 0.0
    assert all(p.ndim == 1 for p in by_name["dense_no_decay"]["params"])
    assert all(p.ndim == 2 for p in by_name["dense"]["params"])
    assert all(g["lr"] == 3e-4 for g in groups)


def test_param_groups_tied_embeddings():
    model = llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    groups = param_groups(model)
    _check_groups(model, groups)
    dense = {g["name"]: g for g in groups}["dense"]["params"]
    assert len(dense) == 1 and dense[0] is model.lm_head.weight
    gpt = gpt2()
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    _check_groups(gpt, param_groups(gpt))


def test_param_groups_scales_frozen_params_and_explicit_targets():
    model = llama()
    wrap_scaling_(model)
    model.model.embed_tokens.weight.requires_grad_(False)
    groups = param_groups(model, weight_decay=0.1)
    _check_groups(model, groups)
    no_decay = {id(p) for p in {g["name"]: g for g in groups}["dense_no_decay"]["params"]}
    scales = [m.scale for m in model.modules() if isinstance(m, ScaledLinear)]
    assert len(scales) == 14 and all(id(s) in no_decay for s in scales)  # a decayed scale would drift to 0

    all_decay = param_groups(model, weight_decay=0.1, no_decay_dense=False)
    assert {g["name"] for g in all_decay} == {"sparse", "dense"}

    some = find_targets(model, filter_fn=lambda mod, fqn: fqn.endswith("q_proj"))
    groups = param_groups(model, targets=some)
    _check_groups(model, groups)
    assert len({g["name"]: g for g in groups}["sparse"]["params"]) == 2

    with pytest.raises(ValueError, match="sparse"):
        param_groups(model, sparse=False)
