"""A property-based sweep over the input surface of `cast-llm train` (hypothesis): numbers out of range,
wrong types, missing / empty / binary / non-UTF-8 / unicode files, bad YAML, models whose widths do not
divide by m, tokenizers without EOS. Every case must end in ONE line naming what was wrong, exit code 2,
no traceback, and no model written."""

from __future__ import annotations

import json
import string

import pytest
import tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cast_llm.cli import main

FAST = ["--batch-size", "2", "--seq-len", "32", "--no-progress", "--no-baseline-eval", "--max-steps", "1",
        "--val-sequences", "1", "--wikitext-windows", "1", "--device", "cpu", "--overwrite"]
# (flag, smallest allowed, largest allowed, integer?) of the numeric options
NUMERIC = [("--batch-size", 1, None, True), ("--grad-accum", 1, None, True), ("--seq-len", 2, None, True),
           ("--max-steps", 1, None, True), ("--log-every", 1, None, True), ("--save-every", 0, None, True),
           ("--keep-last", 1, None, True), ("--val-sequences", 0, None, True), ("--wikitext-windows", 0, None, True),
           ("--mask-interval", 0, None, True), ("--calib-samples", 1, None, True), ("--threads", 0, None, True),
           ("--kd-chunk-size", 1, None, True), ("--scale-groups", 1, None, True), ("--n", 1, None, True),
           ("--eta", 0, 1, False), ("--val-fraction", 0, 0.5, False), ("--min-lr-ratio", 0, 1, False),
           ("--l1-decay", 0, None, False), ("--weight-decay", 0, None, False), ("--grad-clip", 0, None, False),
           ("--repair-fraction", 0, 0.999, False), ("--beta1", 0, 0.999999, False), ("--srste-decay", 0, None, False)]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                derandomize=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("badinput")
    tiny.save_model(d / "llama", "llama")
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    tiny.save_model(d / "odd-width", "llama", intermediate_size=130)  # down_proj: 130 inputs, not a multiple of 4
    tok = tiny.tokenizer()
    tiny.model("llama").save_pretrained(d / "no-eos")
    noeos = type(tok)(tokenizer_object=tok.backend_tokenizer)  # the same vocabulary, no special tokens declared
    noeos.save_pretrained(d / "no-eos")
    return d


def _run(workdir, tmp_path, capsys, *args, model="llama", data=None):
    out = tmp_path / "out"
    argv = ["train", "--model", str(workdir / model), "--data", str(data or workdir / "corpus.jsonl"),
            "--wikitext-file", str(workdir / "eval.txt"), "--output-dir", str(out), *FAST, *args]
    capsys.readouterr()  # what earlier examples left
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("cast-llm train: error:")]
    assert rc == 2, (argv, err[-500:])
    assert "Traceback" not in err and len(lines) == 1, err[-1000:]
    assert not (out / "model.safetensors").exists()
    return lines[0]


@settings(max_examples=110, **SETTINGS)
@given(spec=st.sampled_from(NUMERIC), data=st.data())
def test_numbers_out_of_range(workdir, tmp_path, capsys, spec, data):
    flag, lo, hi, integer = spec
    below = st.integers(-10**6, lo - 1) if integer else st.floats(-1e6, lo, exclude_max=True, allow_nan=False)
    above = (st.integers(hi + 1, 10**6) if integer else st.floats(hi, 1e6, exclude_min=True, allow_nan=False)) \
        if hi is not None else below
    value = data.draw(st.one_of(below, above))
    if flag == "--n":  # n must stay below m: exercise n ≥ m too
        value = data.draw(st.sampled_from([value, 4, 5]))
    line = _run(workdir, tmp_path, capsys, f"{flag}={value}")
    assert flag.lstrip("-") in line or "n < m" in line, line


