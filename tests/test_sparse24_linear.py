"""Sparse24Linear and the model-level swap / plan / release / memory functions, on CPU with the emulated
2:4 kernel and a fake dispatch timer (cast_llm.deploy.sparse24.linear / .model)."""

from __future__ import annotations

import pytest
import tiny
import torch
import torch.nn.functional as F
from deploy_helpers import sparse_model
from torch import nn

from cast_llm.deploy.sparse24 import (
    Dispatcher,
    Sparse24Linear,
    from_sparse24_,
    plan_sparse24_,
    sparse24_layers,
    sparse24_memory,
    to_sparse24_,
)
from cast_llm.deploy.sparse24 import linear as L
from cast_llm.deploy.sparse24.kernels import KERNELS
from cast_llm.errors import CastError
from cast_llm.sparsity.mask import nm_mask

EMU = ("emulated",)


def linear24(in_f=64, out_f=32, bias=True, dtype=torch.float32):
    lin = nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.masked_fill_(~nm_mask(lin.weight), 0)
    return lin


class Timer:
    """dense wins below 16 tokens, the 2:4 kernel from 16 on; counts measurements."""

    def __init__(self):
        self.calls = 0

    def __call__(self, kernel, out_f, in_f, dtype, tokens, mode):
        self.calls += 1
        if kernel == "dense":
            return 1.0, None
        return (0.5 if tokens >= 16 else 2.0), None


def dispatcher(timer=None):
    return Dispatcher(measure=timer or Timer(), gpu="fake", versions="v")


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_from_linear_to_linear_round_trip_is_exact():
    lin = linear24()
    layer = Sparse24Linear.from_linear(lin, kernels=EMU, name="l")
    assert layer.dense_weight is None  # no dispatcher: no dense fallback held
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(layer(x), lin(x))
    back = layer.to_linear()
    assert isinstance(back, nn.Linear) and torch.equal(back.weight, lin.weight) and torch.equal(back.bias, lin.bias)


def test_conv1d_becomes_an_equivalent_layer():
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(32, 64)  # 32 outputs, 64 inputs: weight (64, 32), 2:4 along dim 0
    with torch.no_grad():
        conv.weight.copy_(conv.weight.t().masked_fill(~nm_mask(conv.weight.t()), 0).t())
        nn.init.normal_(conv.bias)
    layer = Sparse24Linear.from_linear(conv, kernels=EMU)
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), conv(x))
    torch.testing.assert_close(layer.to_linear()(x), conv(x))


def test_dispatch_runs_dense_or_sparse_by_token_count(monkeypatch):
    layer = Sparse24Linear.from_linear(linear24(), kernels=EMU, dispatcher=dispatcher())
    assert layer.dense_weight is not None
    used = []
    real_mm = KERNELS["emulated"].mm
    monkeypatch.setattr(KERNELS["emulated"], "mm", lambda *a: used.append(1) or real_mm(*a))
    lin = layer.to_linear()
    for tokens, sparse in ((1, False), (8, False), (16, True), (100, True)):
        used.clear()
        x = torch.randn(tokens, 64)
        torch.testing.assert_close(layer(x), lin(x))
        assert bool(used) == sparse, tokens
    assert layer.kernel_for(1) == "dense" and layer.kernel_for(16) == "emulated"


def test_capture_without_a_graph_mode_plan_is_an_error_that_says_what_to_do(monkeypatch):
    model = sparse_model("llama")
    to_sparse24_(model, kernels=EMU, dispatch=dispatcher())
    layer = sparse24_layers(model)[0][1]
    monkeypatch.setattr(L, "capturing", lambda: True)
    with pytest.raises(CastError, match=r"plan_sparse24_\(model, token_counts=\[4\], modes=\('graph',\)\)"):
        layer(torch.randn(4, 64))
    monkeypatch.setattr(L, "capturing", lambda: False)
    plan_sparse24_(model, [4], modes=("graph",))
    monkeypatch.setattr(L, "capturing", lambda: True)
    assert layer(torch.randn(4, 64)).shape == (4, 64)


