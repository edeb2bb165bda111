"""`cast-llm plan` (cast_llm/plan/): sizes, the model's counts from its config, activation bytes against
autograd, the memory terms, the advice, the closed-form decay forecast against AdamS's exact recursion, the
CLI (offline, one-line errors), and the plan against a measured peak (benchmarks/plan_vs_measured.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import tiny
import torch

from cast_llm.cli import main
from cast_llm.errors import CastError
from cast_llm.plan import Setup, model_shape, plan_memory, shape_of
from cast_llm.plan.activations import activation_bytes
from cast_llm.plan.advice import make_it_fit
from cast_llm.plan.decay import forecast_ratio, plan_decay
from cast_llm.plan.sizes import parse_size

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ sizes
def test_sizes_as_people_write_them():
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("80 GiB") == parse_size("80gib") == 80 * 2**30
    assert parse_size("1.5TB") == 1.5e12 and parse_size("512MiB") == 2**29
    for bad, msg in (("80", "no unit"), ("eighty GB", "expected a size"), ("0GB", "must be > 0"),
                     ("80 GBs", "expected a size")):
        with pytest.raises(CastError, match=msg):
            parse_size(bad)


# ------------------------------------------------------------------------------------------- the shape
def test_embedded_configs_give_the_published_parameter_counts():
    for name, params, targets in (("smollm2-135m", 134_515_008, 106_168_320),
                                  ("meta-llama/Llama-3.2-1B", 1_235_814_400, 973_078_528),
                                  ("llama-3.1-8b", 8_030_261_248, 6_979_321_856)):
        s = model_shape(name)
        assert (s.params, s.target_params) == (params, targets), name
        assert s.layers * s.block_params + s.root_params == s.params
    s = model_shape("llama-3.1-8b")
    assert not s.tied and s.head_params == 128256 * 4096 and s.vocab == 128256


def test_model_shape_from_a_folder_matches_the_real_model(tmp_path):
    tiny.save_model(tmp_path / "m", "llama")
    s = model_shape(str(tmp_path / "m"))
    real = tiny.model("llama")
    assert s.params == sum(p.numel() for p in real.parameters())
    assert s.source.startswith("folder")
    with pytest.raises(CastError, match="unknown model 'llama-9b'"):
        model_shape("llama-9b")
    with pytest.raises(CastError, match="holds no config.json"):
        model_shape(str(tmp_path))


# ------------------------------------------------------------------------------------------ activations
def _saved_bytes(model, ids, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=ids)
    return sum(seen.values())


@pytest.mark.parametrize("autocast", [False, True])
def test_activation_bytes_equal_what_autograd_saves_in_a_llama_block(autocast):
    m = tiny.model("llama", num_hidden_layers=3).train()
    ids = torch.randint(0, tiny.VOCAB, (2, 48))
    s = shape_of(m)
    a = activation_bytes(s, autocast=autocast, seq_len=48)
    planned = a.total(ids.numel(), s.layers) + (2 * s.linear_params if autocast else 0)  # + the bf16 weight casts
    assert _saved_bytes(m, ids, autocast) == planned


def test_activation_checkpointing_keeps_the_block_inputs_and_one_block():
    m = tiny.model("llama", num_hidden_layers=3).train()
    m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, tiny.VOCAB, (2, 48))
    s = shape_of(m)
    a = activation_bytes(s, autocast=False, seq_len=48)
    # what stays saved during the forward: each block's input (and its rotary tables, shared) plus the head
    saved = _saved_bytes(m, ids, False)
    assert saved <= a.total(ids.numel(), s.layers, checkpointing=True)
    assert saved < a.total(ids.numel(), s.layers) / 2


# --------------------------------------------------------------------------------------------- memory
def test_memory_terms_follow_the_options():
    s8 = model_shape("llama-3.1-8b")
    P = s8.params + s8.target_rows * 2
    base = Setup(world=8, strategy="ddp", batch_size=1, seq_len=4096)
    ddp = plan_memory(s8, base)
    assert ddp.persistent["weights (fp32 master)"] == 4 * P and ddp.persistent["AdamS moments μ, v (fp32)"] == 8 * P
    assert ddp.persistent["DDP gradient buckets (= the gradients)"] == 4 * P
    assert ddp.persistent["teacher (bf16)"] == 2 * s8.params and ddp.persistent["N:M masks (bool)"] == s8.target_params
    fsdp = plan_memory(s8, replace(base, strategy="fsdp"))
    assert fsdp.persistent["weights (fp32 master)"] == 4 * P // 8 and fsdp.persistent["teacher (bf16)"] == 2 * s8.params // 8
    # the scaled weights are whole on every GPU, sharded or not; checkpointing keeps one block's
    assert fsdp.step["scaled weights Diag(A)·W"] == 2 * s8.target_params
    ac = plan_memory(s8, replace(base, strategy="fsdp", activation_checkpointing=True))
    assert ac.step["scaled weights Diag(A)·W (one block)"] == 2 * s8.target_params // 32
    assert ac.step["activations (student)"] < fsdp.step["activations (student)"] / 8
    fused = plan_memory(s8, replace(base, fused_head=True))
    assert "student logits" not in fused.step and "teacher logits" not in fused.step
    # it trades three tokens × vocabulary tensors for the head's gradient formed during the forward: a loss at
    # 4096 tokens per micro-batch of a 128k vocabulary, a large gain at 8 × 4096
    big = replace(base, batch_size=8)
    assert plan_memory(s8, replace(big, fused_head=True)).peak < plan_memory(s8, big).peak - 15 * 2**30
    packed = plan_memory(s8, replace(base, packed_masks=True))
    assert packed.persistent["N:M masks (packed)"] == s8.target_params // 8
    fp32_teacher = plan_memory(s8, replace(base, teacher_dtype="fp32"))
    assert fp32_teacher.persistent["teacher (fp32)"] == 4 * s8.params
    nokd = plan_memory(s8, replace(base, kd=False))
    assert not any(k.startswith("teacher") for k in {**nokd.persistent, **nokd.step})
    # the peak is the largest of the three moments, and the verdict adds the CUDA context and fragmentation
    assert ddp.peak == max(ddp.moments.values()) and ddp.needed() > ddp.peak


def test_advice_makes_an_8b_run_fit_on_8_gpus_and_says_how_many_a_13b_needs_on_one():
    s8 = model_shape("llama-3.1-8b")
    setup = Setup(world=8, strategy="ddp", batch_size=1, seq_len=4096, grad_accum=32)
    fit = make_it_fit(s8, setup, 80 * 10**9)
    assert fit.gpus is None and "--fsdp" in fit.flags and fit.plan.fits(80 * 10**9)
    assert not plan_memory(s8, setup).fits(80 * 10**9)
    s13 = model_shape("llama-2-13b")
    fit13 = make_it_fit(s13, Setup(world=1, batch_size=1, seq_len=4096), 80 * 10**9)
    assert fit13.gpus and fit13.gpus > 1 and fit13.plan.fits(80 * 10**9) and "--fsdp" in fit13.flags


# ---------------------------------------------------------------------------------------------- decay
@pytest.mark.parametrize("schedule,lr,lam,sig,warm", [
    ("cosine", 2e-5, 4e-7, 1e-6, False),  # the decay finishes
    ("cosine", 1e-4, 1e-4, 1e-3, False),  # noise dominated: it does not
    ("constant", 2e-5, 1e-4, 1e-4, False),
    ("cosine", 1e-4, 4e-7, 1e-5, True),  # warm start: pruned weights start at 0 and regrow with the noise
])
def test_closed_form_decay_matches_adams_exact_recursion(schedule, lr, lam, sig, warm):
    from cast_llm.optim.forecast import simulate_pruned
    from cast_llm.optim.schedule import lr_factor

    T, rms = 300, 0.01
    f = lr_factor(schedule, T, 6)
    lrs = [lr * f(k) for k in range(T)]
    ratio, _, _ = forecast_ratio(lrs, total_steps=T, l1_decay=lam, grad_rms=sig, weight_rms=rms, warm_start=warm)
    # the reference: the recursion itself on N:M groups of N(0, rms²) weights with Gaussian gradient noise
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1024, 4, generator=g, dtype=torch.float64).mul_(rms).abs().sort(dim=1).values
    pruned, kept = w[:, :2].flatten(), float(w[:, 2:].sum(dim=1).mean())
    if warm:
        pruned = torch.zeros_like(pruned)
    end = simulate_pruned(pruned, torch.zeros_like(pruned), torch.zeros_like(pruned), torch.tensor(sig), lrs,
                          start_step=0, total_steps=T, l1_decay=lam, generator=g)
    exact = kept / (kept + 2 * float(end.abs().mean()))
    # the closed form takes AdamS's denominator at its expectation; the noisy v̂ of the recursion steps a bit
    # further (Jensen), which shows most where the noise dominates
    assert abs(ratio - exact) < 0.025, (ratio, exact)


def test_plan_decay_says_what_would_make_it_finish():
    T = 200
    lrs = [1e-4] * T
    d = plan_decay(lrs, total_steps=T, l1_decay=1e-6, grad_rms=1e-4, weight_rms=0.02, warm_start=False)
    # noise-dominated: a larger lr spreads the pruned weights as fast as it decays them; a larger λ helps
    assert not d.finishes and d.lr_factor is None and d.l1_factor
    better = plan_decay(lrs, total_steps=T, l1_decay=1e-6 * d.l1_factor, grad_rms=1e-4, weight_rms=0.02,
                        warm_start=False)
    assert better.finishes
    assert d.max_grad_rms is not None and d.max_grad_rms < 1e-4
    quiet = plan_decay(lrs, total_steps=T, l1_decay=1e-6, grad_rms=d.max_grad_rms, weight_rms=0.02,
                       warm_start=False)
    assert quiet.ratio >= 0.985


# ------------------------------------------------------------------------------------------------ CLI
def test_plan_cli_8b_on_8_gpus_offline_in_seconds(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "8", "--gpu-memory", "80GB"]) == 0
    assert time.perf_counter() - t0 < 10
    out = capsys.readouterr().out
    assert "embedded config llama-3.1-8b" in out and "8.03B parameters" in out
    for needle in ("AdamS moments", "teacher (bf16)", "activations (student)", "student logits", "DOES NOT FIT",
                   "to make it fit: --fsdp", "--activation-checkpointing", "time:", "decay: S_t"):
        assert needle in out, needle
    assert main(["plan", "--model", "llama-3.2-1b", "--json", "--tokens", "1B", "--tokens-per-s", "1e5"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["time"]["measured"] and d["time"]["seconds"] == pytest.approx(1e4)


@pytest.mark.parametrize("argv,msg", [
    (["--model", "llama-3.1-8b", "--gpus", "0"], "--gpus must be ≥ 1"),
    (["--model", "llama-3.1-8b", "--gpu-memory", "80"], "has no unit; write 80GB"),
    (["--model", "llama-3.1-8b", "--gpu-memory", "lots"], "expected a size such as 80GB"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--gpus", "2"], "--model is required"),
])
def test_plan_cli_bad_input_one_line_errors(argv, msg, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


def test_the_table_of_docs_training_md():
    """benchmarks/plan_table.py: the rows of the docs' table (here two models) and their verdicts."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import plan_table
    finally:
        sys.path.pop(0)
    lines = plan_table.rows(models=["smollm2-135m", "llama-3.1-8b"], gpus=[1, 8])
    assert len(lines) == 2 + 4
    small, big1, big8 = lines[2], lines[4], lines[5]
    assert "| smollm2-135m | 1 |" in small and "| yes |" in small
    assert "| no |" in big1 and "(needs 4 GPUs)" in big1 and "--fsdp" in big1
    assert "| no |" in big8 and "--fsdp --activation-checkpointing" in big8 and "h |" in big8
    assert (REPO / "docs" / "training.md").read_text().count(big8) == 1  # the docs show the current plan


