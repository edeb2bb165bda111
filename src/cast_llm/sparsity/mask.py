"""N:M semi-structured masks (method.md §1, Eq. 6) and their 1-bit storage.

Layout: a weight's LAST dimension is cut into contiguous groups of ``m`` entries (for ``nn.Linear.weight``,
``(out, in)``, that is every row's input features — what NVIDIA sparse tensor cores accelerate). A valid
N:M mask keeps exactly ``n`` entries per group; ``True`` means kept.

Everything here is a pure function of tensors: vectorised over all groups at once, any float dtype,
any device. ``nm_mask`` never sorts: it ranks the ``m`` members of every group by ``m(m-1)/2`` pairwise
comparisons, which is exact for every dtype (bf16/fp16 included) and gives ties a fixed rule.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from cast_llm.errors import NonFiniteError

__all__ = ["nm_mask", "magnitude_mask", "is_nm", "is_nm_mask", "apply_mask_", "pack_mask", "unpack_mask",
           "packed_numel"]


def _check_pattern(n: int, m: int) -> None:
    if not (isinstance(n, int) and isinstance(m, int)) or isinstance(n, bool) or isinstance(m, bool):
        raise TypeError(f"n and m must be ints, got n={n!r}, m={m!r}")
    if m < 1 or not 1 <= n <= m or m > 127:  # 127: the per-entry rank below is kept in int8
        raise ValueError(f"invalid N:M pattern {n}:{m}: need 1 <= n <= m <= 127 (2:4 is the hardware one)")


def _check_groupable(shape: Sequence[int], m: int, what: str = "weight") -> None:
    shape = tuple(shape)
    if len(shape) == 0:
        raise ValueError(f"{what} is a scalar; an N:M mask needs at least one dimension of groups of {m}")
    if shape[-1] % m != 0:
        raise ValueError(
            f"{what} of shape {shape}: its last dimension ({shape[-1]}) is not divisible by m={m}, so it "
            f"cannot be cut into N:M groups of {m}. Leave this layer dense, or pad/transpose it so that the "
            f"grouped dimension is a multiple of {m}."
        )


def nm_mask(weight: Tensor, n: int = 2, m: int = 4) -> Tensor:
    """The N:M magnitude mask of Eq. 6: in every group of ``m`` contiguous entries along the last
    dimension, keep the ``n`` entries with the largest ``|w|``.

    Ties (equal ``|w|``, including all-zero groups and ``+0``/``-0``) go to the LOWER index, so the result
    is deterministic and has exactly ``n`` ``True`` per group. ``±inf`` counts as the largest magnitude; a
    NaN anywhere raises :class:`~cast_llm.errors.NonFiniteError` (its rank would be meaningless).

    Returns a bool tensor of ``weight``'s shape and device (``True`` = kept). ``weight`` may be any float
    dtype; no gradient flows through it. To group along another dimension, transpose first and transpose
    the mask back (GPT-2 ``Conv1D``: ``nm_mask(w.T, n, m).T``).
    """
    _check_pattern(n, m)
    if not weight.is_floating_point():
        raise TypeError(f"nm_mask needs a floating-point weight, got dtype {weight.dtype}")
    _check_groupable(weight.shape, m)
    if weight.numel() == 0:
        return torch.zeros(weight.shape, dtype=torch.bool, device=weight.device)
    groups = weight.numel() // m
    flat = weight.detach().reshape(groups, m)  # (groups, m): one N:M group per row
    keep = torch.empty((groups, m), dtype=torch.bool, device=weight.device)
    # Blocks of groups keep the temporaries cache-resident on CPU (faster than one pass over a large
    # weight: docs/results/performance.md, §5); elsewhere they only bound the temporary memory.
    block = _BLOCK_GROUPS_CPU if weight.device.type == "cpu" else _BLOCK_GROUPS_OTHER
    base = torch.arange(m, dtype=torch.int8, device=weight.device).unsqueeze(1)  # (m, 1)
    nan_probes = []
    for start in range(0, groups, block):
        mag = flat[start : start + block].abs()  # (g, m)
        # a sum of magnitudes is NaN iff one of them is (inf + inf stays inf): a free NaN probe
        nan_probes.append(mag.sum(dtype=torch.float32))
        _rank_block(mag, n, m, base, keep[start : start + block])
    if torch.stack(nan_probes).isnan().any():
        raise NonFiniteError(
            f"nm_mask: the weight of shape {tuple(weight.shape)} contains NaN; its N:M mask is undefined. "
            "Find where the NaN came from (a diverged step?) before recomputing masks."
        )
    return keep.view(weight.shape)


_BLOCK_GROUPS_CPU = 1 << 17
_BLOCK_GROUPS_OTHER = 1 << 24


def magnitude_mask(weight: Tensor, transposed: bool, n: int, m: int) -> Tensor:
    """Eq. 6 in the weight's own layout: groups along the last dim, or along dim 0 when ``transposed`` (GPT-2
    ``Conv1D`` weights, stored ``(in, out)``). No gradient flows through it."""
    w = weight.detach()
    return nm_mask(w.t(), n, m).t().contiguous() if transposed else nm_mask(w, n, m)


def _rank_block(mag: Tensor, n: int, m: int, base: Tensor, out: Tensor) -> None:
    """Write into ``out`` (g, m) whether each entry of ``mag`` (g, m) is among its row's top ``n``."""
    g = mag.shape[0]
    # wins[j] = how many group members entry j beats, as (m, g) so that the int8 updates run on contiguous
    # rows. Each pair (j < k) is decided once: j beats k iff |w_j| >= |w_k| (ties -> lower index), else k
    # beats j. k's count starts at k (its lower-index rivals) and loses one per defeat, so no negated
    # temporary is ever built.
    wins = base.repeat(1, g)
    for j in range(m - 1):
        for k in range(j + 1, m):
            j_beats_k = torch.ge(mag[:, j], mag[:, k]).view(torch.int8)
            wins[j].add_(j_beats_k)
            wins[k].sub_(j_beats_k)
    # kept iff among the top n  <=>  beats at least m - n of the other members
    for j in range(m):
        torch.ge(wins[j], m - n, out=out[:, j])


