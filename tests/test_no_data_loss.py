"""Nothing lost (issue 49): a command that writes a model folder (export, quantize, prune) never writes over
one of its inputs, replaces only the files its own marker lists and only once the new result is complete,
and never replaces a file it did not write. Every refusal is exit 2 and one line, and every file is
byte-identical afterwards."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import tiny
from deploy_helpers import cli, one_line_error, save_hf, sparse_model


def snapshot(folder) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed) with its content hash or link target."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = os.path.join(root, name)
            rel = os.path.relpath(p, folder)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isfile(p):
                out[rel] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    return save_hf(sparse_model("llama"), tmp_path_factory.mktemp("nl") / "sparse")


@pytest.mark.parametrize("where", ["same", "inside", "containing"])
def test_export_refuses_an_output_that_overlaps_the_model(tmp_path, sparse_dir, capsys, where):
    before = snapshot(sparse_dir.parent)
    out = {"same": sparse_dir, "inside": sparse_dir / "sub", "containing": sparse_dir.parent}[where]
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", out, "--overwrite") == 2
    line = one_line_error(capsys)
    assert "MODEL" in line and "--output-dir" in line and str(sparse_dir) in line, line
    assert snapshot(sparse_dir.parent) == before


def test_overwrite_replaces_only_the_listed_files_once_the_new_one_is_complete(tmp_path, sparse_dir, capsys):
    out = tmp_path / "o"
    assert cli("export", sparse_dir, "--format", "hf", "--output-dir", out, "--no-verify") == 0
    (out / "notes.txt").write_text("mine")
    listed = json.loads((out / "cast_llm.json").read_text())["files"]
    assert "model.safetensors" in listed and "notes.txt" not in listed
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", out, "--overwrite") == 0
    assert not (out / "model.safetensors").exists()  # the old format's weights went: the marker listed them
    assert (out / "notes.txt").read_text() == "mine"  # the user's file stayed
    assert (out / "compressed.safetensors").is_file()
    assert sorted(json.loads((out / "cast_llm.json").read_text())["files"]) == sorted(
        p.name for p in out.iterdir() if p.name != "notes.txt")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".stage-")]


def test_a_failed_export_leaves_the_previous_one_intact(tmp_path, sparse_dir, capsys, monkeypatch):
    import cast_llm.jobs.export as export_cli

    out = tmp_path / "o"
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", out) == 0
    before = snapshot(out)
    monkeypatch.setattr(export_cli, "_state_equal", lambda a, b: ["lm_head.weight"])  # verification fails
    assert cli("export", sparse_dir, "--format", "hf", "--output-dir", out, "--overwrite") == 2
    assert "verification failed" in one_line_error(capsys)
    assert snapshot(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".stage-")]


def test_a_folder_cast_llm_did_not_write_keeps_every_file(tmp_path, sparse_dir, capsys):
    downloaded = save_hf(tiny.model("llama"), tmp_path / "Llama")  # a model the user downloaded (no marker)
    before = snapshot(downloaded)
    assert cli("export", sparse_dir, "--format", "hf", "--output-dir", downloaded, "--overwrite",
               "--no-verify") == 2
    line = one_line_error(capsys)
    assert "config.json" in line and "model.safetensors" in line and "did not write" in line, line
    assert snapshot(downloaded) == before
    mine = tmp_path / "mine"  # a non-empty folder whose names do not collide: written beside, nothing replaced
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", mine) == 2
    assert "--overwrite" in one_line_error(capsys)
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", mine, "--overwrite") == 0
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "cast_llm.json").is_file()


@pytest.mark.parametrize("name", ["../victim", "/tmp/x", ".", ""])
def test_a_marker_listing_a_name_outside_the_folder_is_refused(tmp_path, sparse_dir, capsys, name):
    out = tmp_path / "o"
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", out) == 0
    victim = tmp_path / "victim"
    victim.write_text("precious")
    marker = json.loads((out / "cast_llm.json").read_text())
    marker["files"].append(name)
    (out / "cast_llm.json").write_text(json.dumps(marker))
    before = snapshot(tmp_path)
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", out, "--overwrite") == 2
    assert "not a plain name" in one_line_error(capsys)
    assert snapshot(tmp_path) == before


def test_a_planted_link_in_the_output_is_replaced_not_followed(tmp_path, sparse_dir, capsys):
    out = tmp_path / "o"
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", out) == 0
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(victim)  # a listed name, now a link to a file elsewhere
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", out, "--overwrite") == 0
    assert victim.read_text() == "precious" and not (out / "config.json").is_symlink()


def test_prune_refuses_its_model_as_output(tmp_path, capsys):
    model = tiny.save_model(tmp_path / "dense", "llama")
    tiny.write_corpus(tmp_path / "corpus.jsonl")
    before = snapshot(tmp_path)
    for out in (model, tmp_path):  # the model's folder; a folder holding the model and the data
        assert cli("prune", "--method", "magnitude", "--model", model, "--output-dir", out, "--overwrite",
                   "--device", "cpu") == 2
        assert "--model" in one_line_error(capsys)
    assert cli("prune", "--method", "wanda", "--model", model, "--data", tmp_path / "corpus.jsonl",
               "--output-dir", tmp_path / "corpus.jsonl", "--device", "cpu") == 2
    assert "--data" in one_line_error(capsys)
    assert snapshot(tmp_path) == before


def test_quantize_refuses_its_model_as_output_and_names_its_own_flag(tmp_path, sparse_dir, capsys):
    before = snapshot(sparse_dir)
    assert cli("quantize", sparse_dir, "--method", "rtn", "--output-dir", sparse_dir, "--overwrite") == 2
    assert "MODEL" in one_line_error(capsys)
    assert snapshot(sparse_dir) == before
    (tmp_path / "one.txt").write_text(tiny.CORPUS)  # one short document: far fewer than 128 calibration windows
    assert cli("quantize", sparse_dir, "--method", "awq", "--data", tmp_path / "one.txt", "--seq-len", "32",
               "--device", "cpu", "--output-dir", tmp_path / "q") == 2
    line = one_line_error(capsys)
    assert "--calib-samples" in line and "--batch-size" not in line, line
    assert not (tmp_path / "q").exists()


# ------------------------------------------------------------------------------------------ run folders
TRAIN = ["--batch-size", "2", "--seq-len", "32", "--max-steps", "2", "--val-sequences", "1", "--wikitext-windows", "1",
         "--no-progress", "--no-baseline-eval", "--device", "cpu", "--no-report"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runin")
    tiny.save_model(d / "llama", "llama")
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    return d


def train_argv(inputs, out, *extra):
    return ["train", "--model", inputs / "llama", "--data", inputs / "corpus.jsonl", "--wikitext-file",
            inputs / "eval.txt", "--output-dir", out, *TRAIN, *extra]


@pytest.fixture(scope="module")
def finished_run(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert cli(*train_argv(inputs, out)) == 0
    return out


def test_resume_auto_on_a_finished_run_changes_nothing_and_exits_0(inputs, finished_run, capsys):
    before = snapshot(finished_run)
    capsys.readouterr()
    assert cli(*train_argv(inputs, finished_run, "--resume", "auto")) == 0
    out = capsys.readouterr().out
    assert "already finished: " in out and "ppl" in out and str(finished_run) in out, out
    assert snapshot(finished_run) == before
    assert cli("train", "--output-dir", finished_run, "--resume") == 0  # the bare --resume of a job script too
    assert snapshot(finished_run) == before


def test_resume_auto_with_overwrite_trains_a_finished_run_again(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(*train_argv(inputs, out, "--max-steps", "1")) == 0
    (out / "notes.txt").write_text("mine")
    (out / "metrics.jsonl").write_text("")  # trained again: the run writes it again
    capsys.readouterr()
    assert cli(*train_argv(inputs, out, "--max-steps", "1", "--resume", "auto", "--overwrite")) == 0
    assert "starting it again from the beginning" in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text().strip()
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["../victim", "/tmp/victim-abs", ".."])
def test_overwrite_refuses_a_run_marker_naming_anything_outside_the_folder(inputs, tmp_path, capsys, name):
    out = tmp_path / "run"
    out.mkdir()
    (out / "cast_run.json").write_text(json.dumps({"kind": "train", "written": ["metrics.jsonl", name]}))
    (out / "metrics.jsonl").write_text("{}\n")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    before = snapshot(tmp_path)
    assert cli(*train_argv(inputs, out, "--overwrite")) == 2
    assert "not a plain name" in one_line_error(capsys)
    assert snapshot(tmp_path) == before


def test_train_overwrite_into_a_folder_it_did_not_write_names_the_files_it_would_replace(inputs, tmp_path, capsys):
    out = tmp_path / "project"
    out.mkdir()
    (out / "config.yaml").write_text("mine: 1\n")
    (out / "tokenizer.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    assert cli(*train_argv(inputs, out, "--overwrite")) == 2
    line = one_line_error(capsys)
    assert "config.yaml" in line and "tokenizer.json" in line and "notes.txt" not in line, line
    assert snapshot(out) == before


@pytest.mark.parametrize("flag", ["--mask-file", "--wikitext-file", "--data"])
def test_train_refuses_an_output_holding_one_of_its_inputs(inputs, tmp_path, capsys, flag):
    out = tmp_path / "run"
    out.mkdir()
    planted = out / "input.txt"
    planted.write_text(" ".join([tiny.CORPUS] * 20))
    before = snapshot(out)
    argv = [str(a) for a in train_argv(inputs, tmp_path / "run", "--overwrite")]
    if flag in argv:
        argv[argv.index(flag) + 1] = str(planted)
    else:
        argv += [flag, str(planted)]
    assert cli(*argv) == 2
    line = one_line_error(capsys)
    assert flag in line and "--output-dir" in line, line
    assert snapshot(out) == before


def test_a_planted_lock_link_is_refused_and_a_report_probes_without_creating(tmp_path, capsys):
    from cast_llm.errors import CastError
    from cast_llm.train.rundir import LOCK_FILE, RunLock

    victim = tmp_path / "bashrc"
    victim.write_text("precious")
    run = tmp_path / "received"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(victim)
    with pytest.raises(CastError, match="is a link"):
        RunLock(run).acquire()
    assert not RunLock.held(run)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert cli("report", run) == 0
    assert victim.read_text() == "precious" and (run / LOCK_FILE).is_symlink()
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert cli("report", plain) == 0
    assert not (plain / LOCK_FILE).exists()  # a report creates no lock in a folder it only reads
    fifo = tmp_path / "fifo-run"
    fifo.mkdir()
    os.mkfifo(fifo / LOCK_FILE)
    with pytest.raises(CastError, match="not a regular file"):
        RunLock(fifo).acquire()


# ------------------------------------------------------------------------------------------ no code from a folder
EVIL = "import pathlib; pathlib.Path(__file__).with_name('PWNED').write_text('ran')\nclass Attr: pass\n"


def _folder_with(tmp_path, sparse_dir, name, edit):
    import shutil

    d = tmp_path / name
    shutil.copytree(sparse_dir, d)
    (d / "evil.py").write_text(EVIL)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg, d)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("case, says", [
    ("auto_map", "custom code"),
    ("tokenizer_auto_map", "custom code"),
    ("ct_sparsity_format", "not a known format"),
    ("ct_quant_format", "not a known format"),
    ("top_sparsity_config", "not a known format"),
    ("unknown_quant_method", "not a quantizer transformers knows"),
])
def test_a_folder_naming_code_is_refused_in_one_line_before_any_library_reads_it(tmp_path, sparse_dir, capsys,
                                                                                    case, says):
    import time

    def edit(cfg, d):
        if case == "auto_map":
            cfg["auto_map"] = {"AutoModelForCausalLM": "evil.Attr"}
        elif case == "tokenizer_auto_map":
            tc = json.loads((d / "tokenizer_config.json").read_text())
            tc["auto_map"] = {"AutoTokenizer": ["evil.Attr", None]}
            (d / "tokenizer_config.json").write_text(json.dumps(tc))
        elif case == "ct_sparsity_format":
            cfg["quantization_config"] = {"quant_method": "compressed-tensors",
                                          "sparsity_config": {"format": "evil.py:Attr"}}
        elif case == "ct_quant_format":
            cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "evil.py:Attr"}
        elif case == "top_sparsity_config":
            cfg["sparsity_config"] = {"format": "evil.py:Attr"}
        else:
            cfg["quantization_config"] = {"quant_method": "evil.py:Attr"}

    d = _folder_with(tmp_path, sparse_dir, case, edit)
    before = snapshot(d)
    t0 = time.perf_counter()
    for argv in (["export", d, "--output-dir", tmp_path / "o"], ["eval", "ppl", "--model", d],
                 ["plan", "--model", d, "--max-steps", "1"]):
        assert cli(*argv) == 2
        line = one_line_error(capsys)
        assert says in line and str(d) in line, line
    assert time.perf_counter() - t0 < 10
    assert not (d / "PWNED").exists() and snapshot(d) == before and not (tmp_path / "o").exists()


@pytest.mark.parametrize("content, says", [(b"{", "not valid JSON"), (b"\xff\xfe\x00", "not UTF-8"),
                                           (b"[]", "not an object")])
def test_a_malformed_config_json_is_one_line(tmp_path, sparse_dir, capsys, content, says):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(sparse_dir, d)
    (d / "config.json").write_bytes(content)
    for argv in (["export", d, "--output-dir", tmp_path / "o"], ["quantize", d, "--method", "rtn", "--output-dir",
                                                                  tmp_path / "q"]):
        assert cli(*argv) == 2
        line = one_line_error(capsys)
        assert says in line and "config.json" in line, line


def test_a_damaged_tokenizer_or_truncated_weights_file_is_one_line(tmp_path, sparse_dir, capsys):
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(sparse_dir, tok)
    (tok / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"')
    assert cli("export", tok, "--output-dir", tmp_path / "o") == 2
    assert "tokenizer" in one_line_error(capsys)
    cut = tmp_path / "cut"
    shutil.copytree(sparse_dir, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert cli("export", cut, "--output-dir", tmp_path / "o") == 2
    assert "could not load the model folder" in one_line_error(capsys)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ bounded parsing
def _fast_and_small(fn):
    """Run ``fn``; assert it took under 10 s and grew this process's peak memory by under 1 GiB."""
    import resource
    import time

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = fn()
    assert time.perf_counter() - t0 < 10
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) * 1024 < 2**30
    return out


