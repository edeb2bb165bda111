"""The plan reads the run (cast_llm/plan/run.py): `cast-llm plan` and a tiny `cast-llm train` given the same
settings agree on what the run does around its steps, for every method; every flag `plan` takes changes its
report or is refused with a one-line error; an explicit flag is never overridden without a word."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import replace

import pytest
import tiny
import yaml

from cast_llm.cli import build_parser, main
from cast_llm.errors import CastError

# run-only settings (they change nothing the plan estimates, so `plan` refuses them typed): in a --config file
RUN_ONLY = ["--no-progress", "--no-report", "--log-every", "1"]
METHODS = {  # each with what it does around its steps
    "cast": [],  # warm start from SparseGPT's one-shot model
    "paper-exact": ["--paper-exact"],  # dense start, magnitude mask
    "naive": ["--method", "naive"],  # magnitude one-shot model, no SparseGPT
    "srste": ["--method", "srste", "--init-mask", "sparsegpt"],  # SparseGPT's mask only, dense weights
    "ast": ["--method", "ast", "--no-baseline-eval"],
    "maskllm": ["--method", "maskllm"],
}
# typed on both command lines: each changes what an evaluation scores
EVAL_FLAGS = ["--val-sequences", "2", "--test-sequences", "3", "--wikitext-windows", "5", "--eval-seq-len", "16"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("planrun")
    tiny.save_model(d / "llama", "llama")
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    (d / "run.yaml").write_text(yaml.safe_dump(dict(
        model=str(d / "llama"), data=str(d / "corpus.jsonl"), wikitext_file=str(d / "eval.txt"), device="cpu",
        max_steps=2, batch_size=2, seq_len=32, calib_samples=4, lr=1e-3, l1_decay=1e-4, mask_interval=2,
        progress=False, report=False, log_every=1)))
    return d


@pytest.mark.parametrize("method", list(METHODS))
def test_the_plans_startup_work_is_what_the_run_did(method, workdir, tmp_path, monkeypatch):
    """The plan's StartupWork for `plan --config run.yaml FLAGS` against a `train --config run.yaml FLAGS` run:
    its phases (baseline and one-shot evaluations), SparseGPT's calibration as it happened (samples ×
    tokens, at the one-shot methods' calibration length: 16 here, below the training sequences), and the
    tokens each evaluation scored (results.json) — and the trainer's own estimate, which must be the same."""
    import cast_llm.plan.run as plan_run
    import cast_llm.train.memory as train_memory
    import cast_llm.train.methods.masks as masks
    from cast_llm.cli.plan import make_plan

    monkeypatch.setattr(plan_run, "CALIBRATION_SEQ_LEN", 16)
    monkeypatch.setattr(masks, "CALIBRATION_SEQ_LEN", 16)
    flags = ["--config", str(workdir / "run.yaml"), *METHODS[method], *EVAL_FLAGS]
    plan = make_plan(build_parser().parse_args(["plan", *flags]))

    seen = {"calibrations": []}
    real_work, real_prune = train_memory.startup_work, masks.prune_model

    def work(cfg, **kw):
        seen["cfg"], seen["work"] = cfg, real_work(cfg, **kw)
        return seen["work"]

    def prune(model, method_name, calib, **kw):
        seen["calibrations"].append((method_name, tuple(calib.shape)))
        return real_prune(model, method_name, calib, **kw)

    monkeypatch.setattr(train_memory, "startup_work", work)
    monkeypatch.setattr(masks, "prune_model", prune)
    out = tmp_path / "run"
    assert main(["train", *flags, "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())

    assert replace(plan.run, output_dir=seen["cfg"].output_dir) == seen["cfg"]  # the same run
    w = plan.work
    local = dict(gpus_per_node=1, host_memory=None)  # the machine: the plan's options, the trainer's own
    assert replace(w, **local) == replace(seen["work"], **local)
    phases = results["phases"]
    assert w.baseline_eval == ("baseline evaluation (rank 0)" in phases)
    assert (w.warm_start and w.baseline_eval) == ("one-shot evaluation (rank 0)" in phases)
    sparsegpt = [shape for name, shape in seen["calibrations"] if name == "sparsegpt"]
    assert w.sparsegpt == bool(sparsegpt) and w.sparsegpt == (method in ("cast", "srste"))
    if sparsegpt:
        assert sparsegpt == [(4, 16)] and w.calib_tokens == 4 * 16
    seq, eval_len = results["seq_len"], results["eval_seq_len"]
    assert (seq, eval_len, results["wikitext_windows"]) == (32, 16, 5)
    assert w.eval_tokens == results["heldout_sequences"] * seq + results["wikitext_windows"] * eval_len
    assert w.val_tokens == results["validation_sequences"] * seq
    assert w.eval_window == max(eval_len, seq * plan.setup.batch_size)


# ------------------------------------------------------------------ every flag changes the plan or is refused
VALUES = {  # a value other than the default, for every option `cast-llm plan` takes
    "model": ["--model", "llama-3.2-1b"], "seq_len": ["--seq-len", "1024"], "data": ["--data", "x.txt"],
    "calib_samples": ["--calib-samples", "64"], "tokens": ["--tokens", "1B"],
    "max_documents": ["--max-documents", "10"], "val_fraction": ["--val-fraction", "0.05"],
    "test_fraction": ["--test-fraction", "0.05"], "val_sequences": ["--val-sequences", "64"],
    "test_sequences": ["--test-sequences", "64"], "data_cache": ["--data-cache", "/tmp/cache"],
    "l1_decay": ["--l1-decay", "1e-6"], "mask_interval": ["--mask-interval", "5"],
    "scale_groups": ["--scale-groups", "4"], "eta": ["--eta", "0.6"], "kd_temperature": ["--kd-temperature", "2"],
    "kd_chunk_size": ["--kd-chunk-size", "256"], "progress": ["--no-progress"], "seed": ["--seed", "1"],
    "output_dir": ["--output-dir", "/tmp/run"], "overwrite": ["--overwrite"], "n": ["--n", "4", "--m", "8"],
    "m": ["--m", "8"], "skip_incompatible": ["--skip-incompatible"], "resume": ["--resume"],
    "device": ["--device", "cpu"], "precision": ["--precision", "fp32"], "threads": ["--threads", "2"],
    "kernels": ["--kernels", "reference"], "max_steps": ["--max-steps", "100"], "batch_size": ["--batch-size", "2"],
    "grad_accum": ["--grad-accum", "4"], "weight_decay": ["--weight-decay", "0.1"],
    "warmup_steps": ["--warmup-steps", "5"], "lr_schedule": ["--lr-schedule", "constant"],
    "min_lr_ratio": ["--min-lr-ratio", "0.5"], "grad_clip": ["--grad-clip", "0.5"], "log_every": ["--log-every", "5"],
    "eval_every": ["--eval-every", "5"], "baseline_eval": ["--no-baseline-eval"], "save_every": ["--save-every", "5"],
    "keep_last": ["--keep-last", "3"], "keep_checkpoints_after": ["--keep-checkpoints-after"],
    "method": ["--method", "naive"], "global_batch": ["--global-batch", "64"], "lr": ["--lr", "1e-3"],
    "beta1": ["--beta1", "0.8"], "beta2": ["--beta2", "0.99"], "eps": ["--eps", "1e-6"], "scaling": ["--no-scaling"],
    "kd": ["--no-kd"], "teacher_cuda_graph": ["--teacher-cuda-graph"], "fixed_mask": ["--fixed-mask"],
    "init_mask": ["--init-mask", "wanda"], "mask_file": ["--mask-file", "/tmp/masks.safetensors"],
    "fsdp": ["--fsdp"], "paper_exact": ["--paper-exact"], "warm_start": ["--no-warm-start"],
    "repair_fraction": ["--repair-fraction", "0.5"], "final_prune": ["--final-prune", "compensated"],
    "warm_start_mix": ["--warm-start-mix", "0.5"], "regrow_factor": ["--regrow-factor", "2", "--regrow-fraction", "0.1"],
    "regrow_fraction": ["--regrow-fraction", "0.1", "--regrow-factor", "2"],
    "forecast_target": ["--forecast-target", "0.999"], "mask_learner": ["--mask-learner", "srste"],
    "decay_mode": ["--decay-mode", "additive"], "sparse_update": ["--sparse-update", "adam"], "srste_decay": ["--srste-decay", "1e-3"],
    "maskllm_tau": ["--maskllm-tau", "2,0.1"], "maskllm_kappa": ["--maskllm-kappa", "10,50"],
    "maskllm_lr": ["--maskllm-lr", "1e-3"], "maskllm_prior": ["--maskllm-prior", "1"],
    "wikitext_windows": ["--wikitext-windows", "10"], "eval_seq_len": ["--eval-seq-len", "1024"],
    "wikitext_file": ["--wikitext-file", "(a short text: tmp_path/wiki.txt)"], "report": ["--no-report"],
    "speed_check": ["--speed-check"], "layer_stats": ["--no-layer-stats"], "track_weights": ["--track-weights", "5"],
    "track_every": ["--track-every", "5"], "ratio_hist_steps": ["--ratio-hist-steps", "0.5"],
    "activation_checkpointing": ["--activation-checkpointing", "full"], "fsdp_precision": ["--fsdp-precision",
                                                                                            "autocast", "--fsdp"],
    "teacher_dtype": ["--teacher-dtype", "fp32"], "fused_head": ["--fused-head"], "packed_masks": ["--packed-masks"],
    "memory_check": ["--no-memory-check"],
    # the plan's own
    "gpus": ["--gpus", "2"], "gpu_memory": ["--gpu-memory", "40GB"], "gpus_per_node": ["--gpus-per-node", "4"],
    "host_memory": ["--host-memory", "1TB"], "tokens_per_s": ["--tokens-per-s", "1e5"],
    "gpu_tflops": ["--gpu-tflops", "500"], "mfu": ["--mfu", "0.4"], "interconnect": ["--interconnect", "ethernet"],
    "link_bandwidth": ["--link-bandwidth", "10"], "weight_rms": ["--weight-rms", "0.05"],
    "grad_rms": ["--grad-rms", "1e-3"], "json": ["--json"],
}
BASE = ["--model", "smollm2-135m", "--gpus", "8", "--tokens", "20M"]  # (20 steps: the decay forecast is quick)


def test_every_flag_plan_takes_changes_its_report_or_is_refused(monkeypatch, tmp_path):
    """For every option of `cast-llm plan` (train's and its own), typed with a value other than its default on
    a paper-recipe run: the report (text and JSON) differs from the plan without it, or the plan refuses it
    with a one-line error that names it. None is accepted and ignored."""
    import cast_llm.config as config
    import cast_llm.plan.run as plan_run
    from cast_llm.cli.plan import make_plan
    from cast_llm.plan.config import PlanOptions
    from cast_llm.plan.report import plan_lines
    from cast_llm.train.config import TrainConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(plan_run, "model_shape", functools.lru_cache(plan_run.model_shape))
    monkeypatch.setattr(plan_run, "process_rss", lambda: 0)
    monkeypatch.setattr(config, "_hints", functools.lru_cache(config._hints))  # (typing's work, once per class)
    decay, forecasts = plan_run.plan_decay, {}  # the same forecast is asked for again and again: once each

    def plan_decay(lrs, **kw):
        key = (tuple(lrs), tuple(sorted(kw.items())))
        if key not in forecasts:
            forecasts[key] = decay(lrs, **kw)
        return forecasts[key]

    monkeypatch.setattr(plan_run, "plan_decay", plan_decay)
    fields = [f.name for cls in (TrainConfig, PlanOptions) for f in dataclasses.fields(cls)]
    assert not set(fields) - set(VALUES), f"add a value for {set(fields) - set(VALUES)}"
    (tmp_path / "wiki.txt").write_text(" ".join([tiny.CORPUS] * 200))
    values = {**VALUES, "wikitext_file": ["--wikitext-file", str(tmp_path / "wiki.txt")]}
    parser = build_parser()

    def report(argv):
        plan = make_plan(parser.parse_args(["plan", *argv]))
        return "\n".join(plan_lines(plan)) + json.dumps(plan.as_dict(), default=str)

    base = report(BASE)
    changed, refused = [], []
    for name in fields:
        flag = values[name]
        try:
            text = report(BASE + flag)
        except (CastError, SystemExit) as e:
            message = str(e)
            assert isinstance(e, CastError) and len(message.splitlines()) == 1, (name, message)
            assert flag[0] in message or any(f in message for f in flag if f.startswith("--")), (name, message)
            refused.append(name)
            continue
        if name == "json":  # the same plan, printed as JSON by `run`
            continue
        assert text != base, f"{flag} is accepted but changes nothing in the plan"
        changed.append(name)
    # what a plan depends on is accepted; what only the run's own work does is refused
    assert {"seq_len", "val_sequences", "test_sequences", "eval_seq_len", "wikitext_windows", "calib_samples",
            "method", "grad_accum", "fused_head", "gpus", "host_memory"} <= set(changed)
    assert {"data", "seed", "output_dir", "beta1", "kernels"} <= set(refused)


def test_an_explicit_grad_accum_is_never_overridden(capsys, monkeypatch):
    """`plan --grad-accum 1` plans one micro-batch per step (the default recipe's global batch gives way to
    it, as it would in train without a preset); against a preset's global batch it is refused, not replaced."""
    from cast_llm.cli.plan import make_plan

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    plan = make_plan(parser.parse_args(["plan", "--model", "llama-3.1-8b", "--grad-accum", "1"]))
    assert plan.setup.grad_accum == 1 and plan.run.global_batch is None
    assert main(["plan", "--model", "llama-3.1-8b", "--grad-accum", "1"]) == 0
    assert "grad-accum 1;" in capsys.readouterr().out
    assert main(["plan", "--model", "llama-3.1-8b", "--preset", "llama", "--grad-accum", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--grad-accum 1 contradicts --global-batch 256" in err and len(err.splitlines()) == 1


def test_naive_plans_no_sparsegpt_and_long_sequences_calibrate_at_the_one_shot_length(monkeypatch):
    """`plan --method naive` plans no SparseGPT (train --method naive never runs it); at --seq-len 32768 the
    warm start calibrates on --calib-samples × 2048 tokens (the one-shot methods' window), so its block's
    memory does not grow with the training sequence."""
    from cast_llm.cli.plan import make_plan
    from cast_llm.prune.oneshot import CALIBRATION_SEQ_LEN

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    naive = make_plan(parser.parse_args(["plan", "--model", "llama-3.1-8b", "--method", "naive"]))
    assert not naive.work.sparsegpt and not any("SparseGPT" in k for k in naive.startup.memory)
    args = ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--fsdp", "--activation-checkpointing", "full",
            "--fused-head"]
    short = make_plan(parser.parse_args([*args, "--seq-len", "4096"]))
    long = make_plan(parser.parse_args([*args, "--seq-len", "32768", "--wikitext-windows", "4"]))
    key = "rank 0 device: SparseGPT warm start (one block)"
    assert long.work.calib_tokens == short.work.calib_tokens == 128 * CALIBRATION_SEQ_LEN
    assert long.startup.memory[key] == short.startup.memory[key] < 20 * 2**30


def test_plan_refuses_what_it_cannot_know(monkeypatch):
    from cast_llm.cli.plan import make_plan

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CastError, match="--test-sequences 0 scores all the split holds"):
        make_plan(build_parser().parse_args(["plan", "--model", "llama-3.1-8b", "--test-sequences", "0"]))


def test_build_config_is_train_with_the_llama_preset():
    from cast_llm.cli.plan import PLANNED_RUN_DIR, build_config
    from cast_llm.cli.train import build_config as train_config

    parser = build_parser()
    flags = ["--model", "llama-3.1-8b", "--seq-len", "8192"]
    run, _ = build_config(parser.parse_args(["plan", *flags]))
    trained = train_config(parser.parse_args(["train", *flags, "--preset", "llama", "--output-dir", PLANNED_RUN_DIR]))
    assert run == trained
