"""``cast-llm prune`` end to end on tiny random models saved locally, and its one-line errors."""

from __future__ import annotations

import json

import pytest
import tiny
import torch

from cast_llm.cli import main
from cast_llm.sparsity.mask import is_nm

CALIB = ["--calib-samples", "4", "--seq-len", "32", "--device", "cpu"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prune")
    for arch in ("llama", "gpt2"):
        tiny.save_model(d / arch, arch)
    tiny.save_model(d / "odd", "llama", intermediate_size=130)  # down_proj: 130 inputs, not a multiple of 4
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    return d


def prune(workdir, out, *extra, arch="llama"):
    return main(["prune", "--model", str(workdir / arch), "--data", str(workdir / "corpus.jsonl"),
                 "--output-dir", str(out), *CALIB, *extra])


def one_line_error(capsys) -> str:
    # transformers draws a "Loading weights" progress bar on stderr when a model loads: not an error line
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in ln]
    assert len(err) == 1, err
    assert err[0].startswith("cast-llm prune: error: ")
    return err[0]


@pytest.mark.parametrize("arch,method", [("llama", "sparsegpt"), ("gpt2", "wanda"), ("gpt2", "magnitude")])
def test_prune_writes_exact_24_checkpoint_that_plain_transformers_loads(workdir, tmp_path, capsys, arch, method):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert prune(workdir, out, "--method", method, "--eval-text-file", str(workdir / "eval.txt"),
                 "--eval-seq-len", "64", arch=arch) == 0
    printed = capsys.readouterr().out
    assert "all exactly N:M" in printed and "dense:  ppl" in printed and "sparse: ppl" in printed
    assert (out / "cast_llm.json").is_file()

    model = AutoModelForCausalLM.from_pretrained(out)  # plain transformers
    sp = model.config.sparsity
    assert sp["method"] == method and sp["pattern"] == "2:4" and sp["source_model"] == str(workdir / arch)
    one = sp["oneshot"]
    assert one["perplexity"]["dense"]["seq_len"] == 64
    assert one["perplexity"]["sparse"]["perplexity"] < float("inf")
    if method != "magnitude":
        assert one["calibration"] == {"samples": 4, "seq_len": 32, "data": str(workdir / "corpus.jsonl"),
                                      "seed": 0}
    if method == "sparsegpt":
        assert one["damp"] == 0.01 and one["blocksize"] == 128
    params = dict(model.named_parameters())
    assert len(sp["targets"]) == {"llama": 14, "gpt2": 8}[arch]
    for fqn in sp["targets"]:
        w = params[fqn + ".weight"].detach()
        assert is_nm(w.t() if arch == "gpt2" else w, 2, 4), fqn  # GPT-2 Conv1D stores (in, out)
        assert int((w == 0).sum()) == w.numel() // 2


def test_prune_4_8_and_yaml_config(workdir, tmp_path):
    cfg = tmp_path / "prune.yaml"
    cfg.write_text("method: wanda\nn: 4\nm: 8\ncalib-samples: 2\n")
    out = tmp_path / "out"
    assert prune(workdir, out, "--config", str(cfg), "--calib-samples", "3") == 0
    meta = json.loads((out / "config.json").read_text())["sparsity"]
    assert meta["pattern"] == "4:8" and meta["method"] == "wanda"
    assert meta["oneshot"]["calibration"]["samples"] == 3  # the flag overrides the file


def test_existing_output_dir(workdir, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert prune(workdir, out, "--method", "magnitude") == 2
    assert "--overwrite" in one_line_error(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written
    assert prune(workdir, out, "--method", "magnitude", "--overwrite") == 0
    capsys.readouterr()
    # a previous cast-llm output is replaced only with --overwrite (one rule for every command), the notes stay
    assert prune(workdir, out, "--method", "wanda") == 2
    assert "holds a cast-llm output" in one_line_error(capsys)
    assert prune(workdir, out, "--method", "wanda", "--overwrite") == 0
    assert json.loads((out / "config.json").read_text())["sparsity"]["method"] == "wanda"
    assert (out / "notes.txt").read_text() == "mine"


def test_bad_inputs_give_one_line_errors(workdir, tmp_path, capsys):
    out = tmp_path / "never"
    assert prune(workdir, out, "--method", "obs") == 2
    assert "'method' must be one of magnitude, wanda, sparsegpt" in one_line_error(capsys)
    assert prune(workdir, out, "--method", "wanda", arch="odd") == 2
    line = one_line_error(capsys)
    assert "model.layers.0.mlp.down_proj" in line and "--skip-incompatible" in line
    assert prune(workdir, out, "--method", "wanda", "--seq-len", "4096") == 2
    assert "above the maximum" in one_line_error(capsys)
    assert prune(workdir, out, "--method", "sparsegpt", "--blocksize", "30") == 2
    assert "multiple of --m 4" in one_line_error(capsys)
    assert main(["prune", "--method", "wanda"]) == 2
    assert "--output-dir is required" in one_line_error(capsys)
    assert prune(workdir, out, "--method", "wanda", "--calib-samples", "100000") == 2
    assert "too small" in one_line_error(capsys)
    assert not out.exists()


def test_skip_incompatible_leaves_layers_dense(workdir, tmp_path, capsys):
    out = tmp_path / "out"
    assert prune(workdir, out, "--method", "sparsegpt", "--skip-incompatible", arch="odd") == 0
    assert "leaving model.layers.0.mlp.down_proj dense" in capsys.readouterr().out
    meta = json.loads((out / "config.json").read_text())["sparsity"]
    assert "model.layers.0.mlp.down_proj" not in meta["targets"] and len(meta["targets"]) == 12
    assert meta["oneshot"]["left_dense"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


@pytest.mark.slow
def test_prune_smollm2_embedded_one_block_path(tmp_path):
    """The real SmolLM2-135M (30 blocks) through Wanda with a few short calibration sequences."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "smollm2"
    assert main(["prune", "--method", "wanda", "--model", "smollm2-135m", "--calib-samples", "2",
                 "--seq-len", "64", "--device", "cpu", "--output-dir", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(model.config.sparsity["targets"]) == 30 * 7
    w = model.model.layers[29].mlp.down_proj.weight.detach()
    assert is_nm(w, 2, 4) and torch.isfinite(w).all()
