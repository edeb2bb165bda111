"""Packed quantized checkpoints: quantize → pack → load → dequantize is bit-exact vs fake-quant; the CLI."""

from __future__ import annotations

import json

import pytest
import tiny
import torch
from deploy_helpers import cli, one_line_error, save_hf, sparse_model, state_dicts_bitwise_equal
from transformers import AutoModelForCausalLM

from cast_llm.quant import quantize_model_
from cast_llm.quant.pack import FAKE_QUANT_DIR, INDEX_FILE, load_quantized, pack_weight, unpack_weight
from cast_llm.quant.rtn import QuantizedWeight
from cast_llm.sparsity.mask import nm_mask


def _w24(rows, cols):
    w = torch.randn(rows, cols)
    return w.masked_fill(~nm_mask(w, 2, 4), 0)


@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("sparse", [True, False])
def test_pack_unpack_weight_is_exact_and_sparse_codes_take_less(bits, sparse):
    w = _w24(64, 320) if sparse else torch.randn(64, 320)
    qw = QuantizedWeight.from_float(w, bits, 128)
    parts, info = pack_weight(qw)
    back = unpack_weight(parts, info, bits, 128)
    assert torch.equal(back.codes, qw.codes) and torch.equal(back.zero, qw.zero) and torch.equal(back.scale, qw.scale)
    assert info["layout"] == ("nm" if sparse else "dense")
    n = w.numel()
    expected = n // 2 * bits // 8 + n // 8 if sparse else n * bits // 8  # nm: half the codes + 2-bit positions
    assert parts["qweight"].numel() + parts.get("positions", torch.empty(0)).numel() == expected


@pytest.mark.parametrize("method,bits,arch,sparse", [
    ("rtn", 4, "llama", True), ("awq", 3, "llama", True), ("awq", 4, "gpt2", True), ("rtn", 3, "opt", False),
])
def test_quantize_pack_load_is_bitwise_equal_to_fake_quant(tmp_path, method, bits, arch, sparse):
    from cast_llm.quant.pack import save_quantized

    model = sparse_model(arch) if sparse else tiny.model(arch)
    ids = torch.randint(0, tiny.VOCAB, (2, 16))
    result = quantize_model_(model, method=method, bits=bits, group_size=32, calib_ids=ids, grid=2,
                             search_tokens=16)
    model.to(torch.float16)
    out = save_quantized(model, result, tiny.tokenizer(), tmp_path / "q")
    fake = AutoModelForCausalLM.from_pretrained(out / FAKE_QUANT_DIR)  # plain transformers
    packed = load_quantized(out)
    assert state_dicts_bitwise_equal(fake, packed) == []
    assert state_dicts_bitwise_equal(model, packed) == []
    index = json.loads((out / INDEX_FILE).read_text())
    assert {v["layout"] for v in index["targets"].values()} == {"nm" if sparse else "dense"}
    if sparse:
        assert json.loads((out / FAKE_QUANT_DIR / "config.json").read_text())["sparsity"]["pattern"] == "2:4"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    return {"sparse": save_hf(sparse_model("llama"), root / "sparse"), "corpus": tiny.write_corpus(root / "c.jsonl")}


def test_cli_awq_writes_packed_and_fake_quant_that_keep_zeros(tmp_path, model_dirs, capsys):
    out = tmp_path / "q"
    assert cli("quantize", model_dirs["sparse"], "--method", "awq", "--bits", "3", "--group-size", "32",
               "--data", model_dirs["corpus"], "--calib-samples", "4", "--seq-len", "32", "--grid", "4",
               "--search-tokens", "32", "--output-dir", out) == 0
    assert "verified exactly zero" in capsys.readouterr().out
    before = AutoModelForCausalLM.from_pretrained(model_dirs["sparse"])
    fake = AutoModelForCausalLM.from_pretrained(out / FAKE_QUANT_DIR)
    assert fake.dtype == torch.float16
    for (name, p), (_, q) in zip(before.named_parameters(), fake.named_parameters()):
        if name.endswith("proj.weight"):
            assert bool((q[p == 0] == 0).all()), name
    assert state_dicts_bitwise_equal(fake, load_quantized(out)) == []
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["method"] == "awq" and index["bits"] == 3 and index["awq"]


def test_cli_rtn_needs_no_data(tmp_path, model_dirs):
    assert cli("quantize", model_dirs["sparse"], "--method", "rtn", "--bits", "4", "--data", "no-such-data",
               "--dtype", "fp32", "--output-dir", tmp_path / "q") == 0
    assert (tmp_path / "q" / FAKE_QUANT_DIR / "model.safetensors").is_file()


@pytest.mark.parametrize("bad,message", [
    (["--bits", "5"], "'bits' must be one of 2, 3, 4, 8"),
    (["--bits", "four"], "invalid value for 'bits'"),
    (["--method", "gptq"], "'method' must be one of awq, rtn"),
    (["--group-size", "0"], "--group-size must be positive"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, model_dirs, capsys, bad, message):
    assert cli("quantize", model_dirs["sparse"], *bad, "--output-dir", tmp_path / "q") == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "q").exists()
