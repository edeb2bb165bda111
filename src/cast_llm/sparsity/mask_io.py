"""N:M masks as files: what a run starts from with ``--mask-file``, so that a mask (a one-shot method's, or
the one a CAST run learned) can be swapped under one and the same retraining recipe and the comparison rerun.

A mask file is a ``.safetensors`` keyed by target name (``model.layers.0.mlp.up_proj``), each mask in the
weight's own layout packed eight entries a byte (:func:`cast_llm.sparsity.pack_mask`: an eighth of a bool
tensor's bytes; SmolLM2-135M's masks take 13 MB), with ``{"written_by": "cast-llm masks", "n", "m", "source",
"packing": "bits", "shapes"}`` in its metadata. A file written before the packing (bool tensors, no ``packing``)
still loads.
A sparse model folder (a ``cast-llm train`` / ``prune`` export) works too: its mask is where its target
weights are not zero (:func:`mask_of_zeros`; read by :func:`cast_llm.train.methods.masks.masks_from`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from cast_llm.errors import CastError
from cast_llm.io import atomic_write_bytes
from cast_llm.sparsity.mask import magnitude_mask, pack_mask, unpack_mask

__all__ = ["MASKS_MARKER", "mask_of_zeros", "masks_digest", "save_masks", "load_masks"]

MASKS_MARKER = "cast-llm masks"


def mask_of_zeros(weight: Tensor, transposed: bool, n: int, m: int, *, name: str = "weight") -> Tensor:
    """The N:M mask of an N:M-sparse weight: its non-zero entries, completed in a group that holds fewer than
    ``n`` non-zeros (a kept weight that is exactly 0) by the lowest free indices. A group with more than ``n``
    non-zeros is not N:M: a one-line error."""
    nonzero = weight.detach() != 0
    mask = magnitude_mask(nonzero.float(), transposed, n, m)  # ties (zeros) go to the lower index
    if bool((nonzero & ~mask).any()):
        raise CastError(f"{name}: more than {n} non-zero weights in some group of {m}; not an {n}:{m} sparse "
                        "weight (give the exported model of a sparse run, or a mask file)")
    return mask


def save_masks(path: str | Path, masks: dict[str, Tensor], *, n: int, m: int, source: str) -> Path:
    """Write ``masks`` (``{target fqn: bool tensor}``) as a mask file (atomically)."""
    from safetensors.torch import save


    items = sorted(masks.items())
    blob = save({k: pack_mask(v.detach().to(torch.bool).contiguous().cpu()) for k, v in items},
                metadata={"written_by": MASKS_MARKER, "n": str(n), "m": str(m), "source": source,
                          "packing": "bits", "shapes": json.dumps({k: list(v.shape) for k, v in items})})
    return atomic_write_bytes(path, blob)


def masks_digest(masks: dict[str, Tensor]) -> str:
    """SHA-256 of the masks themselves (each target's name, shape and kept entries, in name order): the same
    masks give the same digest whichever process wrote their file. A file's own SHA-256 is not that: safetensors
    writes the metadata in a per-process order, so the same masks saved twice differ in their bytes."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(masks):
        t = masks[name].to(torch.bool).contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_masks(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``(masks, metadata)`` of a mask file written by :func:`save_masks`."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("written_by") != MASKS_MARKER:
                raise CastError(f"{path}: not a cast-llm mask file (no '{MASKS_MARKER}' marker in its metadata)")
            if meta.get("packing") is None:  # a file from before the packing: bool tensors
                return {k: f.get_tensor(k).to(torch.bool) for k in f.keys()}, meta
            if meta["packing"] != "bits":
                raise CastError(f"{path}: unknown mask packing {meta['packing']!r} (this cast-llm reads 'bits')")
            shapes = json.loads(meta["shapes"])
            return {k: unpack_mask(f.get_tensor(k), shapes[k]) for k in f.keys()}, meta
    except CastError:
        raise
    except Exception as e:  # a damaged or foreign file
        raise CastError(f"{path}: cannot be read as a mask file ({type(e).__name__}: {e})") from None
