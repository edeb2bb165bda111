"""Pure functions of cast_llm.analysis on hand-built examples with known answers (method.md §7)."""

from __future__ import annotations

import math

import pytest
import torch

from cast_llm.analysis import (
    RatioHistogram,
    TrackerState,
    group_ratios,
    layer_counts,
    packed_flips,
    packed_popcount,
    parse_hist_steps,
    resolve_hist_steps,
    sample_positions,
)
from cast_llm.sparsity.mask import nm_mask, pack_mask
from cast_llm.sparsity.stats import flip_rate, initial_flip_rate, sparse_weight_ratio


def B(rows):
    return torch.tensor(rows, dtype=torch.bool)


# ------------------------------------------------------------------------------------- per-layer counts
def test_popcount_matches_counting_bits():
    x = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    assert packed_popcount(x) == sum(bin(int(v)).count("1") for v in x)
    assert packed_popcount(torch.tensor([0, 255, 1, 128], dtype=torch.uint8)) == 10
    with pytest.raises(TypeError):
        packed_popcount(torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("shape", [(3, 8), (5, 12), (1, 4)])  # 24, 60 (padded last byte), 4 entries
def test_packed_flips_equal_unpacked_flips(shape):
    a, b = nm_mask(torch.randn(shape)), nm_mask(torch.randn(shape))
    assert packed_flips(pack_mask(a), pack_mask(b)) == int((a != b).sum())
    assert packed_flips(pack_mask(a), pack_mask(a)) == 0


def test_layer_counts_sum_to_the_aggregate_statistics():
    ws = [torch.randn(4, 8), torch.randn(6, 16)]
    m0 = [nm_mask(w) for w in ws]
    m1 = [nm_mask(w + 0.5 * torch.randn_like(w)) for w in ws]
    m2 = [nm_mask(w + 0.5 * torch.randn_like(w)) for w in ws]
    counts = [layer_counts(w, pack_mask(c), c, pack_mask(p), pack_mask(i)) for w, c, p, i in zip(ws, m2, m1, m0)]
    numel = sum(c.numel for c in counts)
    assert sum(c.flips for c in counts) / numel == pytest.approx(flip_rate(m1, m2), abs=0)
    assert sum(c.initial_flips for c in counts) / numel == pytest.approx(initial_flip_rate(m0, m2), abs=0)
    swr = sum(c.kept_l1 for c in counts) / sum(c.total_l1 for c in counts)
    assert swr == pytest.approx(sparse_weight_ratio(ws, m2), rel=1e-6)
    assert counts[0].flip_rate == int((m1[0] != m2[0]).sum()) / 32


# --------------------------------------------------------------------------------------- weight tracking
def _scripted_tracker() -> tuple[TrackerState, list]:
    seq = [  # (step, |w|, mask) of 4 sampled entries
        (1, [0.5, 0.4, 0.3, 0.2], [1, 1, 0, 0]),
        (2, [0.5, 0.35, 0.36, 0.1], [1, 0, 1, 0]),  # entries 1, 2 flip at step 2
        (4, [0.3, 0.45, 0.4, 0.05], [0, 1, 1, 0]),  # entries 0, 1 flip at step 4
        (6, [0.29, 0.46, 0.41, 0.04], [0, 1, 1, 0]),  # nothing flips
    ]
    return TrackerState(), [(s, torch.tensor(a), torch.tensor(m, dtype=torch.bool)) for s, a, m in seq]


def test_tracker_last_flip_step_and_magnitude_on_a_scripted_sequence():
    st, seq = _scripted_tracker()
    for s, a, m in seq:
        st.update(s, a, m)
    assert st.last_flip_step.tolist() == [4, 4, 2, -1]
    assert st.abs_at_last_flip[:3].tolist() == pytest.approx([0.3, 0.45, 0.36])
    assert st.flips.tolist() == [1, 2, 1, 0]
    out = st.summary(total_steps=10)
    assert out["last_flip_mean_abs"] == pytest.approx((0.3 + 0.45 + 0.36) / 3)
    assert out["last_flip_progress"] == pytest.approx((0.4 + 0.4 + 0.2) / 3)
    assert out["flipped_fraction"] == 0.75 and out["mean_flips"] == 1.0
    assert out["kept_mean_abs"] == pytest.approx((0.46 + 0.41) / 2)  # kept at the last check: entries 1, 2
    assert out["pruned_mean_abs"] == pytest.approx((0.29 + 0.04) / 2)
    assert out["checks"] == 4 and out["first_step"] == 1 and out["last_step"] == 6


def test_tracker_without_flips_and_before_any_check():
    assert TrackerState().summary(10)["kept_mean_abs"] is None
    st = TrackerState()
    m = torch.tensor([True, False])
    st.update(1, torch.tensor([1.0, 0.5]), m)
    st.update(2, torch.tensor([1.0, 0.25]), m)
    out = st.summary(2)
    assert out["last_flip_mean_abs"] is None and out["last_flip_progress"] is None
    assert out["flipped_fraction"] == 0.0 and out["pruned_mean_abs"] == 0.25
    with pytest.raises(ValueError):
        st.update(3, torch.ones(3), torch.ones(3, dtype=torch.bool))


def test_tracker_state_dict_round_trip_resumes_exactly(tmp_path):
    ref, seq = _scripted_tracker()
    for s, a, m in seq:
        ref.update(s, a, m)
    first = TrackerState()
    for s, a, m in seq[:2]:
        first.update(s, a, m)
    torch.save(first.state_dict(), tmp_path / "t.pt")
    resumed = TrackerState()
    resumed.load_state_dict(torch.load(tmp_path / "t.pt", weights_only=False))
    for s, a, m in seq[2:]:
        resumed.update(s, a, m)
    assert resumed.summary(10) == ref.summary(10)
    first.update(*seq[2])  # the saved state was a copy: later updates of the original do not leak into it
    assert resumed.checks == 4


def test_sample_positions_are_seeded_distinct_and_spread_by_size():
    numels = [100, 1000, 10, 5000]
    a = sample_positions(numels, 500, seed=3)
    assert [len(x) for x in a] == [len(x) for x in sample_positions(numels, 500, seed=3)]
    assert all(torch.equal(x, y) for x, y in zip(a, sample_positions(numels, 500, seed=3)))
    assert not all(torch.equal(x, y) for x, y in zip(a, sample_positions(numels, 500, seed=4)))
    assert sum(len(x) for x in a) == 500
    for idx, n in zip(a, numels):
        assert idx.unique().numel() == idx.numel() and (idx >= 0).all() and (idx < n).all()
        assert torch.equal(idx, idx.sort().values)
    assert len(a[3]) > len(a[1]) > len(a[2])  # ~ proportional to size (expected 410, 82, 1)
    full = sample_positions([3, 5], 100, seed=0)  # more asked than exist: every entry
    assert [x.tolist() for x in full] == [[0, 1, 2], [0, 1, 2, 3, 4]]
    state = torch.random.get_rng_state()
    sample_positions([10**9], 10, seed=0)  # large layers: no O(total) memory, global RNG untouched
    assert torch.equal(state, torch.random.get_rng_state())


# -------------------------------------------------------------------------------------- ratio histograms
def test_group_ratios_hand_built():
    w = torch.tensor([[4.0, -1.0, 0.5, 2.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, -3.0, 0.0, 0.1, 0.2, 0.3, 0.4]])
    m = B([[1, 0, 0, 1, 1, 1, 0, 0], [1, 0, 1, 0, 0, 0, 1, 1]])
    r = group_ratios(w, m, 4)
    # max pruned / min kept: 1/2; all zeros -> 0/0 := 0; 1/1 (a tie); 0.2/0.3
    assert r.tolist() == pytest.approx([0.5, 0.0, 1.0, 0.2 / 0.3])
    assert torch.equal(group_ratios(w.t().contiguous(), m.t().contiguous(), 4, transposed=True), r)
    inf = group_ratios(torch.tensor([[0.0, 0.0, 1.0, 0.0]]), B([[1, 1, 0, 0]]), 4)  # kept all zero, pruned not
    assert math.isinf(inf.item())
    with pytest.raises(ValueError):
        group_ratios(w, m.float(), 4)


def test_ratio_histogram_bins_and_summaries():
    h = RatioHistogram(step=5, progress=0.5)
    h.add(torch.tensor([0.0, 0.005, 0.05, 0.5, 0.995, 1.5, 3.0, math.inf]))
    assert h.groups == 8 and h.nonfinite == 1
    assert int(h.lin_counts[0]) == 2 and int(h.lin_counts[5]) == 1 and int(h.lin_counts[50]) == 1
    assert int(h.lin_counts[99]) == 1 and int(h.lin_counts[150]) == 1 and h.lin_overflow == 2
    assert h.log_underflow == 1 and h.log_overflow == 1 and int(h.log_counts.sum()) == 6
    assert h.fraction_below(0.1) == 3 / 8
    assert h.quantile(0.5) == pytest.approx(0.505)  # the 4th of 8 values, 0.5, lies in bin [0.50, 0.51)
    assert h.quantile(0.99) == math.inf
    assert h.mean == pytest.approx((0.005 + 0.05 + 0.5 + 0.995 + 1.5 + 3.0) / 7)
    small = RatioHistogram(step=1, progress=1.0)  # CAST-like: ratios far below the linear bins' 0.01
    small.add(torch.tensor([0.0] * 3 + [2e-3] * 4 + [0.5] * 3))
    assert small.quantile(0.3) == 0.0  # below 1e-6
    assert small.quantile(0.5) == pytest.approx(2e-3, rel=0.07)  # from the log bins: ±6 %
    assert small.quantile(0.9) == pytest.approx(0.505) and small.summary()["below_1e-6"] == 0.3
    again = RatioHistogram.from_state_dict(h.state_dict())
    assert again.summary() == h.summary() and torch.equal(again.lin_counts, h.lin_counts)


def test_hist_step_specs():
    assert resolve_hist_steps("0.1,0.5,1.0", 40) == [4, 20, 40]
    assert resolve_hist_steps("7, 0.5 ,1.0,7", 10) == [5, 7, 10]
    assert resolve_hist_steps("0.01", 20) == [1]  # early, not never
    assert resolve_hist_steps("500", 100) == []  # past the end of this run
    assert resolve_hist_steps("", 100) == []
    assert parse_hist_steps(" 0.50, 20 ") == "0.5,20"
    for bad in ("0", "1.5", "abc", "0.0", "-3"):
        with pytest.raises(ValueError):
            parse_hist_steps(bad)
