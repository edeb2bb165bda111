"""Packing small unsigned integers (1-8 bits each) densely into bytes.

Used for the 2-bit positions of the compressed N:M format (method.md §1) and for the 3/4-bit codes and
zero-points of the quantized format (method.md §7). The layout is a little-endian bit stream: code ``i``
occupies bits ``[i*b, (i+1)*b)`` of the stream, least significant bit first, and stream bit ``k`` is bit
``k % 8`` of byte ``k // 8``. So ``b = 1`` is exactly ``numpy.packbits(..., bitorder="little")`` and
``b = 4`` puts code ``2j`` in the low nibble of byte ``j``. ``count * b`` bits take ``ceil(count*b/8)``
bytes: no per-row padding, the caller keeps the shape.
"""

from __future__ import annotations

import math

import torch


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes :func:`pack_bits` writes for ``count`` codes of ``bits`` bits."""
    return math.ceil(count * bits / 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` (any shape, values in ``[0, 2**bits)``) into a 1-D uint8 tensor."""
    _check_bits(bits)
    flat = codes.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) to pack into {bits} bits, "
                         f"got range [{int(flat.min())}, {int(flat.max())}]")
    count = flat.numel()
    # pad to a multiple of 8 codes: 8 codes of b bits are exactly b bytes
    padded = torch.zeros(math.ceil(count / 8) * 8, dtype=torch.uint8, device=flat.device)
    padded[:count] = flat
    shifts = torch.arange(bits, device=flat.device, dtype=torch.uint8)
    stream = (padded.view(-1, 8, 1) >> shifts) & 1  # (count/8, 8 codes, b bits), LSB first
    stream = stream.view(-1, bits, 8)  # (count/8, b bytes, 8 bits) of the same bit stream
    byte_shifts = torch.arange(8, device=flat.device, dtype=torch.uint8)
    # the shifted bits are disjoint, so their uint8 sum is their OR and never exceeds 255
    packed = (stream << byte_shifts).sum(-1, dtype=torch.uint8).view(-1)
    return packed[: packed_nbytes(count, bits)]


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes as a 1-D uint8 tensor."""
    _check_bits(bits)
    need = packed_nbytes(count, bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != need:
        raise ValueError(f"expected a 1-D uint8 tensor of {need} bytes for {count} codes of {bits} bits, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    groups = math.ceil(count / 8)
    padded = torch.zeros(groups * bits, dtype=torch.uint8, device=packed.device)
    padded[:need] = packed
    byte_shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = (padded.view(-1, 1) >> byte_shifts) & 1  # (bytes, 8 bits), LSB first
    stream = stream.view(groups, 8, bits)  # (count/8, 8 codes, b bits)
    shifts = torch.arange(bits, device=packed.device, dtype=torch.uint8)
    codes = (stream << shifts).sum(-1, dtype=torch.uint8).view(-1)
    return codes[:count]
