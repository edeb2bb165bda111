"""Every checked kernel path (cast_llm.kernels) catches a wrong kernel: a result off by 1e-2, one that raises,
one that fails to compile — injected into each path as its candidate, runnable on this CPU.

For each path and fault: the probe (or the in-situ check) catches it; the run finishes on the reference path
with the reference's result, bitwise (every CPU reference here is deterministic); the one-line warning is
printed once; the verdict is written to the verdict file and reused by a fresh process (no second probe).
The switch (``--kernels reference``) and the environment variable force the reference everywhere.

"Off by 1e-2": the candidate is otherwise right and its result is moved by 1e-2 of its largest magnitude
(3e-2 for the graph and 2:4 paths, whose own tolerances accept bf16 noise up to 1-2 %; 1e-2 of the mask
entries flipped for the mask refresh). "Fails to compile": the candidate raises the real error of Triton
compiling a kernel that does not type-check (for sm_90, no GPU needed).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
import tiny
import torch
from step_kernel_checks import _tiny_llama

from cast_llm import kernels
from cast_llm.errors import CastError
from cast_llm.kernels import Candidate

HAS_TRITON = importlib.util.find_spec("triton") is not None
FAULTS = ["off", "raises", pytest.param("compile", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs Triton"))]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _does_not_compile(x_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs) + undefined_name)  # noqa: F821 - the point of this kernel


@pytest.fixture(scope="module")
def compile_error():
    """The error Triton raises compiling a kernel that does not type-check (once per module)."""
    if not HAS_TRITON:
        return None
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        triton.compile(ASTSource(fn=_does_not_compile, signature={"x_ptr": "*fp32", "BLOCK": "constexpr"},
                                 constexprs={"BLOCK": 16}), target=GPUTarget("cuda", 90, 32),
                       options={"enable_fp_fusion": True})
    except Exception as e:  # noqa: BLE001 - whatever Triton raises for it
        return e
    pytest.fail("the broken kernel compiled")


def faulty(real, fault: str, error, perturb):
    """A candidate: ``real`` with ``fault`` injected (``perturb(result, args, kwargs)`` makes it off by 1e-2)."""
    def impl(*args, **kwargs):
        if fault == "raises":
            raise RuntimeError("injected: an illegal memory access was encountered")
        if fault == "compile":
            raise error
        out = real(*args, **kwargs)
        perturb(out, args, kwargs)
        return out
    return impl


def inject(monkeypatch, name: str, candidate: str, load, runs=lambda device: None) -> None:
    """Path ``name`` with ``candidate`` as its only candidate, runnable anywhere."""
    path = kernels.REGISTRY[name]
    monkeypatch.setitem(kernels.REGISTRY, name, dataclasses.replace(
        path, candidates=(Candidate(candidate, load, runs),)))


def bump(t: torch.Tensor, by: float = 1e-2) -> None:
    with torch.no_grad():
        t.add_(by * t.abs().max().clamp_min(1e-12))


def verdicts(name: str) -> dict:
    data = json.loads(Path(os.environ["CAST_LLM_KERNEL_VERDICTS"]).read_text())
    found = {k: v for k, v in data["entries"].items() if f"| {name} |" in k}
    assert found, f"no verdict for {name}"
    return found


def assert_caught_once(capsys, name: str, candidate: str, fallback="reference"):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if f"kernel {name} [{candidate}]" in line]
    assert len(lines) == 1, err
    assert f"using {fallback} for the rest of the run" in lines[0]
    for entry in verdicts(name).values():
        assert entry["candidates"][candidate]["ok"] is False


def assert_reused(monkeypatch, name: str, run) -> None:
    """A fresh process (registry reset, the same verdict file): no probe runs, the reference still does."""
    kernels.reset()
    probes = []
    path = kernels.REGISTRY[name]
    if path.probe is not None:
        real = path.probe
        monkeypatch.setitem(kernels.REGISTRY, name, dataclasses.replace(
            path, probe=lambda *a, **k: probes.append(1) or real(*a, **k)))
    run()
    assert not probes, "the cached verdict should have been reused"


def reference_run(monkeypatch, run):
    kernels.reset()
    monkeypatch.setenv("CAST_LLM_KERNELS", "reference")
    try:
        return run()
    finally:
        monkeypatch.delenv("CAST_LLM_KERNELS")
        kernels.reset()


# ------------------------------------------------------------------------------------------- AdamS update
def _adams_run(steps=4, interval=2):
    from cast_llm.optim.adams import AdamS

    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 32, generator=gen))
    b = torch.nn.Parameter(torch.randn(16, generator=gen))
    opt = AdamS([{"params": [w], "sparse": True}, {"params": [b]}], lr=1e-2, l1_decay=0.1, total_steps=8,
                mask_interval=interval)
    for _ in range(steps):
        w.grad = torch.randn(w.shape, generator=gen)
        b.grad = torch.randn(b.shape, generator=gen)
        opt.step()
    return w.detach().clone(), b.detach().clone(), opt.mask(w).clone()


@pytest.mark.parametrize("fault", FAULTS)
def test_adams_update(monkeypatch, capsys, fault, compile_error):
    from cast_llm.optim import functional

    def perturb(out, args, kwargs):
        for p in args[0]:
            bump(p)

    inject(monkeypatch, "adams.update", "triton",
           lambda: faulty(functional._multi_tensor_adams, fault, compile_error, perturb))
    got = _adams_run()
    assert_caught_once(capsys, "adams.update", "triton")
    want = reference_run(monkeypatch, _adams_run)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert_reused(monkeypatch, "adams.update", _adams_run)


@pytest.mark.parametrize("fault", FAULTS)
def test_adams_mask_refresh(monkeypatch, capsys, fault, compile_error):
    from cast_llm.optim import functional

    def perturb(out, args, kwargs):
        for mask in out:  # flip 1e-2 of the entries
            flat = mask.view(-1)
            flat[:: 100] = ~flat[:: 100] if flat.dtype == torch.bool else flat[:: 100] ^ 1

    def run():
        with kernels.restricted("adams.update", ()):  # the update on its reference in both runs
            return _adams_run()

    inject(monkeypatch, "adams.masks", "triton",
           lambda: faulty(functional._reference_masks, fault, compile_error, perturb))
    got = run()
    assert_caught_once(capsys, "adams.masks", "triton")
    want = reference_run(monkeypatch, run)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert_reused(monkeypatch, "adams.masks", run)


# ----------------------------------------------------------------------------------------------- KD loss
def _kd_run():
    from cast_llm.distill import causal_kd_loss

    gen = torch.Generator().manual_seed(0)
    s = torch.randn(2, 9, 300, generator=gen).requires_grad_(True)
    t = torch.randn(2, 9, 300, generator=gen)
    ids = torch.randint(0, 300, (2, 9), generator=gen)
    out = causal_kd_loss(s, t, ids, eta=0.5, chunk_size=4)
    out.loss.backward()
    return out.loss.detach(), out.kd, out.ce, s.grad


@pytest.mark.parametrize("fault", FAULTS)
def test_kd_loss(monkeypatch, capsys, fault, compile_error):
    from cast_llm.distill import loss as distill

    def real(student, teacher, labels, *, ignore_index, inv_n, eta, temperature, need_grad, chunk_size):
        return distill._chunked(student, teacher, labels, labels != ignore_index, inv_n, eta, temperature, chunk_size,
                                need_grad, torch.float32)

    def perturb(out, args, kwargs):
        for x in out:
            if x is not None:
                bump(x)

    inject(monkeypatch, "kd.loss", "triton", lambda: faulty(real, fault, compile_error, perturb))
    got = _kd_run()
    assert_caught_once(capsys, "kd.loss", "triton")
    want = reference_run(monkeypatch, _kd_run)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert_reused(monkeypatch, "kd.loss", _kd_run)


# ------------------------------------------------------------------------------------- scaled weights
def _layer_run():
    from cast_llm.nn.scaled_weight import scaled_weight

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen).requires_grad_(True)
    a = (0.5 + torch.rand(40, 2, generator=gen)).requires_grad_(True)
    (scaled_weight(w, a, 2, False, torch.float32) * torch.randn(40, 96, generator=gen)).sum().backward()
    return w.grad, a.grad


@pytest.mark.parametrize("fault", FAULTS)
def test_scaled_weight_layer(monkeypatch, capsys, fault, compile_error):
    from cast_llm.nn.scaled_weight import torch_scaled_weight_grads

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors count as kernel tensors: the kernel path is asked

    def perturb(out, args, kwargs):
        for x in out:
            if x is not None:
                bump(x)

    inject(monkeypatch, "scaled_weight.layer", "triton",
           lambda: faulty(torch_scaled_weight_grads, fault, compile_error, perturb))
    got = _layer_run()
    assert_caught_once(capsys, "scaled_weight.layer", "triton")
    want = reference_run(monkeypatch, _layer_run)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert_reused(monkeypatch, "scaled_weight.layer", _layer_run)


def _block_run():
    from cast_llm.nn import wrap_scaling_

    torch.manual_seed(0)
    model = _tiny_llama("cpu")
    wrap_scaling_(model, n_groups=2)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with kernels.restricted("scaled_weight.layer", ()):  # the per-layer fallback: torch ops on this CPU
        logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
    return [logits.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("fault", FAULTS)
def test_scaled_weight_block(monkeypatch, capsys, fault, compile_error):
    from cast_llm.nn.scaled_weight import torch_scaled_weight, torch_scaled_weight_grads

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    class Block:
        forward = staticmethod(faulty(lambda ws, scales, g, tr, dt: [torch_scaled_weight(w, a, g, tr, dt)
                                                                      for w, a in zip(ws, scales)],
                                      fault, compile_error, lambda out, a, k: [bump(x) for x in out]))

        @staticmethod
        def backward(grads, ws, scales, g, tr, need_w, need_a):
            pairs = [torch_scaled_weight_grads(gr, w, a, g, tr, need_w, need_a) for gr, w, a in zip(grads, ws, scales)]
            return [p[0] for p in pairs], [p[1] for p in pairs]

    inject(monkeypatch, "scaled_weight.block", "triton", lambda: Block)
    got = _block_run()
    assert_caught_once(capsys, "scaled_weight.block", "triton")
    want = reference_run(monkeypatch, _block_run)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert_reused(monkeypatch, "scaled_weight.block", _block_run)


# --------------------------------------------------------------------------------------- teacher graph
def _fake_graph(fault, error, captures):
    class Graph:
        @classmethod
        def capture(cls, forward, example):
            captures.append(1)
            if fault == "raises":
                raise RuntimeError("injected: operation not permitted when stream is capturing")
            if fault == "compile":
                raise error
            g = cls()
            g.forward = forward
            return g

        def run(self, input_ids):
            out = self.forward(input_ids).clone()
            bump(out, 3e-2)
            return out
    return Graph


@pytest.mark.parametrize("fault", FAULTS)
def test_teacher_cuda_graph(monkeypatch, capsys, fault, compile_error):
    from cast_llm.distill.teacher import TeacherForward

    monkeypatch.setattr(TeacherForward, "graph_device", "cpu")
    model = tiny.model("llama").requires_grad_(False)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    captures = []
    inject(monkeypatch, "teacher.cuda_graph", "cuda-graph", lambda: _fake_graph(fault, compile_error, captures))
    said = []
    tf = TeacherForward(model, cuda_graph=True, say=said.append)
    got = [tf(ids).clone() for _ in range(3)]
    assert len(said) == 1 and "CUDA graph off, the teacher runs eagerly" in said[0] and len(captures) == 1
    assert verdicts("teacher.cuda_graph")
    want = reference_run(monkeypatch, lambda: TeacherForward(model, cuda_graph=True)(ids).clone())
    assert all(torch.equal(g, want) for g in got)
    # a fresh process: the cached verdict, no capture at all, and the line once
    kernels.reset()
    capsys.readouterr()
    tf = TeacherForward(model, cuda_graph=True, say=said.append)
    assert torch.equal(tf(ids), want) and torch.equal(tf(ids), want) and len(captures) == 1
    assert capsys.readouterr().err.count("kernel teacher.cuda_graph [cuda-graph]") == 1


# ----------------------------------------------------------------------------------------- 2:4 GEMMs
@pytest.mark.parametrize("fault", FAULTS)
def test_sparse24_gemm(monkeypatch, capsys, fault, compile_error):
    from deploy_helpers import sparse_model

    from cast_llm.deploy.sparse24 import Dispatcher, to_sparse24_
    from cast_llm.deploy.sparse24 import kernels as K

    class Wrong(K.EmulatedKernel):
        def __init__(self):
            super().__init__()
            self.name = "cusparselt"

        def mm(self, x2d, state, bias, out_features):
            return faulty(super().mm, fault, compile_error, lambda out, a, k: bump(out, 3e-2))(
                x2d, state, bias, out_features)

    wrong = Wrong()
    monkeypatch.setitem(K.KERNELS, "cusparselt", wrong)
    inject(monkeypatch, "sparse24.gemm", "cusparselt", lambda: wrong)
    base = sparse_model("llama")
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = base(ids).logits

    def run():
        model = copy.deepcopy(base)
        swapped = to_sparse24_(model, kernels=("cusparselt",), skip_incompatible=True,
                               dispatch=Dispatcher(measure=lambda *a: (1.0, None), gpu="fake", versions="v"))
        with torch.no_grad():
            return swapped, model(ids).logits

    swapped, got = run()
    assert swapped == [] and torch.equal(got, want)  # every layer kept its dense F.linear
    assert_caught_once(capsys, "sparse24.gemm", "cusparselt")
    assert_reused(monkeypatch, "sparse24.gemm", run)


# --------------------------------------------------------------------------------------- decoder graph
@pytest.mark.parametrize("fault", FAULTS)
def test_decoder_graph(monkeypatch, capsys, fault, compile_error):
    from cast_llm.deploy.sparse24.decode import EagerRunner, StaticDecoder

    captures = []

    class Runner(EagerRunner):
        name = "manual"

        def capture(self, fn):
            captures.append(1)
            if fault == "raises":
                raise RuntimeError("injected: operation not permitted when stream is capturing")
            if fault == "compile":
                raise compile_error
            self.fn = fn

        def replay(self):
            out = self.fn().clone()
            bump(out, 3e-2)
            return out

    inject(monkeypatch, "sparse24.decode_graph", "manual", lambda: Runner)
    model = tiny.model("llama")
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))

    def run(runner):
        return StaticDecoder(model, batch_size=1, max_len=16, runner=runner).generate(ids, 6)

    got = run(Runner())
    assert_caught_once(capsys, "sparse24.decode_graph", "manual", fallback="reference")
    assert torch.equal(got, run(EagerRunner()))
    kernels.reset()
    assert torch.equal(run(Runner()), got) and len(captures) == 1  # cached: never captured again


# ------------------------------------------------------------------------------------------ the switch
def _correct_everywhere(monkeypatch, probes):
    """Every path with a correct candidate runnable on this CPU, counting probes."""
    for name, path in list(kernels.REGISTRY.items()):
        monkeypatch.setitem(kernels.REGISTRY, name, dataclasses.replace(
            path, probe=lambda *a, _n=name, **k: probes.append(_n) or kernels.Check(0.0, 1.0),
            candidates=tuple(dataclasses.replace(c, runs_on=lambda d: None) for c in path.candidates)))


@pytest.mark.parametrize("how", ["environment", "set_mode"])
def test_reference_forces_every_path_and_probes_nothing(monkeypatch, how):
    probes = []
    _correct_everywhere(monkeypatch, probes)
    if how == "environment":
        monkeypatch.setenv("CAST_LLM_KERNELS", "reference")
    else:
        kernels.set_mode("reference")
    for name, path in kernels.REGISTRY.items():
        for variant in path.variants(torch.device("cpu")):
            assert kernels.choose(name, "cpu", variant) == kernels.REFERENCE, name
    assert not probes
    assert {e["why_reference"] for entries in kernels.taken()["paths"].values() for e in entries} == {
        "CAST_LLM_KERNELS=reference (torch operations only)"}


def test_a_bad_switch_value_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("CAST_LLM_KERNELS", "fast")
    with pytest.raises(CastError, match=r"CAST_LLM_KERNELS must be one of auto, reference, got 'fast'"):
        kernels.mode()
    with pytest.raises(CastError, match="--kernels must be one of"):
        kernels.set_mode("turbo")


def test_train_kernels_reference_is_recorded_in_results(tmp_path):
    from cast_llm.cli import main

    tiny.save_model(tmp_path / "llama", "llama")
    tiny.write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "eval.txt").write_text(tiny.CORPUS)
    argv = ["train", "--model", str(tmp_path / "llama"), "--data", str(tmp_path / "corpus.jsonl"),
            "--output-dir", str(tmp_path / "run"), "--batch-size", "2", "--seq-len", "32", "--max-steps", "2",
            "--kd", "--no-progress", "--no-baseline-eval", "--val-sequences", "2", "--device", "cpu",
            "--wikitext-file", str(tmp_path / "eval.txt"), "--kernels", "reference", "--no-report"]
    assert main(argv) == 0
    taken = json.loads((tmp_path / "run" / "results.json").read_text())["kernels"]
    assert taken["mode"] == "reference"
    entries = [e for es in taken["paths"].values() for e in es]
    assert entries and all(e["took"] == "reference" for e in entries)
    assert {"adams.update", "kd.loss"} <= set(taken["paths"])
