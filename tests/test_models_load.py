"""Model arguments: our own export folders load as dense models, aliases are case-insensitive, a near-miss
alias gets "did you mean" without the network, and an unreachable hub fails at once with one line."""

from __future__ import annotations

import socket
import time

import pytest
import tiny
import torch
from deploy_helpers import cli, save_hf, sparse_model, state_dicts_bitwise_equal

from cast_llm.errors import CastError
from cast_llm.models import (
    canonical_alias,
    export_format,
    load_export,
    load_model,
    load_tokenizer,
    near_alias,
    resolve_model,
)
from cast_llm.models import loading as models


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny 2:4 llama as hf, and its compressed / compressed-tensors / quantized exports (fp16)."""
    root = tmp_path_factory.mktemp("exports")
    src = save_hf(sparse_model("llama", dtype=torch.float16), root / "hf")
    out = {"hf": src}
    for fmt in ("compressed", "compressed-tensors"):
        assert cli("export", src, "--format", fmt, "--output-dir", root / fmt, "--no-verify") == 0
        out[fmt] = root / fmt
    assert cli("quantize", src, "--method", "rtn", "--group-size", "32", "--device", "cpu",
               "--output-dir", root / "quantized") == 0
    out["quantized"] = root / "quantized"
    return out


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the network was touched")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_export_format_names_each_folder(exports, tmp_path):
    assert {k: export_format(v) for k, v in exports.items()} == {
        "hf": None, "compressed": "compressed", "compressed-tensors": "compressed-tensors", "quantized": "quantized"}
    assert export_format(exports["quantized"] / "fake-quant") is None  # a plain HF folder beside the packed one
    assert export_format(tmp_path / "missing") is None


@pytest.mark.parametrize("fmt", ["compressed", "compressed-tensors"])
def test_load_model_decodes_our_exports_bit_identically(exports, fmt):
    ref = load_model(str(exports["hf"]), dtype=torch.float16)
    assert resolve_model(str(exports[fmt])).kind == "export"
    back = load_model(str(exports[fmt]), dtype=torch.float16)
    assert state_dicts_bitwise_equal(ref, back) == [] and not back.training
    assert load_model(str(exports[fmt])).dtype == torch.float32  # the default dtype, as for any folder
    tok = load_tokenizer(str(exports[fmt]))
    assert tok("sparse")["input_ids"] == tiny.tokenizer()("sparse")["input_ids"]


def test_load_model_decodes_a_quantized_folder_to_its_fake_quant_weights(exports):
    q = exports["quantized"]
    ref = load_model(str(q / "fake-quant"))
    assert state_dicts_bitwise_equal(ref, load_model(str(q))) == []
    assert load_tokenizer(str(q)).eos_token == tiny.tokenizer().eos_token
    assert state_dicts_bitwise_equal(load_export(q, dtype=torch.float32), ref) == []


def test_another_head_over_an_export_keeps_the_backbone(exports):
    from transformers import AutoModelForSequenceClassification

    clf = load_model(str(exports["compressed"]), dtype=torch.float32, auto_class=AutoModelForSequenceClassification,
                     num_labels=3, id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2})
    ref = load_model(str(exports["hf"]), dtype=torch.float32)
    assert clf.config.num_labels == 3 and clf.score.weight.shape == (3, 64)
    sd, rd = clf.model.state_dict(), ref.model.state_dict()
    assert all(torch.equal(sd[k], rd[k]) for k in rd)


def test_a_broken_export_is_one_line(exports, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(exports["compressed"], broken)
    (broken / "compressed.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CastError) as e:
        load_model(str(broken))
    assert "\n" not in str(e.value) and str(broken) in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CastError, match="holds no config.json"):
        load_model(str(empty))


def test_aliases_ignore_case():
    assert canonical_alias("SmolLM2-135M") == "smollm2-135m" == canonical_alias(" smollm2-135m ")
    assert canonical_alias("smollm2-13m") is None


def test_alias_in_another_case_resolves_to_the_alias(monkeypatch, no_network):
    monkeypatch.setattr(models, "_embedded", lambda alias: (f"/cache/{alias}-fp32", None))
    src = resolve_model("smollm2-135M")
    assert src.kind == "alias" and src.path == "/cache/smollm2-135m-fp32"


@pytest.mark.parametrize("typo", ["smollm2-13m", "smolm2-135m", "smollm2_135m", "smollm2"])
def test_a_near_alias_is_suggested_without_the_network(typo, no_network, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # must not matter: no hub is consulted at all
    t0 = time.perf_counter()
    with pytest.raises(CastError) as e:
        load_tokenizer(typo)
    assert time.perf_counter() - t0 < 1.0
    msg = str(e.value)
    assert "\n" not in msg and f"'{typo}'" in msg and "did you mean smollm2-135m?" in msg


def test_near_alias_leaves_hub_ids_and_unrelated_names_alone():
    assert near_alias("HuggingFaceTB/smollm2-13m") is None and near_alias("gpt2") is None
    assert near_alias("smollm2-13m") == "smollm2-135m"


def test_offline_hub_fails_at_once_with_one_line(monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    for load in (load_tokenizer, load_model):
        with pytest.raises(CastError) as e:
            load("nobody-here/no-such-model")
        msg = str(e.value)
        assert "\n" not in msg and "'nobody-here/no-such-model'" in msg and "HF_HUB_OFFLINE=1" in msg
        assert "check the name" in msg
    assert time.perf_counter() - t0 < 5.0


def test_unreachable_hub_is_detected_by_one_quick_connection(monkeypatch, tmp_path):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:  # a port nobody listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    models._unreachable.cache_clear()
    try:
        t0 = time.perf_counter()
        with pytest.raises(CastError) as e:
            load_tokenizer("nobody-here/no-such-model")
        assert time.perf_counter() - t0 < 5.0
        assert f"127.0.0.1:{port} does not answer" in str(e.value) and "\n" not in str(e.value)
    finally:
        models._unreachable.cache_clear()


def test_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.setenv("CAST_LLM_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CAST_LLM_CACHE")
    assert models.cache_dir() == tmp_path / "x" / "cast-llm"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # the XDG spec: relative values are ignored
    assert models.cache_dir().name == "cast-llm" and models.cache_dir().is_absolute()


def test_an_export_can_be_exported_again(exports, tmp_path):
    """`cast-llm export RUN-c --format hf` (dtype auto: as stored) gives back the original hf folder."""
    out = tmp_path / "again"
    assert cli("export", exports["compressed"], "--format", "hf", "--output-dir", out) == 0
    assert state_dicts_bitwise_equal(load_model(str(out), dtype="auto"), load_model(str(exports["hf"]),
                                                                                       dtype="auto")) == []
    assert load_model(str(exports["compressed"]), dtype="auto").dtype == torch.float16


def test_a_gguf_is_parsed_once_per_load_and_loads_the_same(tmp_path, monkeypatch):
    """transformers parses a GGUF's metadata for the tokenizer, the config and the weights separately;
    gguf_parsed_once shares one parse (and one tensor-name map) inside its block, with what is loaded unchanged,
    and restores gguf's own functions after it."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny.write_gguf(tmp_path / "tiny.gguf")
    kwargs = {"gguf_file": path.name}
    plain_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **kwargs)
    plain_tok = AutoTokenizer.from_pretrained(tmp_path, **kwargs)

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parses, maps = [], []
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parses.append(a) or real_reader(*a, **k))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or real_map(*a))
    patched = gguf.GGUFReader, gguf.get_tensor_name_map
    with models.gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **kwargs)
        tok = AutoTokenizer.from_pretrained(tmp_path, **kwargs)
    assert len(parses) == 1 and len(maps) == 1, (parses, maps)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == patched  # restored
    assert not state_dicts_bitwise_equal(model, plain_model)  # the names of tensors that differ: none
    assert tok.get_vocab() == plain_tok.get_vocab() and model.config.to_dict() == plain_model.config.to_dict()

    parses.clear()  # load_model and load_tokenizer of a .gguf path each parse it once
    loaded = models.load_model(str(path))
    assert len(parses) == 1 and not state_dicts_bitwise_equal(loaded, plain_model)
    parses.clear()
    assert models.load_tokenizer(str(path)).get_vocab() == plain_tok.get_vocab() and len(parses) == 1
