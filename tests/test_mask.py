"""N:M masks (Eq. 6): property tests against a plain per-group reference, ties, errors, bit packing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cast_llm
import cast_llm.sparsity.mask as mask_mod
from cast_llm.errors import NonFiniteError
from cast_llm.sparsity import apply_mask_, is_nm, nm_mask, pack_mask, unpack_mask
from cast_llm.sparsity.mask import is_nm_mask, packed_numel

PATTERNS = [(1, 4), (2, 4), (2, 8), (4, 8)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_mask(weight: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Per group in plain Python: order members by (-|w|, index), keep the first n."""
    values = weight.detach().double().reshape(-1, m).tolist()  # bf16/fp16 are exact in float64
    keep = []
    for group in values:
        order = sorted(range(m), key=lambda j: (-abs(group[j]), j))
        kept = set(order[:n])
        keep.append([j in kept for j in range(m)])
    return torch.tensor(keep, dtype=torch.bool).reshape(weight.shape)


# tie-heavy values (repeats, +0/-0, whole zero groups) and continuous ones, both exact in fp16/bf16
TIE_VALUES = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, 3.0]
value = st.one_of(st.sampled_from(TIE_VALUES), st.floats(-1000, 1000, width=16, allow_subnormal=False))


@st.composite
def weights(draw):
    n, m = draw(st.sampled_from(PATTERNS))
    dtype = draw(st.sampled_from(DTYPES))
    lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
    shape = (*lead, m * draw(st.integers(1, 5)))
    values = draw(st.lists(value, min_size=math.prod(shape), max_size=math.prod(shape)))
    return torch.tensor(values, dtype=dtype).reshape(shape), n, m


