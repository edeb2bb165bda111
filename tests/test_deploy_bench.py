"""`cast-llm bench-inference`: the dense path runs on CPU; the sparse path is skipped with the reason."""

from __future__ import annotations

import copy
import json
import statistics

import pytest
import tiny
import torch
from deploy_helpers import cli, one_line_error, save_hf, sparse_model

import cast_llm.deploy.bench as bench
from cast_llm.deploy.bench import (
    BenchConfig,
    format_report,
    noise_floor_logits,
    rel_err,
    run_bench,
    within_noise_bound,
)
from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24 import sparse24_layers, to_sparse24_
from cast_llm.prune.magnitude import magnitude_prune_
from cast_llm.targets import find_targets

HAS_SM80 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
FAST = BenchConfig(batch_size=2, prompt_len=8, gen_len=2, warmup=0, repeats=1, linear_repeats=1)


@pytest.mark.skipif(HAS_SM80, reason="checks the CPU report; a GPU run measures the sparse path instead")
def test_cpu_measures_both_paths_with_the_cpu_kernels():
    model = sparse_model("llama")
    dense_bytes = 4 * sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    report = run_bench(model, name="tiny", cfg=FAST)
    assert report.dense.prefill_tokens_per_s > 0 and report.dense.decode_tokens_per_s > 0
    assert not any("magnitude" in n for n in report.notes)  # already 2:4: nothing pruned
    assert {r["regime"] for r in report.per_linear} == {"prefill", "decode"}
    # weights: 14 targets of the tiny LLaMA, dense bytes
    assert report.dense.target_weight_bytes == dense_bytes
    text = format_report(report)
    assert "prefill tokens/s" in text
    why = cpu24.extension_reason()
    if why is not None:  # no extension here: the sparse side is skipped with its reason, never estimated
        assert report.sparse is None and why in report.sparse_skipped and "skipped" in text
        return
    assert report.sparse is not None and report.sparse.decode_tokens_per_s > 0
    assert "above 1x the 2:4 model is faster or smaller" in text  # which way the ratio column reads
    assert all(r["kernel"].startswith("cpu-") for r in report.per_linear)
    assert report.logits_rel_err < 1e-5  # fp32: the 2:4 kernels and dense agree to rounding


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_noise_floor_is_the_emulated_kernel_and_leaves_the_model_as_it_was(arch):
    """The floor's fp32-accumulated forward equals the model run on the torch emulated kernel (fp32 accumulation,
    one rounding), and leaves the model exactly as it was (same modules, same logits, no hooks left)."""
    model = (sparse_model("llama") if arch == "llama" else tiny.model("gpt2")).bfloat16()
    if arch == "gpt2":
        for t in find_targets(model, n=2, m=4, skip_incompatible=True):
            w = t.weight.data
            magnitude_prune_(w.t() if t.transposed else w, 2, 4)
    modules = list(model.modules())
    prompt = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    before = model(input_ids=prompt).logits
    floor = noise_floor_logits(model, prompt, find_targets(model, n=2, m=4, skip_incompatible=True))
    assert list(model.modules()) == modules and not any(m._forward_hooks for m in modules)
    assert torch.equal(model(input_ids=prompt).logits, before)
    emulated = copy.deepcopy(model)
    to_sparse24_(emulated, kernels=["emulated"], dispatch=False)
    assert sparse24_layers(emulated)
    assert torch.equal(emulated(input_ids=prompt).logits, floor)
    assert floor.dtype == torch.bfloat16 and rel_err(floor, before) < 0.05  # another rounding of the same model
    assert within_noise_bound(0.0) == 0.01 and within_noise_bound(0.1) == pytest.approx(0.3)


@pytest.mark.skipif(HAS_SM80, reason="checks the CPU report")
def test_a_bf16_report_judges_its_logits_against_the_measured_floor():
    report = run_bench(sparse_model("llama").bfloat16(), name="tiny", cfg=FAST)
    assert report.logits_noise_floor is not None
    if report.sparse is None:
        return
    assert report.logits_within_noise is (report.logits_rel_err <= within_noise_bound(report.logits_noise_floor))
    assert report.logits_within_noise  # the CPU kernels on a well-conditioned tiny model: bf16 rounding only
    assert "bf16 noise floor" in format_report(report)