# --------------------------------------------------------------------- the plan against a measured peak
@pytest.mark.slow  # ~20 s: a real training run in a subprocess
def test_plan_against_the_peak_a_small_run_measures(tmp_path):
    """benchmarks/plan_vs_measured.py --quick: a real `cast-llm train` of SmolLM2-135M's widths (2 blocks,
    vocabulary 8192, KD) in one process; its peak RSS over the steps against the plan, with glibc returning
    freed blocks to the system (MALLOC_MMAP_THRESHOLD_, so the resident set follows the tensors). The
    tensors' part of the peak (the peak less what the process held outside tensors at the first step) is the
    part the plan predicts: within the benchmark's 15%."""
    out = tmp_path / "q.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plan_vs_measured.py"), "--quick", "--allocator",
                        "returning", "--json", str(out), "--work", str(tmp_path / "w")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["measured_peak"] > row["framework"] > 0
    assert 0.85 <= row["tensor_ratio"] <= 1.15, row
    assert 0.85 <= row["ratio"] <= 1.15, row


def test_plan_around_the_steps_8b_on_8_gpus(capsys, monkeypatch):
    """The terms a paper-scale run meets around its steps: rank 0's start-up and end peaks, the checkpoint
    each rank copies and writes, host memory per node, rank 0's own work and the timeouts derived from it;
    --batch-size 0 picks the micro-batch the trainer would (a global batch of 256 on 8 GPUs)."""
    from cast_llm.plan.startup import MIN_COLLECTIVE_S, MIN_WAIT_S, StartupWork, plan_startup

    s8 = model_shape("llama-3.1-8b")
    setup = Setup(world=8, strategy="fsdp", batch_size=1, seq_len=4096, grad_accum=32, activation_checkpointing=True)
    sp = plan_startup(s8, setup, StartupWork(native_bytes=s8.native_bytes))
    trainable = s8.params + s8.target_rows * 2
    assert s8.native_bytes == 2  # the config's bf16: what the export is written in
    assert sp.checkpoint_bytes == (12 * trainable + s8.target_params) // 8
    assert sp.memory["rank 0 host: loading the model (fp32, and its file)"] == (4 + 2) * s8.params
    assert sp.host_per_node["a checkpoint"] > 8 * sp.checkpoint_bytes
    assert sp.timeouts.collective >= MIN_COLLECTIVE_S and sp.timeouts.wait >= MIN_WAIT_S
    assert sp.timeouts.wait >= 4 * sp.seconds["SparseGPT warm start (rank 0)"]
    ddp = plan_startup(s8, replace(setup, strategy="ddp"), StartupWork(native_bytes=2))
    assert ddp.host_per_node["start-up (every process loads the model)"] > 8 * 4 * s8.params
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--fsdp", "--activation-checkpointing",
                 "--batch-size", "0", "--host-memory", "1TB"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 4 × 4096 tokens, grad-accum 8" in out  # 4 × 8 × 8 GPUs = 256 sequences
    for needle in ("rank 0 device: baseline evaluation (whole fp32 model)", "each rank host: a checkpoint",
                   "host memory per node (8 processes)", "timeouts: training collectives / waiting for rank 0",
                   "start-up and end: needs", "host per node:", "SparseGPT warm start (rank 0)"):
        assert needle in out, needle
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--fsdp", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["startup"]["device_fits"] and d["startup"]["timeouts"]["wait"] >= MIN_WAIT_S
