"""End-to-end `cast-llm train` on tiny random LLaMA / GPT-2 / OPT models (CPU, seconds each)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import tiny
import torch
import yaml
from run_helpers import children_running, free_port, start_cli, wait_for_step
from safetensors.torch import load_file

from cast_llm.cli import main
from cast_llm.train.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[1]
# no HTML report: it is tested where it is the subject (test_report.py), and costs 1-2 s a run elsewhere
BASE = ["--batch-size", "2", "--seq-len", "32", "--log-every", "2", "--val-sequences", "2",
        "--no-progress", "--lr", "1e-3", "--l1-decay", "1e-4", "--mask-interval", "2", "--no-report"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    for arch in ("llama", "gpt2", "opt"):
        tiny.save_model(d / arch, arch)
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    return d


def _train(workdir, out, *extra, arch="llama"):
    argv = ["train", "--model", str(workdir / arch), "--data", str(workdir / "corpus.jsonl"),
            "--output-dir", str(out), "--wikitext-file", str(workdir / "eval.txt"), *BASE, *extra]
    return main(argv)


def _assert_same_run(ref, cut):
    """Bitwise-equal exported weights and identical metrics (throughput aside) of two runs."""
    a, b = load_file(ref / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs]  # noqa: E731
    assert strip(la) == strip(lb)


def _is_24(w: torch.Tensor, transposed: bool) -> bool:
    from cast_llm.sparsity.mask import is_nm

    return is_nm(w.t() if transposed else w, 2, 4)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_train_exports_exact_24_model_that_plain_transformers_loads(workdir, plain_transformers, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert _train(workdir, out, "--max-steps", "4", arch=arch) == 0
    cfg = json.loads((out / "config.json").read_text())
    sp = cfg["sparsity"]
    assert sp["pattern"] == "2:4" and sp["method"] == "cast" and sp["tokens_trained"] == 4 * 2 * 32
    state = load_file(out / "model.safetensors")
    targets = sp["targets"]
    assert len(targets) == {"llama": 14, "gpt2": 8, "opt": 12}[arch]
    for fqn in targets:
        w = state[f"{fqn}.weight"]
        assert _is_24(w, transposed=arch == "gpt2"), fqn
        assert (w == 0).float().mean() == 0.5, fqn
    assert not any("scale" in k or "base_layer" in k for k in state), "scales must be folded away"
    # plain transformers, in a process that never imports cast_llm
    code = (f"import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}); "
            f"assert 'cast_llm' not in sys.modules; "
            f"print(float(m(torch.arange(8)[None]).logits.abs().mean()))")
    r = plain_transformers.run(code, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    for split in ("heldout", "wikitext2"):
        for key in ("dense", "oneshot", "sparse"):  # a warm-started run measures its one-shot start
            assert 1 < res["perplexity"][split][key] < 1e6, (split, key)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [2, 4]
    for r in recs:
        assert {"loss", "ce", "kd", "lr", "tokens", "flip_rate", "initial_flip_rate", "changed_groups",
                "sparse_weight_ratio"} <= set(r)
        assert 0 <= r["flip_rate"] <= 1 and 0 < r["sparse_weight_ratio"] <= 1
        # a group changes when at least one of its entries does, and at most 4 of them do
        assert r["initial_flip_rate"] <= r["changed_groups"] <= 4 * r["initial_flip_rate"]
    assert res["teacher_forward"] == "eager"  # how the teacher ran (kept although the teacher is dropped first)
    masks = res["masks"]  # the run says whether its masks moved, from its own records
    assert masks["initial_flip_rate"] == recs[-1]["initial_flip_rate"]
    assert masks["changed_groups"] == recs[-1]["changed_groups"] and masks["flipped_fraction"] is not None
    AutoModelForCausalLM.from_pretrained(out)  # loads here too


def test_cast_decays_pruned_weights_and_keeps_the_model_close_to_dense(workdir, tmp_path):
    """With enough steps the proportional decay drives the pruned mass to ~0 (S_t → 1)."""
    out = tmp_path / "run"
    assert _train(workdir, out, "--max-steps", "60", "--lr", "5e-3", "--l1-decay", "1e-2", "--log-every", "10",
                  "--paper-exact") == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["sparse_weight_ratio"] > 0.98
    assert recs[-1]["sparse_weight_ratio"] > recs[0]["sparse_weight_ratio"]
    res = json.loads((out / "results.json").read_text())["perplexity"]["heldout"]
    assert res["sparse"] < res["magnitude"]


def test_kill_9_and_resume_is_bitwise_identical(workdir, warm_cli, tmp_path):
    common = ["train", "--model", str(workdir / "llama"), "--data", str(workdir / "corpus.jsonl"),
              "--wikitext-file", str(workdir / "eval.txt"), *BASE, "--max-steps", "12", "--save-every", "2",
              "--no-baseline-eval", "--keep-last", "3"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert main([*common, "--output-dir", str(ref)]) == 0  # in this process: only the killed run needs its own
    p = start_cli(warm_cli, [*common, "--output-dir", str(cut)])  # a process of its own
    deadline = time.time() + 240
    while not (cut / "checkpoints" / "step-00000006").is_dir():
        assert p.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (cut / "model.safetensors").exists()
    assert main([*common, "--output-dir", str(cut), "--resume"]) == 0
    _assert_same_run(ref, cut)


def test_resume_refuses_corrupt_and_incompatible_checkpoints(workdir, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--max-steps", "4", "--save-every", "2", "--no-baseline-eval"]
    assert _train(workdir, out, *args, "--keep-checkpoints-after") == 0
    ck = sorted((out / "checkpoints").iterdir())[-1]
    assert _train(workdir, out, *args[:2], "--lr", "5e-3", "--save-every", "2", "--resume") == 2
    assert "different run configuration" in capsys.readouterr().err
    with (ck / "optimizer.safetensors").open("r+b") as f:
        f.seek(100)
        f.write(b"\x00garbage")
    assert _train(workdir, out, *args, "--resume") == 2
    assert "corrupt" in capsys.readouterr().err


def test_yaml_and_cli_precedence(tmp_path):
    from cast_llm.cli import build_parser
    from cast_llm.cli.train import build_config

    y = tmp_path / "c.yaml"
    y.write_text(yaml.safe_dump({"lr": 1e-3, "seq-len": 64, "eta": 0.4, "max_steps": 7}))
    p = build_parser()
    cfg = build_config(p.parse_args(["train", "--preset", "smollm2-cpu", "--config", str(y), "--lr", "2e-4",
                                     "--output-dir", "x"]))
    assert cfg.lr == 2e-4  # CLI beats YAML
    assert cfg.seq_len == 64 and cfg.eta == 0.4 and cfg.max_steps == 7  # YAML beats preset
    assert cfg.tokens is None  # the file's budget (steps) replaces the preset's (tokens)
    assert cfg.batch_size == 4 and cfg.warmup_steps == 2 and cfg.model == "smollm2-135m"  # preset beats defaults
    cfg = build_config(p.parse_args(["train", "--preset", "smollm2-cpu", "--tokens", "20M", "--output-dir", "x"]))
    assert cfg.tokens == 20_000_000 and cfg.max_steps is None  # a typed budget replaces the preset's
    y.write_text("lrr: 3\n")
    with pytest.raises(Exception, match="unknown option 'lrr'"):
        build_config(p.parse_args(["train", "--config", str(y), "--output-dir", "x"]))
    y.write_text("temperature: 2\n")  # a run's config.yaml from before --kd-temperature
    with pytest.raises(Exception, match="option 'temperature' is now 'kd-temperature'"):
        build_config(p.parse_args(["train", "--config", str(y), "--output-dir", "x"]))
    y.write_text("batch_size: many\n")
    with pytest.raises(Exception, match="batch-size"):
        build_config(p.parse_args(["train", "--config", str(y), "--output-dir", "x", "--max-steps", "1"]))


def _err(capsys) -> str:
    """The one error line (progress bars of model loading may precede it; a traceback may not)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("cast-llm")]
    assert len(lines) == 1, err
    return lines[0]


