"""Bytes autograd keeps for backward, per token, counted from the tensors a LLaMA block saves.

Counted on transformers' LLaMA block (RMSNorm, SDPA attention, gated MLP) as it runs in training; the
count is checked against ``torch.autograd.graph.saved_tensors_hooks`` on real tiny models, in fp32 and
under bf16 autocast (``tests/test_plan.py``). Per token and per block, with ``h`` the hidden width, ``q``
= heads × head_dim, ``kv`` = kv_heads × head_dim, ``i`` the MLP width, ``H`` the heads, ``r`` = 4 the
bytes of the residual stream (fp32 under autocast too: the embeddings are fp32) and ``c`` the bytes of
the matmul dtype (4 in fp32, 2 under bf16 autocast):

=========================  ===============================  ==========================================
saved tensor               fp32                             bf16 autocast
=========================  ===============================  ==========================================
2 RMSNorms                 2 × (2·r·h + 4): input, x·rsqrt   the same (HF computes the norm in fp32)
q/k/v projection input     r·h (one tensor, shared)          3·c·h (autocast casts it once per linear)
SDPA q, k, v, out, lse     c·(2q + 2kv) + 4·H               the same; o_proj's input is a view of out
MLP input                  r·h (shared by gate and up)       2·c·h
gate, act(gate), up, prod  4·c·i                            4·c·i
=========================  ===============================  ==========================================

Outside the blocks: the final norm (2·r·h + 4), the LM head's input (r·h, or c·h under autocast), the
token ids (8) and the rotary cos/sin (2 × seq × head_dim × 4 per micro-batch, shared by the blocks). The
weights the matmuls read are not counted here (fp32 parameters are not copies; their bf16 casts and the
scaled weights ``Diag(A)·W`` are, in :mod:`cast_llm.plan.memory`). For other block types (GPT-2, OPT) the
same count is an approximation (LayerNorm, biases, a 2-matrix MLP): the tests bound its error.
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.plan.shapes import ModelShape

__all__ = ["ActivationBytes", "activation_bytes"]

RESIDUAL = 4  # bytes of the residual stream: fp32 (embeddings are fp32, autocast adds bf16 into fp32)


@dataclass(frozen=True)
class ActivationBytes:
    """Saved bytes per token: one block, and the head (final norm, LM head input, ids); plus the rotary
    tables per micro-batch."""

    per_block: int
    head: int
    rotary: int  # per micro-batch, not per token
    block_input: int  # what activation checkpointing keeps per block and token (the residual stream)

    def total(self, tokens: int, layers: int, *, checkpointing: bool = False) -> int:
        """All saved bytes of a micro-batch of ``tokens`` tokens; with checkpointing the blocks keep only
        their inputs, and one block at a time is recomputed in full during backward."""
        if checkpointing:
            return tokens * (layers * self.block_input + self.per_block + self.head) + self.rotary
        return tokens * (layers * self.per_block + self.head) + self.rotary


def activation_bytes(shape: ModelShape, *, autocast: bool, seq_len: int) -> ActivationBytes:
    """The table of the module docstring for ``shape`` (``autocast``: bf16 autocast, else fp32)."""
    c = 2 if autocast else 4
    r = RESIDUAL
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 2 * (2 * r * h + 4)
    qkv_in = 3 * c * h if autocast else r * h
    sdpa = c * (2 * q + 2 * kv) + 4 * shape.heads
    mlp_in = 2 * c * h if autocast else r * h
    mlp = 4 * c * i
    head = (2 * r * h + 4) + (c * h if autocast else r * h) + 8
    return ActivationBytes(per_block=norms + qkv_in + sdpa + mlp_in + mlp, head=head,
                           rotary=2 * seq_len * shape.head_dim * 4, block_input=r * h)
