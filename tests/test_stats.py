"""Mask statistics of method.md §7 on hand-built examples with known answers."""

from __future__ import annotations

import pytest
import torch

from cast_llm.sparsity.stats import flip_rate, initial_flip_rate, mask_flips, sparse_weight_ratio


def B(rows):
    return torch.tensor(rows, dtype=torch.bool)


M0 = B([[1, 1, 0, 0], [0, 1, 0, 1]])  # layer 1: 8 entries
M1 = B([[1, 0, 1, 0], [0, 1, 0, 1]])  # one swap in group (0): 2 entries changed
L2_0 = B([[1, 0, 1, 0, 1, 1, 0, 0]])  # layer 2: 8 entries
L2_1 = B([[0, 1, 1, 0, 0, 0, 1, 1]])  # 2 + 4 entries changed


def test_single_layer():
    assert mask_flips(M0, M1) == 2
    assert flip_rate(M0, M1) == pytest.approx(2 / 8)
    assert flip_rate(M0, M0) == 0.0
    assert isinstance(flip_rate(M0, M1), float)


def test_aggregation_sums_before_dividing():
    # (2 + 6) / (8 + 8), not the mean of 2/8 and 6/8 weighted equally by accident: use unequal sizes too
    assert flip_rate([M0, L2_0], [M1, L2_1]) == pytest.approx(8 / 16)
    big_prev = torch.zeros(4, 8, dtype=torch.bool)
    big_cur = big_prev.clone()
    big_cur[0, :2] = True  # 2 of 32 changed
    assert flip_rate([M0, big_prev], [M1, big_cur]) == pytest.approx((2 + 2) / (8 + 32))
    assert flip_rate((M0, big_prev), (M1, big_cur)) == flip_rate([M0, big_prev], [M1, big_cur])


def test_initial_flip_rate_compares_with_m0_not_previous():
    m2 = M0.clone()  # flipped away at step 1, back at step 2
    assert flip_rate(M1, m2) == pytest.approx(2 / 8)
    assert initial_flip_rate(M0, m2) == 0.0
    assert initial_flip_rate([M0, L2_0], [M1, L2_1]) == pytest.approx(8 / 16)


def test_sparse_weight_ratio_known_answer():
    w1 = torch.tensor([[1.0, -2.0, 0.5, 0.5], [0.0, 3.0, -1.0, 0.0]])
    # layer 1: kept |1| + |-2| + |3| + |0| = 6 of 8
    assert sparse_weight_ratio(w1, M0) == pytest.approx(6 / 8)
    w2 = torch.tensor([[4.0, 0.0, 0.0, -4.0, 1.0, 1.0, 0.0, 0.0]])
    # layer 2: kept |4| + |0| + |1| + |1| = 6 of 10 -> aggregated (6 + 6) / (8 + 10)
    assert sparse_weight_ratio([w1, w2], [M0, L2_0]) == pytest.approx(12 / 18)
    assert sparse_weight_ratio(w1 * M0, M0) == 1.0
    assert sparse_weight_ratio(torch.zeros(2, 4), M0) == 1.0
    assert sparse_weight_ratio(w1.to(torch.bfloat16), M0) == pytest.approx(6 / 8)


def test_inputs_are_not_modified():
    w = torch.tensor([[1.0, -2.0, 0.5, 0.5]])
    m = B([[1, 0, 1, 0]])
    before = (w.clone(), m.clone())
    sparse_weight_ratio(w, m)
    flip_rate(m, ~m)
    assert torch.equal(w, before[0]) and torch.equal(m, before[1])


def test_errors():
    with pytest.raises(ValueError, match="2 tensors.*1"):
        flip_rate([M0, M0], [M1])
    with pytest.raises(ValueError, match="shape"):
        flip_rate(M0, torch.zeros(2, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        flip_rate(M0.float(), M1)
    with pytest.raises(TypeError, match="bool"):
        sparse_weight_ratio(torch.ones(2, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match="no mask entries"):
        flip_rate([], [])


def test_changed_groups_counts_a_group_once_however_many_entries_swapped():
    from cast_llm.sparsity.stats import changed_group_rate, changed_groups

    init = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 0], [0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    cur = init.clone()
    cur[0, :4] = torch.tensor([0, 0, 1, 1])  # all four entries of a group changed: one group
    cur[1, 4:] = torch.tensor([1, 0, 1, 0])  # one swap (two entries): one group
    assert changed_groups(init, cur, 4) == (2, 4)
    assert changed_group_rate([init, init], [cur, init], 4) == 2 / 8
    # transposed (Conv1D): the groups run along dim 0
    assert changed_groups(init.t().contiguous(), cur.t().contiguous(), 4, transposed=True) == (2, 4)
    assert changed_groups(init, init, 4) == (0, 4)
    with pytest.raises(ValueError, match="no groups of 4"):
        changed_groups(init[:, :6], cur[:, :6], 4)