def test_a_gguf_whose_array_claims_2_to_the_40_items_is_one_line(tmp_path, capsys):
    import struct

    from cast_llm.models.gguf_check import check_gguf

    bad = tmp_path / "bad.gguf"  # 49 bytes: header, one key "k", an array of 2^40 uint32 items, no items
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
                    + struct.pack("<IIQ", 9, 4, 1 << 40))
    assert bad.stat().st_size == 49
    for argv in (["export", bad, "--output-dir", tmp_path / "o"], ["eval", "ppl", "--model", bad]):
        assert _fast_and_small(lambda argv=argv: cli(*argv)) == 2
        line = one_line_error(capsys)
        assert "bad.gguf" in line and "claims 1,099,511,627,776 items" in line, line
    cut = tiny.write_gguf(tmp_path / "ok.gguf")
    check_gguf(cut)  # a valid file passes
    (tmp_path / "cut.gguf").write_bytes(cut.read_bytes()[:200])
    assert cli("eval", "ppl", "--model", tmp_path / "cut.gguf") == 2
    assert "not a valid GGUF file" in one_line_error(capsys)


def test_a_compressed_tensors_shape_larger_than_its_tensors_is_refused_before_allocating(tmp_path, sparse_dir,
                                                                                         capsys):
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path / "ct"
    assert cli("export", sparse_dir, "--format", "compressed-tensors", "--output-dir", out, "--no-verify") == 0
    tensors = load_file(out / "model.safetensors")
    name = next(k for k in tensors if k.endswith(".shape"))
    tensors[name] = torch.tensor([150000, 150000], dtype=torch.int64).view(2, 1)  # 45 GB if zero-filled
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert _fast_and_small(lambda: cli("export", out, "--format", "hf", "--output-dir", tmp_path / "o")) == 2
    line = one_line_error(capsys)
    assert "150000 x 150000" in line and name in line and "damaged" in line, line


