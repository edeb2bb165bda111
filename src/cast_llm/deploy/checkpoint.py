"""Shared plumbing for the deployment formats: output folders, state dicts, rebuilding a model.

* :class:`OutputDir` (:func:`prepare_output_dir`) — the output folder of a command: never one of its inputs,
  replaced only with ``--overwrite``, only the files cast-llm listed there, and only once the new one is complete;
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
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from cast_llm import __version__
from cast_llm.deploy.export import EXPORT_MARKER
from cast_llm.errors import CastError
from cast_llm.io import (
    RunDir,
    fsync_path,
    is_plain_name,
    move_into,
    overlap,
    pretrained_kwargs,
    read_json_object,
    remove_entry,
    resolved,
    staging_dir,
    umask_mode,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CastError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


class OutputDir:
    """The ``--output-dir`` of a command that writes one model folder (export, quantize, prune), checked before
    anything is read or computed, and replaced only once the new result is complete.

    * an output that is, lies inside, or contains one of the command's inputs is refused (the model, the
      calibration data, a text file: ``inputs`` maps each flag to its path);
    * a non-empty folder needs ``--overwrite``. A folder cast-llm wrote (its ``cast_llm.json`` lists its
      files) then has exactly those files replaced; any other entry is left alone. A folder cast-llm did not
      write keeps every file: the new one is written beside them, and refused when any name it writes is
      taken (naming them);
    * :meth:`staged` yields a new folder beside the output; once the block succeeded the old listed files are
      moved aside, the new ones moved in (the marker last), and only then the old ones deleted. A failure
      anywhere before leaves the output as it was.
    """

    def __init__(self, path: str | Path, overwrite: bool, *, inputs: dict[str, str | None] | None = None,
                 flag: str = "--output-dir"):
        self.path, self.overwrite, self.flag = Path(path), overwrite, flag
        for name, given in (inputs or {}).items():
            if not given or not Path(given).expanduser().exists():
                continue  # a hub id, an alias, a data set name: not a path here
            how = overlap(self.path, given)  # "is", "is inside" or "contains"
            if how is not None:
                raise CastError(f"{flag} {self.path} {how} {name} {given}: writing there could destroy "
                                f"{'it' if how != 'contains' else 'what it holds'}; choose another {flag}")
        if _lexists(self.path) and not self.path.is_dir():
            raise CastError(f"{flag} {self.path} exists and is not a folder; choose another {flag}")
        self.previous = self._listed() if self.path.is_dir() else None
        entries = self._entries()
        if entries and not overwrite:
            what = "holds a cast-llm output" if self.previous is not None else "is not empty"
            raise CastError(f"{flag} {self.path} {what}; pass --overwrite to replace "
                            f"{'it' if self.previous is not None else 'nothing in it and write beside its files'}, "
                            f"or choose another {flag}")

    def _entries(self) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if p.name != RunDir.LOCK)

    def _listed(self) -> list[str] | None:
        """The names the folder's own marker lists as written by cast-llm (None: no marker, not ours)."""
        marker = self.path / EXPORT_MARKER
        if not _lexists(marker):
            return None
        if marker.is_symlink():
            raise CastError(f"{marker} is a link, not a marker cast-llm wrote; choose another {self.flag}")
        files = read_json_object(marker, "the folder's cast-llm marker",
                                 fix=f"remove the folder yourself or choose another {self.flag}").get("files")
        if files is None:
            raise CastError(f"{marker} does not list the files of the folder (an older cast-llm wrote it): "
                            f"remove them yourself or choose another {self.flag}")
        bad = [f for f in files if not is_plain_name(f)] if isinstance(files, list) else [files]
        if bad:
            raise CastError(f"{marker} lists {bad[0]!r}, which is not a plain name of a file in the folder: "
                            f"this marker was not written by cast-llm; choose another {self.flag}")
        return sorted(set(files) | {EXPORT_MARKER})

    @contextmanager
    def staged(self) -> Iterator[Path]:
        """A new empty folder beside the output to write the whole result into; published when the block
        ends without an error, discarded otherwise."""
        with staging_dir(resolved(self.path), prefix=".stage-") as tmp:  # (beside it: `.` stages in its parent)
            yield tmp
            self.publish(tmp)

    def publish(self, tmp: Path) -> None:
        marker = tmp / EXPORT_MARKER
        if not marker.is_file():
            raise RuntimeError(f"staged output has no {EXPORT_MARKER}: not moving it into place")
        new = sorted(p.name for p in tmp.iterdir())
        info = json.loads(marker.read_text())
        info["files"] = new  # exactly what is published: the next --overwrite replaces these and nothing else
        marker.write_text(json.dumps(info, indent=2))
        previous = self._listed() if self.path.is_dir() else None  # as it is now, not at the start
        if previous is not None and not self.overwrite:
            raise CastError(f"{self.flag} {self.path} was written by another cast-llm process meanwhile; "
                            "pass --overwrite to replace it")
        mine = set(previous or [])
        taken = [n for n in new if n not in mine and _lexists(self.path / n)]
        if taken:
            raise CastError(f"{self.flag} {self.path} holds {', '.join(taken[:5])}{' …' if len(taken) > 5 else ''}, "
                            f"which cast-llm did not write and would replace; move {'it' if len(taken) == 1 else 'them'} "
                            f"or choose another {self.flag}")
        self.path.mkdir(parents=True, exist_ok=True)
        with staging_dir(resolved(self.path), prefix=".stage-") as old:
            for name in previous or []:  # the previous result, moved aside (renames: nothing is copied)
                if _lexists(self.path / name):
                    os.replace(self.path / name, old / name)
            for name in [n for n in new if n != EXPORT_MARKER] + [EXPORT_MARKER]:
                src = tmp / name
                if src.is_dir():
                    os.chmod(src, umask_mode(0o777))  # (mkdtemp made it 0700)
                os.replace(src, self.path / name)
            fsync_path(self.path)
            for name in previous or []:  # only now: delete the old result
                remove_entry(old, name)