def is_nm_mask(mask: Tensor, n: int = 2, m: int = 4) -> bool:
    """True iff ``mask`` (bool) has EXACTLY ``n`` ``True`` in every group of ``m`` along its last dim.

    This is the condition a mask from :func:`nm_mask` or from a pruning method must meet. A shape whose
    last dimension is not divisible by ``m`` is not N:M: returns False.
    """
    _check_pattern(n, m)
    if mask.dtype != torch.bool:
        raise TypeError(f"is_nm_mask expects a bool mask, got dtype {mask.dtype}")
    if mask.dim() == 0 or mask.shape[-1] % m != 0:
        return False
    if mask.numel() == 0:
        return True
    counts = mask.reshape(-1, m).sum(dim=1, dtype=torch.int32)
    return bool((counts == n).all())


def is_nm(weight: Tensor, n: int = 2, m: int = 4, *, mask: Tensor | None = None) -> bool:
    """True iff every group of ``m`` entries along the last dimension has AT MOST ``n`` non-zeros.

    "At most" is the hardware-valid condition: a 2:4 kernel stores 2 values per group, and a kept weight
    that happens to be exactly 0 is still a valid 2:4 matrix. A shape whose last dimension is not
    divisible by ``m`` cannot be N:M and returns False (no error: this is a check).

    With ``mask=`` (bool, ``weight``'s shape) the check is stricter: the mask must be an exact N:M mask
    (:func:`is_nm_mask`) and ``weight`` must be zero wherever the mask is ``False``.
    """
    _check_pattern(n, m)
    if weight.dim() == 0 or weight.shape[-1] % m != 0:
        return False
    if mask is not None:
        if mask.shape != weight.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} differs from weight shape {tuple(weight.shape)}")
        if not is_nm_mask(mask, n, m):
            return False
        return not bool(((weight != 0) & ~mask).any())
    if weight.numel() == 0:
        return True
    nonzeros = (weight != 0).reshape(-1, m).sum(dim=1, dtype=torch.int32)
    return bool((nonzeros <= n).all())


