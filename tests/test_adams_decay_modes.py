"""AdamS ``decay_mode="additive"`` (AST's decay on the momentum signal, method.md §6) against an independent
float64 reference; the default ``"proportional"`` mode (Eq. 7) is covered by ``test_adams.py``."""

from __future__ import annotations

import math

import pytest
import torch

from cast_llm.optim import AdamS
from cast_llm.sparsity.mask import nm_mask


def reference_ast(theta0, grads, *, lr, betas, eps, lam, total_steps, interval):
    """AST written out: μ~ = μ + (t/T) λ θ on pruned entries, v from μ~², μ from the gradient only."""
    b1, b2 = betas
    theta = theta0.clone()
    mu = torch.zeros_like(theta)
    v = torch.zeros_like(theta)
    mask = None
    for t, g in enumerate(grads, start=1):
        if mask is None or (interval and t % interval == 0):
            mask = nm_mask(theta)  # Eq. 6 from θ_{t-1}
        mu = b1 * mu + (1 - b1) * g
        alpha = min(t / total_steps, 1.0)
        mu_t = torch.where(mask, mu, mu + alpha * lam * theta)
        v = b2 * v + (1 - b2) * mu_t * mu_t
        theta = theta - lr * (mu_t / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return theta, mask


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("storage", ["bool", "packed"])
def test_additive_mode_matches_float64_reference(foreach, storage):
    torch.manual_seed(0)
    theta0 = torch.randn(8, 16, dtype=torch.float64)
    grads = [torch.randn(8, 16, dtype=torch.float64) * 0.1 for _ in range(12)]
    hp = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8)
    want, want_mask = reference_ast(theta0, grads, lam=0.5, total_steps=10, interval=4, **hp)
    p = theta0.clone().requires_grad_()
    opt = AdamS([{"params": [p], "sparse": True}], l1_decay=0.5, total_steps=10, mask_interval=4,
                decay_mode="additive", foreach=foreach, mask_storage=storage, **hp)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-12)
    assert torch.equal(opt.mask(p), want_mask)


def test_additive_decay_ramps_up_and_leaves_kept_entries_alone():
    """With zero gradients: kept entries never move; pruned ones move by the ramped decay only."""
    w = torch.tensor([[4.0, -3.0, 0.5, -0.25]], dtype=torch.float64, requires_grad=True)
    opt = AdamS([{"params": [w], "sparse": True}], lr=0.01, l1_decay=1.0, total_steps=4, mask_interval=0,
                decay_mode="additive")
    before = w.detach().clone()
    w.grad = torch.zeros_like(w)
    opt.step()
    kept = opt.mask(w)
    assert torch.equal(w.detach()[kept], before[kept])
    # t = 1: μ = 0, so μ~ = (1/T) λ θ on pruned entries only: they step towards 0
    moved = (before - w.detach())[~kept]
    assert bool((moved.sign() == before[~kept].sign()).all()), "pruned weights shrink towards 0"


def test_decay_mode_is_validated_and_old_state_dicts_load_as_proportional():
    p = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="decay_mode"):
        AdamS([{"params": [p], "sparse": True}], total_steps=5, decay_mode="sideways")
    opt = AdamS([{"params": [p], "sparse": True}], total_steps=5, l1_decay=0.1)
    p.grad = torch.randn(4, 8)
    opt.step()
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["decay_mode"]  # as written before decay modes existed
    again = AdamS([{"params": [p], "sparse": True}], total_steps=5, l1_decay=0.1, decay_mode="additive")
    again.load_state_dict(sd)
    p.grad = torch.randn(4, 8)
    again.step()  # runs, as the proportional mode it was saved in
    assert again.param_groups[0].get("decay_mode", "proportional") == "proportional"
    assert math.isfinite(float(p.detach().abs().sum()))
