"""AWQ: activation-aware per-input-channel scaling before group-wise quantization (method.md §7).

The math (Lin et al., AWQ, Eq. 4-5), pure functions of tensors. For a layer ``y = W x`` with calibration
inputs ``X`` (T, C), a scale ``s ∈ R^C_{>0}`` per input channel changes nothing in exact arithmetic,
``W x = (W diag(s)) (diag(s)^-1 x)``, but it changes what quantization loses: channels with large
activations get larger weights, hence smaller *relative* rounding error. The scale is searched on a grid::

    s(α) = mean_t |X_tj| ^ α,  normalised by sqrt(max s · min s),   α ∈ {0, 1/grid, …, 1}
    err(α) = Σ_layers ‖ X Wᵀ − X diag(s)⁻¹ Q(W diag(s))ᵀ ‖²   (mean over tokens and outputs)

and the α with the smallest error wins (α = 0 is s = 1, plain round-to-nearest, so AWQ never does worse
than RTN on the search tokens). ``Q`` is the mask-aware quantizer of :mod:`cast_llm.quant.rtn`; since
``W diag(s)`` has its zeros exactly where ``W`` has them, every zero stays zero.

Where ``diag(s)⁻¹`` goes (the choice, made so that the exported model is a plain dense HF model): it is
*folded* into the operation that produces ``x``, exactly as the AWQ paper does, and only where that is
exact:

==========================  =========================================  ==================================
producer of x               fold 1/s into                              consumers scaled by s (columns)
==========================  =========================================  ==================================
input RMSNorm / LayerNorm   norm weight (and bias)                     q, k, v  (GPT-2: c_attn)
post-attention norm         norm weight (and bias)                     gate, up (OPT: fc1, GPT-2: c_fc)
v_proj (no GQA)             rows of v_proj (weight and bias)           o_proj (GPT-2: the v third of c_attn)
up_proj                     rows of up_proj                            down_proj (act(gate) ⊙ up is linear
                                                                       in up)
fc1 with ReLU (OPT)         rows of fc1 (ReLU(x/s) = ReLU(x)/s, s>0)   fc2
==========================  =========================================  ==================================

Layers with no such producer (LLaMA o_proj under grouped-query attention, GPT-2 mlp.c_proj after GELU,
post-norm OPT) get plain RTN. Folding into the producer's *rows* scales them row-wise, which keeps a
sparse producer exactly sparse as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from cast_llm.quant.rtn import fake_quantize

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "opt", "gpt2")


@dataclass
class ScaleGroup:
    """One producer → consumers relation whose per-channel scale AWQ searches and folds."""

    name: str
    producer: nn.Module
    kind: str  # "norm" | "linear" (fold into output rows) | "conv1d" (GPT-2: fold into output columns)
    consumers: list[tuple[str, nn.Module]]  # (fqn inside the block, module); all share the same input
    rows: slice | None = None  # the producer's output channels feeding the consumers (GPT-2 c_attn: v third)
    alpha: float | None = None
    error_ratio: float | None = None  # err(best α) / err(α = 0 = RTN) on the search tokens
    errors: list[float] = field(default_factory=list)


def _has(module, *names) -> bool:
    return all(hasattr(module, n) for n in names)


def scale_groups(block: nn.Module, model_type: str) -> list[ScaleGroup]:
    """The foldable producer → consumers relations of one decoder block (see the module table)."""
    groups: list[ScaleGroup] = []
    if model_type in ("llama", "mistral", "qwen2"):
        at, mlp = block.self_attn, block.mlp
        groups.append(ScaleGroup("input_layernorm", block.input_layernorm, "norm",
                                 [(f"self_attn.{p}", getattr(at, p)) for p in ("q_proj", "k_proj", "v_proj")]))
        if at.v_proj.out_features == at.o_proj.in_features:  # no grouped-query attention
            groups.append(ScaleGroup("self_attn.v_proj", at.v_proj, "linear", [("self_attn.o_proj", at.o_proj)]))
        if _has(mlp, "gate_proj", "up_proj", "down_proj"):
            groups.append(ScaleGroup("post_attention_layernorm", block.post_attention_layernorm, "norm",
                                     [("mlp.gate_proj", mlp.gate_proj), ("mlp.up_proj", mlp.up_proj)]))
            groups.append(ScaleGroup("mlp.up_proj", mlp.up_proj, "linear", [("mlp.down_proj", mlp.down_proj)]))
    elif model_type == "opt":
        at = block.self_attn
        if not getattr(block, "do_layer_norm_before", True):
            return groups  # post-norm (OPT-350M): the norms do not produce the linears' inputs
        groups.append(ScaleGroup("self_attn_layer_norm", block.self_attn_layer_norm, "norm",
                                 [(f"self_attn.{p}", getattr(at, p)) for p in ("q_proj", "k_proj", "v_proj")]))
        groups.append(ScaleGroup("self_attn.v_proj", at.v_proj, "linear", [("self_attn.out_proj", at.out_proj)]))
        groups.append(ScaleGroup("final_layer_norm", block.final_layer_norm, "norm", [("fc1", block.fc1)]))
        if isinstance(block.activation_fn, nn.ReLU):
            groups.append(ScaleGroup("fc1", block.fc1, "linear", [("fc2", block.fc2)]))
    elif model_type == "gpt2":
        at, hidden = block.attn, block.ln_1.weight.shape[0]
        groups.append(ScaleGroup("ln_1", block.ln_1, "norm", [("attn.c_attn", at.c_attn)]))
        if at.c_attn.weight.shape[1] == 3 * hidden:  # [q | k | v] along the output columns
            groups.append(ScaleGroup("attn.c_attn[v]", at.c_attn, "conv1d", [("attn.c_proj", at.c_proj)],
                                     rows=slice(2 * hidden, 3 * hidden)))
        groups.append(ScaleGroup("ln_2", block.ln_2, "norm", [("mlp.c_fc", block.mlp.c_fc)]))
    return groups


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


def oriented(module: nn.Module) -> torch.Tensor:
    """The consumer's weight as (out, in) (GPT-2 Conv1D stores (in, out))."""
    return module.weight.t() if _is_conv1d(module) else module.weight