def test_data_files_that_are_not_what_they_say_are_one_line(tmp_path, capsys):
    model = tiny.save_model(tmp_path / "llama", "llama")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    common = ["--output-dir", tmp_path / "o", "--max-steps", "1", "--batch-size", "2", "--seq-len", "32",
              "--no-progress", "--device", "cpu"]
    assert cli("train", "--model", model, "--data", tmp_path / "bad.parquet", *common) == 2
    assert "not a readable parquet file" in one_line_error(capsys)
    (tmp_path / "nonutf8.csv").write_bytes(b"prompt,completion\n\xff\xfe,b\n")
    (tmp_path / "huge.csv").write_text('prompt,completion\n"' + "a " * 100_000 + '",b\n')  # a 200 kB field
    (tmp_path / "nonutf8.jsonl").write_bytes(b'\xff{"prompt": "a", "completion": "b"}\n')
    for name, says in (("nonutf8.csv", "not UTF-8"), ("huge.csv", "--seq-len"), ("nonutf8.jsonl", "not UTF-8")):
        assert cli("finetune", model, "--data", tmp_path / name, *common) == 2
        line = one_line_error(capsys)
        assert says in line and name in line, line


def _drop_marker_config(run):
    """The report reads config.yaml when the marker holds no config (as older runs wrote it)."""
    marker = json.loads((run / "cast_run.json").read_text())
    marker.pop("config", None)
    (run / "cast_run.json").write_text(json.dumps(marker))


