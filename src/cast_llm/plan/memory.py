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

Under FSDP2's mixed-precision policy (``--fsdp`` in bf16, its default; :mod:`cast_llm.train.fsdp`) there
is no autocast and no whole-model copy: the unsharded parameters are bf16 (``2`` bytes, one block plus one
prefetched, and the root), each block's unsharded gradients bf16 then an fp32 reduce-scatter buffer, the
activations bf16 (the residual stream too), and the scaled weights are formed again in backward, one layer
at a time (:mod:`cast_llm.nn.recomputed_linear`; counted as one block's, an upper bound). Under ``--fsdp``
the weight scales ``A`` are whole on every GPU (``12·Ps`` with their moments, ``4·Ps`` gradient), not
sharded. Recomputation (``--activation-checkpointing``): ``full`` keeps each block's input, ``selective``
also its matmul and attention outputs (:mod:`cast_llm.plan.activations`); both keep one block's scaled
weights at a time.

The peak is the largest of the moments of a step: the end of the forward (activations, copies, logits),
the start of the backward (activations, copies, the logits' gradient, the head's gradient) and its end
(every gradient; with a tied embedding, its two gradient contributions while autograd sums them); with
recomputation two more, the last and the first block recomputed in backward (a block's full activations on
top of what the blocks still keep, and of the gradients formed by then). On a GPU
the verdict adds the CUDA context and a fragmentation margin (:data:`CUDA_CONTEXT`, :data:`FRAGMENTATION`),
which the allocator's own peak does not see; on a CPU the heap's retention of freed blocks
(:data:`CPU_RETENTION`).

The fragmentation margin is the ratio of the caching allocator's peak *reserved* to its peak *allocated*
bytes in published GPU runs (no GPU here: nothing on a CPU measures it — glibc's heap retention, which
``CPU_RETENTION`` covers, is another mechanism). Public runs that report both: 1.11 (pytorch/pytorch#40989,
16,726 / 15,006 MB and 19,354 / 17,402 MB), 1.38-1.50 (meta-llama/llama-cookbook#120: Llama-2-70B, FSDP1
pure bf16, 16 × A100: 58-63 / 42 GB), 1.01-1.05 (nanotron's public Llama-1B benchmark logs,
huggingface.co/nanotron/old_bench: peak_reserved / peak_allocated 26,100 / 25,707 and 27,166 / 25,808 MiB).
:data:`FRAGMENTATION` takes 1.20, inside that range: neither the best case nor FSDP1's worst;
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` lowers it (the allocator's documentation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cast_llm.plan.activations import activation_bytes
from cast_llm.plan.shapes import ModelShape

__all__ = ["Setup", "MemoryPlan", "plan_memory", "STRATEGIES", "CUDA_CONTEXT", "FRAGMENTATION",
           "FRAGMENTATION_SOURCE"]

STRATEGIES = ("single", "ddp", "fsdp")
# Not seen by torch.cuda.max_memory_allocated: the CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers
# (~0.5-1 GiB on an H100 with torch 2.x), and the caching allocator's reserved-but-unallocated blocks
CUDA_CONTEXT = int(1.0 * 2**30)
FRAGMENTATION = 0.20  # peak reserved / peak allocated − 1 of public GPU runs (module docstring: the sources)
FRAGMENTATION_SOURCE = ("reserved/allocated of public GPU runs: 1.01-1.05 (nanotron Llama-1B logs), 1.11 "
                        "(pytorch/pytorch#40989), 1.38-1.50 (llama-cookbook#120, 70B FSDP1); 1.20 taken. Not "
                        "measurable on a CPU (glibc heap retention is another mechanism)")
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
    activation_checkpointing: str = "none"  # none | selective | full (what is recomputed in backward)
    fsdp_precision: str = "policy"  # with fsdp in bf16: policy (FSDP2 MixedPrecisionPolicy) | autocast
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
        """bf16 training (the matmuls in bf16): autocast, or under FSDP2 its mixed-precision policy."""
        return self.precision == "bf16"

    @property
    def policy(self) -> bool:
        """FSDP2's MixedPrecisionPolicy runs (bf16 parameters, no autocast)."""
        return self.strategy == "fsdp" and self.precision == "bf16" and self.fsdp_precision == "policy"

    @property
    def recompute(self) -> str:
        mode = self.activation_checkpointing
        return {False: "none", True: "full"}.get(mode, mode)

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

    def largest_term(self) -> tuple[str, int]:
        """The largest single term (persistent or of the step; the framework's bytes aside) and its bytes."""
        terms = {k: v for k, v in {**self.persistent, **self.step}.items() if k != "framework"}
        name = max(terms, key=terms.get)
        return name, terms[name]

    def as_dict(self) -> dict:
        name, size = self.largest_term()
        margin = ({"fragmentation": FRAGMENTATION, "cuda_context": CUDA_CONTEXT, "source": FRAGMENTATION_SOURCE}
                  if self.setup.device == "cuda" else
                  {"cpu_heap_retention": CPU_RETENTION, "source": "measured: docs/results/plan-vs-measured.md"})
        return {"persistent": dict(self.persistent), "step": dict(self.step), "moments": dict(self.moments),
                "peak": self.peak, "peak_moment": self.peak_moment, "needed": self.needed(), "margin": margin,
                "largest_term": {"name": name, "bytes": size}, "notes": list(self.notes)}


def plan_memory(shape: ModelShape, setup: Setup) -> MemoryPlan:
    """Per-process memory of CAST on ``shape`` under ``setup`` (see the module docstring for each term)."""
    s = setup
    W = s.shards
    fsdp = s.strategy == "fsdp"
    scales = shape.target_rows * s.scale_groups if s.scaling else 0
    # under --fsdp the scales are whole on every GPU (train/fsdp.py); elsewhere every parameter is alike
    sharded, replicated = (shape.params, scales) if fsdp else (shape.params + scales, 0)
    N, V = s.tokens, shape.vocab
    c = 2 if s.autocast else 4  # bytes of the matmul dtype
    u = 2 if s.policy else 4  # bytes of FSDP2's unsharded parameters (bf16 under the policy, else fp32)
    logit = c  # the LM head's output dtype (accelerate's fp32 cast of outputs is undone: train/loop.py)
    t_logit = 2 if (s.autocast or s.teacher_bytes == 2) else 4
    mode = s.recompute
    plan = MemoryPlan(setup=s, shape=shape)
    if not shape.llama_like:
        plan.notes.append(f"activations are counted for LLaMA blocks; for model_type {shape.model_type} they "
                          "are an approximation (within ±50% on GPT-2 / OPT)")

    p = plan.persistent
    p["framework"] = s.framework
    p["weights (fp32 master)"] = 4 * sharded // W
    p["AdamS moments μ, v (fp32)"] = 8 * sharded // W
    if replicated:
        p["weight scales A + moments (fp32, whole per GPU)"] = 12 * replicated
    p["N:M masks" + (" (packed)" if s.packed_masks else " (bool)")] = (shape.target_params // 8 if s.packed_masks
                                                                     else shape.target_params) // W
    if s.kd:
        p[f"teacher ({'bf16' if s.teacher_bytes == 2 else 'fp32'})"] = s.teacher_bytes * shape.params // W
    grads = 4 * sharded // W + 4 * replicated
    if s.strategy == "ddp":
        p["DDP gradient buckets (= the gradients)"] = grads

    # ---- the step
    st = plan.step
    acts = activation_bytes(shape, autocast=s.autocast, seq_len=s.seq_len, bf16_params=s.policy)
    st["activations (student" + ("" if mode == "none" else f", {mode} recomputation") + ")"] = \
        acts.total(N, shape.layers, checkpointing=mode)
    # copies of weights that the matmuls read, whole on every process (not sharded)
    # (with --fused-head the head's weight is cast inside the loss, not by autocast: counted there)
    non_target_linear = shape.linear_params - shape.target_params - (shape.head_params if s.fused_head else 0)
    if s.scaling:
        if s.policy:  # formed again in backward, one layer at a time (counted as a block's: an upper bound)
            st["scaled weights Diag(A)·W (recomputed, one block)"] = c * shape.target_block_params
        elif mode != "none":
            st["scaled weights Diag(A)·W (one block)"] = c * shape.target_block_params
        else:
            st["scaled weights Diag(A)·W"] = c * shape.target_params
        if s.autocast and not s.policy:
            st["bf16 casts of the other linears (autocast cache)"] = 2 * non_target_linear
    elif s.autocast and not s.policy:
        st["bf16 casts of the linears (autocast cache)"] = 2 * shape.linear_params
    chunk = min(s.kd_chunk_size, N)
    # the loss's fp32 work space: ~3 chunk × V rows for the chunked KD loss over whole logits, 1 for CE; the fused
    # head, whose chunk's logits and gradient are counted below, holds 1 row beyond them with CE and 2 with KD on its
    # eager path (1 on the compiled chunk, where torch.compile runs: counted as the eager path, the bound), measured
    # warm in fp32 (benchmarks/dev/fused_head_rows.py, tests/test_head_loss.py: 3 rows with CE, 5 / 4 with KD); the
    # plan had counted 3 for KD, and the 16k runs with KD measured 0.83-0.87 of it
    work = ((2 if s.kd else 1) if s.fused_head else (3 if s.kd else 1)) * chunk * V * 4
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
    fsdp_root = fsdp_blocks = block_grads = 0
    if fsdp:
        prec = "bf16" if s.policy else "fp32"
        fsdp_root = u * shape.root_params  # the root stays unsharded through forward and backward
        fsdp_blocks = 2 * u * shape.block_params  # the block computing and the one prefetched
        # a block's unsharded gradients (in the parameters' dtype) and, under the policy, the fp32 buffer
        # they are copied into for the reduce-scatter
        block_grads = u * shape.block_params + (4 * shape.block_params if s.policy else 0)
        st[f"FSDP2 unsharded root (embeddings, head; {prec})"] = fsdp_root
        st[f"FSDP2 unsharded blocks (2; {prec})"] = fsdp_blocks
        st["FSDP2 block gradients (" + ("bf16 + fp32 reduce buffer)" if s.policy else "fp32)")] = block_grads
        if s.kd:
            st["FSDP2 unsharded teacher blocks (2)"] = 2 * min(s.teacher_bytes, u) * shape.block_params

    static = sum(p.values())
    copies = sum(v for k, v in st.items() if k.startswith(("scaled weights", "bf16 casts")))
    act = next(v for k, v in st.items() if k.startswith("activations (student"))
    # with recomputation, the block being recomputed holds its full activations only during its own backward,
    # after the loss's buffers are gone: a moment of its own, not part of the others
    recomputed = N * acts.per_block if mode != "none" else 0
    act -= recomputed
    acc_grads = grads if (s.grad_accum > 1 and s.strategy != "ddp") else 0  # DDP's are in `static` already
    head_grad = 0 if (acc_grads or s.strategy == "ddp") else 4 * shape.head_params
    # FSDP2 at each moment: the student's root stays unsharded from its forward to the end of its backward;
    # its blocks are unsharded one (plus one prefetched) at a time, in the forward while few activations
    # exist and again from the start of the backward; the teacher's blocks and root only during its forward,
    # which ends before the loss's logits and work space exist
    teacher_fsdp = st.get("FSDP2 unsharded teacher blocks (2)", 0) + (min(s.teacher_bytes, u) * shape.root_params
                                                                      if fsdp and s.kd else 0)
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
        # backward begins with the logits' gradient and the LM head's (bf16: formed in bf16, then cast)
        bwd_start_extra = st["loss gradient buffer (logits-sized)"] + (2 * shape.head_params if s.autocast else 0)
    m = plan.moments
    m["end of forward"] = static + act + copies + fwd_tail + acc_grads + fsdp_root
    m["start of backward"] = (static + act + copies + bwd_start_extra + head_grad + acc_grads + fsdp_root
                              + fsdp_blocks + block_grads)
    if recomputed:  # the block recomputed holds its full activations; between the last block (every block's
        # kept tensors, the head's gradient) and the first (one block's kept tensors, nearly every gradient)
        # the sum is linear in the block's index: the two ends bound it
        fsdp_bwd = fsdp_root + fsdp_blocks + block_grads
        hidden_grad = 4 * N * shape.hidden
        m["recomputing the last block in backward"] = (static + act + recomputed + copies + 4 * shape.head_params
                                                       + hidden_grad + acc_grads + fsdp_bwd)
        kept = acts.block_input if mode == "full" else acts.selective_block
        all_grads = acc_grads or (0 if s.strategy == "ddp" else grads)
        m["recomputing the first block in backward"] = (static + N * kept + recomputed + copies + all_grads
                                                        + hidden_grad + fsdp_bwd)
    # a tied head/embedding weight: autograd holds the head's and the embedding's gradient contributions
    # until it has summed them into a third tensor (measured: docs/results/plan-vs-measured.md)
    tied_extra = 2 * (u if fsdp else 4) * shape.head_params if shape.tied else 0
    fsdp_end = 2 * fsdp_root if fsdp else 0  # root parameters and their unsharded gradients
    m["end of backward"] = static + (0 if s.strategy == "ddp" else grads) + tied_extra + fsdp_end
    return plan
