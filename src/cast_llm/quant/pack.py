"""Packed integer checkpoints of a quantized model, and their loader (method.md §7).

``cast-llm quantize ... --output-dir O`` writes::

    O/quantized.safetensors   per target: <fqn>.qweight (b-bit codes, bit-packed), <fqn>.scales (R, G) fp16,
                              <fqn>.qzeros (b-bit zero-points, bit-packed), and for N:M-sparse targets
                              <fqn>.positions (the 2-bit in-group positions of the stored codes);
                              every other tensor (embeddings, norms incl. AWQ-folded scales, biases) as is
    O/quant_index.json        method, bits, group size, dtype, per target: shape, transposed, layout
    O/config.json, tokenizer files, O/cast_llm.json (completion marker)
    O/fake-quant/             a plain HF checkpoint of the dequantized weights (what `transformers` loads,
                              what `cast-llm eval-ppl` evaluates)

Two layouts per target (codes are ``(R, C)`` in ``(out, in)`` orientation):

* ``"dense"``: all ``R·C`` codes, ``b`` bits each;
* ``"nm"``: when the dequantized weight is N:M, only the codes of the ``n`` kept entries of each group
  (``R·C·n/m`` codes) plus their positions (:class:`cast_llm.deploy.nm_codec.NMSparseWeight`); a pruned
  entry's code is the zero-point of its group (``ŵ = 0`` iff ``q = z``), so the codes are rebuilt exactly.
  4-bit 2:4: 2 bits (codes) + 1 bit (positions) per weight instead of 4.

:func:`load_quantized` dequantizes with the same :func:`cast_llm.quant.rtn.dequantize_codes` that made the
fake-quant weights, so it reproduces ``O/fake-quant`` bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cast_llm.deploy.bitpack import pack_bits, unpack_bits
from cast_llm.deploy.checkpoint import (
    dtype_name,
    model_from_state_dict,
    parse_dtype,
    read_format_index,
    save_config_and_tokenizer,
    staged_output,
    unique_state_dict,
    write_marker,
)
from cast_llm.deploy.export import save_sparse_checkpoint, sparsity_report
from cast_llm.deploy.model_card import quantized_facts, writer_card
from cast_llm.deploy.nm_codec import NMSparseWeight
from cast_llm.errors import CastError
from cast_llm.quant.rtn import QuantizedWeight, num_groups
from cast_llm.sparsity.mask import nm_mask
from cast_llm.targets import find_targets

FORMAT = "cast-llm-quantized"
VERSION = 1
WEIGHTS_FILE = "quantized.safetensors"
INDEX_FILE = "quant_index.json"
FAKE_QUANT_DIR = "fake-quant"


def pack_weight(qw: QuantizedWeight, n: int = 2, m: int = 4) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The stored tensors (names relative to the target) and index entry of one quantized weight."""
    rows, cols = qw.shape
    tensors = {"scales": qw.scale.contiguous(), "qzeros": pack_bits(qw.zero, qw.bits)}
    info: dict[str, Any] = {"shape": [rows, cols], "layout": "dense"}
    nonzero = qw.codes != qw.zero.repeat_interleave(qw.group_size, dim=1)[:, :cols]  # ŵ != 0
    if cols % m == 0 and bool((nonzero.view(rows, cols // m, m).sum(-1) <= n).all()):
        keep = nm_mask(nonzero.float(), n, m)  # every non-zero code, padded by position to exactly n
        sparse = NMSparseWeight.from_dense(torch.where(keep, qw.codes, 0), n, m, mask=keep)
        tensors["qweight"] = pack_bits(sparse.values, qw.bits)
        tensors["positions"] = sparse.positions
        info.update(layout="nm", n=n, m=m, encoding=sparse.encoding)
    else:
        tensors["qweight"] = pack_bits(qw.codes, qw.bits)
    return tensors, info


def unpack_weight(tensors: dict[str, torch.Tensor], info: dict[str, Any], bits: int, group_size: int
                  ) -> QuantizedWeight:
    rows, cols = info["shape"]
    zero = unpack_bits(tensors["qzeros"], bits, rows * num_groups(cols, group_size)).view(rows, -1)
    if info["layout"] == "nm":
        n, m = info["n"], info["m"]
        values = unpack_bits(tensors["qweight"], bits, rows * cols // m * n).view(rows, cols // m * n)
        sparse = NMSparseWeight(values, tensors["positions"], (rows, cols), n, m, info["encoding"])
        codes = sparse.to_dense(fill=zero.repeat_interleave(group_size, dim=1)[:, :cols])
    else:
        codes = unpack_bits(tensors["qweight"], bits, rows * cols).view(rows, cols)
    return QuantizedWeight(codes, tensors["scales"], zero, bits, group_size)


def save_quantized(model, result, tokenizer, output_dir: str | Path, *, n: int = 2, m: int = 4,
                   metadata: dict[str, Any] | None = None) -> Path:
    """Write the packed checkpoint and ``fake-quant/`` of a model quantized by ``quantize_model_``.

    ``model`` holds the fake-quant weights (in the dtype to store the other tensors in); ``result`` is the
    :class:`cast_llm.quant.QuantResult`. Before writing, each packed weight is unpacked again and must equal
    the model's fake-quant weight bit for bit.
    """
    tensors, aliases = unique_state_dict(model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    index: dict[str, Any] = {"format": FORMAT, "version": VERSION, "method": result.method, "bits": result.bits,
                             "group_size": result.group_size, "dtype": dtype_name(dtype), "targets": {},
                             "aliases": aliases, "awq": result.awq_report}
    packed_bytes = 0
    for fqn, qw in result.weights.items():
        dense = tensors.pop(fqn + ".weight")
        parts, info = pack_weight(qw, n, m)
        info["transposed"] = result.transposed[fqn]
        back = unpack_weight(parts, info, qw.bits, qw.group_size).dequantize(dtype)
        if not torch.equal(back.t() if info["transposed"] else back, dense):
            raise CastError(f"internal check failed: packed {fqn} does not reproduce its fake-quant weight; "
                            "nothing was written")
        for k, v in parts.items():
            tensors[f"{fqn}.{k}"] = v
            packed_bytes += v.numel() * v.element_size()
        index["targets"][fqn] = info
    index["bytes"] = {"targets_packed": packed_bytes}
    targets = find_targets(model, n=n, m=m, skip_incompatible=True)
    sparse = all(r.is_nm for r in sparsity_report(model, n=n, m=m, targets=targets))
    quant_info = {k: index[k] for k in ("method", "bits", "group_size")}
    out = Path(output_dir)

    card = quantized_facts(metadata, quant_info)  # the model card: the source's record, what quantize measured
    with staged_output(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        save_config_and_tokenizer(model, tokenizer, tmp)
        writer_card(tmp, model, fmt="quantized", dest=out, card=card, pattern=f"{n}:{m}" if sparse else "none",
                    nm_rows=sparsity_report(model, n=n, m=m, targets=targets) if sparse else None)
        fake = tmp / FAKE_QUANT_DIR
        if sparse:  # keeps the `sparsity` entry and the N:M verification of a plain hf export
            save_sparse_checkpoint(model, tokenizer, fake, n=n, m=m, targets=targets,
                                   method=(metadata or {}).get("sparsity_method", "unknown"),
                                   metadata={"quantization": quant_info}, card=card)
        else:
            model.save_pretrained(fake, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(fake)
            write_marker(fake, "fake-quant-model", quantization=quant_info)
        write_marker(tmp, "quantized-model", format=FORMAT, fake_quant=FAKE_QUANT_DIR, sparse=sparse,
                     quantization=quant_info, **(metadata or {}))
    return out


def read_index(path: str | Path) -> dict[str, Any]:
    """``quant_index.json`` of a packed quantized checkpoint (a CastError for anything else)."""
    return read_format_index(path, INDEX_FILE, FORMAT, VERSION, kind="quantized",
                             hint="write one with `cast-llm quantize`")


def load_quantized_weights(path: str | Path) -> dict[str, QuantizedWeight]:
    """The packed weights of a quantized checkpoint, unpacked to codes / scales / zero-points."""
    p = Path(path)
    index = read_index(p)
    out = {}
    with safe_open(str(p / WEIGHTS_FILE), framework="pt", device="cpu") as f:
        for fqn, info in index["targets"].items():
            names = ["qweight", "scales", "qzeros"] + (["positions"] if info["layout"] == "nm" else [])
            parts = {k: f.get_tensor(f"{fqn}.{k}") for k in names}
            out[fqn] = unpack_weight(parts, info, index["bits"], index["group_size"])
    return out


def load_quantized(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """The dequantized model of a packed checkpoint (equal, bit for bit, to ``path/fake-quant`` in the
    stored dtype)."""
    p = Path(path)
    index = read_index(p)
    dtype = dtype or parse_dtype(index["dtype"])
    weights = load_quantized_weights(p)
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(p / WEIGHTS_FILE), framework="pt", device="cpu") as f:
        skip = {f"{fqn}.{k}" for fqn in index["targets"] for k in ("qweight", "scales", "qzeros", "positions")}
        for key in f.keys():
            if key not in skip:
                state[key] = f.get_tensor(key)
    for fqn, qw in weights.items():
        w = qw.dequantize(dtype)
        state[fqn + ".weight"] = w.t().contiguous() if index["targets"][fqn]["transposed"] else w
    for alias, source in index.get("aliases", {}).items():
        state[alias] = state[source]
    return model_from_state_dict(p, state, dtype=dtype, device=device)
