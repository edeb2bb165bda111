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


def test_activation_bytes_under_the_fsdp_policy_equal_what_autograd_saves():
    """FSDP2's MixedPrecisionPolicy computes with bf16 parameters and no autocast: bf16 residual stream, each
    RMSNorm's fp32 upcast kept, the projections sharing their bf16 input."""
    m = tiny.model("llama", num_hidden_layers=3).train().to(torch.bfloat16)
    ids = torch.randint(0, tiny.VOCAB, (2, 48))
    s = shape_of(m)
    a = activation_bytes(s, autocast=True, seq_len=48, bf16_params=True)
    assert _saved_bytes(m, ids, False) == a.total(ids.numel(), s.layers)


def _selective_storage(contexts) -> int:
    """Bytes the selective checkpoints' forward contexts hold (torch's SAC storage: the saved op outputs)."""
    import torch.utils._pytree as pytree

    seen: dict[int, int] = {}
    for ctx in contexts:
        for outputs in ctx.storage.values():
            for out in outputs.values():
                for leaf in pytree.tree_leaves(out):
                    t = getattr(leaf, "val", None)  # torch's _VersionWrapper of a saved output
                    if torch.is_tensor(t):
                        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "autocast", "policy"])
def test_selective_recomputation_keeps_block_inputs_and_matmul_outputs(precision, monkeypatch):
    """--activation-checkpointing selective: outside the checkpoints each block keeps its input; inside, torch's
    selective checkpoint keeps exactly the matmul and attention outputs the plan counts."""
    import cast_llm.train.memory_options as memory_options

    contexts = []
    make = memory_options._selective_contexts

    def recording():
        forward, recompute = make()
        contexts.append(forward)
        return forward, recompute

    monkeypatch.setattr(memory_options, "_selective_contexts", recording)
    m = tiny.model("llama", num_hidden_layers=3).train()
    if precision == "policy":
        m.to(torch.bfloat16)
    memory_options.enable_activation_checkpointing(m, "selective")
    ids = torch.randint(0, tiny.VOCAB, (2, 48))
    s = shape_of(m)
    a = activation_bytes(s, autocast=precision != "fp32", seq_len=48, bf16_params=precision == "policy")
    outside = _saved_bytes(m, ids, precision == "autocast")
    cast_head = 2 * s.head_params if precision == "autocast" else 0  # autocast's bf16 copy of the LM head
    assert outside == ids.numel() * (s.layers * a.block_input + a.head) + cast_head
    assert len(contexts) == s.layers
    assert _selective_storage(contexts) == ids.numel() * s.layers * (a.selective_block - a.block_input)
    assert a.total(ids.numel(), s.layers, checkpointing="full") < a.total(ids.numel(), s.layers,
                                                                           checkpointing="selective")


# --------------------------------------------------------------------------------------------- memory
def test_memory_terms_follow_the_options():
    s8 = model_shape("llama-3.1-8b")
    P = s8.params + s8.target_rows * 2
    base = Setup(world=8, strategy="ddp", batch_size=1, seq_len=4096)
    ddp = plan_memory(s8, base)
    assert ddp.persistent["weights (fp32 master)"] == 4 * P and ddp.persistent["AdamS moments μ, v (fp32)"] == 8 * P
    assert ddp.persistent["DDP gradient buckets (= the gradients)"] == 4 * P
    assert ddp.persistent["teacher (bf16)"] == 2 * s8.params and ddp.persistent["N:M masks (bool)"] == s8.target_params
    # FSDP2 under autocast: the sharded state divided by 8, the weight scales whole on every GPU, the scaled
    # weights and autocast's bf16 casts whole on every GPU; recomputation keeps one block's scaled weights
    Ps = s8.target_rows * 2
    fsdp = plan_memory(s8, replace(base, strategy="fsdp", fsdp_precision="autocast"))
    assert fsdp.persistent["weights (fp32 master)"] == 4 * s8.params // 8
    assert fsdp.persistent["weight scales A + moments (fp32, whole per GPU)"] == 12 * Ps
    assert fsdp.persistent["teacher (bf16)"] == 2 * s8.params // 8
    assert fsdp.step["scaled weights Diag(A)·W"] == 2 * s8.target_params
    assert fsdp.step["bf16 casts of the other linears (autocast cache)"] == 2 * s8.head_params  # the LM head
    assert fsdp.step["FSDP2 unsharded blocks (2; fp32)"] == 2 * 4 * s8.block_params
    ac = plan_memory(s8, replace(base, strategy="fsdp", fsdp_precision="autocast", activation_checkpointing="full"))
    assert ac.step["scaled weights Diag(A)·W (one block)"] == 2 * s8.target_params // 32
    assert ac.step["activations (student, full recomputation)"] < fsdp.step["activations (student)"] / 8
    sel = plan_memory(s8, replace(base, strategy="fsdp", fsdp_precision="autocast", activation_checkpointing="selective"))
    assert (ac.step["activations (student, full recomputation)"] < sel.step["activations (student, selective "
            "recomputation)"] < fsdp.step["activations (student)"] / 2)
    # the policy (--fsdp's bf16 default): no autocast cache, the scaled weights one block (layer) at a time,
    # bf16 unsharded parameters and activations; no term holds a copy of the whole model's linear weights
    pol = plan_memory(s8, replace(base, strategy="fsdp"))
    assert pol.setup.policy and not any(k.startswith("bf16 casts") for k in pol.step)
    assert pol.step["scaled weights Diag(A)·W (recomputed, one block)"] == 2 * s8.target_params // 32
    assert max(v for k, v in pol.step.items() if not k.startswith(("activations", "gradients"))) < s8.linear_params
    assert pol.step["FSDP2 unsharded blocks (2; bf16)"] == 2 * 2 * s8.block_params
    assert pol.step["FSDP2 block gradients (bf16 + fp32 reduce buffer)"] == 6 * s8.block_params
    assert pol.step["activations (student)"] < fsdp.step["activations (student)"]
    assert pol.peak < fsdp.peak - 20 * 2**30
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