@pytest.mark.parametrize("edit, says", [
    (lambda r: (r / "results.json").write_text("[]"), "results.json"),
    (lambda r: (r / "results.json").write_bytes(b"\xff\xfe"), "not UTF-8"),
    (lambda r: (r / "results.json").write_text('{"perplexity": 5, "steps": "x"}'), "edited by hand"),
    (lambda r: (r / "dynamics.json").write_text("[1]"), "dynamics.json"),
    (lambda r: (_drop_marker_config(r), (r / "config.yaml").write_text("- a list\n")), "not a mapping"),
    (lambda r: (_drop_marker_config(r), (r / "config.yaml").write_text("lr: [\n")), "not valid YAML"),
])
def test_report_on_hand_edited_files_is_one_line(finished_run, tmp_path, capsys, edit, says):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    edit(run)
    assert cli("report", run) == 2
    assert says in one_line_error(capsys)


def test_report_skips_a_torn_layers_line(finished_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    with open(run / "layers.jsonl", "a") as f:
        f.write('{"step": 3, "flip_ra')  # what a killed run leaves
    assert cli("report", run) == 0


def test_a_hand_edited_kernel_verdict_is_probed_again_not_crashed_on(inputs, tmp_path):
    verdicts = tmp_path / "verdicts.json"
    os.environ["CAST_LLM_KERNEL_VERDICTS"] = str(verdicts)  # (the autouse fixture restores it)
    assert cli(*train_argv(inputs, tmp_path / "a", "--max-steps", "1")) == 0
    data = json.loads(verdicts.read_text())
    assert data["entries"]
    for entry in data["entries"].values():  # every field a hand edit could break
        entry["reference_seconds"] = "fast"
        entry["candidates"] = {name: "passed" for name in entry.get("candidates", {})} or {"triton": "passed"}
    verdicts.write_text(json.dumps(data))
    from cast_llm import kernels

    kernels.reset()
    assert cli(*train_argv(inputs, tmp_path / "b", "--max-steps", "1")) == 0


def test_report_writes_through_no_link_planted_in_a_received_run(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "received"
    shutil.copytree(finished_run, run)
    victim = tmp_path / "bashrc"
    victim.write_text("precious")
    (run / "report").mkdir(exist_ok=True)
    (run / "report" / "loss.png").symlink_to(victim)  # a figure the report writes
    (run / "report" / "report.md").symlink_to(victim)
    assert cli("report", run) == 0
    assert victim.read_text() == "precious" and not (run / "report" / "loss.png").is_symlink()
    shutil.rmtree(run / "report")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "report").symlink_to(elsewhere)  # the whole report folder a link
    assert cli("report", run) == 2
    assert "is a link" in one_line_error(capsys) and not any(elsewhere.iterdir())


def test_train_overwrite_keeps_the_previous_run_until_the_new_one_has_finished(inputs, finished_run, tmp_path,
                                                                               monkeypatch, capsys):
    import shutil

    from cast_llm.train import trainer
    from cast_llm.train.rundir import PREVIOUS

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / ".cast-llm.lock").unlink(missing_ok=True)
    (out / "notes.txt").write_text("mine")
    before = {k: v for k, v in snapshot(out).items() if k != "notes.txt"}
    real = trainer.PretrainJob.batch

    def dies(self, step, micro):
        raise RuntimeError("the node died")

    monkeypatch.setattr(trainer.PretrainJob, "batch", dies)
    with pytest.raises(RuntimeError, match="the node died"):
        cli(*train_argv(inputs, out, "--overwrite"))
    assert snapshot(out / PREVIOUS) == before  # the replaced run, whole, while the new one is unfinished
    monkeypatch.setattr(trainer.PretrainJob, "batch", real)
    capsys.readouterr()
    assert cli(*train_argv(inputs, out, "--overwrite")) == 0
    assert "removed the previous run" in capsys.readouterr().out
    assert not (out / PREVIOUS).exists() and (out / "notes.txt").read_text() == "mine"
    assert (out / "model.safetensors").is_file() and (out / "results.json").is_file()