@settings(max_examples=70, **SETTINGS)
@given(flag=st.sampled_from([f for f, *_ in NUMERIC] + ["--lr", "--tokens"]),
       value=st.text(string.ascii_letters + "!?@ #äß€", min_size=1, max_size=12).filter(
           lambda v: v.strip() and not v.startswith("-") and v.lower() not in ("nan", "inf", "infinity")))
def test_wrong_types(workdir, tmp_path, capsys, flag, value):
    line = _run(workdir, tmp_path, capsys, f"{flag}={value}")
    assert flag.lstrip("-") in line, line


@settings(max_examples=30, **SETTINGS)
@given(kind=st.sampled_from(["missing", "empty", "binary", "latin1", "unicode-tiny", "bad-json", "no-text",
                             "bad-suffix", "yaml-garbage", "yaml-binary", "missing-config", "missing-model",
                             "missing-wikitext"]),
       name=st.text("abcdefghijklmnopqrstuvwxyzäöü_", min_size=1, max_size=10))
def test_bad_files(workdir, tmp_path, capsys, kind, name):
    d = tmp_path / "files"
    d.mkdir(exist_ok=True)
    extra, data = [], None
    if kind == "missing":
        data = d / f"{name}-does-not-exist.jsonl"
    elif kind == "empty":
        data = d / f"{name}.txt"
        data.write_text("")
    elif kind == "binary":
        data = d / f"{name}.txt"
        data.write_bytes(bytes(range(256)) * 8)
    elif kind == "latin1":
        data = d / f"{name}.jsonl"
        data.write_bytes(json.dumps({"text": "caf\u00e9 " * 50}, ensure_ascii=False).encode("latin-1"))
    elif kind == "unicode-tiny":
        data = d / f"{name}.txt"
        data.write_text("ä€😀")
    elif kind == "bad-json":
        data = d / f"{name}.jsonl"
        data.write_text('{"text": "ok"}\n{not json\n')
    elif kind == "no-text":
        data = d / f"{name}.jsonl"
        data.write_text(json.dumps({"content": "x" * 100}) + "\n")
    elif kind == "bad-suffix":
        data = d / f"{name}.docx"
        data.write_text("hello")
    elif kind in ("yaml-garbage", "yaml-binary", "missing-config"):
        y = d / f"{name}.yaml"
        if kind == "yaml-garbage":
            y.write_text("lr: [1, 2\n  - nope: :\n")
        elif kind == "yaml-binary":
            y.write_bytes(b"\xff\xfe\x00garbage")
        else:
            y = d / f"{name}-missing.yaml"
        extra = ["--config", str(y)]
    elif kind == "missing-model":
        extra = ["--model", str(d / f"{name}-no-such-model")]
    elif kind == "missing-wikitext":
        extra = ["--wikitext-file", str(d / f"{name}-no-such.txt")]
    line = _run(workdir, tmp_path, capsys, *extra, data=data)
    assert str(d) in line or name in line or kind in ("empty", "unicode-tiny"), line


@pytest.mark.parametrize("m", [4, 8])
def test_widths_that_do_not_divide_by_m(workdir, tmp_path, capsys, m):
    n = m // 2
    line = _run(workdir, tmp_path, capsys, "--n", str(n), "--m", str(m), model="odd-width")
    assert "down_proj" in line and "130" in line and "--skip-incompatible" in line


def test_tokenizer_without_eos(workdir, tmp_path, capsys):
    line = _run(workdir, tmp_path, capsys, model="no-eos")
    assert "EOS" in line


@pytest.mark.parametrize("argv, says", [
    (["train", "--temperature", "2", "--output-dir", "x"], "--temperature is now --kd-temperature"),
    (["scaling-law", "sweep", "--tokens=1M,2M,4M", "--output-dir", "x"], "--tokens is now --budgets"),
    (["finetune", "m", "--val-fraction", "0.2"], "--val-fraction is now --eval-fraction"),
])
def test_a_renamed_flag_is_refused_in_one_line_that_names_its_new_name(capsys, argv, says):
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and says in err[0] and "unrecognized arguments" in err[0], err