@torch.no_grad()
def apply_mask_(weight: Tensor, mask: Tensor) -> Tensor:
    """``weight ← weight ⊙ mask`` in place (Algorithm 1's final prune); returns ``weight``.

    Pruned entries become exactly ``+0`` even if they held NaN/inf (a multiply would keep NaN). Works on
    parameters (no autograd record) and on any shape; ``mask`` must be bool with ``weight``'s shape.
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"apply_mask_ expects a bool mask, got dtype {mask.dtype}; unpack_mask() a packed one")
    if mask.shape != weight.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} differs from weight shape {tuple(weight.shape)}")
    return weight.masked_fill_(~mask.to(weight.device), 0)


# ---------------------------------------------------------------------------------------- bit packing
# Bit order: element 8*i + j of the flattened mask is bit j (value 2**j) of byte i; the tail of the
# last byte is zero padding. Every packer/unpacker in the package (AdamS's too) uses this order.


def packed_numel(numel: int) -> int:
    """Bytes that :func:`pack_mask` uses for a mask of ``numel`` entries (1 bit each, rounded up)."""
    return (int(numel) + 7) // 8


def pack_mask(mask: Tensor) -> Tensor:
    """Pack a bool mask of any shape into a 1-D ``uint8`` tensor, 1 bit per entry (method.md §2's "1/32").

    Round-trips exactly with :func:`unpack_mask` given the original shape; ``numel`` need not be a
    multiple of 8 (the last byte is zero-padded).
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_mask expects a bool mask, got dtype {mask.dtype}")
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if not _LITTLE_ENDIAN or flat.storage_offset() % 8:
        if _LITTLE_ENDIAN:
            flat = flat.clone()  # an int64 view needs 8-byte alignment
        else:  # pragma: no cover - portable path: 8 strided ORs
            bits = flat.view(torch.uint8).view(-1, 8)
            out = bits[:, 0].clone()
            for j in range(1, 8):
                out.bitwise_or_(bits[:, j] << j)
            return out
    # Each int64 word holds 8 mask bytes (0/1; byte j = entry j, little-endian). Folding the word onto
    # itself three times gathers bit 8j down to bit j of byte 0 — 3 shift-ORs on contiguous words,
    # ~15x faster than a shift-and-sum over (bytes, 8).
    x = flat.view(torch.uint8).view(torch.int64)
    x = x | (x >> 7)  # byte k: bits 0-1 = entries k, k+1
    x |= x >> 14  # bits 0-3 = entries k..k+3
    x |= x >> 28  # bits 0-7 = entries k..k+7 (bit 56 is the highest set: no sign bit, no carry)
    return x.to(torch.uint8)  # byte 0 of every word


def unpack_mask(packed: Tensor, shape: Sequence[int] | torch.Size) -> Tensor:
    """Inverse of :func:`pack_mask`: a bool tensor of ``shape`` on ``packed``'s device."""
    shape = torch.Size(shape)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(f"unpack_mask expects the 1-D uint8 tensor of pack_mask, got {packed.dtype} "
                        f"of shape {tuple(packed.shape)}")
    if packed.numel() != packed_numel(shape.numel()):
        raise ValueError(
            f"packed mask has {packed.numel()} bytes but shape {tuple(shape)} needs "
            f"{packed_numel(shape.numel())}; was it packed from a tensor of another shape?"
        )
    if _LITTLE_ENDIAN:
        # the folds of pack_mask in reverse: spread bit j of each byte to bit 8j of an int64 word
        x = packed.to(torch.int64)
        x.bitwise_or_(x << 28).bitwise_and_(0x0000000F0000000F)  # bits 0-3 | bits 4-7 at 32
        x.bitwise_or_(x << 14).bitwise_and_(0x0003000300030003)  # 2 bits at 0, 16, 32, 48
        x.bitwise_or_(x << 7).bitwise_and_(0x0101010101010101)  # 1 bit at 8j
        bits = x.view(torch.uint8)
    else:  # pragma: no cover
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        bits = torch.bitwise_right_shift(packed.unsqueeze(1), shifts).bitwise_and_(1)
    return bits.view(torch.bool).reshape(-1)[: shape.numel()].reshape(shape)


_LITTLE_ENDIAN = sys.byteorder == "little"
