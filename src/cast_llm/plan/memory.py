"""Memory per process (per GPU) of a ``cast-llm train`` run, term by term, from the model's shape alone.

What a CAST step holds (P parameters, Pt of them N:M targets, Ps weight-scale entries, W processes that
shard under FSDP2, N tokens per micro-batch, V the vocabulary):

* **persistent** — fp32 master weights ``4(P+Ps)``, AdamS's moments μ, v ``8(P+Ps)`` (every parameter has
  both: the dense groups are plain Adam), the N:M masks ``Pt`` bytes (bool; ``Pt/8`` packed), the frozen
  teacher ``2P`` (bf16) or ``4P``; all divided by W under FSDP2. DDP keeps the fp32 gradients in its
  communication buckets for the whole run (``gradient_as_bucket_view``: the gradients are views of them).
* **the step** — the gradients ``4(P+Ps)`` (from the first backward to ``zero_grad``); the activations
  (:mod:`cast_llm.plan.activations`); the copies of the weights the matmuls read: under bf16 autocast a bf16
  cast of every Linear weight that autocast caches for the whole forward+backward, and with weight scaling
  the products ``Diag(A)·W`` that the matmuls save (bf16 under autocast, fp32 otherwise) — per GPU these are
  *whole*, FSDP2 does not shard them, and activation checkpointing keeps only one block's products; the
  logits of student and teacher ``N·V`` each, the KD gradient buffer ``N·V`` and ``3·chunk·V`` fp32 of KD
  work space (:mod:`cast_llm.distill`); with ``--fused-head`` only one chunk of logits exists at a time,
  plus the LM head's fp32 gradient formed during the forward. FSDP2 adds the unsharded parameters: the root
  (embeddings, head) for the whole step, two blocks at a time (one prefetched), and their gradients.

The peak is the largest of three moments of a step: the end of the forward (activations, copies, logits),
the start of the backward (activations, copies, the logits' gradient, the head's gradient) and its end
(every gradient; with a tied embedding, its two gradient contributions while autograd sums them). On a GPU
the verdict adds the CUDA context and a fragmentation margin (:data:`CUDA_CONTEXT`, :data:`FRAGMENTATION`),
which the allocator's own peak does not see; on a CPU the heap's retention of freed blocks
(:data:`CPU_RETENTION`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cast_llm.plan.activations import activation_bytes
from cast_llm.plan.shapes import ModelShape

__all__ = ["Setup", "MemoryPlan", "plan_memory", "STRATEGIES", "CUDA_CONTEXT", "FRAGMENTATION"]

STRATEGIES = ("single", "ddp", "fsdp")
# Not seen by torch.cuda.max_memory_allocated: the CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers
# (~0.5-1 GiB on an H100 with torch 2.x), and the caching allocator's unused blocks (a few % of the peak).
CUDA_CONTEXT = int(1.0 * 2**30)
FRAGMENTATION = 0.08
# On a CPU, glibc keeps part of the freed mid-sized blocks (below its mmap threshold) in its heap: the peak
# resident set measured 2-30% above the plan (the most with FSDP2 over gloo; docs/results/plan-vs-measured.md)
CPU_RETENTION = 0.30


@dataclass(frozen=True)
class Setup:
    """A run as the memory plan sees it (one process = one GPU)."""

    device: str = "cuda"  # cuda | cpu
    world: int = 1  # processes
    strategy: str = "single"  # single | ddp | fsdp
    precision: str = "bf16"  # bf16 (autocast, fp32 master weights) | fp32
    batch_size: int = 1  # sequences per micro-batch per process
    grad_accum: int = 1
    seq_len: int = 4096
    kd: bool = True
    scaling: bool = True
    scale_groups: int = 2
    activation_checkpointing: bool = False
    teacher_dtype: str = "auto"  # auto (= the training dtype) | bf16 | fp32
    fused_head: bool = False
    kd_chunk_size: int = 1024
    packed_masks: bool = False
    framework: int = 0  # bytes the process holds before the model (CPU: the interpreter and libraries)

    @property
    def shards(self) -> int:
        return self.world if self.strategy == "fsdp" else 1

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def autocast(self) -> bool:
        return self.precision == "bf16"

    @property
    def teacher_bytes(self) -> int:
        if self.teacher_dtype == "auto":
            return 2 if self.autocast else 4
        return 2 if self.teacher_dtype == "bf16" else 4


@dataclass
class MemoryPlan:
    """The per-process figures of :func:`plan_memory`, in bytes."""

    setup: Setup
    shape: ModelShape | None = None
    persistent: dict[str, int] = field(default_factory=dict)  # alive for the whole run
    step: dict[str, int] = field(default_factory=dict)  # the step's terms (each at its own largest)
    moments: dict[str, int] = field(default_factory=dict)  # the three candidate peaks of a step
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.moments.values())

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.moments.get)

    def needed(self) -> int:
        """What the device must hold: the peak, plus on a GPU the context and the fragmentation margin."""
        if self.setup.device == "cuda":
            return int(self.peak * (1 + FRAGMENTATION)) + CUDA_CONTEXT
        return int(self.peak * (1 + CPU_RETENTION))

    def fits(self, capacity: int) -> bool:
        return self.needed() <= capacity

    def as_dict(self) -> dict:
        return {"persistent": dict(self.persistent), "step": dict(self.step), "moments": dict(self.moments),
                "peak": self.peak, "peak_moment": self.peak_moment, "needed": self.needed(), "notes": list(self.notes)}


def plan_memory(shape: ModelShape, setup: Setup) -> MemoryPlan:
    """Per-process memory of CAST on ``shape`` under ``setup`` (see the module docstring for each term)."""
    s = setup
    W = s.shards
    scales = shape.target_rows * s.scale_groups if s.scaling else 0
    trainable = shape.params + scales
    N, V = s.tokens, shape.vocab
    c = 2 if s.autocast else 4  # bytes of the matmul dtype
    logit = c  # the LM head's output dtype (accelerate's fp32 cast of outputs is undone: train/loop.py)
    t_logit = 2 if (s.autocast or s.teacher_bytes == 2) else 4
    plan = MemoryPlan(setup=s, shape=shape)
    if not shape.llama_like:
        plan.notes.append(f"activations are counted for LLaMA blocks; for model_type {shape.model_type} they "
                          "are an approximation (within ±50% on GPT-2 / OPT)")

    p = plan.persistent
    p["framework"] = s.framework
    p["weights (fp32 master)"] = 4 * trainable // W
    p["AdamS moments μ, v (fp32)"] = 8 * trainable // W
    p["N:M masks" + (" (packed)" if s.packed_masks else " (bool)")] = (shape.target_params // 8 if s.packed_masks
                                                                     else shape.target_params) // W
    if s.kd:
        p[f"teacher ({'bf16' if s.teacher_bytes == 2 else 'fp32'})"] = s.teacher_bytes * shape.params // W
    grads = 4 * trainable // W
    if s.strategy == "ddp":
        p["DDP gradient buckets (= the gradients)"] = grads

    # ---- the step
    st = plan.step
    acts = activation_bytes(shape, autocast=s.autocast, seq_len=s.seq_len)
    st["activations (student)"] = acts.total(N, shape.layers, checkpointing=s.activation_checkpointing)
    # copies of weights that the matmuls read, whole on every process (not sharded)
    # (with --fused-head the head's weight is cast inside the loss, not by autocast: counted there)
    non_target_linear = shape.linear_params - shape.target_params - (shape.head_params if s.fused_head else 0)
    if s.scaling:
        per = shape.target_block_params if s.activation_checkpointing else shape.target_params
        st["scaled weights Diag(A)·W" + (" (one block)" if s.activation_checkpointing else "")] = c * per
        if s.autocast:
            st["bf16 casts of the other linears (autocast cache)"] = 2 * non_target_linear
    elif s.autocast:
        st["bf16 casts of the linears (autocast cache)"] = 2 * shape.linear_params
    chunk = min(s.kd_chunk_size, N)
    work = (3 if s.kd else 1) * chunk * V * 4
    if s.fused_head:
        st["logits, one chunk (student" + (", teacher" if s.kd else "") + ", gradient)"] = \
            chunk * V * (2 * logit + (t_logit if s.kd else 0))
        # the head's fp32 gradient, formed chunk by chunk in the forward; under autocast also the head's bf16
        # copy and one chunk's bf16 product ∂L/∂W before it is summed in
        st["LM head gradient formed in the forward (fp32)"] = (4 + (4 if s.autocast else 0)) * shape.head_params
        st["hidden-state gradient (fp32)"] = 4 * N * shape.hidden
        if s.kd:
            st["teacher hidden states"] = N * shape.hidden * t_logit
    else:
        st["student logits"] = N * V * logit
        if s.kd:
            st["teacher logits"] = N * V * t_logit
        st["loss gradient buffer (logits-sized)"] = N * V * logit
    st["KD loss work space" if s.kd else "loss work space"] = work
    if s.kd:  # the teacher's largest temporaries inside one block (no graph: nothing is kept)
        st["teacher forward temporaries"] = N * (3 * shape.intermediate + 2 * shape.hidden) * s.teacher_bytes
    if s.strategy == "ddp":  # the gradients ARE the buckets counted above: listed here, not added twice
        st["gradients (fp32; the DDP buckets above, counted once)"] = grads
    else:
        st["gradients (fp32)"] = grads
    fsdp_root = fsdp_blocks = 0
    if s.strategy == "fsdp":
        fsdp_root = 4 * shape.root_params  # the root stays unsharded through forward and backward
        fsdp_blocks = 2 * 4 * shape.block_params  # the block computing and the one prefetched
        st["FSDP2 unsharded root (embeddings, head)"] = fsdp_root
        st["FSDP2 unsharded blocks (2)"] = fsdp_blocks
        if s.kd:
            st["FSDP2 unsharded teacher blocks (2)"] = 2 * s.teacher_bytes * shape.block_params

    static = sum(p.values())
    copies = sum(v for k, v in st.items() if k.startswith(("scaled weights", "bf16 casts")))
    act = st["activations (student)"]
    acc_grads = grads if (s.grad_accum > 1 and s.strategy != "ddp") else 0  # DDP's are in `static` already
    head_grad = 0 if (acc_grads or s.strategy == "ddp") else 4 * shape.head_params
    # FSDP2 at each moment: the student's root stays unsharded from its forward to the end of its backward;
    # its blocks are unsharded one (plus one prefetched) at a time, in the forward while few activations
    # exist and again from the start of the backward; the teacher's blocks and root only during its forward,
    # which ends before the loss's logits and work space exist
    teacher_fsdp = st.get("FSDP2 unsharded teacher blocks (2)", 0) + (s.teacher_bytes * shape.root_params
                                                                      if s.strategy == "fsdp" and s.kd else 0)
    teacher_fwd = st.get("teacher forward temporaries", 0) + teacher_fsdp
    if s.fused_head:  # the loss: a chunk of logits, work space, and the gradients it forms for the backward
        loss_phase = (st[next(k for k in st if k.startswith("logits, one chunk"))] + work
                      + st["LM head gradient formed in the forward (fp32)"] + st["hidden-state gradient (fp32)"]
                      + st.get("teacher hidden states", 0))
        fwd_tail = max(teacher_fwd, loss_phase)
        bwd_start_extra = st["LM head gradient formed in the forward (fp32)"] + st["hidden-state gradient (fp32)"]
        head_grad = 0
    else:  # the student's logits, then the teacher's forward, then its logits, the gradient buffer, work space
        loss_phase = st.get("teacher logits", 0) + st["loss gradient buffer (logits-sized)"] + work
        fwd_tail = st["student logits"] + max(teacher_fwd, loss_phase)
        # backward begins with the logits' gradient and the LM head's (autocast: formed in bf16, then cast)
        bwd_start_extra = st["loss gradient buffer (logits-sized)"] + (2 * shape.head_params if s.autocast else 0)
    m = plan.moments
    m["end of forward"] = static + act + copies + fwd_tail + acc_grads + fsdp_root
    m["start of backward"] = (static + act + copies + bwd_start_extra + head_grad + acc_grads + fsdp_root
                              + fsdp_blocks + fsdp_blocks // 2)  # + one block's unsharded gradients
    # a tied head/embedding weight: autograd holds the head's and the embedding's gradient contributions
    # until it has summed them into a third tensor (measured: docs/results/plan-vs-measured.md)
    tied_extra = 2 * 4 * shape.head_params if shape.tied else 0
    fsdp_end = 2 * fsdp_root if s.strategy == "fsdp" else 0  # root parameters and their unsharded gradients
    m["end of backward"] = static + (0 if s.strategy == "ddp" else grads) + tied_extra + fsdp_end
    return plan

