"""LoRA with the sparse merge W + M⊙(BA)·s, and the sparse-mode masks, on tiny 2:4 models (CPU, seconds)."""

from __future__ import annotations

import pytest
import tiny
import torch

from cast_llm.finetune.config import FinetuneConfig
from cast_llm.finetune.lora import (
    attach_nm_masks_,
    build_lora_model,
    lora_layers,
    merge_and_unload_sparse,
    sparse_merge_,
    sparse_unmerge_,
)
from cast_llm.finetune.sparse import SparseMasks
from cast_llm.sparsity.mask import apply_mask_, is_nm, nm_mask
from cast_llm.targets import find_targets


def sparse_model(arch: str, seed: int = 0):
    """A tiny random model whose targets are made 2:4 with the magnitude mask."""
    model = tiny.model(arch, seed)
    for t in find_targets(model):
        w = t.weight.data
        mask = nm_mask(w.t() if t.transposed else w)
        apply_mask_(w, mask.t() if t.transposed else mask)
    return model


def cfg(**kw) -> FinetuneConfig:
    base = dict(model="tiny", data="x.jsonl", output_dir="out", max_steps=1, lora_r=4, lora_alpha=8.0, lora_dropout=0.0)
    return FinetuneConfig(**{**base, **kw})


def randomize_adapters_(model, seed: int = 1) -> None:
    """peft starts B at 0 (ΔW = 0); give A and B values so that the merge has something to do."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for mod in (layer.lora_A["default"], layer.lora_B["default"]):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * 0.1)


def _is_24(w, transposed):
    return is_nm(w.t() if transposed else w, 2, 4)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_sparse_merge_is_exactly_w_plus_masked_ba_and_keeps_the_mask(arch):
    model = sparse_model(arch)
    targets = find_targets(model)
    before = {t.fqn: t.weight.detach().clone() for t in targets}
    peft_model = build_lora_model(model, targets, cfg())
    randomize_adapters_(peft_model)
    # the expected result, from the adapter weights alone
    expected = {}
    for name, layer in lora_layers(peft_model):
        fqn = name.removeprefix("base_model.model.")
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        delta = (b @ a) * layer.scaling["default"]  # (out, in)
        if arch == "gpt2":
            delta = delta.t()  # Conv1D stores (in, out)
        w0 = before[fqn]
        expected[fqn] = w0 + torch.where(w0 != 0, delta, torch.zeros_like(delta))
    assert len(expected) == len(targets)
    merged = merge_and_unload_sparse(peft_model)
    assert not list(lora_layers(merged))
    for t in find_targets(merged):
        w = t.weight.detach()
        assert torch.equal(w, expected[t.fqn]), t.fqn
        assert torch.equal(w != 0, before[t.fqn] != 0), t.fqn  # the very same mask
        assert _is_24(w, t.transposed) and not torch.equal(w, before[t.fqn])


def test_masked_forward_trains_the_model_that_is_merged():
    """masked_forward: the trained (unmerged) model and the merged model compute the same function."""
    x = torch.randint(0, tiny.VOCAB, (2, 12))
    for masked, same in ((True, True), (False, False)):
        model = sparse_model("llama")
        peft_model = build_lora_model(model, find_targets(model), cfg(lora_masked_forward=masked))
        randomize_adapters_(peft_model)
        with torch.no_grad():
            trained = peft_model(input_ids=x).logits
            merged = merge_and_unload_sparse(peft_model)(input_ids=x).logits
        assert torch.allclose(trained, merged, atol=1e-5) == same


def test_masked_forward_gradients_vanish_on_pruned_positions():
    """∂L/∂ΔW is zero where M = 0, so B A only learns what the merge keeps."""
    model = sparse_model("llama")
    peft_model = build_lora_model(model, find_targets(model), cfg())
    randomize_adapters_(peft_model)
    name, layer = next(iter(lora_layers(peft_model)))
    delta = layer.get_delta_weight("default")
    delta.retain_grad()
    layer.get_delta_weight = lambda adapter: delta  # observe the tensor the forward uses
    peft_model(input_ids=torch.randint(0, tiny.VOCAB, (2, 8))).logits.sum().backward()
    mask = layer.cast_nm_mask
    assert delta.grad[~mask].abs().max() == 0 and delta.grad[mask].abs().max() > 0


def test_peft_merge_and_unload_and_unmerge_keep_the_pattern():
    """With the masks attached, peft's own merge/unmerge are masked too, and reversible."""
    model = sparse_model("gpt2")
    targets = find_targets(model)
    before = {t.fqn: t.weight.detach().clone() for t in targets}
    peft_model = build_lora_model(model, targets, cfg())
    randomize_adapters_(peft_model)
    assert sparse_merge_(peft_model) == len(targets)
    assert sparse_merge_(peft_model) == 0  # already merged: nothing twice
    assert sparse_unmerge_(peft_model) == len(targets)
    for t in targets:
        assert torch.equal(t.weight != 0, before[t.fqn] != 0)
        torch.testing.assert_close(t.weight.detach(), before[t.fqn], rtol=0, atol=1e-6)
    merged = peft_model.merge_and_unload()  # peft's API, dispatched to the masked variant
    for t in find_targets(merged):
        assert torch.equal(t.weight != 0, before[t.fqn] != 0) and _is_24(t.weight, t.transposed)


def test_adapter_saved_alone_reloads_with_plain_peft_and_merges_sparse(tmp_path):
    from peft import PeftModel

    model = sparse_model("llama")
    peft_model = build_lora_model(model, find_targets(model), cfg())
    randomize_adapters_(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    ref = {t.fqn: t.weight.detach().clone() for t in find_targets(merge_and_unload_sparse(peft_model))}
    reloaded = PeftModel.from_pretrained(sparse_model("llama"), tmp_path / "adapter")  # no masks attached
    merged = merge_and_unload_sparse(reloaded)  # finds the N:M layers itself
    for t in find_targets(merged):
        assert torch.equal(t.weight, ref[t.fqn]), t.fqn


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # lm_head is adapted on purpose here
def test_attach_finds_nm_layers_without_targets():
    from peft import LoraConfig, get_peft_model

    model = sparse_model("opt")
    n_targets = len(find_targets(model))
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "fc1", "lm_head"]))
    assert attach_nm_masks_(peft_model) == 2 * 2  # q_proj and fc1 of both blocks; lm_head is dense
    assert n_targets == 12


def test_sparse_masks_keep_pruned_weights_and_moments_at_zero_through_adamw():
    model = sparse_model("gpt2")
    targets = find_targets(model)
    masks = SparseMasks(targets)
    start = {t.fqn: t.weight.detach().clone() for t in targets}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        model(input_ids=torch.randint(0, tiny.VOCAB, (2, 8))).logits.square().mean().backward()
        masks.mask_grads_()
        opt.step()
        masks.enforce_(opt)
        opt.zero_grad()
    assert masks.violations() == {}
    for t in targets:
        keep = start[t.fqn] != 0
        assert torch.equal(t.weight != 0, keep)
        assert (opt.state[t.weight]["exp_avg"][~keep] == 0).all()
        assert (opt.state[t.weight]["exp_avg_sq"][~keep] == 0).all()
        assert not torch.equal(t.weight.detach(), start[t.fqn])  # the kept weights did train
    state = masks.state_dict()
    again = SparseMasks(targets)
    again.load_state_dict(state)
    assert all(torch.equal(again.masks[k], masks.masks[k]) for k in masks.masks)
    with torch.no_grad():
        targets[0].weight[~masks.masks[targets[0].fqn]] = 1.0
    assert list(masks.violations()) == [targets[0].fqn]
