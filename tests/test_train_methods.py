"""Every training method and CAST ablation end to end through `cast-llm train` (tiny random models, CPU):
an exact 2:4 export with the method in its metadata, the switches doing what they claim, exact resume."""

from __future__ import annotations

import json
import shutil

import pytest
import tiny
import torch
from safetensors.torch import load_file

from cast_llm.cli import main
from cast_llm.sparsity.mask import is_nm

BASE = ["--batch-size", "2", "--seq-len", "32", "--log-every", "2", "--val-sequences", "1", "--wikitext-windows",
        "1", "--no-progress", "--lr", "1e-2", "--l1-decay", "1e-3", "--mask-interval", "2", "--no-baseline-eval",
        "--calib-samples", "4", "--no-report"]  # the HTML report: tested in test_report.py


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("methods")
    for arch in ("llama", "gpt2"):
        tiny.save_model(d / arch, arch)
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 10))
    return d


def _train(workdir, out, *extra, arch="llama", steps=4):
    argv = ["train", "--model", str(workdir / arch), "--data", str(workdir / "corpus.jsonl"), "--output-dir",
            str(out), "--wikitext-file", str(workdir / "eval.txt"), "--max-steps", str(steps), *BASE, *extra]
    return main(argv)


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _check_export(out, method, transposed=False):
    sp = json.loads((out / "config.json").read_text())["sparsity"]
    assert sp["pattern"] == "2:4" and sp["method"] == method
    state = load_file(out / "model.safetensors")
    for fqn in sp["targets"]:
        w = state[f"{fqn}.weight"]
        assert is_nm(w.t() if transposed else w, 2, 4), fqn
    assert not any(k.endswith((".mask", ".logits", ".scale")) or "base_layer" in k for k in state), \
        "wrappers must be gone from the export"
    return sp


@pytest.mark.parametrize("args, method, arch", [
    (["--method", "naive"], "naive", "llama"),
    (["--method", "srste"], "srste", "llama"),
    (["--method", "srste", "--scaling"], "srste", "gpt2"),
    (["--method", "ast"], "ast", "llama"),
    (["--method", "maskllm"], "maskllm", "gpt2"),
    (["--method", "cast", "--mask-learner", "srste"], "cast", "llama"),
])
def test_every_method_trains_and_exports_an_exact_24_checkpoint(workdir, tmp_path, args, method, arch):
    out = tmp_path / "run"
    assert _train(workdir, out, *args, arch=arch) == 0
    sp = _check_export(out, method, transposed=arch == "gpt2")
    assert sp["tokens_trained"] == 4 * 2 * 32 and "training" in sp
    recs = _records(out)
    assert [r["step"] for r in recs] == [2, 4]
    assert all({"flip_rate", "initial_flip_rate", "sparse_weight_ratio"} <= set(r) for r in recs)
    res = json.loads((out / "results.json").read_text())
    assert 1 < res["perplexity"]["heldout"]["sparse"] < 1e7
    if "--mask-learner" in args:  # SR-STE with CAST's KD and scaling: both at work, and said in the checkpoint
        assert sp["training"]["mask_learner"] == "srste" and sp["training"]["scaling"] is True
        assert sp["training"]["srste_decay"] > 0 and any(r["kd"] > 0 for r in recs)


def test_fixed_mask_no_kd_no_scaling_switches(workdir, tmp_path):
    fixed, learned = tmp_path / "fixed", tmp_path / "learned"
    assert _train(workdir, fixed, "--method", "cast", "--fixed-mask", "--no-kd", "--no-scaling", steps=6) == 0
    assert _train(workdir, learned, "--method", "cast", "--lr", "3e-2", steps=6) == 0
    a, b = _records(fixed), _records(learned)
    assert all(r["flip_rate"] == 0 and r["initial_flip_rate"] == 0 for r in a), "--fixed-mask: no flips"
    assert any(r["flip_rate"] > 0 for r in b), "a learned mask must move at this learning rate"
    # (CAST's student starts as the teacher, so its first KL may be exactly 0)
    assert all(r["kd"] == 0 for r in a) and any(r["kd"] > 0 for r in b)
    training = _check_export(fixed, "cast")["training"]
    assert training == {**training, "kd": False, "scaling": False, "mask_interval": 0, "mask_learner": "adams"}
    assert _check_export(learned, "cast")["training"]["scaling"] is True


def test_naive_with_kd_and_a_wanda_mask(workdir, tmp_path):
    """naive + KD (method.md §6) from a Wanda mask: distils, and the mask never moves."""
    out = tmp_path / "run"
    assert _train(workdir, out, "--method", "naive", "--kd", "--init-mask", "wanda") == 0
    recs = _records(out)
    assert all(r["kd"] > 0 and r["flip_rate"] == 0 and r["initial_flip_rate"] == 0 for r in recs)
    assert _check_export(out, "naive")["training"]["init_mask"] == "wanda"