def test_the_largest_term_and_the_option_that_removes_it():
    from cast_llm.plan.advice import remedy

    s8 = model_shape("llama-3.1-8b")
    ddp = plan_memory(s8, Setup(world=8, strategy="ddp", batch_size=1, seq_len=4096))
    name, size = ddp.largest_term()
    assert name == "AdamS moments μ, v (fp32)" and size == max(v for k, v in {**ddp.persistent, **ddp.step}.items())
    assert remedy(name, ddp.setup).startswith("--fsdp")
    long = Setup(world=8, strategy="fsdp", batch_size=1, seq_len=32768)
    name, _ = plan_memory(s8, long).largest_term()
    assert name == "activations (student)" and remedy(name, long).startswith("--activation-checkpointing selective")
    auto = replace(long, fsdp_precision="autocast", seq_len=1024)
    assert plan_memory(s8, auto).largest_term()[0] == "scaled weights Diag(A)·W"
    assert remedy("scaled weights Diag(A)·W", auto).startswith("--fsdp-precision policy")
    assert remedy("teacher (fp32)", long) == "--teacher-dtype bf16"
    assert remedy("student logits", long).startswith("--fused-head")


def test_mfu_default_reproduces_the_published_fsdp_throughput():
    """torchtitan's docs/performance.md (torch 1963fc8, torchtitan 9dec370, Dec 2024): Llama-3.1-8B, FSDP2
    (1D), 8 H100s, bf16, local batch 2 × 8192 tokens, selective recomputation, eager: 5,762 tokens/s per
    GPU. Plain training (no teacher, no weight scaling) planned with the default MFU gives that figure; the
    NVLink communication stays below the compute (hidden, as in the published run)."""
    from cast_llm.plan.config import PlanOptions
    from cast_llm.plan.timing import ASSUMED_MFU, plan_time

    assert PlanOptions.__dataclass_fields__["mfu"].default == ASSUMED_MFU
    s8 = model_shape("llama-3.1-8b")
    plain = Setup(world=8, strategy="fsdp", batch_size=2, seq_len=8192, grad_accum=1, kd=False, scaling=False,
                  activation_checkpointing="selective")
    t = plan_time(s8, plain, 10**9, link="nvlink")
    assert t.tokens_per_s / 8 == pytest.approx(5762, rel=0.01)
    assert t.comm_s < t.compute_s


