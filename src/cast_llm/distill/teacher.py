"""The frozen teacher's forward of Eq. 13 (``P_t``): no autograd state, no KV cache, and on CUDA a graph replay.

The teacher is a constant: its forward needs no autograd graph and no version counters (``inference_mode``)
and no KV cache (``use_cache=False``). On a GPU the forward of a small model can be bound by the host — a
SmolLM2-135M forward launches ~1,500 kernels — so with ``cuda_graph=True`` (``--teacher-cuda-graph``) the
teacher's forward is captured once in a CUDA graph and replayed at every step: one launch, no Python. Its
batches have one shape for the whole run (a few shapes at most: each gets its own graph, up to
``MAX_GRAPHS``; others run eagerly).

Off by default, until a GPU measurement says it pays (``benchmarks/train_step.py`` times both): while a
stream is capturing, transformers (5.2x) skips its packed-sequence check (a host read) and builds an explicit
causal mask, so the graphed attention runs SDPA with a mask instead of ``is_causal`` (no flash kernel) — less
host time, possibly more GPU time. Versions of transformers that make the host read during capture fail the
capture, and the teacher runs eagerly (see below).

Safety: the graph is the in-situ checked kernel path ``teacher.cuda_graph`` (:mod:`cast_llm.kernels`). The
capture runs the forward twice on a side stream first (lazy initialisation, cuBLAS handles), and the first
replay is compared with an eager forward on the same batch; any exception during capture or a mismatch
switches graphs off for the rest of the run (said once, through ``say``) and the teacher runs eagerly — the
results are the same either way, only slower. The verdict is kept per GPU, driver, library versions, model
class, transformers version and dtypes: a model whose capture failed here is not captured again in later runs
(said once), and ``CAST_LLM_KERNELS=reference`` never captures. A graph's output buffer is rewritten by the
next replay: use the logits before the next teacher call (the training loop does: the KD loss consumes
them). FSDP2-sharded teachers (collectives, all-gather buffers) always run eagerly, under ``no_grad``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata

import torch
from torch import Tensor

from cast_llm import kernels

__all__ = ["TeacherForward", "MAX_GRAPHS", "no_packed_sequence_check"]

MAX_GRAPHS = 2  # batch shapes with their own graph (a run has one; a last short batch would be a second)
WARMUP = 2  # eager forwards on the side stream before the capture
MATCH_REL = 1e-2  # max |replay − eager| / max |eager|: bf16 noise passes, a stale or garbage buffer does not


class TeacherForward:
    """``TeacherForward(teacher)(input_ids)`` → the teacher's logits (see the module docstring).

    ``cuda_graph``: capture and replay on CUDA (ignored elsewhere); ``sharded``: an FSDP2 teacher (eager,
    ``no_grad``); ``say``: where the one-line notice goes when graphs are switched off.
    """

    def __init__(self, teacher: torch.nn.Module, *, cuda_graph: bool = False, sharded: bool = False, say=None):
        self.teacher = teacher
        self.sharded = sharded
        self.cuda_graph = cuda_graph and not sharded
        self.say = say or (lambda *a, **k: None)
        self.graphs: dict[tuple, _Graph] = {}
        self.off_reason: str | None = None  # why graphs were switched off (None: on, or never tried)

    def eager(self, input_ids: Tensor) -> Tensor:
        with torch.no_grad() if self.sharded else torch.inference_mode(), no_packed_sequence_check():
            return self.teacher(input_ids=input_ids, use_cache=False).logits

    graph_device = "cuda"  # the device type whose forwards are captured (tests drive the logic on "cpu")

    def __call__(self, input_ids: Tensor) -> Tensor:
        if self.cuda_graph and self.off_reason is None and input_ids.device.type == self.graph_device:
            key = _key(input_ids)
            graph = self.graphs.get(key)
            if graph is None and len(self.graphs) < MAX_GRAPHS and self._allowed(input_ids):
                graph = self._capture(input_ids, key)
            if graph is not None:
                return graph.run(input_ids)
        return self.eager(input_ids)

    def _variant(self, input_ids: Tensor) -> tuple:
        device = input_ids.device.type
        p = next(self.teacher.parameters())
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else "no autocast"
        try:
            transformers = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            transformers = None
        return (type(self.teacher).__name__, f"transformers {transformers}", p.dtype, autocast)

    def _allowed(self, input_ids: Tensor) -> bool:
        """Whether the checked path lets this teacher be captured (not --kernels reference, not failed here)."""
        choice = kernels.choose(TEACHER_GRAPH.name, input_ids.device, self._variant(input_ids))
        if choice == kernels.REFERENCE:
            self.off_reason = kernels.why_not(TEACHER_GRAPH.name, input_ids.device, self._variant(input_ids))
            return False
        return True

    @property
    def mode(self) -> str:
        """What runs the teacher: ``cuda-graph``, ``eager`` or ``eager (why graphs are off)``."""
        if self.off_reason is not None:
            return f"eager ({self.off_reason})"
        return "cuda-graph" if self.graphs else "eager"

    def _capture(self, input_ids: Tensor, key: tuple) -> _Graph | None:
        variant = self._variant(input_ids)
        check = None
        try:
            graph = kernels.implementation(TEACHER_GRAPH.name, "cuda-graph").capture(self.eager, input_ids)
            got = graph.run(input_ids).float()
            want = self.eager(input_ids).float()
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
            check = kernels.Check(err, MATCH_REL)
            if not check.ok:  # (NaN fails too)
                raise RuntimeError(f"the graph's logits differ from eager ones: max |Δ| = {err:.3g} of max |logit|")
        except Exception as e:  # capture is an optimisation: any failure leaves the eager forward
            self.off_reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}".rstrip(": ")
            self.graphs.clear()
            kernels.record(TEACHER_GRAPH.name, input_ids.device, variant, "cuda-graph", self.off_reason,
                           announce=False)
            self.say(f"teacher: CUDA graph off, the teacher runs eagerly ({self.off_reason})")
            return None
        kernels.record(TEACHER_GRAPH.name, input_ids.device, variant, "cuda-graph", None, check)
        self.graphs[key] = graph
        return graph


@contextlib.contextmanager
def no_packed_sequence_check():
    """transformers (5.x) looks for several sequences packed into one row whenever a forward has neither a KV
    cache nor an attention mask — the teacher's case, the student's in training and every scored window's —
    and that check reads the device on the host (``masking_utils.find_packed_sequence_indices``: ``.all()`` of
    a device tensor), once per forward. Our forwards pass ``input_ids`` only, so the positions are 0..T-1 in
    every row and the check can only answer "not packed" (None): inside this context it is answered without
    the read. Where transformers has no such function, nothing changes."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - an older transformers: no packed-sequence logic at all
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _not_packed(position_ids):
    return None


