"""Shared plumbing for the deployment formats: output folders, state dicts, rebuilding a model.

* :func:`prepare_output_dir` — refuse to clobber a folder unless asked, and then only a checkpoint folder;
* :func:`read_format_index` — the JSON index of one of our formats, checked for format and version;
* :func:`staged_output` — write into a temporary folder beside the target, move in when complete, the
  ``cast_llm.json`` completion marker last (the same protocol as :func:`cast_llm.deploy.export.save_sparse_checkpoint`);
* :func:`unique_state_dict` — the model's tensors once each (tied ``lm_head`` = embedding is stored once,
  recorded as an alias), contiguous, on the CPU;
* :func:`model_from_state_dict` — a transformers model from a ``config.json`` folder and a dense state dict
  (meta-device init: no random initialisation of weights that are overwritten anyway).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from cast_llm import __version__
from cast_llm.deploy.export import CHECKPOINT_MARKER
from cast_llm.errors import CastError
from cast_llm.io import move_into, staging_dir

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CastError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def prepare_output_dir(path: str | Path, overwrite: bool) -> Path:
    """Check that ``path`` may be written. With ``overwrite``, an existing *checkpoint* folder (one holding
    ``cast_llm.json`` or ``config.json``) is removed first so no file of an older format lingers."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CastError(f"--output-dir {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise CastError(f"--output-dir {out} is not empty; pass --overwrite to replace it")
        if not ((out / CHECKPOINT_MARKER).is_file() or (out / "config.json").is_file()):
            raise CastError(f"refusing to overwrite {out}: it is not a checkpoint folder (no {CHECKPOINT_MARKER} "
                            "or config.json); choose another --output-dir")
        shutil.rmtree(out)
    return out


@contextmanager
def staged_output(out_dir: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``out_dir``; on success its files are moved into ``out_dir``."""
    out = Path(out_dir)
    with staging_dir(out, prefix=".stage-") as tmp:
        yield tmp
        if not (tmp / CHECKPOINT_MARKER).is_file():
            raise RuntimeError(f"staged checkpoint has no {CHECKPOINT_MARKER}: not moving it into place")
        subdirs = [p for p in tmp.iterdir() if p.is_dir()]
        out.mkdir(parents=True, exist_ok=True)
        for d in subdirs:  # sub-folders (e.g. fake-quant/) are complete checkpoints of their own
            if (out / d.name).exists():
                shutil.rmtree(out / d.name)
            d.rename(out / d.name)
        move_into(tmp, out, last=CHECKPOINT_MARKER)


def read_format_index(folder: str | Path, index_file: str, fmt: str, version: int, *, kind: str, hint: str,
                      required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON index of one of our checkpoint formats (``fmt``, at most ``version``); a CastError naming the
    folder when the index (or one of the ``required`` files) is missing or of another format / a newer version.
    ``kind`` names the format in messages, ``hint`` says how to write one."""
    p = Path(folder)
    needed = (index_file, *required)
    if not all((p / f).is_file() for f in needed):
        raise CastError(f"{p} is not a {kind} checkpoint (no {' / '.join(needed)}); {hint}")
    index = json.loads((p / index_file).read_text())
    if index.get("format") != fmt or index.get("version", 0) > version:
        raise CastError(f"{p}: unsupported {kind} format {index.get('format')} v{index.get('version')} "
                        f"(this cast-llm reads {fmt} v{version})")
    return index


def write_marker(folder: Path, kind: str, **info: Any) -> None:
    payload = {"kind": kind, "cast_llm_version": __version__, **info}
    (folder / CHECKPOINT_MARKER).write_text(json.dumps(payload, indent=2))


def unique_state_dict(model) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, aliases)``: every state-dict tensor once (CPU, contiguous); ``aliases[name] = first_name``
    for tensors sharing storage with an earlier one (tied embeddings), which safetensors cannot store twice."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict().items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    return tensors, aliases


def save_config_and_tokenizer(model, tokenizer, folder: Path, extra_config: dict[str, Any] | None = None) -> None:
    model.config.save_pretrained(folder)
    if extra_config:
        cfg_file = folder / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg.update(extra_config)
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(folder)
        except (ValueError, OSError):  # an invalid generation config must not block a weights export
            pass
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def model_from_state_dict(folder: str | Path, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype,
                          device: str | torch.device = "cpu"):
    """A causal LM built from ``folder/config.json`` holding exactly ``state_dict`` (cast to ``dtype``)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(folder)
    for key in ("sparsity", "quantization_config"):  # our metadata; a quantization_config would trigger a quantizer
        if hasattr(config, key):
            delattr(config, key)
    # the concrete class: the Auto class cannot take a state dict without a path
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model = model_cls.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype)
    missing = [k for k in model.state_dict() if k not in state_dict]
    tied = {k for k in missing if _is_tied(model, k)}
    if set(missing) - tied:
        raise CastError(f"{folder}: the stored weights lack {sorted(set(missing) - tied)[:5]}; the checkpoint "
                        "is incomplete or was written for another architecture")
    return model.to(device).eval()


def _is_tied(model, key: str) -> bool:
    """True if parameter ``key`` shares storage with another parameter (a tied embedding)."""
    sd = model.state_dict()
    ptr = sd[key].untyped_storage().data_ptr()
    return any(k != key and v.untyped_storage().data_ptr() == ptr for k, v in sd.items())
