"""Bit packing and the compact N:M weight codec (method.md §1): exact round trips and sizes."""

from __future__ import annotations

import pytest
import torch
from deploy_helpers import bitwise_equal

from cast_llm.deploy.bitpack import pack_bits, packed_nbytes, unpack_bits
from cast_llm.deploy.nm_codec import NMSparseWeight, choose_encoding, index_bits
from cast_llm.errors import CastError
from cast_llm.sparsity.mask import nm_mask, pack_mask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PATTERNS = [(2, 4), (1, 4), (4, 8), (2, 8)]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 7, 8, 13, 1000])
def test_pack_bits_round_trip(bits, count):
    codes = torch.randint(0, 1 << bits, (count,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(count, bits)
    assert torch.equal(unpack_bits(packed, bits, count), codes)


def test_pack_bits_known_layout():
    # little-endian bit stream: code 2j in the low nibble of byte j; 2-bit codes LSB first
    assert pack_bits(torch.tensor([1, 2, 3]), 4).tolist() == [0x21, 0x03]
    assert pack_bits(torch.tensor([1, 2, 3, 0, 3]), 2).tolist() == [0b00111001, 0b11]
    # 3-bit: 8 codes fill exactly 3 bytes
    assert pack_bits(torch.full((8,), 7), 3).tolist() == [255, 255, 255]
    mask = torch.rand(5, 13) > 0.5
    assert torch.equal(pack_bits(mask.to(torch.uint8), 1), pack_mask(mask))  # 1 bit = the mask packing


def test_pack_bits_rejects_codes_out_of_range():
    with pytest.raises(ValueError, match="codes must lie"):
        pack_bits(torch.tensor([4]), 2)
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.tensor([1]), 9)


def _sparse(shape, n, m, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g).to(dtype)
    return w.masked_fill(~nm_mask(w, n, m), 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", PATTERNS)
@pytest.mark.parametrize("encoding", ["auto", "index", "bitmask"])
def test_nm_round_trip_is_bitwise(dtype, n, m, encoding):
    w = _sparse((24, 64), n, m, dtype)
    w[3, :m] = 0  # a group with no non-zero at all
    w[5, :m] = 0
    w[5, 1] = -2.5  # and one with fewer than n
    packed = NMSparseWeight.from_dense(w, n, m, encoding=encoding)
    assert packed.values.shape == (24, 64 // m * n) and packed.values.dtype == dtype
    assert bitwise_equal(packed.to_dense(), w)
    assert packed.nbytes == NMSparseWeight.expected_nbytes((24, 64), n, m, w.element_size(), encoding)


def test_fp16_24_size_is_0_5625_of_dense():
    w = _sparse((256, 512), 2, 4, torch.float16)
    packed = NMSparseWeight.from_dense(w)
    assert packed.encoding == "index"
    assert packed.nbytes == 0.5625 * w.numel() * 2  # 0.5 values + 2 bits per kept value (1/16)
    assert packed.positions.numel() == w.numel() // 2 * index_bits(4) // 8


def test_encoding_choice_takes_the_smaller():
    assert choose_encoding(2, 4) == "index"  # 4 bits either way: index on a tie
    assert choose_encoding(1, 4) == "index"  # 2 < 4
    assert choose_encoding(4, 8) == "bitmask"  # 12 > 8
    assert choose_encoding(2, 8) == "index"  # 6 < 8


def test_dense_weight_is_refused_with_its_name():
    w = torch.randn(8, 16)
    with pytest.raises(CastError, match=r"layers\.3\.mlp\.up_proj .*not 2:4"):
        NMSparseWeight.from_dense(w, 2, 4, name="layers.3.mlp.up_proj")
    with pytest.raises(CastError, match="multiple of m=4"):
        NMSparseWeight.from_dense(torch.zeros(4, 6), 2, 4)


def test_integer_codes_with_explicit_mask_and_fill():
    codes = torch.randint(0, 16, (6, 16), dtype=torch.uint8)
    keep = nm_mask(torch.rand(6, 16), 2, 4)
    packed = NMSparseWeight.from_dense(torch.where(keep, codes, 0), 2, 4, mask=keep)
    fill = torch.full((6, 16), 7, dtype=torch.uint8)
    assert torch.equal(packed.mask(), keep)
    assert torch.equal(packed.to_dense(fill=fill), torch.where(keep, codes, fill))
