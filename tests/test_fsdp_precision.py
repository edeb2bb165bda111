"""``--fsdp-precision``: FSDP2's MixedPrecisionPolicy as the bf16 default of ``--fsdp``, on CPU over gloo.

The precision the issue asks for (bf16 all-gather and compute, fp32 reduce-scatter, fp32 sharded master
weights; AdamS, its masks and their refresh on the fp32 shards; the weight scales fp32) runs here at world
1 and world 2 — the same code as on CUDA, where only the backend (NCCL) differs. The gradient-level checks
(bf16 forward, whole 2:4 groups on every rank, gradients equal to one process in the same precision) are
in ``tests/fsdp_worker.py``; these are the runs end to end."""

from __future__ import annotations

import json
import os
import shutil
import types

import pytest
import tiny
import torch
from safetensors.torch import load_file

from cast_llm.errors import CastError
from cast_llm.train.fsdp import precision_mode

ARGS = ["--seq-len", "32", "--log-every", "1", "--val-sequences", "1", "--no-progress", "--lr", "1e-2",
        "--l1-decay", "1e-2", "--mask-interval", "1", "--max-steps", "4", "--no-baseline-eval",
        "--wikitext-windows", "1", "--no-report", "--no-layer-stats", "--track-weights", "0",
        "--ratio-hist-steps", "", "--paper-exact", "--device", "cpu", "--precision", "bf16", "--fsdp",
        "--grad-clip", "0"]
# --grad-clip 0: clipping's global norm sums the ranks' squares in another order than one process does (an
# ulp of the coefficient, which this strong decay amplifies over 4 steps); without it world 2 IS world 1, bit
# for bit. Clipping over shards + replicated scales is checked in tests/fsdp_worker.py.


def test_precision_mode_resolves_auto_and_refuses_what_cannot_run():
    cfg = lambda **kw: types.SimpleNamespace(**{"fsdp": True, "fsdp_precision": "auto", **kw})  # noqa: E731
    assert precision_mode(cfg(), "bf16") == "policy"
    assert precision_mode(cfg(fsdp_precision="autocast"), "bf16") == "autocast"
    assert precision_mode(cfg(), "no") == "fp32"
    assert precision_mode(cfg(fsdp=False), "bf16") == "none"  # DDP and one process keep autocast
    with pytest.raises(CastError, match="add --precision bf16"):
        precision_mode(cfg(fsdp_precision="policy"), "no")
    with pytest.raises(CastError, match="applies to --fsdp runs only: add --fsdp"):
        precision_mode(cfg(fsdp=False, fsdp_precision="policy"), "bf16")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdpprec")
    tiny.save_model(d / "llama", "llama", num_hidden_layers=3)
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    return d


def _torchrun(launch, workdir, out, nproc: int, *extra):
    """``torchrun --nproc_per_node NPROC -m cast_llm.cli train ...``, its ranks forked warm (conftest's
    warm_torchrun)."""
    r = launch.run(["-m", "cast_llm.cli", "train", "--model", str(workdir / "llama"), "--data",
                    str(workdir / "corpus.jsonl"), "--wikitext-file", str(workdir / "eval.txt"), *ARGS,
                    "--output-dir", str(out), *extra], nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.skipif(os.environ.get("CAST_SKIP_DDP") == "1", reason="CAST_SKIP_DDP=1")
def test_policy_at_world_2_matches_world_1_and_resumes_exactly(workdir, tmp_path, warm_torchrun):
    """The same 4 steps (global batch 2: one process × 2 micro-batches, or two × 1) under the policy at world 1
    and 2 end bitwise equal — losses, mask statistics, final weights and masks, the masks having moved (most
    entries flip under this strong decay): bf16 gradients of the same micro-batches, summed in fp32 either
    way; world 2 recomputes selectively (the matmul outputs kept, the rest recomputed: the same numbers).
    config.yaml and results.json say "policy". A world-2 run resumed from its step-2 checkpoint ends
    bitwise equal to the uninterrupted one."""
    one, two = tmp_path / "w1", tmp_path / "w2"
    log = _torchrun(warm_torchrun, workdir, one, 1, "--batch-size", "1", "--grad-accum", "2")
    assert "FSDP2 precision: policy" in log
    _torchrun(warm_torchrun, workdir, two, 2, "--batch-size", "1", "--save-every", "2", "--keep-checkpoints-after",
              "--activation-checkpointing", "selective")
    for out in (one, two):
        assert json.loads((out / "results.json").read_text())["fsdp_precision"] == "policy"
        assert "fsdp_precision: policy" in (out / "config.yaml").read_text()
    strip = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs]  # noqa: E731
    ma, mb = strip(_metrics(one)), strip(_metrics(two))
    assert max(x["initial_flip_rate"] for x in ma) > 0.1  # the masks moved: "identical" means something
    assert ma == mb
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    cut = tmp_path / "cut"  # the world-2 run as a preemption after step 2 would have left it
    shutil.copytree(two, cut)
    for ck in (cut / "checkpoints").iterdir():
        if ck.name != "step-00000002":
            shutil.rmtree(ck)
    for f in ("model.safetensors", "config.json", "results.json"):
        (cut / f).unlink()
    log = _torchrun(warm_torchrun, workdir, cut, 2, "--batch-size", "1", "--save-every", "2", "--resume")
    assert "at step 2" in log
    c = load_file(cut / "model.safetensors")
    for k in b:
        assert torch.equal(b[k], c[k]), k
    assert strip(_metrics(cut)) == mb
