"""The trainer's teacher forward (distill/teacher.py): inference_mode without KV cache, and the CUDA-graph
replay with its fallbacks — the graph logic driven on CPU with a fake capture, the real capture on CUDA."""

from __future__ import annotations

import pytest
import tiny
import torch

import cast_llm.distill.teacher as teacher_mod
from cast_llm.distill import causal_kd_loss
from cast_llm.distill.teacher import MAX_GRAPHS, TeacherForward


@pytest.fixture(scope="module")
def model():
    return tiny.model("llama").requires_grad_(False)


def _ids(batch=2, seq=9, seed=0):
    return torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_eager_forward_is_inference_mode_without_cache_and_feeds_the_kd_loss(model, monkeypatch):
    monkeypatch.setattr(TeacherForward, "graph_device", "cpu")
    monkeypatch.setattr(teacher_mod._Graph, "capture", lambda *a: pytest.fail("graphs are off by default"))
    ids = _ids()
    tf = TeacherForward(model)
    logits = tf(ids)
    assert tf.mode == "eager" and logits.is_inference()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert torch.equal(logits, want)
    student = want.clone().requires_grad_(True)  # the KD loss takes the inference tensor as the teacher
    causal_kd_loss(student * 1.5, logits, ids, eta=0.5).loss.backward()
    assert student.grad is not None and torch.isfinite(student.grad).all()


def test_sharded_teacher_runs_under_no_grad_and_never_graphs(model, monkeypatch):
    monkeypatch.setattr(TeacherForward, "graph_device", "cpu")
    monkeypatch.setattr(teacher_mod._Graph, "capture", lambda *a: pytest.fail("a sharded teacher must not capture"))
    tf = TeacherForward(model, cuda_graph=True, sharded=True)
    out = tf(_ids())
    assert not out.is_inference() and not out.requires_grad and tf.mode == "eager"


class _FakeGraph:
    """Stands in for a captured graph on CPU: replays the eager forward into a fixed output buffer."""

    captured: list[tuple] = []

    def __init__(self, forward, example, corrupt=False):
        self.forward, self.corrupt = forward, corrupt
        self.static_out = forward(example).clone()

    @classmethod
    def capture(cls, forward, example):
        cls.captured.append(tuple(example.shape))
        return cls(forward, example)

    def run(self, input_ids):
        self.static_out.copy_(self.forward(input_ids) + (100.0 if self.corrupt else 0.0))
        return self.static_out


def test_graph_is_captured_once_per_shape_and_replayed(model, monkeypatch):
    monkeypatch.setattr(TeacherForward, "graph_device", "cpu")
    monkeypatch.setattr(teacher_mod, "_Graph", _FakeGraph)
    _FakeGraph.captured = []
    said = []
    tf = TeacherForward(model, cuda_graph=True, say=said.append)
    a, b = tf(_ids(seed=0)), tf(_ids(seed=1))
    assert a is b  # the same static buffer, rewritten by every replay
    assert tf.mode == "cuda-graph" and _FakeGraph.captured == [(2, 9)]
    with torch.no_grad():
        assert torch.equal(b, model(input_ids=_ids(seed=1)).logits)
    shapes = [(1, 9), (2, 5), (3, 4)]
    for bs, seq in shapes:
        tf(_ids(bs, seq))
    # up to MAX_GRAPHS shapes get a graph; the others run eagerly, and nothing is said
    assert len(_FakeGraph.captured) == MAX_GRAPHS and len(tf.graphs) == MAX_GRAPHS and not said


@pytest.mark.parametrize("failure", ["capture raises", "replay differs"])
def test_a_failed_capture_or_check_switches_graphs_off_and_says_why(model, monkeypatch, failure):
    monkeypatch.setattr(TeacherForward, "graph_device", "cpu")

    class Broken(_FakeGraph):
        @classmethod
        def capture(cls, forward, example):
            if failure == "capture raises":
                raise RuntimeError("operation not permitted when stream is capturing\nmore lines")
            return cls(forward, example, corrupt=True)

    monkeypatch.setattr(teacher_mod, "_Graph", Broken)
    said = []
    tf = TeacherForward(model, cuda_graph=True, say=said.append)
    ids = _ids()
    out = tf(ids)
    with torch.no_grad():
        assert torch.equal(out, model(input_ids=ids).logits)  # eager, the same numbers
    tf(ids)
    assert len(said) == 1 and "CUDA graph off" in said[0] and not tf.graphs
    expected = "not permitted" if failure == "capture raises" else "differ from eager"
    assert expected in tf.off_reason and tf.mode.startswith("eager (")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_the_eager_forward_under_autocast():
    m = tiny.model("llama").cuda().to(torch.bfloat16).requires_grad_(False)
    said = []
    tf = TeacherForward(m, cuda_graph=True, say=said.append)
    for seed in range(3):
        ids = _ids(seed=seed).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = tf(ids).clone()
            want = tf.eager(ids)
        assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    assert tf.mode == "cuda-graph", (tf.mode, said)
