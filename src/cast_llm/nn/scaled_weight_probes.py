"""How the scaled-weight kernels are checked (:mod:`cast_llm.kernels`): the probes and timers of the kernel paths
``scaled_weight.layer`` (declared in :mod:`cast_llm.nn.scaled_weight`) and ``scaled_weight.block``
(:mod:`cast_llm.nn.scaled_group`).

Both compare with the torch ops they replace, on weights whose sizes are no multiple of the kernels' tiles
(40 rows, column blocks of 48 and 24 entries) and, for the block, also on aligned ones (the kernels'
vectorised variant):

* ``∂L/∂W = A ⊙ ∂L/∂W_scale`` and the block's forward ``Diag(A) W`` are one float32 product rounded once, so
  they must equal the torch ops bit for bit — except for a low-precision weight under Triton's interpreter,
  whose conversion truncates where a GPU (and torch) rounds to nearest: then one ulp (2^-7 bf16, 2^-10 fp16);
* ``∂L/∂A = Σ_block ∂L/∂W_scale ⊙ W`` is a float32 sum in another order: ``max |Δ| / max |ref|`` against
  float64 at most 1e-5.
"""

from __future__ import annotations

import torch

from cast_llm.kernels import Check, seconds_per_call
from cast_llm.kernels.switch import interpreting

__all__ = ["layer_probe", "layer_timer", "layer_variants", "block_probe", "block_timer", "block_variants"]

_ULP = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _rounding_tol(dtype: torch.dtype) -> float:
    return _ULP[dtype] if interpreting() else 0.0


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().cpu().double(), ref.detach().cpu().double()
    if x.shape != ref.shape:
        return float("inf")
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _worse(a: Check, b: Check) -> Check:
    """The check further past (or closer to) its tolerance; a NaN error is the worst."""
    def ratio(c: Check) -> float:
        r = c.error / c.tolerance if c.tolerance > 0 else (0.0 if c.error == 0 else float("inf"))
        return float("inf") if r != r else r

    return b if ratio(b) > ratio(a) else a


def _layer_case(out_f: int, in_f: int, g: int, transposed: bool, w_dtype, grad_dtype, gen):
    shape = (in_f, out_f) if transposed else (out_f, in_f)
    w = torch.randn(shape, generator=gen).to(w_dtype)
    a = 0.5 + torch.rand(out_f, g, generator=gen)
    grad = torch.randn(shape, generator=gen).to(grad_dtype)
    return grad, w, a


def _grads_check(got, grad, w, a, g, transposed, need_w, need_a, reference) -> Check:
    gw, ga = got
    worst = Check(0.0, 1.0)
    rw, _ = reference(grad, w, a, g, transposed, need_w, False)
    _, ra = reference(grad.double(), w.double(), a.double(), g, transposed, False, need_a)
    if need_w:
        worst = _worse(worst, Check(_rel(gw, rw), _rounding_tol(w.dtype)))
    if need_a:
        worst = _worse(worst, Check(_rel(ga, ra), 1e-5))
    return worst


def layer_probe(impl, device: torch.device, variant: tuple, *, reference) -> Check:
    """``reference(grad, weight, scale, n_groups, transposed, need_w, need_a)``: the torch-ops backward."""
    grad_dtype, w_dtype, layout, needs = variant
    transposed, need_w, need_a = layout == "transposed", "dW" in needs, "dA" in needs
    gen = torch.Generator().manual_seed(0)
    grad, w, a = _layer_case(40, 96, 2, transposed, w_dtype, grad_dtype, gen)
    got = impl(grad.to(device), w.to(device), a.to(device), 2, transposed, need_w, need_a)
    return _grads_check(got, grad, w, a, 2, transposed, need_w, need_a, reference)


def layer_timer(impl, device: torch.device, variant: tuple, *, reference) -> float:
    grad_dtype, w_dtype, layout, needs = variant
    transposed, need_w, need_a = layout == "transposed", "dW" in needs, "dA" in needs
    gen = torch.Generator().manual_seed(0)
    grad, w, a = (x.to(device) for x in _layer_case(2048, 2048, 2, transposed, w_dtype, grad_dtype, gen))
    run = reference if impl is None else impl
    return seconds_per_call(lambda: run(grad, w, a, 2, transposed, need_w, need_a), device)


def layer_variants(device: torch.device) -> list[tuple]:
    return [(torch.bfloat16, torch.float32, "rows", "dW+dA"), (torch.bfloat16, torch.float32, "transposed", "dW+dA")]


# ------------------------------------------------------------------------------------------------ a block
_RAGGED = [(40, 96), (24, 96), (96, 48)]  # (out, in): column blocks of 48 and 24 entries, rows no multiple of 16
_ALIGNED = [(32, 64), (64, 32)]


def block_probe(impl, device: torch.device, variant: tuple, *, forward_reference, reference) -> Check:
    """``impl.forward(weights, scales, n_groups, transposed, out_dtype)`` and ``impl.backward(grads, weights,
    scales, n_groups, transposed, need_w, need_a)`` against ``forward_reference(weight, scale, n_groups,
    transposed, out_dtype)`` and the torch-ops backward ``reference``, member by member."""
    w_dtype, out_dtype, layout, needs = variant
    transposed, need_w, need_a = layout == "transposed", "dW" in needs, "dA" in needs
    gen = torch.Generator().manual_seed(1)
    worst = Check(0.0, 1.0)
    for shapes in (_RAGGED, _ALIGNED):
        cases = [_layer_case(o, i, 2, transposed, w_dtype, out_dtype, gen) for o, i in shapes]
        ws = [w.to(device) for _, w, _ in cases]
        scales = [a.to(device) for _, _, a in cases]
        outs = impl.forward(ws, scales, 2, transposed, out_dtype)
        for out, (_, w, a) in zip(outs, cases):
            worst = _worse(worst, Check(_rel(out, forward_reference(w, a, 2, transposed, out_dtype)),
                                        _rounding_tol(out_dtype)))
        gws, gas = impl.backward([grad.to(device) for grad, _, _ in cases], ws, scales, 2, transposed, need_w,
                                 need_a)
        for gw, ga, (grad, w, a) in zip(gws, gas, cases):
            worst = _worse(worst, _grads_check((gw, ga), grad, w, a, 2, transposed, need_w, need_a, reference))
    return worst


def block_timer(impl, device: torch.device, variant: tuple, *, forward_reference, reference) -> float:
    """A LLaMA-1B-shaped block (q/o 2048², k/v 256 × 2048, gate/up 5632 × 2048, down 2048 × 5632), both ways."""
    w_dtype, out_dtype, layout, needs = variant
    transposed, need_w, need_a = layout == "transposed", "dW" in needs, "dA" in needs
    gen = torch.Generator().manual_seed(0)
    shapes = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)]
    cases = [[x.to(device) for x in _layer_case(o, i, 2, transposed, w_dtype, out_dtype, gen)] for o, i in shapes]
    grads, ws, scales = ([c[k] for c in cases] for k in range(3))
    if impl is None:
        def run():
            for grad, w, a in cases:
                forward_reference(w, a, 2, transposed, out_dtype)
                reference(grad, w, a, 2, transposed, need_w, need_a)
    else:
        def run():
            impl.forward(ws, scales, 2, transposed, out_dtype)
            impl.backward(grads, ws, scales, 2, transposed, need_w, need_a)
    return seconds_per_call(run, device)


def block_variants(device: torch.device) -> list[tuple]:
    return [(torch.float32, torch.bfloat16, "rows", "dW+dA"), (torch.float32, torch.float32, "rows", "dW+dA")]