def _key(input_ids: Tensor) -> tuple:
    device = input_ids.device.type
    return (tuple(input_ids.shape), input_ids.dtype, input_ids.device, torch.is_autocast_enabled(device),
            torch.get_autocast_dtype(device))


class _Graph:
    """One captured forward: a static input buffer, the graph, its static output."""

    def __init__(self, graph, static_in: Tensor, static_out: Tensor):
        self.graph, self.static_in, self.static_out = graph, static_in, static_out

    @classmethod
    def capture(cls, forward, example: Tensor) -> _Graph:
        static_in = example.clone()
        main = torch.cuda.current_stream(example.device)
        side = torch.cuda.Stream(device=example.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                forward(static_in)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = forward(static_in)
        return cls(graph, static_in, static_out)

    def run(self, input_ids: Tensor) -> Tensor:
        self.static_in.copy_(input_ids)
        self.graph.replay()
        return self.static_out


def _probe(impl, device: torch.device, variant: tuple) -> kernels.Check:
    """``cast-llm doctor``'s check: a tiny random LLaMA's forward captured and replayed against eager."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)
    tf = TeacherForward(model)
    ids = torch.randint(0, 256, (2, 32), device=device)
    graph = impl.capture(tf.eager, ids)
    got = graph.run(ids).float()
    want = tf.eager(ids).float()
    return kernels.Check(float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)), MATCH_REL)


TEACHER_GRAPH = kernels.register(kernels.CheckedPath(
    name="teacher.cuda_graph",
    what="the frozen teacher's forward replayed as one CUDA graph (distill/teacher.py, --teacher-cuda-graph)",
    reference="the eager forward on the same batch",
    measure="max |Δ logit| / max |logit|",
    candidates=(kernels.Candidate(
        "cuda-graph", lambda: _Graph,
        lambda d: None if d.type == TeacherForward.graph_device else "CUDA graphs capture CUDA work only"),),
    probe=_probe, in_situ=True,
    variants=lambda device: [("LlamaForCausalLM", "tiny random", torch.bfloat16, "no autocast")],
))
