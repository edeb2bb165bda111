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

Under FSDP2's mixed-precision policy (``bf16_params``: bf16 weights, no autocast) the residual stream is
bf16 too (r = 2, the embedding is), each RMSNorm keeps its fp32 upcast of the input, its rsqrt and its bf16
output (6·h + 4), and the projections share their (bf16) input: 2·(6·h + 4) + 2·h + SDPA + 2·h + 4·c·i.

With recomputation (``--activation-checkpointing``) a block keeps its input (r·h) and — ``selective`` —
the outputs of its matmuls and attention (``SAVED_OPS`` of :mod:`cast_llm.train.memory_options`):
c·(q + 2·kv + h) for the q/k/v/o projections, c·(2·i + h) for gate, up and down, c·q + 4·H for SDPA's
output and log-sum-exp; one block at a time is recomputed whole in backward. Counted on the selective
checkpoint's own storage in ``tests/test_plan.py``.

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

    selective_block: int = 0  # what selective recomputation keeps per block and token (input + matmul outputs)

    def total(self, tokens: int, layers: int, *, checkpointing: bool | str = False) -> int:
        """All saved bytes of a micro-batch of ``tokens`` tokens. ``checkpointing``: ``none`` (False),
        ``full`` (True: the blocks keep only their inputs) or ``selective`` (their inputs and matmul outputs);
        with either, one block at a time is recomputed in full during backward."""
        mode = {False: "none", True: "full"}.get(checkpointing, checkpointing)
        if mode == "none":
            return tokens * (layers * self.per_block + self.head) + self.rotary
        kept = self.block_input if mode == "full" else self.selective_block
        return tokens * (layers * kept + self.per_block + self.head) + self.rotary


def activation_bytes(shape: ModelShape, *, autocast: bool, seq_len: int, bf16_params: bool = False) -> ActivationBytes:
    """The table of the module docstring for ``shape`` (``autocast``: bf16 autocast, else fp32;
    ``bf16_params``: bf16 weights without autocast, as under FSDP2's mixed-precision policy)."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if bf16_params:
        c = r = 2
        norm = 6 * h + 4  # fp32 upcast of the input (kept by pow and mul), rsqrt, the bf16 output
        per_block = 2 * norm + 2 * h + c * (2 * q + 2 * kv) + 4 * shape.heads + 2 * h + 4 * c * i
        head = norm + 2 * h + 8
        rotary = 2 * seq_len * shape.head_dim * 2  # cast to the hidden states' dtype
    else:
        c = 2 if autocast else 4
        r = RESIDUAL
        norms = 2 * (2 * r * h + 4)
        qkv_in = 3 * c * h if autocast else r * h
        sdpa = c * (2 * q + 2 * kv) + 4 * shape.heads
        mlp_in = 2 * c * h if autocast else r * h
        mlp = 4 * c * i
        per_block = norms + qkv_in + sdpa + mlp_in + mlp
        head = (2 * r * h + 4) + (c * h if autocast else r * h) + 8
        rotary = 2 * seq_len * shape.head_dim * 4
    matmul_outputs = c * (q + 2 * kv + h) + c * (2 * i + h) + c * q + 4 * shape.heads
    return ActivationBytes(per_block=per_block, head=head, rotary=rotary, block_input=r * h,
                           selective_block=r * h + matmul_outputs)