def test_communication_bytes_per_step_and_the_interconnects():
    from cast_llm.plan.timing import comm_bytes, interconnect, plan_time

    s8 = model_shape("llama-3.1-8b")
    pol = Setup(world=8, strategy="fsdp", batch_size=1, seq_len=4096, grad_accum=4)
    c = comm_bytes(s8, pol)
    ring = 7 / 8
    blocks = s8.layers * s8.block_params
    assert c["all-gather of the student (forward and backward)"] == int(4 * ring * 2 * (s8.root_params + 2 * blocks))
    assert c["reduce-scatter of the gradients (fp32)"] == int(4 * ring * 4 * s8.params)
    assert c["all-gather of the teacher (forward)"] == int(4 * ring * 2 * s8.params)
    assert c["all-reduce of the weight scales' gradients"] == int(2 * ring * 4 * s8.target_rows * 2)
    # fp32 all-gathers under autocast: twice the policy's
    auto = comm_bytes(s8, replace(pol, fsdp_precision="autocast"))
    assert auto["all-gather of the student (forward and backward)"] == 2 * c["all-gather of the student (forward and backward)"]
    assert comm_bytes(s8, replace(pol, strategy="ddp"))["all-reduce of the fp32 gradients"] == int(
        2 * ring * 4 * (s8.params + s8.target_rows * 2))
    assert comm_bytes(s8, replace(pol, world=1)) == {}
    times = {link: plan_time(s8, pol, 10**9, link=link) for link in ("nvlink", "ib", "ethernet")}
    assert times["nvlink"].tokens_per_s > times["ib"].tokens_per_s > times["ethernet"].tokens_per_s
    assert times["ethernet"].comm_s > times["ethernet"].compute_s  # communication-bound over Ethernet
    assert interconnect("auto", 8, 8) == "nvlink" and interconnect("auto", 16, 8) == "ib"
    with pytest.raises(CastError, match="name it .--interconnect ib or ethernet"):
        interconnect("nvlink", 16, 8)


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
    assert d["fits"] and d["time"]["measured"] and d["time"]["seconds"] == pytest.approx(d["time"]["tokens"] / 1e5)
    # the run trains whole steps: 1B tokens rounded up to a step of 256 × 4096
    assert d["time"]["tokens"] == d["time"]["steps"] * 256 * 4096 and 0 <= d["time"]["tokens"] - 1e9 < 256 * 4096