def test_bad_inputs_give_one_line_errors(workdir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(workdir, out, "--max-steps", "1", "--model", str(tmp_path / "nope")) == 2
    assert "not found" in _err(capsys)
    assert main(["train", "--model", "no-such-org/no-such-model", "--data", str(workdir / "corpus.jsonl"),
                 "--output-dir", str(out), "--max-steps", "1"]) == 2
    assert "could not load model" in _err(capsys)
    assert _train(workdir, out, "--max-steps", "1", "--seq-len", "512") == 2
    assert "maximum" in _err(capsys)
    (tmp_path / "empty.txt").write_text("   \n")
    assert _train(workdir, out, "--max-steps", "1", "--data", str(tmp_path / "empty.txt")) == 2
    assert "no non-empty text" in _err(capsys)
    (tmp_path / "small.txt").write_text("too small")
    assert _train(workdir, out, "--max-steps", "1", "--data", str(tmp_path / "small.txt")) == 2
    assert "too small" in _err(capsys)
    assert _train(workdir, out, "--max-steps", "1", "--wikitext-file", str(tmp_path / "missing.txt")) == 2
    assert "missing.txt" in _err(capsys)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert _train(workdir, foreign, "--max-steps", "1") == 2
    assert "not a cast-llm run" in _err(capsys)
    assert (foreign / "notes.txt").read_text() == "mine"
    assert main(["train", "--output-dir", str(out)]) == 2
    assert "budget" in _err(capsys)


def test_a_missing_data_file_is_one_line_before_the_plan_and_leaves_no_folder(workdir, tmp_path, capsys):
    """Inputs are checked before the memory plan is printed and before the run folder is made: a missing
    --data file (or --wikitext-file) is one error line, nothing on stdout, no folder."""
    out = tmp_path / "run"
    capsys.readouterr()
    assert _train(workdir, out, "--max-steps", "1", "--data", str(tmp_path / "nope.jsonl")) == 2
    said = capsys.readouterr()
    lines = [line for line in said.err.splitlines() if line.startswith("cast-llm")]
    assert len(lines) == 1 and "data source not found" in lines[0] and "nope.jsonl" in lines[0], said.err
    assert "Traceback" not in said.err and "memory plan" not in said.out + said.err
    assert not out.exists()
    assert _train(workdir, out, "--max-steps", "1", "--wikitext-file", str(tmp_path / "missing.txt")) == 2
    said = capsys.readouterr()
    assert "missing.txt" in said.err and "memory plan" not in said.out + said.err and not out.exists()


def test_incompatible_widths_name_the_layer_and_can_be_skipped(workdir, tmp_path, capsys):
    d = tiny.save_model(tmp_path / "odd", "llama", intermediate_size=130)
    out = tmp_path / "run"
    assert _train(workdir, out, "--max-steps", "2", "--model", str(d)) == 2
    assert "down_proj" in _err(capsys)
    assert _train(workdir, out, "--max-steps", "2", "--model", str(d), "--skip-incompatible") == 0
    sp = json.loads((out / "config.json").read_text())["sparsity"]
    assert not any("down_proj" in t for t in sp["targets"]) and len(sp["targets"]) == 12


def test_nan_loss_stops_and_keeps_last_good_checkpoint(workdir, tmp_path, capsys):
    out = tmp_path / "run"
    rc = _train(workdir, out, "--max-steps", "30", "--save-every", "1", "--lr", "1e30", "--no-baseline-eval",
                "--grad-clip", "0", "--warmup-steps", "0")
    assert rc == 2
    err = _err(capsys)
    assert "loss became" in err and "last good checkpoint" in err
    assert not (out / "model.safetensors").exists()
    good = sorted((out / "checkpoints").iterdir())
    assert good, "the checkpoints written before the NaN must survive"


# one uninterrupted 2-process DDP run, launched once for the two tests below: 10 steps of micro-batch 1 on each
# rank, started the way the docs say — `accelerate launch --multi_gpu --num_processes 2 … --device cpu`
# (accelerate 1.x's `--cpu` switch starts several CPU processes only through MPI; `--multi_gpu` starts them with
# torchrun and our `--device cpu` makes the Accelerator use gloo on the CPU). A plain torchrun launch of the
# same run is bitwise equal to it (checked here: weights and every metrics line).
DDP_ARGS = ["--seq-len", "32", "--log-every", "1", "--val-sequences", "2", "--no-progress", "--lr", "1e-3",
            "--l1-decay", "1e-4", "--mask-interval", "2", "--max-steps", "10", "--no-baseline-eval", "--device",
            "cpu", "--no-report"]


@pytest.fixture(scope="module")
def ddp_ref(workdir, tmp_path_factory):
    if os.environ.get("CAST_SKIP_DDP") == "1":
        pytest.skip("CAST_SKIP_DDP=1")
    out = tmp_path_factory.mktemp("ddp-ref") / "ref"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                str(free_port()), "-m", "cast_llm.cli"]
    r = subprocess.run([*launcher, "train", *_data_args(workdir), *DDP_ARGS, "--batch-size", "1", "--output-dir",
                        str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return types.SimpleNamespace(out=out, stdout=r.stdout)


def test_ddp_two_cpu_processes_match_single_process(workdir, ddp_ref, tmp_path):
    """Two CPU processes (gloo DDP through accelerate) with micro-batch 1 each == one process with 2: the same
    weights and losses up to float summation order over 10 steps."""
    single, ddp = tmp_path / "single", ddp_ref.out
    assert main(["train", *_data_args(workdir), *DDP_ARGS, "--batch-size", "2", "--output-dir", str(single)]) == 0
    assert "on 2 process(es)" in ddp_ref.stdout
    a, b = load_file(single / "model.safetensors"), load_file(ddp / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    la = [json.loads(x) for x in (single / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (ddp / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in la] == [r["tokens"] for r in lb]
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], rel=1e-5)


def test_sigterm_to_one_rank_of_two_stops_both_at_the_same_step_and_resumes_bitwise(workdir, ddp_ref, tmp_path):
    """2 gloo DDP processes under torchrun; SIGTERM reaches one worker only: the ranks agree (all-reduce) on
    the step, write one complete checkpoint, exit 75; `--resume auto` with the same launch ends bitwise equal
    to the uninterrupted 2-process run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def launch(out, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "cast_llm.cli", "train", *_data_args(workdir), *DDP_ARGS, "--batch-size",
               "1", "--output-dir", str(out), *extra]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    cut = tmp_path / "cut"
    p = launch(cut)
    wait_for_step(cut, 4, p)
    workers = children_running("cast_llm.cli", p.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGTERM)  # one rank only
    out, err = p.communicate(timeout=600)
    complete = [c for c in (cut / "checkpoints").iterdir() if (c / "meta.json").is_file()]
    assert len(complete) == 1, (out[-2000:], err[-3000:])
    assert "stopped at step" in out + err
    p = launch(cut, "--resume", "auto")
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    _assert_same_run(ddp_ref.out, cut)


# ------------------------------------------------------------------------------------------------ FSDP2
FSDP_COMMON = ["--seq-len", "32", "--log-every", "2", "--val-sequences", "2", "--no-progress", "--lr", "1e-3",
               "--l1-decay", "1e-4", "--mask-interval", "2", "--no-baseline-eval", "--device", "cpu", "--no-report"]


def _data_args(workdir):
    return ["--model", str(workdir / "llama"), "--data", str(workdir / "corpus.jsonl"), "--wikitext-file",
            str(workdir / "eval.txt")]


@pytest.mark.skipif(os.environ.get("CAST_SKIP_DDP") == "1", reason="CAST_SKIP_DDP=1")
def test_fsdp2_masks_of_row_shards_equal_full_tensor_masks(tmp_path, warm_torchrun):
    """AdamS on DTensor parameters sharded like FSDP2 (rows; Conv1D-style weights by columns), uneven shards
    and tied magnitudes included: every rank's mask == the full tensor's mask on its rows, at every step;
    gathered masks == full masks; a full-tensor set_mask keeps the local rows; the per-rank optimizer state
    (moments, masks, packed or not) round-trips exactly. In the same launch (tests/fsdp_worker.py): a model
    loaded by rank 0 alone reaches every rank's shards (rank 1 never holds a whole tensor), the teacher in
    bf16 likewise; between micro-batches no rank holds more than its gradient shards, and the accumulated
    gradients equal one process's; rank 0's errors reach rank 1 as one line, a checkpoint failing on rank 0
    alone fails everywhere."""
    r = warm_torchrun.run([str(REPO / "tests" / "fsdp_worker.py"), str(tmp_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK 0" in r.stdout and "OK 1" in r.stdout


# one uninterrupted 2-process FSDP2 run, launched once for the two tests below (most of a launch's time is its
# processes' imports: 12 of 15 s of a one-process run, profiled here): 8 steps of micro-batch 1 × 2
# accumulations on each rank, a checkpoint every 2 steps, kept
FSDP_REF = ["--max-steps", "8", "--batch-size", "1", "--grad-accum", "2", "--fsdp", "--save-every", "2",
            "--keep-last", "10"]


@pytest.fixture(scope="module")
def fsdp_ref(workdir, tmp_path_factory, warm_torchrun):
    if os.environ.get("CAST_SKIP_DDP") == "1":
        pytest.skip("CAST_SKIP_DDP=1")
    d = tmp_path_factory.mktemp("fsdp-ref")
    tokens = d / "token-cache"  # of this run and its resumes alone: its builds are counted below
    out = d / "ref"
    r = warm_torchrun.run(["-m", "cast_llm.cli", "train", *_data_args(workdir), *FSDP_COMMON, *FSDP_REF,
                           "--keep-checkpoints-after", "--data-cache", str(tokens), "--output-dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    return types.SimpleNamespace(out=out, tokens=tokens, stdout=r.stdout)


def test_fsdp2_two_cpu_processes_match_single_process_and_export_exact_24(workdir, fsdp_ref, plain_transformers,
                                                                          tmp_path):
    """--fsdp on 2 gloo CPU processes (student + teacher sharded, weight scaling, KD, AdamS on shards) with
    micro-batch 1 × 2 accumulations each == one unsharded process with micro-batch 2 × 2, and the export is the
    same exact 2:4 HF model. Tolerance as for DDP: the two runs differ only in float summation order (the
    gradient is averaged over ranks by reduce-scatter instead of summed in one batch), ~1e-7 relative per step
    over 8 steps."""
    single, sharded = tmp_path / "single", fsdp_ref.out
    assert main(["train", *_data_args(workdir), *FSDP_COMMON, "--max-steps", "8", "--batch-size", "2",
                 "--grad-accum", "2", "--output-dir", str(single)]) == 0
    assert "on 2 process(es)" in fsdp_ref.stdout and "FSDP2: student and teacher sharded" in fsdp_ref.stdout
    a, b = load_file(single / "model.safetensors"), load_file(sharded / "model.safetensors")
    assert a.keys() == b.keys()
    sp = json.loads((sharded / "config.json").read_text())["sparsity"]
    assert len(sp["targets"]) == 14 and sp["tokens_trained"] == 8 * 4 * 32
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    for fqn in sp["targets"]:
        w = b[f"{fqn}.weight"]
        assert _is_24(w, transposed=False) and (w == 0).float().mean() == 0.5, fqn
        assert torch.equal(a[f"{fqn}.weight"] == 0, w == 0), fqn  # the same final masks
    assert not any("scale" in k or "base_layer" in k for k in b), "scales must be folded away"
    code = (f"import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(sharded)!r}); assert 'cast_llm' not in sys.modules; "
            f"print(float(m(torch.arange(8)[None]).logits.abs().mean()))")
    r = plain_transformers.run(code, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    la = [json.loads(x) for x in (single / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (sharded / "metrics.jsonl").read_text().splitlines()]
    assert [x["tokens"] for x in la] == [x["tokens"] for x in lb]
    for x, y in zip(la, lb):  # mask statistics summed over the ranks' shards == those of the full tensors
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["flip_rate"] == y["flip_rate"] and x["initial_flip_rate"] == y["initial_flip_rate"]
        assert x["sparse_weight_ratio"] == pytest.approx(y["sparse_weight_ratio"], rel=1e-6)


def test_fsdp2_resume_from_a_killed_runs_checkpoint_is_bitwise_identical(workdir, fsdp_ref, tmp_path, warm_torchrun):
    """A sharded run killed after its step-4 checkpoint and resumed with --resume ends bitwise equal to the
    uninterrupted one; the checkpoint holds one file per rank and is refused by a run with another process
    count or without --fsdp. The kill is the state a SIGKILL leaves (it runs no code of ours: what is on disk
    is the checkpoints completed before it, the run's files of a finished run not yet written), made from the
    reference run's own folder; a real SIGKILL is tested on one process (test_kill_9_and_resume_is_bitwise_
    identical), a real signal to FSDP2 ranks and a killed save's partial folders in the rehearsal below."""
    from cast_llm.errors import CastError
    from cast_llm.train.checkpoint import fingerprint, load_checkpoint
    from cast_llm.train.config import TrainConfig

    ref, cut = fsdp_ref.out, tmp_path / "cut"
    shutil.copytree(ref, cut)
    for ck in (cut / "checkpoints").iterdir():
        if ck.name != "step-00000004":
            shutil.rmtree(ck)
    for f in ("model.safetensors", "config.json", "results.json"):
        (cut / f).unlink()
    ck = cut / "checkpoints" / "step-00000004"
    assert {"model-rank00000.safetensors", "model-rank00001.safetensors", "optimizer-rank00001.safetensors",
            "scheduler.json", "meta.json"} <= {f.name for f in ck.iterdir()}
    fp = fingerprint(TrainConfig(**json.loads((cut / "cast_run.json").read_text())["config"]))
    with pytest.raises(CastError, match="same number of processes"):
        load_checkpoint(ck, fp, rank=0, world_size=1)
    with pytest.raises(CastError, match="same --fsdp setting"):
        load_checkpoint(ck, fp)
    r = warm_torchrun.run(["-m", "cast_llm.cli", "train", *_data_args(workdir), *FSDP_COMMON, *FSDP_REF,
                           "--data-cache", str(fsdp_ref.tokens), "--output-dir", str(cut), "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 4" in r.stdout, r.stdout
    _assert_same_run(ref, cut)
    # two 2-process jobs (uninterrupted, resumed) tokenised the corpus once: the first job's first rank
    builds = list(fsdp_ref.tokens.glob("*/builds.jsonl"))
    assert len(builds) == 1 and len(builds[0].read_text().splitlines()) == 1, [b.read_text() for b in builds]


def test_fsdp_refuses_unsupported_setups_with_one_line_errors(workdir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(workdir, out, "--max-steps", "1", "--fsdp", "--method", "srste") == 2
    assert "--fsdp supports --method cast" in _err(capsys)
    assert _train(workdir, out, "--max-steps", "1", "--fsdp", "--eval-every", "1") == 2
    assert "--eval-every" in _err(capsys)
    assert _train(workdir, out, "--max-steps", "1", "--fsdp", "--overwrite", "--no-baseline-eval") == 2
    assert "distributed launch" in _err(capsys)


def test_accelerate_use_fsdp_launch_turns_on_our_fsdp2(workdir, tmp_path, capsys, monkeypatch):
    """`accelerate launch --use_fsdp …` sets ACCELERATE_USE_FSDP: the trainer takes over (--fsdp) and switches
    accelerate's own wrapping off, so the model is never sharded twice. One process here: the FSDP2 path
    must then say it needs a distributed launch (proof that it was taken) rather than train unsharded."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    out = tmp_path / "run"
    assert _train(workdir, out, "--max-steps", "1", "--overwrite", "--no-baseline-eval") == 2
    assert "distributed launch" in _err(capsys)
    import os

    assert os.environ["ACCELERATE_USE_FSDP"] == "false"


def test_split_is_the_same_for_every_seed_and_a_one_file_corpus_gets_a_sequence_split(workdir, tmp_path, capsys):
    """Seeds 0 and 1 are scored on the same test text (one split digest); one .txt file (one document) is split
    by sequences, scores its held-out windows (not 'n/a') and says which split it made."""
    digests = []
    for seed in (0, 1):
        out = tmp_path / f"s{seed}"
        assert _train(workdir, out, "--max-steps", "1", "--seed", str(seed), "--no-baseline-eval",
                      "--test-sequences", "2", "--val-fraction", "0.15", "--test-fraction", "0.15") == 0
        res = json.loads((out / "results.json").read_text())
        digests.append(res["data_split"]["sha256"])
        assert res["data_split"]["kind"] == "documents" and res["perplexity"]["heldout"]["sparse"] > 1
        assert res["perplexity"]["validation"]["sparse"] > 1
    assert digests[0] == digests[1]
    capsys.readouterr()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join([tiny.CORPUS] * 30))
    out = tmp_path / "txt"
    assert main(["train", "--model", str(workdir / "llama"), "--data", str(corpus), "--output-dir", str(out),
                 "--wikitext-file", str(workdir / "eval.txt"), *BASE, "--max-steps", "1", "--no-baseline-eval",
                 "--val-sequences", "4", "--test-sequences", "4"]) == 0
    printed = capsys.readouterr().out
    assert "data split: sequence split" in printed
    res = json.loads((out / "results.json").read_text())
    assert res["data_split"]["kind"] == "sequences" and res["heldout_sequences"] >= 1
    assert res["perplexity"]["heldout"]["sparse"] > 1 and "n/a" not in printed.split("test ppl")[-1].split("\n")[0]


# ------------------------------------------------------------------------- paper-scale runs, scaled down
def test_global_batch_is_split_over_any_number_of_processes():
    """--global-batch (the presets' paper batch) is micro-batch × accumulation × processes on 1, 2 and 8
    processes; --batch-size 0 takes the largest micro-batch the plan fits; what cannot split is refused."""
    from cast_llm.errors import CastError
    from cast_llm.plan.batch import split_global_batch
    from cast_llm.train.config import PRESETS

    assert PRESETS["llama"]["global_batch"] == 256 and PRESETS["llama"]["batch_size"] == 0
    for world in (1, 2, 8):
        fits_up_to_4 = lambda b, a: b <= 4  # noqa: E731
        micro, accum = split_global_batch(256, world, batch_size=0, grad_accum=1, fits=fits_up_to_4)
        assert micro * accum * world == 256 and micro == 4, world
        micro, accum = split_global_batch(256, world, batch_size=2, grad_accum=1, fits=fits_up_to_4)
        assert (micro, accum * world) == (2, 128)
    assert split_global_batch(256, 8, batch_size=0, grad_accum=1, fits=lambda b, a: False) == (1, 32)
    assert split_global_batch(None, 8, batch_size=4, grad_accum=3, fits=None) == (4, 3)
    with pytest.raises(CastError, match="cannot be split over 3 processes"):
        split_global_batch(256, 3, batch_size=0, grad_accum=1, fits=lambda b, a: True)
    with pytest.raises(CastError, match="--batch-size 3 does not divide"):
        split_global_batch(256, 2, batch_size=3, grad_accum=1, fits=None)
    with pytest.raises(CastError, match="contradicts --global-batch"):
        split_global_batch(256, 2, batch_size=4, grad_accum=4, fits=None)
    with pytest.raises(CastError, match="needs --global-batch"):
        split_global_batch(None, 1, batch_size=0, grad_accum=1, fits=None)


def test_train_leaves_the_callers_config_as_it_was(workdir, tmp_path):
    """What the launch settles (micro-batch and accumulation from --global-batch, here the largest micro-batch
    the plan fits) goes into a config derived from the caller's: the object passed to train() is unchanged, and
    the run's config.yaml records the settled values."""
    import dataclasses

    from cast_llm.train.config import TrainConfig
    from cast_llm.train.trainer import train

    cfg = TrainConfig(model=str(workdir / "llama"), data=str(workdir / "corpus.jsonl"), output_dir=str(tmp_path / "run"),
                      wikitext_file=str(workdir / "eval.txt"), max_steps=2, global_batch=4, batch_size=0,
                      seq_len=32, log_every=1, val_sequences=2, wikitext_windows=2, progress=False, report=False,
                      baseline_eval=False, lr=1e-3, method="naive", device="cpu")
    before = dataclasses.asdict(cfg)
    results = train(cfg, log=lambda *a, **k: None)
    assert results["steps"] == 2
    assert dataclasses.asdict(cfg) == before  # batch_size still 0, grad_accum 1: nothing was written into it
    ran = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert ran["batch_size"] > 0 and ran["batch_size"] * ran["grad_accum"] == 4 and ran["global_batch"] == 4


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    return tiny.write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", docs=240)


def _preset_args(workdir, corpus):
    """--preset llama, scaled down to the tiny model: its sequence length and a few steps."""
    return ["--preset", "llama", "--model", str(workdir / "llama"), "--data", str(corpus), "--wikitext-file",
            str(workdir / "eval.txt"), "--seq-len", "32", "--calib-samples", "8", "--val-sequences", "2",
            "--wikitext-windows", "2", "--no-progress", "--log-every", "1", "--device", "cpu", "--no-report",
            "--lr", "1e-3"]


def test_preset_llama_is_the_papers_global_batch_on_one_process(workdir, big_corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", *_preset_args(workdir, big_corpus), "--max-steps", "1", "--output-dir", str(out)]) == 0
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["batch_size"] * cfg["grad_accum"] == 256 and cfg["global_batch"] == 256
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["tokens"] == 256 * 32


@pytest.mark.skipif(os.environ.get("CAST_SKIP_DDP") == "1", reason="CAST_SKIP_DDP=1")
def test_fsdp2_paper_scale_rehearsal_sigterm_and_resume(workdir, big_corpus, tmp_path, warm_torchrun):
    """The paper's run scaled down, on 2 gloo processes with FSDP2: --preset llama (a global batch of 256
    sequences), the SparseGPT warm start and the baseline evaluation on rank 0, SIGTERM after a checkpoint:
    every rank stops at the same step with a checkpoint whose first save printed its cost. The resume
    computes no warm start again, removes the partial checkpoint folders a killed save of ours left (and
    only those), and ends with an exact 2:4 export in the model's own dtype."""
    out = tmp_path / "run"
    args = ["-m", "cast_llm.cli", "train", *_preset_args(workdir, big_corpus), "--fsdp", "--max-steps", "8",
            "--save-every", "2", "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), *args], env=env, start_new_session=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "step-00000002").is_dir() and p.poll() is None:
        assert time.time() < deadline
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    log = p.communicate(timeout=300)[0]
    assert "SIGTERM received" in log and "stopped at step" in log, log[-3000:]
    assert "start: model prepared for cast, its one-shot start included" in log and "on rank 0 alone" in log
    assert "dense model (the original)" in log and "one-shot SparseGPT 2:4 (the warm start)" in log
    assert "a SIGTERM needs" in log
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["batch_size"] * cfg["grad_accum"] * 2 == 256
    results = json.loads((out / "results.json").read_text())
    assert results["checkpoint"]["bytes_per_rank"] > 0 and "one-shot start" in results["phases"]
    meta = json.loads((list_checkpoints(out)[-1] / "meta.json").read_text())
    assert {"model-rank00000.safetensors", "model-rank00001.safetensors"} <= set(meta["files"])
    ours, theirs = out / "checkpoints" / "step-00000099.tmp", out / "checkpoints" / "step-00000098.tmp"
    for d in (ours, theirs):
        d.mkdir()
        (d / "model-rank00000.safetensors").write_bytes(b"partial")
    (ours / ".cast-llm-checkpoint").write_text("{}")
    r = warm_torchrun.run(["-m", "cast_llm.cli", "train", "--output-dir", str(out), "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "not computed again" in r.stdout and "one-shot start included" not in r.stdout
    assert "dense model (the original)" not in r.stdout  # the baseline is measured once per run
    assert "removed 1 partial checkpoint folder(s)" in r.stdout and not ours.exists() and theirs.exists()
    sp = json.loads((out / "config.json").read_text())["sparsity"]
    w = load_file(out / "model.safetensors")
    for fqn in sp["targets"]:
        assert _is_24(w[f"{fqn}.weight"], transposed=False), fqn
    assert json.loads((out / "results.json").read_text())["export_dtype"] == "float32"  # the tiny model's own


@pytest.mark.skipif(os.environ.get("CAST_SKIP_DDP") == "1", reason="CAST_SKIP_DDP=1")
def test_fsdp2_a_nan_on_one_rank_stops_every_rank_with_one_line(workdir, tmp_path):
    """The finiteness check is agreed: a NaN loss on rank 1 alone stops both ranks at the same step, each with
    one line (no hang, no traceback) — rank 0 sees it in its gradients, which the reduce-scatter brought —
    and no model is written."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CAST_TEST_NAN_RANK": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO / "tests" / "rank_fault_worker.py"), "train", *_data_args(workdir), *FSDP_COMMON, "--max-steps",
           "4", "--batch-size", "1", "--fsdp", "--output-dir", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "error: loss became nan at step 3; stopped (no checkpoint was written)" in r.stderr, r.stderr[-3000:]
    assert "error: a gradient became non-finite (NaN/Inf) at step 3 while the loss was finite" in r.stderr
    assert "cast_llm/train" not in r.stderr and not (out / "model.safetensors").exists()  # no traceback of ours


def test_a_slow_one_shot_start_is_saved_at_once_and_checkpoints_follow_the_clock(workdir, tmp_path, monkeypatch,
                                                                                capsys):
    """A one-shot start slower than START_CHECKPOINT_S is saved at once (a step-0 checkpoint: a run stopped
    before its first periodic checkpoint never computes it again); without --save-every a checkpoint is
    written whenever AUTO_SAVE_S of wall time has passed (here 0: after every step), the last step's too; the
    first checkpoint says what a SIGTERM's grace must cover."""
    import cast_llm.train.loop as loop

    monkeypatch.setattr(loop, "START_CHECKPOINT_S", 0.0)
    monkeypatch.setattr(loop, "AUTO_SAVE_S", 0.0)
    out = tmp_path / "run"
    assert _train(workdir, out, "--max-steps", "3", "--keep-last", "10", "--keep-checkpoints-after") == 0
    assert [c.name for c in list_checkpoints(out)] == [f"step-{s:08d}" for s in range(4)]
    said = capsys.readouterr().out
    assert said.count("a SIGTERM needs") == 1 and "start: model prepared for cast" in said
    assert json.loads((out / "results.json").read_text())["checkpoint"]["seconds"] >= 0
    monkeypatch.setattr(loop, "AUTO_SAVE_S", 3600.0)  # a short run with a quick start: no checkpoint at all
    monkeypatch.setattr(loop, "START_CHECKPOINT_S", 60.0)
    assert _train(workdir, tmp_path / "short", "--max-steps", "3", "--keep-checkpoints-after") == 0
    assert list_checkpoints(tmp_path / "short") == []


@pytest.mark.parametrize("flags,match", [
    (["--preset", "llama", "--grad-accum", "1"],
     r"^--grad-accum 1 with --global-batch 256 \(from --preset llama\) and --batch-size 0: .*leave --grad-accum out$"),
    (["--global-batch", "8", "--batch-size", "2", "--grad-accum", "2"],
     r"^--grad-accum 2 contradicts --global-batch 8 with --batch-size 2 on 1 process\(es\), which needs "
     r"--grad-accum 4; give one of them$"),
])
def test_an_explicit_grad_accum_is_never_replaced_by_the_global_batchs(flags, match, monkeypatch):
    """`--grad-accum 1` under a preset's --global-batch used to become the derived accumulation without a word
    (1 is also the default, which the launch reads as "derive it"): refused at the command line now."""
    import argparse

    from cast_llm.cli import train as train_cli
    from cast_llm.cli.train import build_config
    from cast_llm.errors import CastError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    train_cli.register(sub)
    args = parser.parse_args(["train", "--model", "m", "--data", "d", "--output-dir", "o", "--tokens", "1000", *flags])
    with pytest.raises(CastError, match=match):
        build_config(args)
    ok = parser.parse_args(["train", "--model", "m", "--data", "d", "--output-dir", "o", "--tokens", "1000", "--global-batch", "8",
                            "--batch-size", "2", "--grad-accum", "4"])
    assert build_config(ok).grad_accum == 4
