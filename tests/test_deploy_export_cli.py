"""`cast-llm export`: every format end to end, and one-line errors for bad inputs (exit 2)."""

from __future__ import annotations

import json

import pytest
import tiny
import torch
from deploy_helpers import cli, one_line_error, save_hf, sparse_model, state_dicts_bitwise_equal

from cast_llm.deploy.compressed import load_compressed
from cast_llm.deploy.compressed_tensors import load_compressed_tensors
from cast_llm.models import load_model


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    return save_hf(sparse_model("llama"), tmp_path_factory.mktemp("m") / "sparse")


@pytest.mark.parametrize("fmt", ["hf", "compressed", "compressed-tensors"])
def test_export_every_format_verifies_and_round_trips(tmp_path, sparse_dir, capsys, fmt):
    out = tmp_path / fmt
    assert cli("export", sparse_dir, "--format", fmt, "--output-dir", out, "--dtype", "fp16") == 0
    stdout = capsys.readouterr().out
    assert "verified" in stdout and f"wrote {fmt} checkpoint" in stdout
    ref = load_model(str(sparse_dir), dtype=torch.float16)
    back = {"hf": lambda: load_model(str(out), dtype=torch.float16), "compressed": lambda: load_compressed(out),
            "compressed-tensors": lambda: load_compressed_tensors(out)}[fmt]()
    assert state_dicts_bitwise_equal(ref, back) == []
    assert (out / "cast_llm.json").is_file() and (out / "tokenizer.json").is_file()
    if fmt == "hf":
        assert json.loads((out / "config.json").read_text())["sparsity"]["pattern"] == "2:4"


def test_export_of_a_dense_model_names_the_layer(tmp_path, capsys):
    dense = save_hf(tiny.model("llama"), tmp_path / "dense")
    assert cli("export", dense, "--format", "compressed", "--output-dir", tmp_path / "o") == 2
    err = one_line_error(capsys)
    assert "not 2:4 sparse" in err and "model.layers.0.self_attn.q_proj" in err
    assert not (tmp_path / "o").exists()


def test_export_refuses_a_non_empty_folder_without_overwrite(tmp_path, sparse_dir, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", out) == 2
    assert "--overwrite" in one_line_error(capsys)
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", out, "--overwrite") == 0
    assert (out / "notes.txt").read_text() == "mine"  # written beside it: nothing the tool did not write is touched


def test_overwrite_replaces_an_older_export_of_another_format(tmp_path, sparse_dir):
    out = tmp_path / "o"
    assert cli("export", sparse_dir, "--format", "hf", "--output-dir", out, "--no-verify") == 0
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", out, "--overwrite") == 0
    assert not (out / "model.safetensors").exists()  # no stale dense weights beside the compressed ones


def test_bad_format_and_pattern_are_one_line_errors(tmp_path, sparse_dir, capsys):
    assert cli("export", sparse_dir, "--format", "onnx", "--output-dir", tmp_path / "o") == 2
    assert "must be one of hf, compressed, compressed-tensors" in one_line_error(capsys)
    assert cli("export", sparse_dir, "--format", "compressed-tensors", "--n", "1", "--output-dir",
               tmp_path / "o") == 2
    assert "2:4 only" in one_line_error(capsys)