def test_plan_json_8b_fsdp_reports_policy_recomputation_margin_communication_largest_term(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--fsdp", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["precision"]["policy"] and "MixedPrecisionPolicy" in d["precision"]["what"]
    assert d["setup"]["fsdp_precision"] == "policy" and d["recomputation"] == "none"
    margin = d["memory"]["margin"]
    assert margin["fragmentation"] == 0.20 and "pytorch/pytorch#40989" in margin["source"]
    assert "CPU" in margin["source"]  # what a CPU cannot measure, said
    comm = d["time"]["communication"]
    assert comm["interconnect"] == "nvlink" and comm["total_bytes"] > 0 and comm["seconds_per_step"] > 0
    assert "reduce-scatter of the gradients (fp32)" in comm["bytes_per_gpu_per_step"]
    largest = d["memory"]["largest_term"]
    terms = {**d["memory"]["persistent"], **d["memory"]["step"]}
    assert largest["name"] in terms and largest["bytes"] == max(v for k, v in terms.items() if k != "framework")
    assert largest["remedy"]


def test_plan_70b_without_scaling_fits_64_gpus_with_full_recomputation(capsys, monkeypatch):
    """Meta-Llama-3-70B (embedded from its public config): 70.55B parameters; with --no-scaling under the
    FSDP2 policy and full recomputation it fits 64 × 80 GB; without recomputation it does not, and the
    advice says which term is the largest and what removes it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    s70 = model_shape("llama-3-70b")
    assert (s70.hidden, s70.layers, s70.heads, s70.kv_heads, s70.intermediate, s70.vocab) == (
        8192, 80, 64, 8, 28672, 128256)
    assert s70.params == 70_553_706_496 and not s70.tied
    args = ["plan", "--model", "llama-3-70b", "--gpus", "64", "--gpu-memory", "80GB", "--fsdp", "--no-scaling"]
    assert main([*args, "--activation-checkpointing", "full", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["precision"]["policy"] and d["recomputation"] == "full"
    assert d["time"]["communication"]["interconnect"] == "ib"  # 64 GPUs: 8 nodes
    assert main([*args, "--seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    assert "the largest term: activations (student) " in out and "what removes it: --activation-checkpointing" in out


@pytest.mark.parametrize("argv,msg", [
    (["--model", "llama-3.1-8b", "--gpus", "0"], "--gpus must be ≥ 1"),
    (["--model", "llama-3.1-8b", "--gpu-memory", "80"], "has no unit; write 80GB"),
    (["--model", "llama-3.1-8b", "--gpu-memory", "lots"], "expected a size such as 80GB"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--gpus", "2"], "--model is required"),
    (["--model", "llama-3.1-8b", "--gpus", "16", "--interconnect", "nvlink"], "talk over the network"),
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
    assert "| no |" in big8 and "| --fsdp |" in big8 and "h |" in big8  # under the policy --fsdp alone
    assert "--fsdp --activation-checkpointing selective (needs 4 GPUs)" in big1
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
    setup = Setup(world=8, strategy="fsdp", batch_size=1, seq_len=4096, grad_accum=32, activation_checkpointing="full")
    sp = plan_startup(s8, setup, StartupWork(native_bytes=s8.native_bytes))
    assert s8.native_bytes == 2  # the config's bf16: what the export is written in
    # every rank: its shards of weights, moments and masks, and the weight scales whole
    assert sp.checkpoint_bytes == (12 * s8.params + s8.target_params) // 8 + 12 * s8.target_rows * 2
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
    assert "micro-batch 8 × 4096 tokens, grad-accum 4" in out  # 8 × 4 × 8 GPUs = 256 sequences
    for needle in ("rank 0 device: baseline evaluation (whole fp32 model)", "each rank host: a checkpoint",
                   "host memory per node (8 processes)", "timeouts: training collectives / waiting for rank 0",
                   "start-up and end: needs", "host per node:", "SparseGPT warm start (rank 0)"):
        assert needle in out, needle
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--fsdp", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["startup"]["device_fits"] and d["startup"]["timeouts"]["wait"] >= MIN_WAIT_S


def test_plan_takes_trains_flags_preset_and_config_and_forecasts_with_the_runs_schedule(tmp_path, monkeypatch):
    """`cast-llm plan` reads the training configuration `cast-llm train` would (flags, --preset, --config): the
    same TrainConfig; the decay forecast runs on the learning rates the run's own schedule code gives
    (warm-up, min-lr ratio) and the run's own repair fraction."""
    import cast_llm.plan.run as plan_run_module
    from cast_llm.cli import build_parser
    from cast_llm.cli.plan import build_config as plan_config
    from cast_llm.cli.train import build_config as train_config
    from cast_llm.optim.schedule import TRAIN_WARMUP, schedule_lrs

    parser = build_parser()
    flags = ["--model", "smollm2-135m", "--max-steps", "40", "--warmup-steps", "6", "--min-lr-ratio", "0.25",
             "--lr", "1e-4", "--seq-len", "128", "--batch-size", "2", "--global-batch", "8"]
    run = train_config(parser.parse_args(["train", *flags, "--preset", "llama", "--output-dir", str(tmp_path / "run")]))
    planned, options = plan_config(parser.parse_args(["plan", *flags, "--gpus", "2"]))
    assert replace(planned, output_dir=run.output_dir) == run and options.gpus == 2
    seen = {}
    real = plan_run_module.plan_decay
    monkeypatch.setattr(plan_run_module, "plan_decay",
                        lambda lrs, **kw: (seen.update(lrs=lrs, **kw), real(lrs, **kw))[1])
    plan = plan_run_module.plan_run(planned, options)
    assert plan.setup.batch_size * plan.setup.grad_accum * plan.setup.world == 8 and plan.time.steps == 40
    assert seen["lrs"] == schedule_lrs(run, 40, run.lr, default_warmup=TRAIN_WARMUP)  # what CAST's forecasts use
    assert seen["lrs"][6] == 1e-4 and abs(seen["lrs"][-1] - 0.25e-4) < 1e-6  # warm-up and the floor honoured
    assert seen["prune_step"] == 40 - round(run.effective_repair_fraction * 40) and seen["warm_start"]
    # --preset and --config as train reads them
    assert plan_config(parser.parse_args(["plan", "--model", "llama-3.1-8b", "--preset", "gpt2"]))[0].seq_len == 1024
    (tmp_path / "run.yaml").write_text("model: llama-3.2-1b\nseq_len: 2048\nfsdp: true\nmax_steps: 100\n")
    from_file, opts = plan_config(parser.parse_args(["plan", "--config", str(tmp_path / "run.yaml"), "--gpus", "4"]))
    assert (from_file.model, from_file.seq_len, from_file.fsdp, opts.gpus) == ("llama-3.2-1b", 2048, True, 4)
    # without a preset or config file: train's --preset llama
    from cast_llm.train.config import PRESETS

    default, _ = plan_config(parser.parse_args(["plan", "--model", "llama-3.1-8b"]))
    assert all(getattr(default, k) == v for k, v in PRESETS["llama"].items())
