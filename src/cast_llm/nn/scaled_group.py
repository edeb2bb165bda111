"""The ScaledLinear layers of one decoder block scaled in ONE op each way (CUDA): Eq. 12 without per-layer cost.

Per layer, ``W_scale = Diag(A) W`` is one elementwise product forward and one fused kernel backward — cheap on
the GPU, but each costs host time (an autograd node, allocations, a launch: ~40 µs per layer and step with
the per-layer path), and a SmolLM2-135M step has 210 such layers on a GPU that a ~140 ms step keeps waiting
for the host. So the layers of each decoder block are scaled together:

* a forward pre-hook on the block (``model.layers.3``, ``transformer.h.3``, …) forms every member's
  ``W_scale`` in one Triton launch (:func:`~cast_llm.nn.triton_scaled_weight.grouped_scaled_weights`) as the
  outputs of ONE autograd node, and hands each layer its own; the layer then only runs its matmul;
* that node's backward, which autograd calls once all of the block's matmuls have produced their weight
  gradients (i.e. when the block's backward is done), forms every ``∂L/∂W`` and ``∂L/∂A`` in one launch;
* a forward hook (also on exceptions) takes the weights back, so a layer called on its own — or under
  ``no_grad``, or when any member is not a plain CUDA tensor in a kernel-supported dtype (FSDP2's DTensor
  shards, float64 reference tests, CPU) — runs the per-layer path, which computes the same numbers.

The block is the fqn prefix up to its first integer component (``model.layers.3.self_attn.q_proj`` →
``model.layers.3``); blocks with one member are not grouped. Memory: a block's bf16 weight gradients live
until the block's backward ends (per layer they were converted to the fp32 ``.grad`` one by one) — one
block's worth. A member the block's forward did not call gets no gradient (None), as per layer.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from cast_llm import kernels
from cast_llm.kernels.switch import interpreting, triton_runs_on
from cast_llm.nn import scaled_weight, scaled_weight_probes
from cast_llm.nn.scaled_weight import matmul_dtype, torch_scaled_weight, torch_scaled_weight_grads

__all__ = ["group_by_block_", "ungroup_", "SCALED_WEIGHT_BLOCK"]

MEMBERS = "_cast_scaled_members"  # attribute of a block: its ScaledLinear layers (a plain list)


def _kernel():
    return scaled_weight._kernel()  # looked up per call: the layer's loader (and a test's stand-in for it)


def group_by_block_(model: nn.Module, fqns: list[str]) -> int:
    """Scale the ScaledLinear layers ``fqns`` of ``model`` block by block (see the module docstring);
    returns how many blocks were grouped. Idempotent: layers already in their block's group are skipped."""
    blocks: dict[str, list[str]] = {}
    for fqn in fqns:
        parts = fqn.split(".")
        first = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
        if first is not None:
            blocks.setdefault(".".join(parts[: first + 1]), []).append(fqn)
    grouped = 0
    for prefix, names in blocks.items():
        block = model.get_submodule(prefix)
        members = block.__dict__.get(MEMBERS)
        new = [model.get_submodule(n) for n in names]
        if members is None:
            if len(new) < 2:
                continue
            members = []
            block.__dict__[MEMBERS] = members
            block.register_forward_pre_hook(_pre_hook)
            block.register_forward_hook(_post_hook, always_call=True)
        members.extend(m for m in new if all(m is not x for x in members))
        grouped += 1
    return grouped


def ungroup_(model: nn.Module) -> None:
    """Remove every block group of ``model`` (the fold calls this): layers go back to the per-layer path."""
    for block in model.modules():
        members = block.__dict__.pop(MEMBERS, None)
        if members is None:
            continue
        for m in members:
            m.__dict__.pop("_grouped", None)
        for hooks in (block._forward_pre_hooks, block._forward_hooks):
            for key in [k for k, fn in hooks.items() if fn in (_pre_hook, _post_hook)]:
                del hooks[key]
                getattr(block, "_forward_hooks_always_called", {}).pop(key, None)


def _pre_hook(block: nn.Module, args) -> None:
    members = block.__dict__.get(MEMBERS)
    if not members:
        return
    outs = _scaled_weights(members)
    for i, m in enumerate(members):
        m.__dict__["_grouped"] = outs[i] if outs is not None else None


def _post_hook(block: nn.Module, args, output) -> None:
    for m in block.__dict__.get(MEMBERS, ()):
        m.__dict__["_grouped"] = None