def test_export_into_the_current_folder_stages_beside_it(tmp_path, sparse_dir, monkeypatch):
    work = tmp_path / "project"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    assert cli("export", sparse_dir, "--format", "compressed", "--output-dir", ".", "--overwrite") == 0
    assert (work / "notes.txt").read_text() == "mine" and (work / "cast_llm.json").is_file()
    assert not [p for p in work.iterdir() if p.name.startswith(".stage-")]


@pytest.mark.parametrize("edit, says", [
    (lambda m: [], "JSON list"),
    (lambda m: {**m, "files": ["model.safetensors"]}, "plain names"),
    (lambda m: {**m, "files": {"../../../etc/hostname": "0" * 64}}, "plain names"),
    (lambda m: {**m, "fingerprint": [1]}, "fingerprint"),
    (lambda m: {**m, "step": "x"}, "step"),
    (lambda m: {**m, "sharded": {"world_size": "x"}}, "sharded"),
])
def test_a_hand_made_checkpoint_meta_json_is_one_line(inputs, tmp_path, capsys, edit, says):
    out = tmp_path / "run"
    assert cli(*train_argv(inputs, out, "--max-steps", "2", "--save-every", "1", "--keep-checkpoints-after")) == 0
    meta_files = sorted((out / "checkpoints").glob("step-*/meta.json"))
    (out / "results.json").unlink()  # an unfinished run: --resume reads its newest checkpoint
    meta_files[-1].write_text(json.dumps(edit(json.loads(meta_files[-1].read_text()))))
    capsys.readouterr()
    assert cli("train", "--output-dir", out, "--resume") == 2
    line = one_line_error(capsys)
    assert "meta.json is not what cast-llm writes" in line and says in line, line


