"""Training state on disk without pickle: tensors in safetensors, everything else in JSON.

A checkpoint holds nested Python state — a model ``state_dict``, an optimizer's (int keys, tuples of
betas, bool/uint8 masks, step counters), an LR scheduler's, RNG states (a Python tuple, a NumPy uint32
array, torch byte tensors), observers' running values. :func:`save_state` writes such a tree as
``NAME.json`` (the structure, with tagged nodes for what JSON lacks) plus ``NAME.safetensors`` (every
tensor, referenced from the JSON by key); :func:`load_state` rebuilds it. Loading parses JSON and
safetensors only, so a checkpoint — someone else's, copied between machines — can never execute code;
anything the format cannot express is refused at *save* time, naming where in the tree it is.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cast_llm import dtensor
from cast_llm.errors import CastError

__all__ = ["encode", "decode", "save_state", "load_state", "StateFormatError"]

TAG = "__cast_state__"  # marks a tagged node; a plain dict is stored as a tagged "dict" node too


class StateFormatError(CastError):
    """A state file that is not what :func:`save_state` writes (corrupt, hand-made, or another format)."""


def encode(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``obj`` as a JSON-able tree plus the tensors it references (``{key: CPU tensor}``, not copied)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    alive: list[torch.Tensor] = []  # keeps every seen tensor alive, so no address is reused while encoding

    def tensor_key(t: torch.Tensor, where: str) -> str:
        if dtensor.is_dtensor(t):
            raise TypeError(f"{where}: a DTensor; save its local shard (to_local()) instead")
        t = t.detach().to("cpu")
        alive.append(t)
        sig = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) \
            if t.numel() else None
        if sig is not None and sig in seen:  # the same tensor twice (tied weights): stored once
            return seen[sig]
        key = f"t{len(tensors)}"
        tensors[key] = t  # (views of one storage are fine: write_safetensors writes each tensor's own bytes)
        if sig is not None:
            seen[sig] = key
        return key

    def enc(x: Any, where: str) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {TAG: "float", "v": repr(x)}
        if isinstance(x, torch.Tensor):
            return {TAG: "tensor", "key": tensor_key(x, where)}
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in "biuf":
                raise TypeError(f"{where}: NumPy array of dtype {x.dtype} cannot be stored")
            wide = {"b": np.bool_, "i": np.int64, "u": np.int64, "f": np.float64}[x.dtype.kind]
            return {TAG: "ndarray", "dtype": x.dtype.str, "key": tensor_key(torch.from_numpy(x.astype(wide)), where)}
        if isinstance(x, np.generic):
            return enc(x.item(), where)
        if isinstance(x, torch.Size):
            return {TAG: "tuple", "items": [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, torch.dtype):
            return {TAG: "dtype", "v": str(x).removeprefix("torch.")}
        if isinstance(x, tuple):
            return {TAG: "tuple", "items": [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise TypeError(f"{where}: dict key {k!r} of type {type(k).__name__} cannot be stored")
                items.append([enc(k, where), enc(v, f"{where}.{k}")])
            return {TAG: "dict", "items": items}
        raise TypeError(f"{where}: a {type(x).__name__} cannot be stored in a checkpoint (tensors, numbers, "
                        "strings, lists, tuples and dicts only)")

    return enc(obj, "state"), tensors


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`encode`."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        kind = x.get(TAG)
        if kind == "dict":
            return {dec(k): dec(v) for k, v in x["items"]}
        if kind == "tuple":
            return tuple(dec(v) for v in x["items"])
        if kind == "float":
            return float(x["v"])
        if kind == "tensor":
            return _tensor(x["key"])
        if kind == "ndarray":
            return _tensor(x["key"]).numpy().astype(np.dtype(x["dtype"]))
        if kind == "dtype":
            dt = getattr(torch, str(x["v"]), None)
            if not isinstance(dt, torch.dtype):
                raise StateFormatError(f"unknown dtype {x['v']!r} in a state file")
            return dt
        raise StateFormatError(f"unexpected node {str(x)[:80]!r} in a state file")

    def _tensor(key: str) -> torch.Tensor:
        if key not in tensors:
            raise StateFormatError(f"a state file refers to tensor {key!r}, which its .safetensors file lacks")
        return tensors[key]

    return dec(tree)


def save_state(stem: str | Path, obj: Any) -> list[Path]:
    """Write ``obj`` as ``STEM.json`` + ``STEM.safetensors``; returns the two paths (not atomic by itself:
    checkpoints write into a temporary folder that is renamed when complete)."""
    stem = Path(stem)
    tree, tensors = encode(obj)
    js, st = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    js.write_text(json.dumps({"format": "cast-llm-state/1", "tree": tree}))
    write_safetensors(tensors, st)
    return [js, st]


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """The safetensors format (an 8-byte little-endian header length, the JSON header padded to 8 bytes, then
    every tensor's bytes), written one tensor at a time: ``safetensors.torch.save_file`` first turns every
    tensor into ``bytes``, a second copy of a whole checkpoint shard in host memory (12 GiB per rank at 8B on
    8 GPUs). ``safetensors.torch.load_file`` reads it back."""
    header, offset = {}, 0
    for key, t in tensors.items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise StateFormatError(f"tensor {key}: dtype {t.dtype} cannot be stored")
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for t in tensors.values():
            if t.numel():  # one contiguous copy at most, of this tensor alone
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def load_state(stem: str | Path) -> Any:
    """Read what :func:`save_state` wrote (JSON and safetensors only: no code can run)."""
    from safetensors.torch import load_file

    stem = Path(stem)
    js, st = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    try:
        doc = json.loads(js.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StateFormatError(f"{js} cannot be read as a cast-llm state file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != "cast-llm-state/1":
        raise StateFormatError(f"{js} is not a cast-llm state file (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    try:
        tensors = load_file(str(st))
    except Exception as e:  # safetensors raises its own error types for a torn or foreign file
        raise StateFormatError(f"{st} cannot be read as safetensors ({type(e).__name__}: {e})") from None
    return decode(doc["tree"], tensors)