def test_a_dense_model_is_magnitude_pruned_for_timing_and_says_so():
    report = run_bench(tiny.model("gpt2"), name="tiny-gpt2", cfg=FAST)
    assert any("magnitude-pruned" in n for n in report.notes)


def test_both_paths_weights_are_allocated_alike_layer_by_layer_values_and_ties_kept():
    """On a CPU VM the model allocated last prefilled up to 1.5x faster (cpu24-notes.md §49): the twin and the model
    it is compared with get fresh copies of their target weights in alternating order, nothing else changes."""
    model = tiny.model("llama")
    twin = copy.deepcopy(model)
    fqns = [t.fqn for t in find_targets(model, n=2, m=4, skip_incompatible=True)]
    params = {(id(m), f): m.get_submodule(f).weight for m in (model, twin) for f in fqns}
    before = {k: (p.data_ptr(), p.detach().clone()) for k, p in params.items()}
    order = []
    real_clone = torch.Tensor.clone
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "clone", lambda t, *a, **k: order.append(t.data_ptr()) or real_clone(t, *a, **k))
        bench.allocate_alike(model, twin, fqns)
    for (mid, f), p in params.items():
        assert model.get_submodule(f).weight is p if mid == id(model) else twin.get_submodule(f).weight is p
        assert p.data_ptr() != before[(mid, f)][0] and torch.equal(p.detach(), before[(mid, f)][1])
    first = [order[2 * i] for i in range(len(fqns))]  # which model's layer i was copied first
    firsts = [before[(id(model), f)][0] for f in fqns]
    assert [a == b for a, b in zip(first, firsts)] == [i % 2 == 0 for i in range(len(fqns))]
    report = run_bench(tiny.model("llama"), name="tiny", cfg=FAST)
    assert any("re-allocated alike" in n for n in report.notes) == (report.sparse is not None)


@pytest.mark.skipif(HAS_SM80, reason="checks the CPU report")
def test_cli_json_on_cpu(tmp_path, capsys):
    path = save_hf(sparse_model("llama"), tmp_path / "m")
    assert cli("bench-inference", path, "--prompt-len", "8", "--gen-len", "2", "--repeats", "1", "--warmup", "0",
               "--linear-repeats", "1", "--dtype", "fp32", "--json") == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["device"].startswith("cpu") and out["dtype"] == "float32"
    assert out["dense"]["prefill_tokens_per_s"] > 0
    why = cpu24.extension_reason()
    assert (out["sparse"] is None and why in out["sparse_skipped"]) if why else out["sparse"]["decode_tokens_per_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without CUDA")
def test_cli_cuda_without_cuda_is_a_one_line_error(tmp_path, capsys):
    assert cli("bench-inference", "no-such-model", "--device", "cuda") == 2
    assert "CUDA is not available" in one_line_error(capsys)
    assert cli("bench-inference", "random:llama-1b", "--device", "cpu") == 2
    assert "random:llama-2-7b" in one_line_error(capsys)


@pytest.mark.skipif(HAS_SM80, reason="checks the CPU report")
def test_the_cpu_report_times_the_two_paths_paired_where_a_twin_fits(monkeypatch):
    if cpu24.extension_reason() is not None:
        pytest.skip("no CPU 2:4 extension here: there is no 2:4 path to pair with")
    order, real, models = [], bench._generate, []
    real_flusher = bench.cache_flusher

    def recording(model, prompt, gen_len):  # the model run_bench was given is the one swapped to 2:4 in place
        order.append("sparse" if model is models[-1] else "dense")
        return real(model, prompt, gen_len)

    def flusher(device):  # the caches flushed before every timed generation (the warm-ups need none)
        flush, nbytes = real_flusher(device)
        assert nbytes == bench.flush_bytes() > 0
        return (lambda: order.append("flush")), nbytes

    monkeypatch.setattr(bench, "_generate", recording)
    monkeypatch.setattr(bench, "cache_flusher", flusher)
    cfg = BenchConfig(batch_size=1, prompt_len=8, gen_len=2, warmup=1, repeats=3, linear_repeats=1)
    models.append(sparse_model("llama"))
    report = run_bench(models[-1], name="tiny", cfg=cfg)
    assert report.timing.startswith("paired") and "timing: paired" in format_report(report)
    assert report.dense.decode_tokens_per_s > 0 and report.sparse.decode_tokens_per_s > 0
    timed = order[order.index("flush"):]
    assert timed == ["flush", "dense", "flush", "sparse", "flush", "sparse", "flush", "dense", "flush", "dense",
                     "flush", "sparse"]  # a pair a repeat, the order alternating, each after a flush
    assert "every generation starts after a read of" in report.timing
    assert report.logits_rel_err < 1e-5  # fp32: the twin's and the 2:4 model's prompt logits agree
    # each pair's ratio, in the JSON and the table: dense's seconds over 2:4's of the same repeat
    pairs = report.to_dict()["pair_ratios"]
    assert set(pairs) == {"prefill", "decode"} and all(len(v) == 3 for v in pairs.values())
    assert pairs["decode"][1] == pytest.approx(report.dense.decode_s[1] / report.sparse.decode_s[1])
    assert statistics.median(report.sparse.prefill_s) * 1e3 == pytest.approx(report.sparse.prefill_ms)
    assert "decode 2:4 / dense in each pair: " in format_report(report)

    order.clear()
    monkeypatch.setattr(bench.machine, "available_memory", lambda: 0)
    models.append(sparse_model("llama"))
    report = run_bench(models[-1], name="tiny", cfg=cfg)
    assert report.timing.startswith("sequential") and "does not fit" in report.timing
    assert report.to_dict()["pair_ratios"] == {} and "in each pair" not in format_report(report)
    assert [x for x in order if x != "flush"] == ["sparse"] * 8  # one model only: its dense warm-up and repeats,
    assert order.count("flush") == 6  # then its 2:4 ones, each timed one after a flush