def test_swapped_model_matches_dense_logits_prefill_and_decode_with_kv_cache():
    model = sparse_model("llama", torch.float64)
    ids = torch.randint(0, tiny.VOCAB, (2, 9))
    with torch.no_grad():
        ref = model(ids, use_cache=True)
        ref_next = model(ids[:, -1:] * 0 + 5, past_key_values=ref.past_key_values, use_cache=True).logits
    names = to_sparse24_(model, kernels=EMU, dispatch=dispatcher())
    assert len(names) == 14
    with torch.no_grad():
        out = model(ids, use_cache=True)
        nxt = model(ids[:, -1:] * 0 + 5, past_key_values=out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(nxt, ref_next, rtol=1e-10, atol=1e-10)


def test_embeddings_and_tied_lm_head_stay_dense_and_tied():
    model = sparse_model("llama")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    to_sparse24_(model, kernels=EMU, dispatch=False)
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(".layers." in fqn for fqn, _ in sparse24_layers(model))


def test_filter_fn_narrows_and_from_sparse24_restores_the_model_exactly():
    model = sparse_model("llama")
    ids = torch.randint(0, tiny.VOCAB, (1, 6))
    ref = logits(model, ids)
    names = to_sparse24_(model, kernels=EMU, filter_fn=lambda m, fqn: ".mlp." in fqn, dispatch=False)
    assert len(names) == 6 and all(".mlp." in n for n in names)
    torch.testing.assert_close(logits(model, ids), ref)
    assert sorted(from_sparse24_(model)) == sorted(names)
    assert sparse24_layers(model) == [] and torch.equal(logits(model, ids), ref)


def test_a_layer_that_is_not_24_stops_the_swap_before_anything_changes():
    model = sparse_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.fill_(1.0)
    with pytest.raises(CastError, match=r"model\.layers\.1\.self_attn\.v_proj: weight \(32, 64\) is not exactly 2:4"):
        to_sparse24_(model, kernels=EMU)
    assert sparse24_layers(model) == []
    names = to_sparse24_(model, kernels=EMU, skip_incompatible=True)
    assert len(names) == 13 and "v_proj" in model._sparse24_skipped[0]


def test_plan_release_and_memory_accounting():
    model = sparse_model("llama")
    to_sparse24_(model, kernels=EMU, dispatch=dispatcher())
    params = sum(p.numel() * 4 for p in model.parameters())  # fp32; the tied embedding once
    dense_targets = sum(layer.in_features * layer.out_features * 4 for _, layer in sparse24_layers(model))
    mem = sparse24_memory(model)
    assert mem["dense_fallback"] == dense_targets and mem["other"] == params
    # emulated form: fp32 kept half + one uint8 position per kept value
    assert mem["compressed"] == dense_targets // 2 + dense_targets // 8
    plan = plan_sparse24_(model, {"eager": [1, 64], "graph": [64]})
    assert plan["model.layers.0.mlp.down_proj"] == {"eager:1": "dense", "eager:64": "emulated", "graph:64": "emulated"}
    # planned for decode (1 token) only: every layer runs dense -> the compressed form is released
    model2 = sparse_model("llama")
    to_sparse24_(model2, kernels=EMU, dispatch=dispatcher())
    plan_sparse24_(model2, [1], release=True)
    assert sparse24_memory(model2)["compressed"] == 0
    assert sparse24_layers(model2) == []  # dense-only layers are plain nn.Linear again: no wrapper cost
    # prefill only: every layer runs 2:4 -> the dense fallback is released, memory is the compressed form
    model3 = sparse_model("llama")
    to_sparse24_(model3, kernels=EMU, dispatch=dispatcher())
    plan_sparse24_(model3, [256], release=True)
    mem3 = sparse24_memory(model3)
    assert mem3["dense_fallback"] == 0 and mem3["compressed"] == mem["compressed"]
    ids = torch.randint(0, tiny.VOCAB, (1, 3))
    assert logits(model3, ids).shape == (1, 3, tiny.VOCAB)  # 3 tokens would pick dense: it runs 2:4 instead


def test_moving_or_casting_a_compressed_layer_is_refused_but_no_op_moves_are_fine():
    model = sparse_model("llama")
    to_sparse24_(model, kernels=EMU, dispatch=False)
    model.to("cpu")
    with pytest.raises(CastError, match="cannot be moved or cast"):
        model.to(torch.float64)
    layer = sparse24_layers(model)[0][1]
    with pytest.raises(CastError, match="got a torch.float64 input"):
        layer(torch.randn(2, 64, dtype=torch.float64))


def test_torch_compile_sees_one_opaque_op():
    layer = Sparse24Linear.from_linear(linear24(), kernels=EMU)
    x = torch.randn(3, 5, 64)
    torch.library.opcheck(torch.ops.cast_llm.sparse24_linear.default, (x, layer._op_id, 32))
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), F.linear(x, layer.dense(), layer.bias))