def test_resume_with_a_hand_edited_results_json_is_one_line(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(*train_argv(inputs, out, "--max-steps", "2", "--save-every", "1", "--keep-checkpoints-after")) == 0
    (out / "results.json").write_text('["not", "ours"]')
    capsys.readouterr()
    assert cli("train", "--output-dir", out, "--resume") == 2
    line = one_line_error(capsys)
    assert "results.json" in line and "not an object" in line, line


def test_finetune_resume_auto_on_a_finished_run_changes_nothing(finished_run, tmp_path, capsys):
    data = tmp_path / "instr.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"The quick fox {i}. Animal:", "completion": " fox"}) + "\n"
                            for i in range(24)))
    out = tmp_path / "ft"
    argv = ["finetune", finished_run, "--data", data, "--output-dir", out, "--seq-len", "32", "--max-steps", "1",
            "--batch-size", "2", "--lora-r", "4", "--no-progress", "--device", "cpu", "--no-per-layer-report"]
    assert cli(*argv) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert cli(*argv, "--resume", "auto") == 0
    assert "already finished: " in capsys.readouterr().out
    assert snapshot(out) == before


def test_prepare_data_and_train_refuse_a_cache_inside_their_data(inputs, tmp_path, capsys):
    import shutil

    data = tmp_path / "texts"
    data.mkdir()
    shutil.copy(inputs / "corpus.jsonl", data / "corpus.jsonl")
    before = snapshot(data)
    assert cli("prepare-data", "--model", inputs / "llama", "--data", data, "--data-cache", data / "cache",
               "--seq-len", "32", "--no-progress") == 2
    line = one_line_error(capsys)
    assert "--data-cache" in line and "--data" in line, line
    assert cli(*train_argv(inputs, tmp_path / "run"), "--data", data, "--data-cache", data / "cache") == 2
    assert "--data-cache" in one_line_error(capsys)
    assert snapshot(data) == before and not (tmp_path / "run").exists()
