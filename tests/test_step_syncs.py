"""A training step (CAST, KD, several micro-batches, a mask refresh) reads nothing on the host between log steps
(issue 29), and a non-finite step is still never applied (train/finite.py).

On CPU the host reads are counted (tests/step_sync_checks.py) in a process of its own under TRITON_INTERPRET=1, where
every training-step kernel takes its Triton (CUDA) path; on a GPU the same run goes under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronising call.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from step_sync_checks import HostReads

from cast_llm.errors import CastError
from cast_llm.optim.adams import AdamS
from cast_llm.train.finite import FiniteGuard, skips_on_device

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_the_counter_sees_every_kind_of_host_read():
    t = torch.arange(6.0)
    reads = HostReads()
    with reads:
        reads.active, reads.label = True, "probe"
        t.sum().item()
        float(t[0])
        bool(t[1] > 0)
        t.tolist()
        t.cpu()
        t.nonzero()
        t[t > 2]
        torch.where(t > 2, t, 0.0)  # no read: the data decide nothing on the host
        reads.active = False
        t.sum().item()  # not counted: outside the steps
    kinds = [what for _, what, _ in reads.reads]
    assert any("item" in k for k in kinds) and any("__float__" in k for k in kinds)
    assert any("__bool__" in k for k in kinds) and any("tolist" in k for k in kinds)
    assert any("cpu" in k for k in kinds) and any("nonzero" in k for k in kinds)
    assert any("boolean mask" in k for k in kinds)
    assert not any("where" in k for k in kinds)


@pytest.mark.skipif(not HAS_TRITON or HAS_CUDA, reason="needs Triton's interpreter (a GPU runs the CUDA variant)")
def test_a_kd_training_step_reads_nothing_on_the_host_between_log_steps(triton_interpreter, tmp_path):
    code = ("import json, sys, step_sync_checks as c\n"
            f"out = c.count_in_training({str(tmp_path)!r})\n"
            "print('RESULT ' + json.dumps(out, default=str))\n")
    proc = triton_interpreter.run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
    assert out["rc"] == 0 and out["seen"] == [0, 1, 2, 3, 4]
    assert out["reads"] == [], "\n".join(map(str, out["reads"]))
    # the steps counted ran the CUDA code: every training-step kernel took its Triton path
    took = {path: {e["took"] for e in entries} for path, entries in out["kernels"]["paths"].items()}
    assert took == {"adams.update": {"triton"}, "adams.masks": {"triton"}, "kd.loss": {"triton"},
                    "scaled_weight.block": {"triton"}}, took


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and Triton")
def test_a_kd_training_step_does_not_synchronise_on_cuda(tmp_path, monkeypatch):
    """The same run on a GPU, steps 1-3 under torch.cuda.set_sync_debug_mode('error')."""
    import tiny

    from cast_llm.cli import main
    from cast_llm.train.methods import cast as cast_method

    tiny.save_model(tmp_path / "llama", "llama")
    tiny.write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "eval.txt").write_text(tiny.CORPUS)
    real_begin, real_finalize = cast_method.CastMethod.begin_step, cast_method.CastMethod.finalize

    def begin_step(self, model, optimizer, step):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step in (1, 2, 3) else "default")
        return real_begin(self, model, optimizer, step)

    def finalize(self, *a, **k):
        torch.cuda.set_sync_debug_mode("default")
        return real_finalize(self, *a, **k)

    monkeypatch.setattr(cast_method.CastMethod, "begin_step", begin_step)
    monkeypatch.setattr(cast_method.CastMethod, "finalize", finalize)
    argv = ["train", "--model", str(tmp_path / "llama"), "--data", str(tmp_path / "corpus.jsonl"),
            "--output-dir", str(tmp_path / "run"), "--batch-size", "2", "--seq-len", "32", "--grad-accum", "3",
            "--max-steps", "5", "--log-every", "5", "--kd", "--mask-interval", "3", "--no-progress",
            "--no-baseline-eval", "--val-sequences", "2", "--device", "cuda", "--precision", "bf16",
            "--wikitext-file", str(tmp_path / "eval.txt"), "--track-weights", "0", "--ratio-hist-steps=", "--no-report",
            "--paper-exact"]
    try:
        assert main(argv) == 0
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------------------ non-finite steps
def _adams_pair():
    w = torch.nn.Parameter(torch.randn(8, 16))
    b = torch.nn.Parameter(torch.randn(8))
    return [w, b], AdamS([{"params": [w], "sparse": True}, {"params": [b]}], lr=0.1, total_steps=10)


@pytest.mark.parametrize("kind", ["adams", "adamw_fused"])
def test_a_flagged_step_changes_nothing_and_the_flag_stays(kind):
    if kind == "adams":
        params, opt = _adams_pair()
    else:
        params = [torch.nn.Parameter(torch.randn(8, 16))]
        opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    assert skips_on_device(opt)
    guard = FiniteGuard(torch.device("cpu"))
    for p in params:
        p.grad = torch.randn_like(p)
    guard.arm(opt, None)
    opt.step()  # a good step: applied
    guard.stepped(0)
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in params]
    guard.watch(torch.tensor(float("nan")), 1)
    guard.arm(opt, None)
    opt.step()
    guard.stepped(1)
    for p, b, st in zip(params, before, states):
        assert torch.equal(p, b)
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v), k  # moments and the step count untouched
    guard.watch(torch.tensor(1.0), 2)  # a finite loss later: the flag stays up until the host reads it
    guard.arm(opt, None)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    with pytest.raises(CastError, match=r"loss became nan at step 2; stopped \(the last good checkpoint is ck\)"):
        guard.check("ck")


def test_a_nonfinite_gradient_with_a_finite_loss_is_caught_by_adams_on_the_device():
    params, opt = _adams_pair()
    guard = FiniteGuard(torch.device("cpu"))
    guard.watch(torch.tensor(2.0), 0)
    for p in params:
        p.grad = torch.randn_like(p)
    params[0].grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in params]
    guard.arm(opt, None)
    opt.step()
    guard.stepped(0)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    with pytest.raises(CastError, match="a gradient became non-finite .* at step 1 while the loss was finite"):
        guard.check(None)


def test_an_optimizer_that_cannot_skip_on_the_device_is_checked_on_the_host():
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=0.1, foreach=True)
    assert not skips_on_device(opt)
    guard = FiniteGuard(torch.device("cpu"))
    guard.arm(opt, None)  # nothing wrong yet: no error, no attribute set
    assert getattr(opt, "found_inf", None) is None
    guard.watch(torch.tensor(float("inf")), 0)
    with pytest.raises(CastError, match="loss became inf at step 1"):
        guard.arm(opt, "ck")