def _lexists(p: Path) -> bool:
    """Whether ``p`` exists as an entry (a dangling link included)."""
    return os.path.lexists(p)


def prepare_output_dir(path: str | Path, overwrite: bool, *, inputs: dict[str, str | None] | None = None) -> OutputDir:
    """Check that ``path`` may be written (:class:`OutputDir`); write into ``.staged()`` of the result."""
    return OutputDir(path, overwrite, inputs=inputs)


@contextmanager
def staged_output(out_dir: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``out_dir``; on success its files are moved into ``out_dir``."""
    out = Path(out_dir)
    with staging_dir(out, prefix=".stage-") as tmp:
        yield tmp
        if not (tmp / EXPORT_MARKER).is_file():
            raise RuntimeError(f"staged checkpoint has no {EXPORT_MARKER}: not moving it into place")
        subdirs = [p for p in tmp.iterdir() if p.is_dir()]
        out.mkdir(parents=True, exist_ok=True)
        for d in subdirs:  # sub-folders (e.g. fake-quant/) are complete checkpoints of their own
            if (out / d.name).exists():
                shutil.rmtree(out / d.name)
            d.rename(out / d.name)
        move_into(tmp, out, last=EXPORT_MARKER)


def read_format_index(folder: str | Path, index_file: str, fmt: str, version: int, *, kind: str, hint: str,
                      required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON index of one of our checkpoint formats (``fmt``, at most ``version``); a CastError naming the
    folder when the index (or one of the ``required`` files) is missing or of another format / a newer version.
    ``kind`` names the format in messages, ``hint`` says how to write one."""
    p = Path(folder)
    needed = (index_file, *required)
    if not all((p / f).is_file() for f in needed):
        raise CastError(f"{p} is not a {kind} checkpoint (no {' / '.join(needed)}); {hint}")
    index = read_json_object(p / index_file, f"the index of a {kind} checkpoint", fix=hint)
    if index.get("format") != fmt or index.get("version", 0) > version:
        raise CastError(f"{p}: unsupported {kind} format {index.get('format')} v{index.get('version')} "
                        f"(this cast-llm reads {fmt} v{version})")
    return index


def write_marker(folder: Path, kind: str, **info: Any) -> None:
    """The completion marker, written last: it lists the folder's files (what a later ``--overwrite`` replaces)."""
    files = sorted({p.name for p in Path(folder).iterdir()} | {EXPORT_MARKER})
    payload = {"kind": kind, "cast_llm_version": __version__, **info, "files": files}
    (folder / EXPORT_MARKER).write_text(json.dumps(payload, indent=2))


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

    config = AutoConfig.from_pretrained(folder, **pretrained_kwargs())
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