def _scaled_weights(members: list) -> tuple | None:
    """Every member's W_scale from one launch, or None when the block must take the per-layer path."""
    if not torch.is_grad_enabled() or any(getattr(m, "recompute_weight", False) for m in members):
        return None  # (recomputing layers keep no W_scale: nn/recomputed_linear.py)
    first = members[0]
    w0 = first.base_layer.weight
    device = w0.device
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return None
    plain = (torch.Tensor, nn.Parameter)
    weights, scales = [], []
    for m in members:
        if m.n_groups != first.n_groups or m.transposed != first.transposed:
            return None
        w, a = m.base_layer.weight, m.scale
        if type(w) not in plain or type(a) not in plain:
            return None
        weights.append(w)
        scales.append(a)
    kernel = _kernel()
    if kernel is None or kernel.grouped_unsupported_reason(weights, scales, first.n_groups) is not None:
        return None
    out_dtype = matmul_dtype(w0)
    need_w, need_a = any(w.requires_grad for w in weights), any(a.requires_grad for a in scales)
    variant = (w0.dtype, out_dtype, "transposed" if first.transposed else "rows",
               "+".join(x for x, need in (("dW", need_w), ("dA", need_a)) if need))
    path = kernels.choose("scaled_weight.block", device, variant)
    if path == kernels.REFERENCE:
        return None
    meta = (first.n_groups, first.transposed, out_dtype, path, variant)
    try:
        return _GroupedScaledWeights.apply(meta, *weights, *scales)
    except Exception as e:  # noqa: BLE001 - a launch that fails (nothing was written): the per-layer path
        kernels.record("scaled_weight.block", device, variant, path, e)
        return None


class _GroupedScaledWeights(torch.autograd.Function):
    """(meta, W_1 … W_k, A_1 … A_k) → (W_scale_1 … W_scale_k): one node, one launch each way."""

    @staticmethod
    def forward(ctx, meta, *tensors):
        n_groups, transposed, out_dtype, path, _ = meta
        k = len(tensors) // 2
        ctx.save_for_backward(*tensors)
        ctx.meta = meta
        ctx.set_materialize_grads(False)  # a member the forward never called: no gradient, not zeros
        impl = kernels.implementation("scaled_weight.block", path)
        return tuple(impl.forward(list(tensors[:k]), list(tensors[k:]), n_groups, transposed, out_dtype))

    @staticmethod
    def backward(ctx, *grads):
        n_groups, transposed, _, path, variant = ctx.meta
        tensors = ctx.saved_tensors
        k = len(tensors) // 2
        need = ctx.needs_input_grad[1:]
        live = [i for i, g in enumerate(grads) if g is not None and (need[i] or need[k + i])]
        out: list = [None] * (2 * k)
        if live:
            need_w = any(need[i] for i in live)
            need_a = any(need[k + i] for i in live)
            args = ([grads[i] for i in live], [tensors[i] for i in live], [tensors[k + i] for i in live])
            try:
                gws, gas = kernels.implementation("scaled_weight.block", path).backward(
                    *args, n_groups, transposed, need_w, need_a)
            except Exception as e:  # noqa: BLE001 - the torch ops, member by member, for this and later blocks
                kernels.record("scaled_weight.block", tensors[0].device, variant, path, e)
                pairs = [torch_scaled_weight_grads(g, w, a, n_groups, transposed, need_w, need_a)
                         for g, w, a in zip(*args)]
                gws, gas = [p[0] for p in pairs], [p[1] for p in pairs]
            for j, i in enumerate(live):
                out[i] = gws[j] if need[i] else None
                out[k + i] = gas[j] if need[k + i] else None
        return (None, *out)


class _TritonBlock:
    """The grouped Triton kernels as the block path's implementation (looked up at every call: tests wrap them)."""

    @staticmethod
    def forward(*args):
        return _kernel().grouped_scaled_weights(*args)

    @staticmethod
    def backward(*args):
        return _kernel().grouped_scaled_weight_grads(*args)


SCALED_WEIGHT_BLOCK = kernels.register(kernels.CheckedPath(
    name="scaled_weight.block",
    what="ScaledLinear layers of a decoder block, forward and backward in one launch each (nn/scaled_group.py)",
    reference="the per-layer torch ops (∂L/∂A against float64)",
    measure="max |Δ| / max |ref| of W_scale, ∂L/∂W or ∂L/∂A",
    candidates=(kernels.Candidate("triton", lambda: _TritonBlock, triton_runs_on),),
    probe=functools.partial(scaled_weight_probes.block_probe, forward_reference=torch_scaled_weight,
                            reference=torch_scaled_weight_grads),
    timer=functools.partial(scaled_weight_probes.block_timer, forward_reference=torch_scaled_weight,
                            reference=torch_scaled_weight_grads),
    variants=scaled_weight_probes.block_variants,
))