@settings(max_examples=300, deadline=None)
@given(weights())
def test_nm_mask_is_top_n_per_group_with_lower_index_tie_break(case):
    weight, n, m = case
    mask = nm_mask(weight, n, m)
    assert mask.dtype == torch.bool and mask.shape == weight.shape
    assert (mask.reshape(-1, m).sum(dim=1) == n).all()
    assert torch.equal(mask, reference_mask(weight, n, m))
    assert is_nm_mask(mask, n, m)
    assert is_nm(weight * mask, n, m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_nm_mask_hand_examples(dtype, device):
    w = torch.tensor(
        [
            [0.1, -0.5, 0.5, 0.2, 0.0, 0.0, 0.0, 0.0],  # tie at |0.5| between idx 1, 2; all-zero group
            [-0.0, 0.0, -0.0, 0.0, 1.0, 1.0, 1.0, -1.0],  # signed zeros; four equal magnitudes
            [3.0, 1.0, 2.0, -4.0, 2.0, 1.0, -1.0, 1.0],  # distinct; a 3-way tie for 2nd place
        ],
        dtype=dtype,
        device=device,
    )
    expected = torch.tensor(
        [
            [0, 1, 1, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 1, 0, 0],
            [1, 0, 0, 1, 1, 1, 0, 0],
        ],
        dtype=torch.bool,
        device=device,
    )
    assert torch.equal(nm_mask(w), expected)
    assert torch.equal(nm_mask(w, 1, 4).sum(dim=1).cpu(), torch.tensor([2, 2, 2]))
    assert nm_mask(w, 4, 4).all()


def test_nm_mask_infinities_count_as_largest():
    w = torch.tensor([[1.0, float("-inf"), float("inf"), 2.0], [float("inf")] * 4])
    assert nm_mask(w).tolist() == [[False, True, True, False], [True, True, False, False]]


def test_nm_mask_blocking_matches_one_block(monkeypatch):
    # the cache blocking must not change the result across block boundaries (3 groups per block here)
    w = torch.randn(7, 40)
    w[2, :8] = 0.25  # ties straddling a block edge
    expected = reference_mask(w, 2, 4)
    monkeypatch.setattr(mask_mod, "_BLOCK_GROUPS_CPU", 3)
    assert torch.equal(nm_mask(w), expected)
    assert torch.equal(nm_mask(w, 2, 8), reference_mask(w, 2, 8))


def test_nm_mask_non_contiguous_and_requires_grad():
    w = torch.randn(8, 12, requires_grad=True)
    mask_t = nm_mask(w.T, 2, 4)  # groups along dim 0 of w (GPT-2 Conv1D layout)
    assert mask_t.shape == (12, 8) and not mask_t.requires_grad
    assert torch.equal(mask_t, reference_mask(w.T, 2, 4))


def test_nm_mask_errors():
    with pytest.raises(ValueError, match=r"\(3, 6\).*not divisible by m=4"):
        nm_mask(torch.randn(3, 6))
    with pytest.raises(ValueError, match="1 <= n <= m"):
        nm_mask(torch.randn(2, 4), n=5, m=4)
    with pytest.raises(ValueError, match="1 <= n <= m"):
        nm_mask(torch.randn(2, 4), n=0, m=4)
    with pytest.raises(TypeError, match="floating-point"):
        nm_mask(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="scalar"):
        nm_mask(torch.tensor(1.0))
    w = torch.randn(4, 8)
    w[3, 5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"\(4, 8\).*NaN"):
        nm_mask(w)
    assert nm_mask(torch.empty(0, 8)).shape == (0, 8)


def test_is_nm_counts_at_most_n_nonzeros():
    w = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    assert is_nm(w) and is_nm(w, 1, 4) is False
    assert not is_nm(torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert not is_nm(torch.ones(2, 6))  # 6 is not divisible by 4: cannot be 2:4
    assert is_nm(torch.zeros(3, 8), 2, 8)
    mask = torch.tensor([[True, False, True, False], [False, True, False, True]])
    assert is_nm(w, mask=mask)  # a kept entry that is 0 is still valid
    assert not is_nm(w, mask=torch.tensor([[True, True, False, False], [False, True, False, True]]))
    assert not is_nm(w, mask=torch.tensor([[True, True, True, False], [False, True, False, True]]))


def test_is_nm_mask_exact_count():
    assert is_nm_mask(torch.tensor([[True, False, True, False]]))
    assert not is_nm_mask(torch.tensor([[True, False, False, False]]))  # 1:4 is not an exact 2:4 mask
    with pytest.raises(TypeError):
        is_nm_mask(torch.ones(1, 4))


def test_apply_mask_zeroes_pruned_and_keeps_kept_bits():
    w = torch.nn.Parameter(torch.tensor([[1.5, float("nan"), -2.0, 0.25]]))
    mask = torch.tensor([[True, False, True, False]])
    out = apply_mask_(w, mask)
    assert out is w
    assert w.tolist() == [[1.5, 0.0, -2.0, 0.0]]
    with pytest.raises(ValueError, match="differs"):
        apply_mask_(w, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        apply_mask_(w, torch.ones(1, 4))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=3), st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(shape, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) > 0.5
    packed = pack_mask(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (packed_numel(mask.numel()),)
    assert torch.equal(unpack_mask(packed, mask.shape), mask)


def test_pack_unaligned_and_strided_views():
    base = torch.rand(41) > 0.5
    for view in (base[1:17], base[3:], base.view(1, 41)[:, 5:37]):  # storage offsets not multiples of 8
        assert torch.equal(unpack_mask(pack_mask(view), view.shape), view)
    grid = torch.rand(6, 10) > 0.5
    assert torch.equal(unpack_mask(pack_mask(grid.t()), (10, 6)), grid.t())


def test_pack_bit_order_and_errors():
    mask = torch.tensor([True] + [False] * 8 + [True])  # 10 entries -> 2 bytes
    assert pack_mask(mask).tolist() == [1, 2]
    assert pack_mask(torch.ones(2, 4, dtype=torch.bool)).tolist() == [255]
    with pytest.raises(ValueError, match="needs 2"):
        unpack_mask(torch.zeros(3, dtype=torch.uint8), (4, 4))
    with pytest.raises(TypeError):
        unpack_mask(torch.zeros(2, dtype=torch.int32), (4, 4))
    with pytest.raises(TypeError):
        pack_mask(torch.ones(4))


def test_public_reexports():
    assert cast_llm.nm_mask is nm_mask and cast_llm.pack_mask is pack_mask and cast_llm.is_nm is is_nm


def test_mask_of_zeros_reads_an_nm_weight_and_refuses_a_dense_one():
    from cast_llm.errors import CastError
    from cast_llm.sparsity.mask_io import mask_of_zeros

    w = torch.tensor([[0.0, 3.0, 0.0, -1.0, 0.0, 0.0, 5.0, 0.0]])  # second group: one kept weight is exactly 0
    mask = mask_of_zeros(w, False, 2, 4)
    assert mask.tolist() == [[False, True, False, True, True, False, True, False]]
    assert torch.equal(mask_of_zeros(w.t().contiguous(), True, 2, 4), mask.t())
    with pytest.raises(CastError, match="more than 2 non-zero"):
        mask_of_zeros(torch.ones(1, 8), False, 2, 4)


def test_masks_digest_names_the_masks_not_the_file(tmp_path):
    """One digest for the same masks however their file was written (another ``source`` in the metadata, or
    the metadata in another order, as another process writes it); one moved group, or another target name,
    gives another digest."""
    from cast_llm.io import sha256_file
    from cast_llm.sparsity.mask_io import load_masks, masks_digest, save_masks

    masks = {"a.proj": nm_mask(torch.randn(8, 16), 2, 4), "b.proj": nm_mask(torch.randn(4, 8), 2, 4)}
    save_masks(tmp_path / "x.safetensors", masks, n=2, m=4, source="run x")
    save_masks(tmp_path / "y.safetensors", masks, n=2, m=4, source="run y")
    assert sha256_file(tmp_path / "x.safetensors") != sha256_file(tmp_path / "y.safetensors")
    assert masks_digest(load_masks(tmp_path / "x.safetensors")[0]) == masks_digest(masks) \
        == masks_digest(load_masks(tmp_path / "y.safetensors")[0])
    moved = dict(masks)
    moved["b.proj"] = masks["b.proj"].clone()
    moved["b.proj"][0, :4] = ~moved["b.proj"][0, :4]  # the group's other two weights kept: still 2:4
    assert masks_digest(moved) != masks_digest(masks)
    assert masks_digest({"c.proj": masks["a.proj"], "b.proj": masks["b.proj"]}) != masks_digest(masks)


def test_a_mask_file_holds_eight_entries_a_byte_and_reads_back_exactly(tmp_path):
    """Packed bits: every entry back in place whatever the shape (a tail that does not fill a byte, a
    transposed Conv1D layout), about an eighth of a bool file's bytes; a file of bool tensors (before the
    packing) still loads, a damaged one is a one-line error."""
    from safetensors.torch import save_file

    from cast_llm.errors import CastError
    from cast_llm.sparsity.mask_io import MASKS_MARKER, load_masks, save_masks

    g = torch.Generator().manual_seed(3)
    masks = {"a.proj": nm_mask(torch.randn(64, 128, generator=g), 2, 4),
             "b.proj": nm_mask(torch.randn(12, 8, generator=g), 2, 4).t().contiguous(),  # (8, 12): transposed
             "c.proj": torch.rand(3, 7, generator=g) > 0.5}  # 21 entries: a last byte with 3 bits unused
    path = save_masks(tmp_path / "m.safetensors", masks, n=2, m=4, source="test")
    back, meta = load_masks(path)
    assert meta["packing"] == "bits" and set(back) == set(masks)
    for k, v in masks.items():
        assert back[k].dtype == torch.bool and back[k].shape == v.shape and torch.equal(back[k], v), k
    bools = tmp_path / "old.safetensors"
    save_file({k: v for k, v in masks.items()}, str(bools), metadata={"written_by": MASKS_MARKER, "n": "2", "m": "4"})
    assert all(torch.equal(load_masks(bools)[0][k], v) for k, v in masks.items())
    assert path.stat().st_size < 0.2 * bools.stat().st_size
    save_file({"a.proj": torch.zeros(5, dtype=torch.uint8)}, str(tmp_path / "bad.safetensors"),
              metadata={"written_by": MASKS_MARKER, "packing": "bits", "shapes": '{"a.proj": [64, 128]}'})
    with pytest.raises(CastError, match="cannot be read as a mask file"):
        load_masks(tmp_path / "bad.safetensors")