@torch.no_grad()
def search_scale(x: torch.Tensor, act_mean: torch.Tensor, weights: list[torch.Tensor], *, bits: int,
                 group_size: int, grid: int = 20) -> tuple[torch.Tensor, float, list[float]]:
    """The AWQ grid search. ``x`` (T, C) search inputs, ``act_mean`` (C,) mean |x| over all calibration
    tokens, ``weights`` the consumers as (out, in). Returns ``(s (C,), best α, error per α)``."""
    x = x.float()
    refs = [x @ w.float().t() for w in weights]  # (T, out) each
    base = act_mean.float().clamp(min=1e-6)
    best_err, best_s, best_alpha, errors = None, None, 0.0, []
    for i in range(grid + 1):
        alpha = i / grid
        s = base.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = 0.0
        for w, ref in zip(weights, refs):
            w32 = w.float()
            wq = fake_quantize(w32 * s, bits, group_size, mask=w32 != 0) / s  # Q(W diag(s)) diag(s)^-1
            err += float((x @ wq.t() - ref).pow(2).mean())
        errors.append(err)
        if best_err is None or err < best_err:
            best_err, best_s, best_alpha = err, s, alpha
    return best_s, best_alpha, errors


@torch.no_grad()
def fold_scale_(group: ScaleGroup, s: torch.Tensor) -> None:
    """Apply ``s`` exactly: consumers' input columns × s, the producer's output ÷ s."""
    p = group.producer
    if group.kind == "norm":
        p.weight.div_(s.to(p.weight.dtype))
        if getattr(p, "bias", None) is not None:
            p.bias.div_(s.to(p.bias.dtype))
    elif group.kind == "linear":  # nn.Linear (out, in): output rows
        rows = group.rows or slice(None)
        p.weight[rows].div_(s.to(p.weight.dtype)[:, None])
        if p.bias is not None:
            p.bias[rows].div_(s.to(p.bias.dtype))
    elif group.kind == "conv1d":  # Conv1D (in, out): output columns
        cols = group.rows or slice(None)
        p.weight[:, cols].div_(s.to(p.weight.dtype)[None, :])
        if p.bias is not None:
            p.bias[cols].div_(s.to(p.bias.dtype))
    else:
        raise ValueError(f"unknown producer kind {group.kind!r}")
    for _, c in group.consumers:
        if _is_conv1d(c):
            c.weight.mul_(s.to(c.weight.dtype)[:, None])  # (in, out): rows are input channels
        else:
            c.weight.mul_(s.to(c.weight.dtype)[None, :])  # (out, in)
