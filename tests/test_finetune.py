"""End-to-end `cast-llm finetune` on tiny random 2:4 LLaMA / GPT-2 models and tiny synthetic tasks (CPU)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import tiny
import torch
import yaml
from safetensors.torch import load_file

from cast_llm.cli import main
from cast_llm.sparsity.mask import apply_mask_, is_nm, nm_mask
from cast_llm.targets import find_targets

ANIMALS = ["fox", "dog", "owl", "cat", "bee", "elk"]
FAST = ["--seq-len", "48", "--log-every", "2", "--no-progress", "--lora-r", "4", "--no-per-layer-report"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("finetune")
    for arch in ("llama", "gpt2"):
        model = tiny.model(arch)
        for t in find_targets(model):  # make the tiny model 2:4 in the test itself
            w = t.weight.data
            mask = nm_mask(w.t() if t.transposed else w)
            apply_mask_(w, mask.t() if t.transposed else mask)
        model.save_pretrained(d / f"{arch}-24")
        tiny.tokenizer().save_pretrained(d / f"{arch}-24")
    tiny.save_model(d / "llama-dense", "llama")
    rng = random.Random(0)
    with (d / "instr.jsonl").open("w") as f:
        for _ in range(48):
            a = rng.choice(ANIMALS)
            f.write(json.dumps({"prompt": f"The quick {a} jumps. Animal:", "completion": f" {a}"}) + "\n")
    # separable: the label is which of two word sets the text uses
    words = {"yes": "quick brown fox jumps", "no": "lazy dog sleeps over"}
    with (d / "cls.csv").open("w") as f:
        f.write("text,label\n")
        for _ in range(96):
            label = rng.choice(["yes", "no"])
            f.write(f"{' '.join(rng.sample(words[label].split(), 3))},{label}\n")
    return d


def _finetune(workdir, out, model="llama-24", *extra):
    return main(["finetune", str(workdir / model), "--data", str(workdir / "instr.jsonl"), "--output-dir", str(out),
                 *FAST, *extra])


def _weights(path, targets_of_model):
    state = load_file(path / "model.safetensors")
    return {fqn: state[f"{fqn}.weight"] for fqn in targets_of_model}


def _input_targets(workdir, model):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(workdir / model)
    return {t.fqn: (t.weight.detach().clone(), t.transposed) for t in find_targets(m)}


@pytest.mark.parametrize("model", ["llama-24", "gpt2-24"])
def test_lora_merge_keeps_the_exact_mask_and_equals_w_plus_masked_ba(workdir, tmp_path, model):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert _finetune(workdir, out, model, "--mode", "lora", "--max-steps", "4", "--lr", "1e-2") == 0
    before = _input_targets(workdir, model)
    after = _weights(out, before)
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    acfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    scaling = acfg["lora_alpha"] / acfg["r"]
    for fqn, (w0, transposed) in before.items():
        a = adapter[f"base_model.model.{fqn}.lora_A.weight"]
        b = adapter[f"base_model.model.{fqn}.lora_B.weight"]
        delta = (b @ a) * scaling
        delta = delta.t() if transposed else delta
        mask = w0 != 0
        assert torch.equal(after[fqn], w0 + mask * delta), fqn  # W + M⊙(BA)·s, exactly
        assert torch.equal(after[fqn] != 0, mask), fqn  # the very same N:M mask
        assert is_nm(after[fqn].t() if transposed else after[fqn], 2, 4)
        assert b.abs().max() > 0  # the adapter did train
    sp = json.loads((out / "config.json").read_text())["sparsity"]
    assert sp["method"] == "lora-finetune" and sp["pattern"] == "2:4" and sp["mask_changed_entries"] == 0
    res = json.loads((out / "results.json").read_text())
    assert res["sparsity"]["after"]["is_nm"] and res["after"]["loss"] < res["before"]["loss"]
    assert 0 <= res["after"]["exact_match"] <= 1 and res["after"]["exact_match_examples"] == 5
    AutoModelForCausalLM.from_pretrained(out)  # plain transformers loads it


def test_sparse_mode_trains_kept_weights_only(workdir, tmp_path):
    out = tmp_path / "run"
    assert _finetune(workdir, out, "llama-24", "--mode", "sparse", "--max-steps", "4", "--lr", "1e-3",
                     "--weight-decay", "0.1", "--save-every", "2", "--keep-checkpoints-after") == 0
    before = _input_targets(workdir, "llama-24")
    after = _weights(out, before)
    for fqn, (w0, _) in before.items():
        assert torch.equal(after[fqn] != 0, w0 != 0), fqn
        assert not torch.equal(after[fqn], w0), fqn
    from cast_llm.train.state_io import load_state

    ck = load_state(out / "checkpoints" / "step-00000002" / "model")
    assert all(torch.equal(ck[f"{f}.weight"] != 0, w0 != 0) for f, (w0, _) in before.items())
    sp = json.loads((out / "config.json").read_text())["sparsity"]
    assert sp["method"] == "sparse-finetune" and sp["mask_changed_entries"] == 0


def test_dense_mode_reports_that_sparsity_is_lost(workdir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _finetune(workdir, out, "llama-24", "--mode", "dense", "--max-steps", "2", "--lr", "1e-3",
                     "--per-layer-report") == 0
    printed = capsys.readouterr().out
    assert "warning: --mode dense: the fine-tuned model is dense" in printed and "no longer 2:4" in printed
    assert "14 NOT N:M" in printed and "NOT N:M" in printed.split("sparsity of the exported model:")[1]
    sp = json.loads((out / "config.json").read_text())["sparsity"]
    assert sp["pattern"] == "none" and sp["method"] == "dense-finetune" and sp["base_pattern"] == "2:4"
    assert sp["mask_changed_entries"] > 0
    res = json.loads((out / "results.json").read_text())["sparsity"]
    assert res["before"]["is_nm"] and not res["after"]["is_nm"] and len(res["after"]["not_nm"]) == 14
    assert json.loads((out / "cast_llm.json").read_text())["kind"] == "dense-model"


@pytest.mark.parametrize("mode", ["lora", "sparse"])
def test_classification_head_learns_a_separable_task(workdir, tmp_path, mode):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "run"
    lr = "1e-2" if mode == "lora" else "3e-3"
    assert main(["finetune", str(workdir / "gpt2-24"), "--task", "classification", "--mode", mode, "--data",
                 str(workdir / "cls.csv"), "--output-dir", str(out), "--max-steps", "30", "--batch-size", "8",
                 "--lr", lr, "--eval-fraction", "0.25", *FAST]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["after"]["examples"] == 24 and res["after"]["accuracy"] >= 0.9, res["after"]
    assert res["after"]["accuracy"] > res["before"]["accuracy"] + 0.2
    assert res["sparsity"]["after"]["is_nm"] and res["sparsity"]["mask_changed_entries"] == 0
    model = AutoModelForSequenceClassification.from_pretrained(out)  # plain transformers, head and labels
    assert model.config.id2label == {0: "no", 1: "yes"} and model.score.weight.shape[0] == 2


@pytest.mark.parametrize("mode", ["lora", "sparse"])
def test_resume_from_a_checkpoint_is_bitwise_identical(workdir, tmp_path, mode):
    args = ["--mode", mode, "--max-steps", "4", "--save-every", "2", "--lr", "1e-3", "--lora-dropout", "0.1",
            "--no-baseline-eval", "--eval-every", "2"]
    ref = tmp_path / "ref"
    assert _finetune(workdir, ref, "llama-24", *args, "--keep-checkpoints-after") == 0
    cut = tmp_path / "cut"
    shutil.copytree(ref, cut)
    for f in ["model.safetensors", "cast_llm.json", "results.json"]:
        (cut / f).unlink()
    shutil.rmtree(cut / "adapter", ignore_errors=True)
    # keep only the step-2 checkpoint (the run also saved its last step before the export)
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    shutil.rmtree(cut / "checkpoints" / "step-00000004")
    assert _finetune(workdir, cut, "llama-24", *args, "--resume") == 0
    a, b = load_file(ref / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    strip = lambda p: [{k: v for k, v in json.loads(x).items() if k != "tokens_per_s"}  # noqa: E731
                       for x in (p / "metrics.jsonl").read_text().splitlines()]
    assert strip(ref) == strip(cut) and [r["step"] for r in strip(cut)] == [2, 4]


def test_yaml_config_and_cli_precedence(workdir, tmp_path):
    from cast_llm.cli import build_parser
    from cast_llm.cli.finetune import build_config

    y = tmp_path / "c.yaml"
    y.write_text(yaml.safe_dump({"lora_r": 16, "mode": "sparse", "max-steps": 7, "data": "d.jsonl"}))
    cfg = build_config(build_parser().parse_args(["finetune", "m", "--config", str(y), "--mode", "lora",
                                                  "--output-dir", "o"]))
    assert (cfg.model, cfg.mode, cfg.lora_r, cfg.max_steps, cfg.peak_lr) == ("m", "lora", 16, 7, 2e-4)
    y.write_text("lora_rank: 3\n")
    with pytest.raises(Exception, match="unknown option 'lora_rank'"):
        build_config(build_parser().parse_args(["finetune", "m", "--config", str(y)]))


def _err(capsys) -> str:
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("cast-llm")]
    assert len(err) == 1, err
    return err[0]


def test_missing_data_is_one_line_and_leaves_no_folder(workdir, tmp_path, capsys):
    """--data / --eval-data that are not there: one error line before anything is loaded, no run folder."""
    out = tmp_path / "run"
    for flag in ("--data", "--eval-data"):
        capsys.readouterr()
        assert _finetune(workdir, out, "llama-24", flag, str(tmp_path / "nope.jsonl"), "--max-steps", "1") == 2
        said = capsys.readouterr()
        lines = [line for line in said.err.splitlines() if line.startswith("cast-llm")]
        assert len(lines) == 1 and f"{flag} {tmp_path / 'nope.jsonl'}: data source not found" in lines[0], said.err
        assert "Traceback" not in said.err and not out.exists()


def test_bad_inputs_give_one_line_errors(workdir, tmp_path, capsys):
    out = tmp_path / "run"
    ok = ["--max-steps", "1"]
    assert _finetune(workdir, out, "llama-dense", "--mode", "sparse", *ok) == 2
    err = _err(capsys)
    assert "is not 2:4" in err and "0.00% zero" in err and "14 NOT N:M" in err and "--mode dense" in err
    assert _finetune(workdir, out, "llama-dense", "--mode", "lora", *ok) == 2
    assert "is not 2:4" in _err(capsys)
    assert _finetune(workdir, out, "nope", *ok) == 2
    assert "not found" in _err(capsys)
    assert main(["finetune", "--data", "x.jsonl", "--output-dir", str(out), *ok]) == 2
    assert "MODEL is required" in _err(capsys)
    assert _finetune(workdir, out, "llama-24") == 2
    assert "--max-steps" in _err(capsys)
    assert _finetune(workdir, out, "llama-24", *ok, "--task", "classification") == 2
    assert "has no 'label'" in _err(capsys)
    assert main(["finetune", str(workdir / "llama-24"), "--data", str(workdir / "cls.csv"), "--output-dir",
                 str(out), *ok]) == 2
    assert "'prompt' and 'completion'" in _err(capsys)
    assert _finetune(workdir, out, "llama-24", *ok, "--lora-target-modules", "no_such_proj") == 2
    assert "no_such_proj" in _err(capsys)
    assert _finetune(workdir, out, "llama-24", *ok, "--seq-len", "4096") == 2
    assert "maximum" in _err(capsys)
    assert main(["finetune", str(workdir / "llama-24"), "--task", "classification", "--data", "hf:glue:sst2",
                 "--output-dir", str(out), *ok]) == 2
    assert "could not load dataset hf:glue:sst2" in _err(capsys)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert _finetune(workdir, foreign, "llama-24", *ok) == 2
    assert "not a cast-llm run" in _err(capsys) and (foreign / "notes.txt").read_text() == "mine"
