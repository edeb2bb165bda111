"""How long a run takes: tokens ÷ throughput, the throughput measured (``--tokens-per-s``) or estimated.

The estimate has two parts per optimizer step, per GPU:

* **compute** — the matmul FLOPs of the step (the usual ``6·P`` per token of a forward + backward over the
  non-embedding weights, plus causal attention ``6·L·seq·q`` at half the square; the teacher's forward
  ``2·P`` + attention with KD; a second student forward with ``--activation-checkpointing full``; nothing
  for ``selective``, which recomputes only the cheap operators) at the GPU's peak × a model-FLOPs
  utilisation. :data:`ASSUMED_MFU` is calibrated on a published measurement of plain FSDP2 training on
  H100s (torchtitan, Llama-3.1-8B on 8 GPUs: docs/training.md, "Large models", has the settings): with this
  FLOP count, 0.30 reproduces its 5,762 tokens/s per GPU (``tests/test_plan.py``).
* **communication** — the bytes each GPU receives per step (:func:`comm_bytes`): under FSDP2 every
  micro-batch all-gathers the student's parameters twice (forward; backward, the root excepted) in the
  policy's bf16 (fp32 under autocast), reduce-scatters its gradients in fp32, all-gathers the teacher once,
  and every step all-reduces the replicated weight scales' gradients; DDP all-reduces the fp32 gradients
  once per step. Ring collectives: a GPU receives ``(W−1)/W`` of the whole for an all-gather or a
  reduce-scatter, twice that for an all-reduce. Over the interconnect the user names (:data:`INTERCONNECTS`,
  nominal per-GPU bandwidths; NCCL reaches less than nominal, so this part is optimistic).

FSDP2 prefetches the next block's all-gather and overlaps the reduce-scatters with the backward, and the
published runs the MFU comes from overlapped theirs on NVLink, so a step takes ``max(compute,
communication)`` plus what cannot overlap: the first all-gather of a micro-batch (root and first block)
and its last reduce-scatter (one block). A measured ``--tokens-per-s`` from a short run of the same
configuration (``metrics.jsonl``) replaces all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cast_llm.errors import CastError
from cast_llm.plan.memory import Setup
from cast_llm.plan.shapes import ModelShape

__all__ = ["TimePlan", "flops_per_token", "comm_bytes", "plan_time", "interconnect", "H100_BF16_TFLOPS",
           "ASSUMED_MFU", "INTERCONNECTS"]

H100_BF16_TFLOPS = 989.0  # H100 SXM dense bf16 peak (the default of --gpu-tflops)
# tokens/s per GPU × flops_per_token(plain FSDP2 step) / 989e12 for torchtitan's Llama-3.1-8B, 8 × H100,
# FSDP2 eager, bf16, seq 8192, local batch 2, selective recomputation: 5,762 × 51.5e9 / 989e12 = 0.30
ASSUMED_MFU = 0.30
# --interconnect: nominal bandwidth per GPU and direction (bytes/s), and what it stands for
INTERCONNECTS = {
    "nvlink": (450e9, "NVLink 4 within an H100 SXM node: 900 GB/s per GPU both directions together"),
    "ib": (50e9, "InfiniBand NDR, one 400 Gb/s NIC per GPU (DGX H100; torchtitan's platform: 400 Gb/s per GPU)"),
    "ethernet": (12.5e9, "100 Gb/s Ethernet (RoCE) per GPU"),
}


def interconnect(name: str, gpus: int, gpus_per_node: int) -> str:
    """The interconnect a run's collectives cross: ``auto`` is NVLink within one node, InfiniBand across
    nodes; NVLink named for more GPUs than a node holds is refused (the ring crosses the network)."""
    if name == "auto":
        return "nvlink" if gpus <= gpus_per_node else "ib"
    if name not in INTERCONNECTS:
        raise CastError(f"--interconnect must be one of auto, {', '.join(INTERCONNECTS)}, got {name!r}")
    if name == "nvlink" and gpus > gpus_per_node:
        raise CastError(f"--interconnect nvlink joins the GPUs of one node ({gpus_per_node}, --gpus-per-node); "
                        f"{gpus} GPUs talk over the network: name it (--interconnect ib or ethernet)")
    return name


@dataclass
class TimePlan:
    tokens: int
    tokens_per_s: float  # over all processes
    measured: bool  # True: the user's figure; False: the estimate
    flops_per_token: float
    steps: int
    compute_s: float = 0.0  # per optimizer step (estimate only)
    comm_s: float = 0.0  # per optimizer step at the interconnect's bandwidth
    exposed_s: float = 0.0  # communication that cannot overlap the compute
    comm: dict = field(default_factory=dict)  # bytes received per GPU and step, by collective
    interconnect: str = ""
    bandwidth: float = 0.0  # bytes/s per GPU

    @property
    def seconds(self) -> float:
        return self.tokens / self.tokens_per_s

    @property
    def comm_bytes(self) -> int:
        return sum(self.comm.values())

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "measured": self.measured,
                "flops_per_token": self.flops_per_token, "steps": self.steps, "seconds": self.seconds,
                "compute_s_per_step": self.compute_s,
                "communication": {"interconnect": self.interconnect, "bytes_per_s_per_gpu": self.bandwidth,
                                  "bytes_per_gpu_per_step": dict(self.comm), "total_bytes": self.comm_bytes,
                                  "seconds_per_step": self.comm_s, "exposed_seconds_per_step": self.exposed_s,
                                  "source": INTERCONNECTS[self.interconnect][1] if self.interconnect else None}}


def flops_per_token(shape: ModelShape, setup: Setup) -> float:
    """Matmul FLOPs per trained token (student forward + backward, teacher forward, recomputation)."""
    dense = shape.params - (0 if shape.tied else shape.head_params) - (shape.root_params - shape.head_params)
    dense = max(dense, shape.linear_params)  # the matmul weights: blocks and LM head, not the embedding lookup
    attn = 2 * shape.layers * setup.seq_len * shape.heads * shape.head_dim  # forward, causal (half of 4·L·s·q)
    forward = 2 * dense + attn
    total = 3 * forward  # forward + backward (2×)
    if setup.kd:
        total += forward
    if setup.recompute == "full":  # selective keeps the matmul outputs: it recomputes no matmul
        total += forward
    return float(total)


def comm_bytes(shape: ModelShape, setup: Setup) -> dict[str, int]:
    """Bytes one GPU receives per optimizer step, by collective (ring algorithms; see the module docstring)."""
    W = setup.world
    if W == 1 or setup.strategy == "single":
        return {}
    ring = (W - 1) / W
    scales = shape.target_rows * setup.scale_groups if setup.scaling else 0
    if setup.strategy == "ddp":
        return {"all-reduce of the fp32 gradients": int(2 * ring * 4 * (shape.params + scales))}
    u = 2 if setup.policy else 4  # the all-gathered parameters' bytes
    blocks = shape.layers * shape.block_params
    per_micro = {"all-gather of the student (forward and backward)": ring * u * (shape.root_params + 2 * blocks),
                 "reduce-scatter of the gradients (fp32)": ring * 4 * shape.params}
    if setup.kd:
        per_micro["all-gather of the teacher (forward)"] = ring * min(setup.teacher_bytes, u) * shape.params
    out = {k: int(v * setup.grad_accum) for k, v in per_micro.items()}
    if scales:
        out["all-reduce of the weight scales' gradients"] = int(2 * ring * 4 * scales)
    return out


def plan_time(shape: ModelShape, setup: Setup, tokens: int, *, tokens_per_s: float | None = None,
              gpu_tflops: float = H100_BF16_TFLOPS, mfu: float = ASSUMED_MFU, link: str = "nvlink",
              bandwidth: float | None = None) -> TimePlan:
    """``link``: the interconnect (:func:`interconnect`); ``bandwidth``: bytes/s per GPU instead of its
    nominal one."""
    per_step = setup.batch_size * setup.seq_len * setup.grad_accum * setup.world
    steps = max(1, -(-tokens // per_step))
    fpt = flops_per_token(shape, setup)
    comm = comm_bytes(shape, setup)
    bw = bandwidth or INTERCONNECTS[link][0]
    if tokens_per_s is not None:
        return TimePlan(tokens, float(tokens_per_s), True, fpt, steps, comm=comm, interconnect=link, bandwidth=bw)
    compute = per_step * fpt / (setup.world * gpu_tflops * 1e12 * mfu)
    comm_s = sum(comm.values()) / bw
    exposed = 0.0
    if setup.strategy == "fsdp" and setup.world > 1:  # a micro-batch's first all-gather and last reduce-scatter
        u = 2 if setup.policy else 4
        first = (u * (shape.root_params + shape.block_params) + 4 * shape.block_params) * (setup.world - 1) / setup.world
        exposed = setup.grad_accum * first / bw
    step_s = max(compute, comm_s) + exposed
    return TimePlan(tokens, per_step / step_s, False, fpt, steps, compute_s=compute, comm_s=comm_s,
                    exposed_s=exposed, comm=comm, interconnect=link, bandwidth=bw)