@pytest.mark.parametrize("method", ["ast", "maskllm"])
def test_resume_from_a_checkpoint_is_bitwise_identical(workdir, tmp_path, method):
    """Stop after step 2 (a copy of the step-2 checkpoint), resume, and land on the uninterrupted run."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = ["--method", method, "--save-every", "2", "--keep-last", "3"]
    assert _train(workdir, full, *args, "--keep-checkpoints-after") == 0
    cut.mkdir()
    for name in ("cast_run.json", "config.yaml", "metrics.jsonl", "results.json"):
        if (full / name).exists():
            shutil.copy(full / name, cut / name)
    shutil.copytree(full / "checkpoints" / "step-00000002", cut / "checkpoints" / "step-00000002")
    assert _train(workdir, cut, *args, "--resume") == 0
    a, b = load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    strip = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs]  # noqa: E731
    assert strip(_records(full)) == strip(_records(cut))


def test_mask_freedom_options_train_and_export_exact_24(workdir, tmp_path):
    """--warm-start-mix and --regrow-factor/--regrow-fraction end to end: the export is exactly 2:4, records
    both options, and the mask the warm start hands over moves (these options exist to free it)."""
    out = tmp_path / "run"
    assert _train(workdir, out, "--method", "cast", "--warm-start", "--init-mask", "magnitude", "--no-kd",
                  "--warm-start-mix", "0.5", "--regrow-factor", "5", "--regrow-fraction", "0.5",
                  "--repair-fraction", "0", steps=6) == 0
    training = _check_export(out, "cast")["training"]
    assert training["warm_start_mix"] == 0.5 and training["regrow_factor"] == 5 and training["regrow_fraction"] == 0.5
    assert any(r["initial_flip_rate"] > 0 for r in _records(out)), "half-dense pruned entries must win places"


# ------------------------------------------------------------------------------------------- --mask-file
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_mask_file_retrains_the_dense_model_under_exactly_that_mask(workdir, tmp_path, arch):
    """--mask-file: the run starts from dense ⊙ mask (naive: fixed mask), so its export has exactly the file's
    zeros; a sparse model folder gives the same mask as the file written from it."""
    from cast_llm.models import load_model
    from cast_llm.sparsity.mask_io import load_masks, save_masks
    from cast_llm.targets import find_targets
    from cast_llm.train.methods.masks import masks_from

    # a mask that is not the dense model's own magnitude mask: the magnitude mask of another random model
    other = tiny.model(arch, seed=7)
    targets = find_targets(other, n=2, m=4)
    from cast_llm.sparsity.mask import magnitude_mask

    masks = {t.fqn: magnitude_mask(t.weight, t.transposed, 2, 4) for t in targets}
    path = save_masks(tmp_path / "m.safetensors", masks, n=2, m=4, source="tiny seed 7")
    loaded, meta = load_masks(path)
    assert meta["source"] == "tiny seed 7" and all(torch.equal(loaded[k], masks[k]) for k in masks)
    out = tmp_path / "run"
    assert _train(workdir, out, "--method", "naive", "--kd", "--mask-file", str(path), arch=arch) == 0
    sp = _check_export(out, "naive", transposed=arch == "gpt2")
    assert sp["training"]["init_mask"] == "file" and sp["training"]["mask_file"] == str(path)
    state = load_file(out / "model.safetensors")
    for fqn, mask in masks.items():
        assert torch.equal(state[f"{fqn}.weight"] != 0, mask), fqn
    # the exported folder as a mask source: the same masks
    model = load_model(str(workdir / arch))
    again = masks_from(out, find_targets(model, n=2, m=4), 2, 4)
    assert all(torch.equal(again[k], masks[k]) for k in masks)


def test_mask_file_refusals_are_one_line_errors(workdir, tmp_path, capsys):
    from cast_llm.sparsity.mask_io import save_masks

    out = tmp_path / "run"
    assert _train(workdir, out, "--method", "naive", "--mask-file", str(tmp_path / "none.safetensors")) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert _train(workdir, out, "--method", "naive", "--mask-file", str(workdir / "corpus.jsonl"),
                  "--overwrite") == 2
    assert "cannot be read as a mask file" in capsys.readouterr().err
    assert _train(workdir, out, "--method", "naive", "--mask-file", "x", "--init-mask", "wanda") == 2
    assert "--mask-file gives the initial mask: it excludes --init-mask" in capsys.readouterr().err
    bad = save_masks(tmp_path / "bad.safetensors", {"model.layers.0.mlp.up_proj": torch.ones(3, 4, dtype=torch.bool)},
                     n=2, m=4, source="bad")
    assert _train(workdir, out, "--method", "naive", "--mask-file", str(bad), "--overwrite") == 2
    err = capsys.readouterr().err
    assert "holds no mask for target" in err or "is (3, 4)" in err
    assert err.count("\n") == 1


def test_cast_mask_learners_are_methods_not_branches():
    """--mask-learner picks the method get_method returns; CastMethod itself has no SR-STE branch."""
    import inspect

    from cast_llm.train.methods import CastMethod, CastSRSTEMethod, SRSTEMethod, get_method
    from cast_llm.train.methods import cast as cast_module

    assert type(get_method("cast")) is CastMethod
    learner = get_method("cast", mask_learner="srste")
    assert isinstance(learner, SRSTEMethod) and type(learner) is CastSRSTEMethod and learner.name == "cast"
    assert "srste" not in inspect.getsource(cast_module).split("class CastMethod", 1)[1].lower()
