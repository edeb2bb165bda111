"""The training-step Triton kernels (scaled-weight backward, fused KD loss) against float64 references.

Shared by tests/test_step_kernels.py: run directly on CUDA, or in a subprocess with TRITON_INTERPRET=1 on
CPU tensors (the interpreter must be switched on before Triton is imported, hence the subprocess). Every check
goes through the public entry points (ScaledLinear's backward, kd_loss) and also confirms that the kernel,
not the torch fallback, did the work. Each returns the worst errors it saw; the tests own the tolerances.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

import cast_llm.distill as distill
from cast_llm.kernels.registry import probing
from cast_llm.nn import ScaledLinear
from cast_llm.nn import triton_scaled_weight as sw_kernel

VOCAB = 49152  # SmolLM2's vocabulary: 12 kernel blocks of 4096 per row
TAIL_VOCAB = 3 * 4096 + 123  # three whole kernel blocks and a part of one: the masked tail


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().cpu().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _reference_scaled(kind: str, w: torch.Tensor, a: torch.Tensor, bias, x: torch.Tensor, upstream: torch.Tensor):
    """y, ∂L/∂W, ∂L/∂A of ``y = x (Diag(A) W)^T + b`` in float64, straight from the formula: each column
    block ``b`` of row ``r`` is multiplied by ``A[r, b]`` (the scale repeated over the block's columns)."""
    w, a, x = (t.detach().cpu().double().requires_grad_(True) for t in (w, a, x))
    out_f, g = a.shape
    if kind == "linear":  # weight (out, in)
        scaled = w * a.repeat_interleave(w.shape[1] // g, dim=1)
        y = F.linear(x, scaled, None if bias is None else bias.detach().cpu().double())
    else:  # Conv1D: weight (in, out)
        scaled = w * a.t().repeat_interleave(w.shape[0] // g, dim=0)
        y = x @ scaled + (0 if bias is None else bias.detach().cpu().double())
    gw, ga = torch.autograd.grad((y * upstream.cpu().double()).sum(), (w, a))
    return y.detach(), gw, ga


def check_scaled_weight(device: str) -> dict[str, float]:
    """Worst relative errors of ScaledLinear's forward/backward (kernel path) against the float64 formula;
    fp32 without autocast (the kernel's own error) and bf16 autocast with fp32 master weights (the training
    setting: the bf16 matmuls dominate). Also the kernel alone on given gradients, for both layouts."""
    calls = []
    original = sw_kernel.scaled_weight_grads

    def counting(*args, **kwargs):
        if not probing():  # the checks before first use (cast_llm.kernels) do not count
            calls.append(1)
        return original(*args, **kwargs)

    sw_kernel.scaled_weight_grads = counting
    errors = {"fp32": 0.0, "autocast_bf16": 0.0, "kernel_grad_w": 0.0, "kernel_grad_a": 0.0}
    try:
        gen = torch.Generator().manual_seed(0)
        for kind in ("linear", "conv1d"):
            for g in (1, 2):
                for autocast in (False, True):
                    torch.manual_seed(0)
                    # 40 rows (not a multiple of the 16-row tile), 96 inputs: blocks of 48 / 96 columns
                    base = nn.Linear(96, 40) if kind == "linear" else Conv1D(40, 96)
                    layer = ScaledLinear.from_linear(base, n_groups=g).to(device)
                    with torch.no_grad():
                        layer.scale.copy_(0.5 + torch.rand(layer.scale.shape, generator=gen))
                    x = torch.randn(3, 7, 96, generator=gen).to(device)
                    upstream = torch.randn(3, 7, 40, generator=gen)
                    dev_type = torch.device(device).type
                    with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=autocast):
                        y = layer(x)
                    (y.float() * upstream.to(device)).sum().backward()
                    ry, rgw, rga = _reference_scaled(kind, layer.weight, layer.scale, layer.bias, x, upstream)
                    key = "autocast_bf16" if autocast else "fp32"
                    errors[key] = max(errors[key], _rel(y, ry), _rel(layer.weight.grad, rgw),
                                      _rel(layer.scale.grad, rga))
        expected = 8
        # the kernel alone: a bf16 gradient, fp32 weight and scale; ∂L/∂W must equal torch's product bitwise
        for transposed in (False, True):
            for g in (1, 2):
                out_f, in_f = 40, 96
                shape = (in_f, out_f) if transposed else (out_f, in_f)
                w = torch.randn(shape, generator=gen)
                a = 0.5 + torch.rand(out_f, g, generator=gen)
                grad = torch.randn(shape, generator=gen).bfloat16()
                gw, ga = original(grad.to(device), w.to(device), a.to(device), g, transposed)
                a_full = a.t().repeat_interleave(in_f // g, 0) if transposed else a.repeat_interleave(in_f // g, 1)
                if not torch.equal(gw.cpu(), grad.float() * a_full):
                    errors["kernel_grad_w"] = max(errors["kernel_grad_w"], _rel(gw, grad.double() * a_full.double()))
                prod = grad.double() * w.double()
                ra = (prod.t() if transposed else prod).reshape(out_f, g, in_f // g).sum(-1)
                errors["kernel_grad_a"] = max(errors["kernel_grad_a"], _rel(ga, ra))
    finally:
        sw_kernel.scaled_weight_grads = original
    errors["kernel_calls_missing"] = float(expected - len(calls))
    return errors


def _reference_kd(s, t, y, eta, temperature, ignore_index=-100):
    """Eq. 13 in float64 from the formulas (F.kl_div + F.cross_entropy), and its gradient w.r.t. ``s``."""
    s = s.detach().cpu().double().requires_grad_(True)
    keep = y.cpu() != ignore_index
    n = int(keep.sum())
    ce = F.cross_entropy(s[keep], y.cpu()[keep], reduction="sum") / n
    kl = torch.zeros((), dtype=torch.float64)
    if t is not None:
        lt = F.log_softmax(t.detach().cpu().double()[keep] / temperature, -1)
        kl = F.kl_div(F.log_softmax(s[keep] / temperature, -1), lt, log_target=True, reduction="sum") / n
        kl = kl * temperature**2
    loss = eta * kl + (1 - eta) * ce
    (grad,) = torch.autograd.grad(loss, s)
    return float(loss.detach()), float(kl.detach()), float(ce.detach()), grad


def check_kd(device: str) -> dict[str, float]:
    """Worst errors of kd_loss through the fused kernel against float64 — the paper's setting at V = 49,152
    (SmolLM2's), the other branches at a vocabulary that ends in a part block (3 × 4096 + 123; the interpreter's
    time grows with V) — loss/kd/ce relative errors and the gradient's max error relative to its largest entry,
    per logits dtype; ignored rows (one of them NaN) must get an exactly zero gradient."""
    gen = torch.Generator().manual_seed(0)
    errors: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        loss_err = grad_err = 0.0
        # (eta, T, with teacher): the paper's T = 1 with η = 1/2; T != 1 (every term); pure CE without a teacher
        # (its T = 1 is the CE's own: a T != 1 takes the kernel's other branch, the result must not change)
        for eta, temperature, teacher in ((0.5, 1.0, True), (1 / 3, 2.0, True), (0.0, 1.0, False), (0.0, 2.0, False)):
            V = VOCAB if (eta, temperature, teacher) == (0.5, 1.0, True) else TAIL_VOCAB
            # 2 x 7 tokens (not a multiple of anything the kernel tiles), causal: the last of each is ignored
            s = (3 * torch.randn(2, 7, V, generator=gen)).to(dtype)
            t = (3 * torch.randn(2, 7, V, generator=gen)).to(dtype) if teacher else None
            ids = torch.randint(0, V, (2, 7), generator=gen)
            ids[1, 3] = -100  # one more ignored row, holding NaN logits
            s[1, 2, 11] = float("nan")
            s_dev = s.to(device).requires_grad_(True)
            t_dev = t.to(device) if t is not None else None
            if distill.kd_path(s_dev.reshape(-1, V), None if t_dev is None else t_dev.reshape(-1, V),
                               temperature, True) != "triton":
                raise AssertionError("kd_loss would not use the fused kernel here")
            out = distill.causal_kd_loss(s_dev, t_dev, ids.to(device), eta=eta, temperature=temperature)
            (grad,) = torch.autograd.grad(out.loss, s_dev)
            labels = distill.shift_labels(ids).reshape(-1)
            s2, t2 = s.reshape(-1, V), None if t is None else t.reshape(-1, V)
            r_loss, r_kl, r_ce, r_grad = _reference_kd(s2, t2, labels, eta, temperature)
            ignored = labels == -100
            g2 = grad.detach().reshape(-1, V).cpu()
            if not bool((g2[ignored] == 0).all()) or not bool(torch.isfinite(g2).all()):
                raise AssertionError("ignored rows must get a zero gradient, every other entry a finite one")
            for got, ref in ((out.loss, r_loss), (out.ce, r_ce), (out.kd, r_kl)):
                loss_err = max(loss_err, abs(float(got.detach()) - ref) / max(abs(ref), 1e-3))
            grad_err = max(grad_err, _rel(g2[~ignored], r_grad[~ignored]))
        errors[f"{name}_loss"] = loss_err
        errors[f"{name}_grad"] = grad_err
    # labels read through their own stride: a strided view gives what a contiguous copy gives, bit for bit
    from cast_llm.distill import triton_kd

    s = (3 * torch.randn(6, 5000, generator=gen)).to(device)
    y = torch.randint(0, 5000, (6, 2), generator=gen).to(device)
    y[2, 0] = -100
    inv_n = torch.tensor(1 / 5, device=device)
    kw = dict(ignore_index=-100, inv_n=inv_n, eta=0.0, temperature=1.0, need_grad=True)
    strided, contiguous = triton_kd.fused_kd(s, None, y[:, 0], **kw), triton_kd.fused_kd(s, None, y[:, 0].clone(), **kw)
    errors["kd_label_stride"] = float(not all(torch.equal(a, b) for a, b in zip(strided, contiguous)))
    return errors


def _tiny_llama(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(device)


def check_grouped(device: str) -> dict[str, float]:
    """A tiny LLaMA whose ScaledLinear layers are scaled block by block (one launch per block each way)
    against the same model on the per-layer path: the logits and every gradient, in fp32 and under bf16
    autocast. Returns the worst differences (0 = bitwise) and how many launches each path made."""
    import copy

    from cast_llm.nn import triton_scaled_weight as k
    from cast_llm.nn import wrap_scaling_

    calls = {"grouped_fwd": 0, "grouped_bwd": 0, "single_bwd": 0}
    originals = {name: getattr(k, name) for name in ("grouped_scaled_weights", "grouped_scaled_weight_grads",
                                                     "scaled_weight_grads")}

    def counting(name, key):
        def run(*args, **kwargs):
            calls[key] += not probing()
            return originals[name](*args, **kwargs)
        return run

    k.grouped_scaled_weights = counting("grouped_scaled_weights", "grouped_fwd")
    k.grouped_scaled_weight_grads = counting("grouped_scaled_weight_grads", "grouped_bwd")
    k.scaled_weight_grads = counting("scaled_weight_grads", "single_bwd")
    errors = {"fp32_logits": 0.0, "fp32_grads": 0.0, "bf16_logits": 0.0, "bf16_grads": 0.0}
    try:
        base = _tiny_llama(device)
        gen = torch.Generator().manual_seed(0)
        models = []
        for group in (True, False):
            m = copy.deepcopy(base)
            wrap_scaling_(m, n_groups=2, group_blocks=group)
            models.append(m)
        for p0, p1 in zip(*(list(m.parameters()) for m in models)):  # the same non-trivial scales in both
            if p0.dim() == 2 and p0.shape[1] == 2:
                with torch.no_grad():
                    value = (0.5 + torch.rand(p0.shape, generator=gen)).to(device)
                    p0.copy_(value)
                    p1.copy_(value)
        ids = torch.randint(0, 128, (2, 9), generator=gen).to(device)
        upstream = torch.randn(2, 9, 128, generator=gen).to(device)
        for autocast in (False, True):
            outs = []
            for m in models:
                m.zero_grad(set_to_none=True)
                with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
                    logits = m(input_ids=ids).logits
                (logits.float() * upstream).sum().backward()
                outs.append((logits.detach(), [p.grad for p in m.parameters()]))
            (l0, g0), (l1, g1) = outs
            key = "bf16" if autocast else "fp32"
            errors[f"{key}_logits"] = _rel(l0, l1.double())
            errors[f"{key}_grads"] = max(_rel(a, b.double()) for a, b in zip(g0, g1))
    finally:
        for name, fn in originals.items():
            setattr(k, name, fn)
    # 1 block x 2 settings: one grouped launch each way per step; the per-layer model: 7 backward launches per step
    errors["launch_count_mismatch"] = float(abs(calls["grouped_fwd"] - 2) + abs(calls["grouped_bwd"] - 2)
                                            + abs(calls["single_bwd"] - 14))
    return errors
