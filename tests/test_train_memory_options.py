"""The memory options of `cast-llm train` on a tiny model: what each changes and what it leaves alone.

--activation-checkpointing and --packed-masks change memory only (the same trained model, bit for bit);
--fused-head computes the same loss without full logits (equal up to float summation order);
--teacher-dtype bf16 puts the teacher (only) in bf16; the plan is printed at the top and the measured peak at
the end; DDP keeps its gradients in its buckets; FSDP2 with the options matches one process with them."""

from __future__ import annotations

import json
import os

import pytest
import tiny
import torch
from safetensors.torch import load_file

import cast_llm.train.trainer as trainer
from cast_llm.cli import main

BASE = ["--seq-len", "32", "--log-every", "1", "--val-sequences", "1", "--no-progress",
        "--lr", "1e-3", "--l1-decay", "1e-4", "--mask-interval", "2", "--max-steps", "3", "--no-baseline-eval",
        "--wikitext-windows", "1", "--no-report", "--no-layer-stats", "--track-weights", "0",
        "--ratio-hist-steps", "", "--paper-exact", "--device", "cpu"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("memopts")
    tiny.save_model(d / "llama", "llama", num_hidden_layers=3)
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    return d


def _args(workdir, batch=2):
    return ["--model", str(workdir / "llama"), "--data", str(workdir / "corpus.jsonl"), "--wikitext-file",
            str(workdir / "eval.txt"), "--batch-size", str(batch), *BASE]


def _train(workdir, out, *extra):
    return main(["train", *_args(workdir), "--output-dir", str(out), *extra])


def _weights(out):
    return load_file(out / "model.safetensors")


def _losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(workdir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert _train(workdir, out) == 0
    return out


def test_checkpointing_and_packed_masks_change_memory_only(workdir, reference, tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(workdir, out, "--activation-checkpointing", "--packed-masks") == 0
    text = capsys.readouterr().out
    a, b = _weights(reference), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(reference) == _losses(out)
    # the plan printed at the top knows the options; the peak is measured over the steps
    assert "memory plan" in text and "N:M masks (packed)" in text and "(one block)" in text
    mem = json.loads((out / "results.json").read_text())["memory"]
    assert mem["measured_peak"] > 0 and mem["planned_peak"] > 0 and 0.5 < mem["ratio"] < 2
    assert "gradient_checkpointing" not in json.loads((out / "config.json").read_text())


def test_selective_recomputation_trains_the_same_model(workdir, reference, tmp_path, capsys):
    """--activation-checkpointing selective: the matmul and attention outputs kept, the rest recomputed in
    backward: the same trained model, bit for bit; the plan at the top counts it; config.yaml says it."""
    out = tmp_path / "run"
    assert _train(workdir, out, "--activation-checkpointing", "selective") == 0
    text = capsys.readouterr().out
    a, b = _weights(reference), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(reference) == _losses(out)
    assert "activations (student, selective recomputation)" in text
    assert "activation_checkpointing: selective" in (out / "config.yaml").read_text()


@pytest.mark.parametrize("value,mode", [(True, "full"), (False, "none"), ("true", "full"), ("off", "none"),
                                        ("Selective", "selective"), ("full", "full")])
def test_recomputation_mode_reads_the_old_boolean_spelling(value, mode):
    from cast_llm.config import coerce
    from cast_llm.train.config import TrainConfig

    assert coerce(TrainConfig, "activation_checkpointing", value, "config.yaml") == mode


def test_recomputation_mode_refuses_other_values_in_one_line(workdir, tmp_path, capsys):
    assert _train(workdir, tmp_path / "run", "--activation-checkpointing", "some") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected one of none, selective, full" in err[0]


def test_fused_head_trains_the_same_model_without_full_logits(workdir, reference, tmp_path, monkeypatch):
    def no_full_logits(*a, **k):
        raise AssertionError("--fused-head must not compute the loss on full logits")

    monkeypatch.setattr(trainer, "lm_loss", no_full_logits)
    out = tmp_path / "run"
    assert _train(workdir, out, "--fused-head") == 0
    assert _losses(out) == pytest.approx(_losses(reference), rel=1e-5)
    a, b = _weights(reference), _weights(out)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


def test_teacher_dtype_bf16_changes_the_teacher_only(workdir, tmp_path, monkeypatch):
    seen = []
    real = trainer.lm_loss

    def spy(student_logits, teacher_logits, input_ids, cfg):
        seen.append((student_logits.dtype, teacher_logits.dtype))
        return real(student_logits, teacher_logits, input_ids, cfg)

    monkeypatch.setattr(trainer, "lm_loss", spy)
    assert _train(workdir, tmp_path / "run", "--teacher-dtype", "bf16") == 0
    assert seen and all(s == (torch.float32, torch.bfloat16) for s in seen)  # fp32 training, bf16 teacher


def test_packed_masks_are_refused_outside_adams(workdir, tmp_path, capsys):
    assert _train(workdir, tmp_path / "run", "--method", "srste", "--packed-masks") == 2
    assert "--packed-masks is AdamS's mask storage" in capsys.readouterr().err


@pytest.mark.slow  # ~10 s: two ranks
@pytest.mark.skipif(os.environ.get("CAST_SKIP_DDP") == "1", reason="CAST_SKIP_DDP=1")
def test_fsdp2_with_the_memory_options_matches_one_process(workdir, tmp_path, warm_torchrun):
    """2 gloo processes, --fsdp with checkpointing, fused head and packed masks (the teacher sharded and its
    head all-gathered for the fused loss) == one process with micro-batch 2 and the same options."""
    opts = ["--activation-checkpointing", "--fused-head", "--packed-masks"]
    single, sharded = tmp_path / "single", tmp_path / "fsdp"
    assert _train(workdir, single, *opts) == 0
    r = warm_torchrun.run(["-m", "cast_llm.cli", "train", *_args(workdir, batch=1), "--fsdp", *opts,
                           "--output-dir", str(sharded)], 2)  # torchrun's two ranks, forked warm
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FSDP2: student and teacher sharded" in r.stdout and "peak memory per process" in r.stdout
    a, b = _weights(single), _weights(sharded)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def test_a_run_that_will_not_fit_stops_before_loading_anything_with_the_options(workdir, tmp_path, monkeypatch,
                                                                              capsys):
    """The plan is made from the model's config before any weight is read: when it does not fit the device,
    the run stops there (exit 2, no run folder, the model never loaded) with the flags that would make it fit;
    --no-memory-check starts anyway."""
    import cast_llm.train.memory as memory
    from cast_llm.errors import CastError
    from cast_llm.plan import Setup, model_shape, plan_memory

    plan = plan_memory(model_shape("llama-3.1-8b"), Setup(device="cuda", world=8, strategy="ddp", seq_len=4096))
    monkeypatch.setattr(memory, "device_capacity", lambda device, world: 80 * 10**9)
    with pytest.raises(CastError, match="run out of memory; it would fit with --fsdp"):
        memory.refuse_if_too_large(plan, torch.device("cpu"), 8)
    memory.refuse_if_too_large(plan_memory(model_shape("smollm2-135m"), Setup(device="cuda", seq_len=512)),
                               torch.device("cpu"), 1)  # fits: nothing said

    loaded = []
    monkeypatch.setattr(trainer, "load_model", lambda *a, **k: loaded.append(a) or tiny.model("llama"))
    for module in (trainer, memory):
        monkeypatch.setattr(module, "device_capacity", lambda device, world: 2**20)  # 1 MiB per process
    out = tmp_path / "run"
    assert main(["train", *_args(workdir), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "run out of memory" in err and "--no-memory-check" in err and "--batch-size 1" not in err
    assert not out.exists() and loaded == []
    assert main(["train", *_args(workdir), "--output-dir", str(out), "--no-memory-check"]) == 0
    assert len(loaded) == 1
