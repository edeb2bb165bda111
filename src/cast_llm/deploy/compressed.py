"""``--format compressed``: our compact N:M checkpoint (method.md §1, §7 "speed and memory").

Layout of the output folder::

    config.json               the model's config (+ the ``sparsity`` entry of an hf export)
    compressed.safetensors    per target ``<fqn>.weight.values`` (R, C·n/m) and ``<fqn>.weight.positions``
                              (uint8, bit-packed); every other tensor (embeddings, norms, biases, ...) as is
    compressed_index.json     format, version, n, m, dtype, per target: shape, transposed, encoding, and the
                              tied-tensor aliases; plus the measured bytes of targets and of the rest
    tokenizer files, generation_config.json
    cast_llm.json             completion marker (written last)

There is deliberately no ``model.safetensors``: plain ``transformers`` must not mistake the folder for a
dense checkpoint. :func:`load_compressed` rebuilds the dense model bit-identically (pruned entries come back
as ``+0.0``) and, with ``semi_structured=True`` on a CUDA GPU, swaps the targets to 2:4 layers
(:mod:`cast_llm.deploy.sparse24`: compressed once, cuSPARSELt / CUTLASS kernels; docs/deployment.md).

For fp16 2:4 targets the on-disk size is 0.5 (values) + 0.0625 (2-bit positions) = 0.5625 × dense, plus a
few hundred bytes of safetensors header. GPT-2 ``Conv1D`` weights are stored in ``(out, in)`` orientation
(groups along the input dim) and transposed back on load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cast_llm.deploy.checkpoint import (
    DTYPES,
    dtype_name,
    model_from_state_dict,
    read_format_index,
    save_config_and_tokenizer,
    staged_output,
    unique_state_dict,
    write_marker,
)
from cast_llm.deploy.export import sparsity_report, verify_nm
from cast_llm.deploy.model_card import writer_card
from cast_llm.deploy.nm_codec import NMSparseWeight
from cast_llm.deploy.semi_structured import require_semi_structured
from cast_llm.deploy.sparse24 import Dispatcher, Sparse24Linear, to_sparse24_
from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24.kernels import CPU_KERNELS, available_kernels
from cast_llm.errors import CastError
from cast_llm.io import pretrained_kwargs
from cast_llm.layers import set_submodule
from cast_llm.targets import find_targets

FORMAT = "cast-llm-compressed-nm"
VERSION = 1
WEIGHTS_FILE = "compressed.safetensors"
INDEX_FILE = "compressed_index.json"


def _model_dtype(model) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def compress_state_dict(model, *, n: int = 2, m: int = 4, targets=None, encoding: str = "auto"
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and index of the compressed format for ``model`` (verified N:M first)."""
    targets = targets if targets is not None else find_targets(model, n=n, m=m, skip_incompatible=True)
    verify_nm(model, n=n, m=m, targets=targets)  # names every non-N:M layer in one error
    tensors, aliases = unique_state_dict(model)
    index: dict[str, Any] = {"format": FORMAT, "version": VERSION, "n": n, "m": m,
                             "dtype": dtype_name(_model_dtype(model)), "targets": {}, "aliases": aliases}
    target_bytes = dense_target_bytes = 0
    for t in targets:
        key = t.fqn + ".weight"
        if key in aliases:  # a target tied to another tensor (never in practice): keep it dense
            continue
        w = tensors.pop(key)
        dense_target_bytes += w.numel() * w.element_size()
        w2d = w.t() if t.transposed else w  # (out, in): groups along the input dim
        packed = NMSparseWeight.from_dense(w2d, n, m, encoding=encoding, name=t.fqn)
        tensors[key + ".values"] = packed.values
        tensors[key + ".positions"] = packed.positions
        target_bytes += packed.nbytes
        index["targets"][t.fqn] = {"shape": list(packed.shape), "transposed": t.transposed,
                                   "encoding": packed.encoding}
    other = sum(v.numel() * v.element_size() for k, v in tensors.items() if not k.endswith((".values", ".positions")))
    index["bytes"] = {"targets_compressed": target_bytes, "targets_dense": dense_target_bytes, "other": other}
    return tensors, index


