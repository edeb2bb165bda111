"""AWQ (method.md §7): exact scale folding, the scale search beats RTN on outlier channels, zeros stay zero."""

from __future__ import annotations

import pytest
import tiny
import torch
from deploy_helpers import sparse_model

from cast_llm.prune.blockwise import capture_block_inputs, run_block
from cast_llm.quant import quantize_model_
from cast_llm.quant.awq import fold_scale_, scale_groups, search_scale
from cast_llm.quant.rtn import fake_quantize
from cast_llm.sparsity.mask import nm_mask
from cast_llm.targets import find_block_list, find_targets

ARCHS = {
    "llama-gqa": ("llama", {}),  # v_proj -> o_proj cannot be folded under GQA
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "opt": ("opt", {}),
    "gpt2": ("gpt2", {}),
}
EXPECTED_GROUPS = {
    "llama-gqa": ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"],
    "llama-mha": ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"],
    "opt": ["self_attn_layer_norm", "self_attn.v_proj", "final_layer_norm", "fc1"],
    "gpt2": ["ln_1", "attn.c_attn[v]", "ln_2"],
}


@pytest.mark.parametrize("name", ARCHS)
def test_folding_any_scale_preserves_the_block_function_float64(name):
    arch, overrides = ARCHS[name]
    model = sparse_model(arch, torch.float64, **overrides)
    # non-trivial norm / bias parameters so the fold into them is really exercised
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    _, blocks = find_block_list(model)
    inp = capture_block_inputs(model, blocks, torch.randint(0, tiny.VOCAB, (2, 16)), batch_size=2,
                               device=torch.device("cpu"))[0]
    block = blocks[0]
    before = run_block(block, inp)
    groups = scale_groups(block, model.config.model_type)
    assert [g.name for g in groups] == EXPECTED_GROUPS[name]
    zeros_before = {id(p): (p == 0).clone() for p in block.parameters() if p.ndim == 2}
    for g in groups:
        width = g.consumers[0][1].weight.shape[0 if type(g.consumers[0][1]).__name__ == "Conv1D" else 1]
        fold_scale_(g, torch.rand(width, dtype=torch.float64) * 4 + 0.1)
    torch.testing.assert_close(run_block(block, inp), before, rtol=1e-10, atol=1e-10)
    for p in block.parameters():
        if p.ndim == 2:
            assert torch.equal(p == 0, zeros_before[id(p)])  # scaling never creates or removes a zero


def _outlier_layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 512, generator=g) * 0.02
    w = w.masked_fill(~nm_mask(w, 2, 4), 0)
    x = torch.randn(2048, 512, generator=g)
    x[:, [7, 100, 333, 480]] *= 40.0  # a few outlier input channels, as in LLM activations
    return w, x


@pytest.mark.parametrize("bits", [4, 3])
def test_awq_output_error_is_below_rtn_on_outlier_channels(bits):
    w, x = _outlier_layer()
    s, alpha, errors = search_scale(x[:1024], x.abs().mean(0), [w], bits=bits, group_size=128, grid=20)
    ref = x @ w.t()
    rtn_err = (x @ fake_quantize(w, bits, 128).t() - ref).pow(2).mean()
    awq_w = fake_quantize(w * s, bits, 128, mask=w != 0) / s
    awq_err = (x @ awq_w.t() - ref).pow(2).mean()  # measured on all tokens, not only the search subset
    assert alpha > 0
    assert awq_err < 0.7 * rtn_err, (float(awq_err), float(rtn_err))
    assert bool((awq_w[w == 0] == 0).all())
    assert errors[0] == pytest.approx(float((x[:1024] @ fake_quantize(w, bits, 128).t() - ref[:1024])
                                            .pow(2).mean()), rel=1e-5)  # alpha = 0 is RTN


@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_awq_model_keeps_every_zero(arch, bits):
    model = sparse_model(arch)
    targets = find_targets(model)
    zeros = {t.fqn: (t.weight == 0).clone() for t in targets}
    ids = torch.randint(0, tiny.VOCAB, (4, 16))
    result = quantize_model_(model, method="awq", bits=bits, group_size=32, calib_ids=ids, grid=4,
                             search_tokens=32)
    assert result.zeros_checked == sum(int(z.sum()) for z in zeros.values())
    for t in targets:
        assert bool((t.weight[zeros[t.fqn]] == 0).all())
    assert {r["group"] for r in result.awq_report} >= {"ln_1" if arch == "gpt2" else "input_layernorm"}
    assert all(0.0 <= r["alpha"] <= 1.0 and r["error_ratio"] <= 1.0 for r in result.awq_report)


def test_a_wrong_fold_is_caught_by_the_function_check(monkeypatch):
    import cast_llm.quant.calibration as cal

    def consumers_only(group, s):  # forgets to divide the producer: changes the function
        for _, c in group.consumers:
            c.weight.data.mul_(s[None, :])

    monkeypatch.setattr(cal, "fold_scale_", consumers_only)
    model = sparse_model("llama")
    with pytest.raises(RuntimeError, match="changed the output of block 0"):
        quantize_model_(model, method="awq", bits=4, group_size=32, calib_ids=torch.randint(0, tiny.VOCAB, (2, 8)),
                        grid=2, search_tokens=8)
