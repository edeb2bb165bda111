"""``--format compressed-tensors``: the legacy ``sparse-24-bitmask`` layout (method.md §7 "deployment").

This is the layout that vLLM < 0.19.1 serves for 2:4 models (compressed-tensors removed its sparse
compressors in 0.15). It is written here by our own code, with no dependency on compressed-tensors; when
``compressed-tensors<0.15`` is installed, the tests decompress our files with *its* decompressor.

Per 2:4 target (an ``nn.Linear`` weight ``(R, C)``, 2:4 along its last dim):

* ``<fqn>.compressed``: ``(R, C/2)`` the kept values, in row-major order, in the weight's dtype;
* ``<fqn>.bitmask``: ``(R, ceil(C/8))`` uint8, the kept-mask bit-packed per row, little-endian bit order
  (``numpy.packbits(mask, axis=-1, bitorder="little")``);
* ``<fqn>.shape``: ``(2, 1)`` int64, the dense shape.

Everything else is stored under its own name in ``model.safetensors``; ``config.json`` gets
``quantization_config = {"quant_method": "compressed-tensors", "sparsity_config": {"format":
"sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"], "ignore": [non-target linears],
...}}`` — which means plain ``transformers`` will only load it with ``compressed-tensors`` installed.
Size: fp16 values 0.5 + bitmask 0.0625 = 0.5625 × dense, the same as our compressed format for 2:4.

GPT-2 ``Conv1D`` weights are refused: the format compresses the *stored* tensor along its last dim and
its loaders put the decompressed tensor back under the same name, while Conv1D stores ``(in, out)`` with
the 2:4 groups along dim 0. Use ``--format compressed`` (which handles the transpose) for GPT-2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from cast_llm.deploy.bitpack import pack_bits, unpack_bits
from cast_llm.deploy.checkpoint import (
    model_from_state_dict,
    save_config_and_tokenizer,
    staged_output,
    unique_state_dict,
    write_marker,
)
from cast_llm.deploy.export import EXPORT_MARKER, verify_nm
from cast_llm.deploy.model_card import writer_card
from cast_llm.errors import CastError
from cast_llm.io import read_json, read_json_object
from cast_llm.layers import is_linear_like
from cast_llm.sparsity.mask import nm_mask
from cast_llm.targets import find_targets

WEIGHTS_FILE = "model.safetensors"
SPARSITY_FORMAT = "sparse-24-bitmask"
COMPAT_VERSION = "0.14.0.1"  # the last compressed-tensors release with this compressor
# No install hint names compressed-tensors<0.15 any more: those releases resolve a `format` they do not know as
# `file.py:attr` and run that file. cast-llm reads this layout with its own decoder (no library needed) and
# refuses a config naming an unknown format before any library sees it (models.loading.check_model_folder).
LIBRARY_HINT = ("served by vLLM < 0.19.1; read back with `cast-llm` itself (its own decoder, no library needed); "
                "compressed-tensors < 0.15 runs code named in a config: install it only where every model folder "
                "it reads is trusted")


def compressed_tensors_version() -> str | None:
    """The installed compressed-tensors version if it still has the sparse-24-bitmask compressor, else None."""
    try:
        import compressed_tensors
        from compressed_tensors.compressors.sparse_compressors.sparse_24_bitmask import (  # noqa: F401
            Sparse24BitMaskCompressor,
        )
    except Exception:  # absent, or a release without sparse compressors (>= 0.15), or broken by its deps
        return None
    return getattr(compressed_tensors, "__version__", "unknown")


def pack_bitmask_rows(mask: torch.Tensor) -> torch.Tensor:
    """(R, C) bool -> (R, ceil(C/8)) uint8, each row padded to whole bytes, LSB first."""
    rows, cols = mask.shape
    padded_cols = (cols + 7) // 8 * 8
    padded = torch.zeros(rows, padded_cols, dtype=torch.uint8, device=mask.device)
    padded[:, :cols] = mask.to(torch.uint8)
    return pack_bits(padded, 1).view(rows, padded_cols // 8)


def unpack_bitmask_rows(packed: torch.Tensor, cols: int) -> torch.Tensor:
    rows, nbytes = packed.shape
    return unpack_bits(packed.reshape(-1).contiguous(), 1, rows * nbytes * 8).view(rows, nbytes * 8)[:, :cols].bool()


def compress_24_bitmask(weight: torch.Tensor, name: str = "weight") -> dict[str, torch.Tensor]:
    """The three tensors of one 2:4 weight ``(R, C)`` (raises CastError naming ``name`` unless 2:4)."""
    rows, cols = weight.shape
    if cols % 4:
        raise CastError(f"{name}: {cols} columns is not a multiple of 4; it cannot be 2:4")
    keep = nm_mask(weight, 2, 4)  # every non-zero, padded with the first zeros of under-full groups
    if bool((weight.masked_select(~keep) != 0).any()):
        raise CastError(f"{name} {tuple(weight.shape)} is not 2:4 sparse")
    values = weight.masked_select(keep).view(rows, cols // 2)  # row-major order of the kept entries
    return {"compressed": values.contiguous(), "bitmask": pack_bitmask_rows(keep),
            "shape": torch.tensor([rows, cols], dtype=torch.int64).view(2, 1)}


def decompress_24_bitmask(compressed: torch.Tensor, bitmask: torch.Tensor, shape) -> torch.Tensor:
    rows, cols = (int(s) for s in torch.as_tensor(shape).flatten().tolist())
    keep = unpack_bitmask_rows(bitmask, cols)
    out = torch.zeros(rows, cols, dtype=compressed.dtype, device=compressed.device)
    out.masked_scatter_(keep, compressed.reshape(-1))
    return out


def _linear_names(model: nn.Module) -> list[str]:
    return [fqn for fqn, mod in model.named_modules() if is_linear_like(mod)]


def save_compressed_tensors(model, tokenizer, output_dir: str | Path, *, targets=None,
                            metadata: dict[str, Any] | None = None, card: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (exactly 2:4) in the compressed-tensors ``sparse-24-bitmask`` layout — a legacy layout
    today (:data:`cast_llm.deploy.model_card.COMPRESSED_TENSORS_LEGACY`), with a model card (``card``)."""
    targets = targets if targets is not None else find_targets(model, n=2, m=4, skip_incompatible=True)
    conv1d = [t.fqn for t in targets if t.transposed]
    if conv1d:
        raise CastError(f"--format compressed-tensors cannot store transposed (GPT-2 Conv1D) layers such as "
                        f"{conv1d[0]}: sparse-24-bitmask needs the 2:4 groups along the stored last dim; "
                        "use --format compressed or hf")
    rows = verify_nm(model, n=2, m=4, targets=targets)
    tensors, aliases = unique_state_dict(model)
    for t in targets:
        w = tensors.pop(t.fqn + ".weight")
        for key, value in compress_24_bitmask(w, t.fqn).items():
            tensors[f"{t.fqn}.{key}"] = value
    zeros = sum(r.zeros for r in rows)
    numel = sum(r.numel for r in rows)
    target_names = {t.fqn for t in targets}
    sparsity_config = {
        "format": SPARSITY_FORMAT,
        "sparsity_structure": "2:4",
        "targets": ["Linear"],
        "ignore": [f for f in _linear_names(model) if f not in target_names],
        "global_sparsity": zeros / max(numel, 1),
        "registry_requires_subclass": False,
    }
    quantization_config = {"quant_method": "compressed-tensors", "version": COMPAT_VERSION,
                           "sparsity_config": sparsity_config, "transform_config": {}}
    out = Path(output_dir)
    with staged_output(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        save_config_and_tokenizer(model, tokenizer, tmp, {"quantization_config": quantization_config})

        writer_card(tmp, model, fmt="compressed-tensors", dest=out, card=card, pattern="2:4", nm_rows=rows,
                    sparsity=getattr(model.config, "sparsity", None))
        write_marker(tmp, "compressed-tensors-sparse-24-bitmask", aliases=aliases, **(metadata or {}))
    return out


def is_compressed_tensors_checkpoint(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    config = read_json(cfg)  # a damaged config.json is not one of ours (the loader then names what is wrong)
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    sc = qc.get("sparsity_config") if isinstance(qc, dict) else None
    return isinstance(sc, dict) and sc.get("format") == SPARSITY_FORMAT


def _check_stored_shapes(file: Path, f, prefix: str, keys: list[str]) -> None:
    """The dense shape a target's ``.shape`` tensor declares must be what its stored ``.compressed`` (R, C/2) and
    ``.bitmask`` (R, ceil(C/8)) tensors hold, checked from the safetensors header before anything is allocated
    (a ``.shape`` claiming 150000 x 150000 would zero-fill 45 GB first); a one-line CastError otherwise."""
    missing = [f"{prefix}.{part}" for part in ("compressed", "shape") if f"{prefix}.{part}" not in keys]
    if missing:
        raise CastError(f"{file}: {prefix}.bitmask has no {missing[0]}: the checkpoint is damaged")
    shape_slice = f.get_slice(prefix + ".shape")
    if list(shape_slice.get_shape()) not in ([2, 1], [2]) or shape_slice.get_dtype() not in ("I64", "I32"):
        raise CastError(f"{file}: {prefix}.shape is {shape_slice.get_dtype()} {shape_slice.get_shape()}, not the two "
                        "integers of a dense shape: the checkpoint is damaged")
    rows, cols = (int(v) for v in f.get_tensor(prefix + ".shape").flatten().tolist())
    compressed = list(f.get_slice(prefix + ".compressed").get_shape())
    bitmask = list(f.get_slice(prefix + ".bitmask").get_shape())
    if rows < 1 or cols < 4 or cols % 4 or compressed != [rows, cols // 2] or bitmask != [rows, -(-cols // 8)]:
        raise CastError(f"{file}: {prefix}.shape says {rows} x {cols}, but the stored tensors are .compressed "
                        f"{compressed} and .bitmask {bitmask} (a 2:4 weight of that shape stores "
                        f"[{rows}, {cols // 2}] and [{rows}, {-(-cols // 8)}]): the checkpoint is damaged")


def decompress_compressed_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The dense state dict of a sparse-24-bitmask checkpoint written by :func:`save_compressed_tensors`."""
    p = Path(path)
    if not is_compressed_tensors_checkpoint(p):
        raise CastError(f"{p} is not a compressed-tensors {SPARSITY_FORMAT} checkpoint")
    marker = read_json_object(p / EXPORT_MARKER, "the export's marker") if (p / EXPORT_MARKER).is_file() else {}
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(p / WEIGHTS_FILE), framework="pt", device="cpu") as f:
        keys = list(f.keys())
        prefixes = {k[: -len(".bitmask")] for k in keys if k.endswith(".bitmask")}
        for prefix in prefixes:
            _check_stored_shapes(p / WEIGHTS_FILE, f, prefix, keys)  # before anything of the dense size is allocated
            w = decompress_24_bitmask(f.get_tensor(prefix + ".compressed"), f.get_tensor(prefix + ".bitmask"),
                                      f.get_tensor(prefix + ".shape"))
            state[prefix + ".weight"] = w
        stored = {f"{p_}.{part}" for p_ in prefixes for part in ("compressed", "bitmask", "shape")}
        for k in keys:
            if k not in stored:
                state[k] = f.get_tensor(k)
    aliases = marker.get("aliases", {})
    for alias, source in aliases.items() if isinstance(aliases, dict) else ():
        if source not in state:
            raise CastError(f"{p / EXPORT_MARKER}: alias {alias!r} names {source!r}, which "
                            f"{WEIGHTS_FILE} does not hold: the checkpoint is damaged")
        state[alias] = state[source]
    return state


def load_compressed_tensors(path: str | Path, *, dtype: torch.dtype | None = None, device="cpu"):
    """Rebuild the dense model from a sparse-24-bitmask checkpoint with our own decoder."""
    state = decompress_compressed_tensors(path)
    dtype = dtype or next(v.dtype for v in state.values() if v.is_floating_point())
    return model_from_state_dict(path, state, dtype=dtype, device=device)