def save_compressed(model, tokenizer, output_dir: str | Path, *, n: int = 2, m: int = 4, targets=None,
                    encoding: str = "auto", metadata: dict[str, Any] | None = None,
                    card: dict[str, Any] | None = None) -> Path:
    """Write ``model`` in the compressed N:M format (refuses a model that is not exactly N:M), with a model
    card (``card``: recorded facts of the model's origin, :mod:`cast_llm.deploy.model_card`)."""
    tensors, index = compress_state_dict(model, n=n, m=m, targets=targets, encoding=encoding)
    out = Path(output_dir)
    with staged_output(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        save_config_and_tokenizer(model, tokenizer, tmp)

        writer_card(tmp, model, fmt="compressed", dest=out, card=card, pattern=f"{n}:{m}",
                    sparsity=getattr(model.config, "sparsity", None),
                    nm_rows=sparsity_report(model, n=n, m=m, targets=targets))
        write_marker(tmp, "compressed-sparse-model", format=FORMAT, pattern=f"{n}:{m}", **(metadata or {}))
    return out


def is_compressed_checkpoint(path: str | Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file() and (Path(path) / WEIGHTS_FILE).is_file()


def read_index(path: str | Path) -> dict[str, Any]:
    """``compressed_index.json`` of a compressed checkpoint (a CastError for anything else)."""
    return read_format_index(path, INDEX_FILE, FORMAT, VERSION, kind="compressed", required=(WEIGHTS_FILE,),
                             hint="write one with `cast-llm export MODEL --format compressed`")


def decompress_state_dict(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The dense state dict of a compressed checkpoint (tied aliases included)."""
    p = Path(path)
    index = read_index(p)
    n, m = index["n"], index["m"]
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(p / WEIGHTS_FILE), framework="pt", device=str(device)) as f:
        keys = set(f.keys())
        for fqn, info in index["targets"].items():
            key = fqn + ".weight"
            packed = NMSparseWeight(f.get_tensor(key + ".values"), f.get_tensor(key + ".positions"),
                                    tuple(info["shape"]), n, m, info["encoding"])
            w = packed.to_dense()
            state[key] = w.t().contiguous() if info["transposed"] else w
            keys -= {key + ".values", key + ".positions"}
        for key in keys:
            state[key] = f.get_tensor(key)
    for alias, source in index.get("aliases", {}).items():
        state[alias] = state[source]
    return state


def load_compressed(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                    semi_structured: bool = False, sparse24: bool = False, dispatch: Dispatcher | bool = True):
    """The model of a compressed checkpoint, on ``device`` in ``dtype`` (default: as stored).

    * default: the dense model, rebuilt bit-identically (pruned entries ``+0.0``);
    * ``sparse24=True`` (CPU): the targets load **straight into** :class:`~cast_llm.deploy.sparse24.Sparse24Linear`
      layers holding only the file's kept values and positions (the positions stream is the CPU kernels' own
      form), so no dense copy of a target weight is ever made and resident memory is the compressed size.
      Each layer runs the CPU 2:4 kernel or, where the dispatcher measures it faster (large token counts), the
      dense weight rebuilt into one scratch buffer shared by all layers of a shape. ``dtype`` defaults to the
      stored one; fp16 (which the CPU kernels do not take) loads as fp32, exactly — pass ``torch.bfloat16`` for
      the faster, rounded model. Without the CPU extension (one line says why) the targets load dense.
      ``dispatch``: a :class:`~cast_llm.deploy.sparse24.Dispatcher` (e.g. with a cache file), True (a new one)
      or False (always the 2:4 kernel);
    * ``semi_structured=True`` (CUDA, compute capability ≥ 8.0, fp16/bf16): the dense model, then every target
      swapped to a 2:4 layer always running its GPU kernel (the dense copy freed as it is swapped; for the
      measured dense/2:4 choice call :func:`~cast_llm.deploy.sparse24.to_sparse24_` on the dense model instead).
    """
    index = read_index(path)
    stored = DTYPES.get(index["dtype"], torch.float32)
    if sparse24:
        if semi_structured:
            raise CastError("load_compressed: pass sparse24=True (CPU) or semi_structured=True (CUDA), not both")
        if torch.device(device).type != "cpu":
            raise CastError(f"load_compressed(sparse24=True) loads onto the CPU, not {device}; on a GPU use "
                            "semi_structured=True")
        return _load_sparse24(Path(path), index, dtype or (torch.float32 if stored == torch.float16 else stored),
                              dispatch)
    dtype = dtype or stored
    if semi_structured:
        require_semi_structured(device, dtype)
    model = model_from_state_dict(path, decompress_state_dict(path), dtype=dtype, device=device)
    if semi_structured:
        names = set(index["targets"])
        to_sparse24_(model, filter_fn=lambda module, fqn: fqn in names, dispatch=False)
    return model


def _load_sparse24(path: Path, index: dict[str, Any], dtype: torch.dtype, dispatch):
    """See :func:`load_compressed` (``sparse24=True``): parameters are created on the meta device, every
    non-target tensor is read from the file into its place, every target becomes a Sparse24Linear."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if index["n"] != 2 or index["m"] != 4:
        raise CastError(f"{path}: a {index['n']}:{index['m']} checkpoint; the 2:4 layers load 2:4 ones only "
                        "(load it dense: load_compressed(path))")
    if dtype not in (torch.bfloat16, torch.float32):
        raise CastError(f"the CPU 2:4 layers run bfloat16 or float32, not {dtype}; pass dtype=torch.bfloat16")
    kernels, why = available_kernels("cpu", dtype, CPU_KERNELS)
    if not kernels:
        print(f"cast-llm: no CPU 2:4 kernel runs here ({next(iter(why.values()), 'none')}); {path} loads dense",
              file=sys.stderr)
        return model_from_state_dict(path, decompress_state_dict(path), dtype=dtype, device="cpu")
    config = AutoConfig.from_pretrained(path, **pretrained_kwargs())
    for key in ("sparsity", "quantization_config"):
        if hasattr(config, key):
            delattr(config, key)
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with init_empty_weights(include_buffers=False):  # parameters on meta (no bytes); buffers (RoPE) real
        model = model_cls._from_config(config, dtype=dtype)
    if dispatch is True:
        dispatch = Dispatcher(device="cpu")
    targets = index["targets"]
    with safe_open(str(path / WEIGHTS_FILE), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        for fqn, info in targets.items():
            out_f, in_f = info["shape"]
            key = fqn + ".weight"
            if info["encoding"] != "index" or info["transposed"]:
                packed = NMSparseWeight(f.get_tensor(key + ".values"), f.get_tensor(key + ".positions"),
                                        (out_f, in_f), 2, 4, info["encoding"])
                w = packed.to_dense()
                state = cpu24.compress((w.t().contiguous() if info["transposed"] else w).to(dtype))
            else:
                values = f.get_tensor(key + ".values").to(dtype)
                positions = f.get_tensor(key + ".positions")
                if in_f % 8 == 0:  # the file's 2-bit stream, row after row: exactly the kernels' meta
                    meta = positions.view(out_f, in_f // 8)
                else:
                    codes = NMSparseWeight(values, positions, (out_f, in_f), 2, 4, "index").positions_tensor()
                    meta = cpu24.pack_positions(codes.reshape(out_f, in_f // 2).to(torch.uint8))
                cpu24.check_positions(meta, in_f, f"{path / WEIGHTS_FILE}: {key}.positions")
                state = {"values": values.contiguous(), "meta": meta.contiguous()}
            keys -= {key + ".values", key + ".positions"}
            bias_key = fqn + ".bias"
            bias = f.get_tensor(bias_key).to(dtype) if bias_key in keys else None
            keys.discard(bias_key)
            layer = Sparse24Linear(in_f, out_f, states={"cpu24": state}, kernels=kernels, dense_weight=None,
                                   bias=bias, dtype=dtype, device=torch.device("cpu"), dispatcher=dispatch or None,
                                   name=fqn)
            set_submodule(model, fqn, layer)
        for key in sorted(keys):
            set_module_tensor_to_device(model, key, "cpu", value=f.get_tensor(key).to(dtype))
    for alias, source in index.get("aliases", {}).items():
        owner, _, leaf = alias.rpartition(".")
        src_owner, _, src_leaf = source.rpartition(".")
        setattr(model.get_submodule(owner), leaf, getattr(model.get_submodule(src_owner), src_leaf))
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise CastError(f"{path}: the stored weights lack {left[:5]}; the checkpoint is incomplete or was written "
                        "for another architecture")
    return model.eval()


def on_disk_bytes(path: str | Path) -> dict[str, int]:
    """Sizes of the weight files of a checkpoint folder (all ``*.safetensors``), and their total."""
    files = sorted(Path(path).glob("*.safetensors"))
    sizes = {f.name: f.stat().st_size for f in files}
    sizes["total"] = sum(sizes.values())
    return sizes
