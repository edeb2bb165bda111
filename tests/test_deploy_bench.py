"""`cast-llm bench-inference`: the dense path runs on CPU; the sparse path is skipped with the reason."""

from __future__ import annotations

import json

import pytest
import tiny
import torch
from deploy_helpers import cli, one_line_error, save_hf, sparse_model

from cast_llm.deploy.bench import BenchConfig, format_report, run_bench

HAS_SM80 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
FAST = BenchConfig(batch_size=2, prompt_len=8, gen_len=2, warmup=0, repeats=1, linear_repeats=1)


@pytest.mark.skipif(HAS_SM80, reason="checks the CPU report; a GPU run measures the sparse path instead")
def test_cpu_reports_dense_numbers_and_skips_the_sparse_path():
    model = sparse_model("llama")
    report = run_bench(model, name="tiny", cfg=FAST)
    assert report.dense.prefill_tokens_per_s > 0 and report.dense.decode_tokens_per_s > 0
    assert report.sparse is None and "CUDA devices only" in report.sparse_skipped
    assert report.notes == []  # already 2:4: nothing pruned
    assert {r["regime"] for r in report.per_linear} == {"prefill", "decode"}
    assert all("sparse_us" not in r for r in report.per_linear)
    # weights: 14 targets of the tiny LLaMA, dense bytes
    assert report.dense.target_weight_bytes == 4 * sum(p.numel() for n, p in model.named_parameters()
                                                       if n.endswith("proj.weight"))
    text = format_report(report)
    assert "skipped" in text and "prefill tokens/s" in text


def test_a_dense_model_is_magnitude_pruned_for_timing_and_says_so():
    report = run_bench(tiny.model("gpt2"), name="tiny-gpt2", cfg=FAST)
    assert any("magnitude-pruned" in n for n in report.notes)


@pytest.mark.skipif(HAS_SM80, reason="checks the CPU report")
def test_cli_json_on_cpu(tmp_path, capsys):
    path = save_hf(sparse_model("llama"), tmp_path / "m")
    assert cli("bench-inference", path, "--prompt-len", "8", "--gen-len", "2", "--repeats", "1", "--warmup", "0",
               "--linear-repeats", "1", "--dtype", "fp32", "--json") == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["device"].startswith("cpu") and out["dtype"] == "float32"
    assert out["sparse"] is None and "CUDA" in out["sparse_skipped"]
    assert out["dense"]["prefill_tokens_per_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without CUDA")
def test_cli_cuda_without_cuda_is_a_one_line_error(tmp_path, capsys):
    assert cli("bench-inference", "no-such-model", "--device", "cuda") == 2
    assert "CUDA is not available" in one_line_error(capsys)
    assert cli("bench-inference", "random:llama-1b", "--device", "cpu") == 2
    assert "random:llama-2-7b" in one_line_error(capsys)
