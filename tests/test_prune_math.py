"""The tensor math of the one-shot baselines (method.md §6): hand-built examples and a float64 OBS reference."""

from __future__ import annotations

import logging

import pytest
import torch

from cast_llm.errors import CastError
from cast_llm.prune import (
    accumulate_col_sq_norm,
    accumulate_hessian,
    finalize_hessian,
    magnitude_prune_,
    sparsegpt_prune_,
    wanda_prune_,
    wanda_scores,
)
from cast_llm.sparsity.mask import is_nm

PATTERNS = [(2, 4), (4, 8), (1, 4)]


def correlated_inputs(tokens: int, cols: int, seed: int) -> torch.Tensor:
    """(tokens, cols) inputs with correlated columns of very different scales, like LLM activations."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, cols, generator=g)
    mix = torch.eye(cols) + 0.5 * torch.randn(cols, cols, generator=g) / cols**0.5
    # log-normal column scales; moderate on purpose: with extreme outlier columns the 1 % damping (relative
    # to mean diag H) swamps the small columns and SparseGPT can fall behind Wanda on a random layer
    scale = torch.exp(0.5 * torch.randn(cols, generator=g))
    return (z @ mix) * scale


def layer_stats(x: torch.Tensor):
    """Wanda's squared column norms and SparseGPT's Hessian, through the accumulators, in two batches."""
    half = x.shape[0] // 2
    col = accumulate_col_sq_norm(accumulate_col_sq_norm(None, x[:half]), x[half:])
    xxt = accumulate_hessian(accumulate_hessian(None, x[:half]), x[half:])
    return col, finalize_hessian(xxt, x.shape[0])


def test_accumulators_match_direct_formulas():
    x = correlated_inputs(64, 16, seed=1)
    col, h = layer_stats(x)
    torch.testing.assert_close(col, (x**2).sum(0))
    torch.testing.assert_close(h, 2 / 64 * x.t() @ x)


def test_wanda_hand_built_layer():
    # input column norms ‖X_j‖ = 4, 1, 1, 0.5 | 1, 2, 2.5, 10 (given as squared norms)
    norms = torch.tensor([4.0, 1.0, 1.0, 0.5, 1.0, 2.0, 2.5, 10.0])
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0, 4.0, 3.0, 2.0, 1.0],
                      [-4.0, 1.0, 1.5, 1.0, 0.5, -0.5, 0.1, 0.01]])
    # scores |w|·‖X‖:  row 0: 4, 2, 3, 2   | 4, 6, 5, 10   -> keep cols 0, 2 | 5, 7
    #                  row 1: 16, 1, 1.5, .5 | .5, 1, .25, .1 -> keep cols 0, 2 | 4, 5
    expected = torch.tensor([[1, 0, 1, 0, 0, 1, 0, 1],
                             [1, 0, 1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(wanda_scores(w, norms**2), w.abs() * norms)
    pruned = w.clone()
    mask = wanda_prune_(pruned, norms**2, 2, 4)
    assert torch.equal(mask, expected)
    assert torch.equal(pruned, torch.where(expected, w, torch.zeros_like(w)))
    # magnitude alone keeps different entries on this layer: the input norms matter
    assert not torch.equal(magnitude_prune_(w.clone(), 2, 4), expected)


def test_sparsegpt_with_identity_hessian_is_magnitude_pruning():
    # H = I: no coupling between columns, so no OBS update and the saliency is w² up to a constant
    w = torch.randn(8, 16)
    mag = w.clone()
    magnitude_prune_(mag, 2, 4)
    sgpt = w.clone()
    info = sparsegpt_prune_(sgpt, torch.eye(16), 2, 4, blocksize=8)
    assert torch.equal(sgpt, mag)
    assert info.retries == 0 and info.dead_columns == 0


def reference_obs(w: torch.Tensor, h: torch.Tensor, n: int, m: int, damp: float):
    """SparseGPT by brute force in float64: explicit inverses of H restricted to the unprocessed columns.

    No Cholesky, no lazy blocks: at column j, ``Hinv_F = inv(H[j:, j:])``; a group's choice uses each
    column k's own ``inv(H[k:, k:])[0, 0]``; the OBS update is ``−(w_j − q_j) / Hinv_F[0,0] · Hinv_F[0, :]``.
    """
    w, h = w.double().clone(), h.double().clone()
    cols = w.shape[1]
    h = h + damp * h.diagonal().mean() * torch.eye(cols, dtype=h.dtype)
    keep = torch.ones_like(w, dtype=torch.bool)
    loss = 0.0
    for j in range(cols):
        hinv = torch.linalg.inv(h[j:, j:])
        if j % m == 0:
            diag = torch.stack([torch.linalg.inv(h[k:, k:])[0, 0] for k in range(j, j + m)])
            saliency = w[:, j : j + m] ** 2 / diag  # (R, m)
            drop = saliency.argsort(dim=1)[:, : m - n]
            keep[:, j : j + m].scatter_(1, drop, False)
        q = torch.where(keep[:, j], w[:, j], torch.zeros_like(w[:, j]))
        err = w[:, j] - q
        loss += float((err**2 / hinv[0, 0]).sum() / 2)
        w[:, j:] -= (err / hinv[0, 0])[:, None] * hinv[0][None, :]
        w[:, j] = q
    return w, keep, loss


@pytest.mark.parametrize("blocksize", [4, 8, 16])
def test_sparsegpt_matches_float64_brute_force_obs(blocksize):
    x = correlated_inputs(256, 16, seed=2).double()
    h = 2 / x.shape[0] * x.t() @ x
    w = torch.randn(6, 16, dtype=torch.float64)
    ref_w, ref_keep, ref_loss = reference_obs(w, h, 2, 4, damp=0.01)
    out = w.clone()
    info = sparsegpt_prune_(out, h, 2, 4, blocksize=blocksize, damp=0.01, dtype=torch.float64)
    assert torch.equal(info.mask, ref_keep)
    torch.testing.assert_close(out, ref_w, rtol=1e-9, atol=1e-10)
    assert info.loss == pytest.approx(ref_loss, rel=1e-9)


def reconstruction_error(w, w_hat, x) -> float:
    return float(torch.linalg.norm(x @ (w - w_hat).t()))  # ‖WX − ŴX‖ with inputs as rows


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n,m", PATTERNS)
def test_sparsegpt_reconstructs_better_than_wanda_and_magnitude(seed, n, m):
    x = correlated_inputs(512, 64, seed=seed)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(100 + seed))
    col, h = layer_stats(x)
    results = {}
    for name in ("magnitude", "wanda", "sparsegpt"):
        out = w.clone()
        if name == "magnitude":
            magnitude_prune_(out, n, m)
        elif name == "wanda":
            wanda_prune_(out, col, n, m)
        else:
            sparsegpt_prune_(out, h, n, m, blocksize=16)
        assert is_nm(out, n, m)
        assert int((out == 0).sum()) >= w.numel() * (m - n) // m
        results[name] = reconstruction_error(w, out, x)
    assert results["sparsegpt"] < results["wanda"]
    assert results["sparsegpt"] < results["magnitude"]


@pytest.mark.parametrize("n,m", PATTERNS)
def test_every_method_is_exactly_nm_and_keeps_surviving_weights(n, m):
    w = torch.randn(16, 32)
    w[0, :m] = 1.0  # ties inside a group still give exactly n per group
    col, h = layer_stats(correlated_inputs(128, 32, seed=3))
    for mask, out in [
        (magnitude_prune_(a := w.clone(), n, m), a),
        (wanda_prune_(b := w.clone(), col, n, m), b),
        (sparsegpt_prune_(c := w.clone(), h, n, m, blocksize=8).mask, c),
    ]:
        assert is_nm(out, n, m)
        assert torch.equal(mask.view(16, -1, m).sum(-1), torch.full((16, 32 // m), n))
        assert bool((out[~mask] == 0).all())


def test_sparsegpt_writes_through_a_transposed_view():
    w_t = torch.randn(32, 8)  # Conv1D layout (in, out); prune the (out, in) view in place
    h = layer_stats(correlated_inputs(128, 32, seed=4))[1]
    expected = w_t.t().clone()
    sparsegpt_prune_(expected, h, 2, 4)
    sparsegpt_prune_(w_t.t(), h, 2, 4)
    assert torch.equal(w_t.t(), expected) and is_nm(w_t.t(), 2, 4)


def test_sparsegpt_dead_input_columns():
    x = correlated_inputs(128, 16, seed=5)
    x[:, 3] = 0  # an input feature that never fires: diag H = 0
    h = layer_stats(x)[1]
    w = torch.randn(4, 16)
    info = sparsegpt_prune_(w, h, 2, 4)
    assert info.dead_columns == 1 and info.retries == 0
    assert bool((w[:, 3] == 0).all()) and is_nm(w, 2, 4) and torch.isfinite(w).all()


def test_sparsegpt_cholesky_retry_is_reported(caplog):
    h = torch.ones(8, 8)  # rank 1 with a non-zero diagonal: the second Cholesky pivot is exactly 0
    w = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="cast_llm.prune.sparsegpt"):
        info = sparsegpt_prune_(w, h, 2, 4, damp=0.0, name="layers.0.mlp")
    assert info.retries == 1 and info.damp == pytest.approx(0.01)
    assert "layers.0.mlp" in caplog.text and "Cholesky failed" in caplog.text
    assert is_nm(w, 2, 4) and torch.isfinite(w).all()


def test_sparsegpt_gives_up_with_a_clear_error():
    h = -torch.eye(8)  # negative definite: no damping proportional to mean(diag H) can help
    with pytest.raises(CastError, match="layers.1.attn could not be factorised"):
        sparsegpt_prune_(torch.randn(4, 8), h, 2, 4, damp=0.01, name="layers.1.attn")
    with pytest.raises(CastError, match="NaN"):
        sparsegpt_prune_(torch.randn(4, 8), torch.full((8, 8), float("nan")), 2, 4)