def test_the_dense_fp32_baseline_is_timed_where_the_cpu_does_not_multiply_bf16_natively(monkeypatch, tmp_path):
    """On a CPU without AVX512-BF16 / AMX torch's bf16 GEMM is emulated and fp32 is the dense path a user would run
    for long prompts: auto times it there (paired with the others, the same weights upcast), on times it anywhere,
    off never; the table gains its column and the ratio against the better dense path of each row."""
    cpu, on, off = torch.device("cpu"), BenchConfig(dense_fp32="on"), BenchConfig(dense_fp32="off")
    auto = BenchConfig()
    for native, timed in ((False, True), (True, False), (None, False)):  # None: flags unreadable: not assumed
        monkeypatch.setattr(bench.machine, "native_half_matmul", lambda half, native=native: native)
        assert (bench.fp32_baseline(auto, cpu, torch.bfloat16) is not None) is timed
        assert bench.fp32_baseline(on, cpu, torch.bfloat16) and bench.fp32_baseline(off, cpu, torch.bfloat16) is None
    assert bench.fp32_baseline(on, cpu, torch.float32) is None  # the model is fp32 already
    assert bench.fp32_baseline(auto, torch.device("meta"), torch.bfloat16) is None  # a GPU's is native
    monkeypatch.setattr(bench.machine, "native_half_matmul", lambda half: False)
    assert "does not multiply bf16 natively" in bench.fp32_baseline(auto, cpu, torch.bfloat16)

    order, real, models = [], bench._generate, []

    def recording(model, prompt, gen_len):
        dtype = next(model.parameters()).dtype
        order.append("sparse" if model is models[-1] else "fp32" if dtype == torch.float32 else "dense")
        return real(model, prompt, gen_len)

    monkeypatch.setattr(bench, "_generate", recording)
    cfg = BenchConfig(batch_size=1, prompt_len=8, gen_len=2, warmup=0, repeats=2, linear_repeats=1)
    models.append(sparse_model("llama").bfloat16())
    report = run_bench(models[-1], name="tiny", cfg=cfg)
    d, d32 = report.dense, report.dense_fp32
    assert d32 is not None and d32.decode_tokens_per_s > 0 and d32.prefill_tokens_per_s > 0
    assert d32.target_weight_bytes == 2 * d.target_weight_bytes  # the same layers, 4 bytes a weight
    text = format_report(report)
    assert "dense fp32" in text and "vs best dense" in text and "does not multiply bf16" in text
    if report.sparse is not None:  # paired: the three paths a repeat, the order reversed on the next
        assert order[-6:] == ["dense", "fp32", "sparse", "sparse", "fp32", "dense"]
        best = max(d.decode_tokens_per_s, d32.decode_tokens_per_s)
        line = next(x for x in text.splitlines() if x.lstrip().startswith("decode tokens/s"))
        assert line.split()[-1] == f"{report.sparse.decode_tokens_per_s / best:.2f}x"
        # per linear, the fp32 layer is timed in the same interleaved measurement as dense and the kernels
        assert all(p["dense_fp32_us"] > 0 and p["speedup_vs_fp32"] == pytest.approx(p["dense_fp32_us"] / p["sparse_us"])
                   for p in report.per_linear)
        assert "us, 2:4" in text
        r = report.to_dict()["ratios"]  # the JSON carries the table's ratio columns
        assert r["decode_vs_best_dense"] == pytest.approx(report.sparse.decode_tokens_per_s / best)
        assert r["prefill"] == pytest.approx(report.sparse.prefill_tokens_per_s / d.prefill_tokens_per_s)
    bench.plot_report(report, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 0
    assert json.loads(json.dumps(report.to_dict()))["dense_fp32"]["decode_tokens_per_s"] > 0

    order.clear()
    models.append(sparse_model("llama").bfloat16())
    report = run_bench(models[-1], name="tiny", cfg=BenchConfig(**{**cfg.__dict__, "dense_fp32": "off"}))
    assert report.dense_fp32 is None and "fp32" not in order and "dense fp32" not in format_report(report)
    assert not any("dense_fp32_us" in p for p in report.per_linear)

    monkeypatch.setattr(bench.machine, "available_memory", lambda: 0)  # neither a twin nor an fp32 copy fits
    models.append(sparse_model("llama").bfloat16())
    report = run_bench(models[-1], name="tiny", cfg=cfg)
    assert report.dense_fp32 is None and "does not fit" in report.dense_fp32_note
    assert "dense fp32: not timed" in format_report(report)


def test_the_timed_prefill_computes_the_head_for_the_last_position_only_as_generate_does():
    """transformers' generate passes logits_to_keep=1 to the prompt's forward: the timed generation does too (the
    head of every prompt position is a product no generating user pays); the check reads every position."""
    model = sparse_model("llama")
    shapes = []
    model.register_forward_hook(lambda m, args, kwargs, out: shapes.append(tuple(out.logits.shape)), with_kwargs=True)
    prompt = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    prefill_s, decode_s = bench._generate(model, prompt, 2)
    assert prefill_s > 0 and decode_s > 0
    assert shapes == [(2, 1, model.config.vocab_size)] * 3  # the prompt's forward, then two decode steps
    assert bench.prompt_logits(model, prompt).shape == (2, 8, model.config.vocab_size)


def test_the_cpu_per_linear_table_times_dense_and_the_kernels_together(monkeypatch):
    """One interleaved measurement per (shape, token count) holds dense and every kernel (a paired comparison,
    as the dispatcher's); a kernel that failed there (inf) is never the table's fastest."""
    from cast_llm.deploy.sparse24 import timing

    calls = []

    def fake(kernels, out_f, in_f, dtype, tokens, mode, device):
        calls.append((tuple(kernels), out_f, in_f, tokens, mode))
        # at 4 tokens the 2:4 kernel is faster by the median but slower in two of five paired rounds
        avx2 = [1e-3] * 5 if tokens == 1 else [1e-3, 1e-3, 1e-3, 3e-3, 3e-3]
        return {"dense": (2e-3, None, [2e-3] * 5), "cpu-avx2": (1e-3, None, avx2),
                "cpu-avx512": (float("inf"), "RuntimeError: wrong", None)}

    monkeypatch.setattr(timing, "measure_gemms_rounds", fake)
    rows = bench.bench_linears({(8, 16): ["q_proj"]}, {"prefill": 4, "decode": 1}, dtype=torch.float32,
                               device=torch.device("cpu"), kernels=["cpu-avx512", "cpu-avx2"])
    assert calls == [(("dense", "cpu-avx512", "cpu-avx2"), 8, 16, 4, "eager"),
                     (("dense", "cpu-avx512", "cpu-avx2"), 8, 16, 1, "eager")]
    assert [(r["kernel"], r["speedup"]) for r in rows] == [("cpu-avx2", 2.0), ("cpu-avx2", 2.0)]
    # the dispatcher's paired rule on the same rounds, in the row and in the table
    assert [(r["rounds_won"], r["rounds"], r["paired_rule_takes_it"]) for r in rows] == [(3, 5, False), (5, 5, True)]
    text = "\n".join(bench.linear_line(r) for r in rows)
    assert "faster in 3/5 rounds: the paired rule keeps dense" in text
    assert "faster in 5/5 rounds: the paired rule takes it" in text
