"""How long a run takes: tokens ÷ throughput, the throughput measured (``--tokens-per-s``) or estimated.

The estimate counts the matmul FLOPs of a step per token (the usual ``6·P`` of a forward + backward over
the non-embedding weights, plus causal attention ``6·L·seq·q`` at half the square), adds the teacher's
forward (``2·P`` + attention) with KD and a second student forward with activation checkpointing, and
divides by the GPUs' peak × an assumed model-FLOPs utilisation. It is a guess of the right order, not a
measurement: a measured ``tokens_per_s`` from a short run of the same configuration (``metrics.jsonl``)
replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.plan.memory import Setup
from cast_llm.plan.shapes import ModelShape

__all__ = ["TimePlan", "flops_per_token", "plan_time", "H100_BF16_TFLOPS", "ASSUMED_MFU"]

H100_BF16_TFLOPS = 989.0  # H100 SXM dense bf16 peak (the default of --gpu-tflops)
ASSUMED_MFU = 0.35  # HF LLaMA blocks under FSDP2 + bf16 autocast, CAST's extra elementwise work included


@dataclass
class TimePlan:
    tokens: int
    tokens_per_s: float  # over all processes
    measured: bool  # True: the user's figure; False: the FLOP estimate
    flops_per_token: float
    steps: int

    @property
    def seconds(self) -> float:
        return self.tokens / self.tokens_per_s

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "measured": self.measured,
                "flops_per_token": self.flops_per_token, "steps": self.steps, "seconds": self.seconds}


def flops_per_token(shape: ModelShape, setup: Setup) -> float:
    """Matmul FLOPs per trained token (student forward + backward, teacher forward, recomputation)."""
    dense = shape.params - (0 if shape.tied else shape.head_params) - (shape.root_params - shape.head_params)
    dense = max(dense, shape.linear_params)  # the matmul weights: blocks and LM head, not the embedding lookup
    attn = 2 * shape.layers * setup.seq_len * shape.heads * shape.head_dim  # forward, causal (half of 4·L·s·q)
    forward = 2 * dense + attn
    total = 3 * forward  # forward + backward (2×)
    if setup.kd:
        total += forward
    if setup.activation_checkpointing:
        total += forward
    return float(total)


def plan_time(shape: ModelShape, setup: Setup, tokens: int, *, tokens_per_s: float | None = None,
              gpu_tflops: float = H100_BF16_TFLOPS, mfu: float = ASSUMED_MFU) -> TimePlan:
    per_step = setup.batch_size * setup.seq_len * setup.grad_accum * setup.world
    steps = max(1, -(-tokens // per_step))
    fpt = flops_per_token(shape, setup)
    if tokens_per_s is not None:
        return TimePlan(tokens, float(tokens_per_s), True, fpt, steps)
    rate = setup.world * gpu_tflops * 1e12 * mfu / fpt
    return TimePlan(tokens, rate, False, fpt, steps)
