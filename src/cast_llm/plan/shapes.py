"""What the plan needs to know about a model, from its config alone: counts and widths, no weights.

:func:`model_config` finds the config (a local folder or ``config.json``, the hub or its cache, or one of
the configs embedded in ``plan/configs/`` for offline use); :func:`model_shape` builds the model on the
``meta`` device (no memory, ~1 s at 8B) and counts what the memory plan multiplies: parameters in and out of
the decoder blocks, the N:M targets (exactly the layers ``cast-llm train`` would make sparse), the LM head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cast_llm.errors import CastError
from cast_llm.io import pretrained_kwargs, read_json_object

__all__ = ["ModelShape", "EMBEDDED", "model_config", "model_shape", "shape_of"]

# The configs shipped in plan/configs/<key>.json (values of the public model cards' config.json) and the hub
# ids that name the same architecture.
EMBEDDED: dict[str, tuple[str, ...]] = {
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct"),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct",
                     "meta-llama/Meta-Llama-3.1-8B-Instruct", "RedHatAI/Sparse-Llama-3.1-8B-2of4",
                     "neuralmagic/Sparse-Llama-3.1-8B-2of4"),
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf"),
    "llama-2-13b": ("meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-13b-chat-hf"),
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-70B-Instruct"),
}
# Families whose decoder block is LLaMA's (RMSNorm, SDPA attention, gated MLP): the activation bytes of
# plan/activations.py are counted from this block and tested against autograd's saved tensors.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelShape:
    """Counts (in parameters) and widths of a causal LM, as the memory plan uses them."""

    name: str
    model_type: str
    params: int  # all (unique) parameters
    root_params: int  # outside the decoder blocks: embeddings, final norm, LM head
    block_params: int  # one decoder block
    layers: int
    target_params: int  # the N:M target weights (all blocks)
    target_rows: int  # Σ output rows of the targets (a weight scale A has rows × scale_groups entries)
    linear_params: int  # every Linear weight the forward multiplies by, LM head included
    head_params: int  # the LM head weight (vocab × hidden)
    tied: bool  # LM head shares the input embedding
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int | None
    source: str = ""  # where the config came from, for the report
    native_bytes: int = 4  # bytes per parameter of the dtype the config names (the export's), fp32 if none

    @property
    def llama_like(self) -> bool:
        return self.model_type in LLAMA_LIKE

    @property
    def target_block_params(self) -> int:
        return self.target_params // max(1, self.layers)


def embedded_key(name: str) -> str | None:
    low = name.strip().lower()
    for key, ids in EMBEDDED.items():
        if low == key or low in (i.lower() for i in ids):
            return key
    return None


def embedded_config(key: str) -> dict:
    return json.loads(resources.files("cast_llm.plan").joinpath(f"configs/{key}.json").read_text())


def model_config(name: str):
    """``(transformers config, where it came from)`` for a model folder / ``config.json`` / hub id / alias.

    A hub id is looked up in the hub (config only) when the hub answers, else in the local hub cache; the
    architectures of ``EMBEDDED`` fall back to the shipped config when neither has it (gated repositories
    without a token included)."""
    from transformers import AutoConfig

    p = Path(name).expanduser()
    if p.is_file() and p.suffix == ".json":
        cfg = read_json_object(p, "a model config", fix="pass a Hugging Face config.json")
        return _from_dict(cfg, str(p)), f"file {p}"
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CastError(f"{p} holds no config.json: pass a Hugging Face model folder, a config.json or a hub id")
        from cast_llm.models.loading import check_model_folder  # in-function: keeps --help fast (torch)

        check_model_folder(p)  # custom code (auto_map), unknown quantization formats: refused before transformers
        return AutoConfig.from_pretrained(str(p), **pretrained_kwargs()), f"folder {p}"
    if p.suffix == ".gguf" or name.startswith((".", "/", "~")):
        raise CastError(f"model path not found or not a folder / config.json: {name}")
    key = embedded_key(name)
    if key is not None and "/" not in name:
        return _from_dict(embedded_config(key), key), f"embedded config {key}"
    if "/" not in name:
        raise CastError(f"unknown model '{name}': give a model folder, a config.json, a hub id ORG/NAME, or one of "
                        f"the embedded configs ({', '.join(EMBEDDED)})")
    from cast_llm.models import hub_offline_reason  # in-function: keeps --help fast (torch)

    offline = hub_offline_reason(timeout=2.0)
    try:
        cfg = AutoConfig.from_pretrained(name, **pretrained_kwargs(local_files_only=bool(offline)))
        return cfg, ("hub cache" if offline else "hub") + f" {name}"
    except Exception as e:  # not cached / gated / no network: the embedded copy when we have one
        if key is not None:
            why = f"hub out of reach: {offline}" if offline else f"hub: {type(e).__name__}"
            return _from_dict(embedded_config(key), key), f"embedded config {key} ({why})"
        where = f"the hub is out of reach ({offline}) and the local hub cache has no copy" if offline else \
            f"the hub did not give its config ({type(e).__name__})"
        raise CastError(f"unknown model '{name}': {where}; give a model folder or config.json, or one of the "
                        f"embedded configs ({', '.join(EMBEDDED)})") from None


def _from_dict(d: dict, where: str):
    from transformers import AutoConfig

    d = dict(d)
    model_type = d.pop("model_type", None)
    if not model_type:
        raise CastError(f"{where}: config has no model_type")
    try:
        return AutoConfig.for_model(model_type, **d)
    except (KeyError, ValueError) as e:
        raise CastError(f"{where}: transformers does not know model_type {model_type!r} ({e})") from None


def model_shape(name: str, *, n: int = 2, m: int = 4) -> ModelShape:
    """The :class:`ModelShape` of a model named as ``cast-llm plan`` takes it (see :func:`model_config`), its
    targets those of the ``n``:``m`` pattern."""
    import torch
    from transformers import AutoModelForCausalLM

    config, source = model_config(name)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise CastError(f"model '{name}' ({source}): transformers cannot build a causal LM from its config "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None
    return shape_of(model, name=name, source=source, n=n, m=m)


def shape_of(model, *, name: str = "", source: str = "", n: int = 2, m: int = 4) -> ModelShape:
    """Count a (meta or real) causal LM as :class:`ModelShape` does; ``cast-llm train`` calls it on the model
    it loaded."""
    from torch import nn

    # in-function: keeps --help fast (torch)
    from cast_llm.layers import is_linear_like
    from cast_llm.targets import find_block_list, find_targets

    cfg = model.config
    found = find_block_list(model)
    if found is None:
        raise CastError(f"model '{name}': no decoder block list found in {type(model).__name__}")
    blocks = found[1]
    unique = {id(p): p for p in model.parameters()}
    in_blocks = {id(p) for p in blocks.parameters()}
    targets = find_targets(model, n=n, m=m, skip_incompatible=True)
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    linear = {id(mod.weight): mod.weight for mod in model.modules()
              if (isinstance(mod, nn.Linear) or is_linear_like(mod)) and getattr(mod, "weight", None) is not None}
    hidden = int(getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0))
    heads = int(getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 1))
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    inter = int(getattr(cfg, "intermediate_size", None) or getattr(cfg, "ffn_dim", None)
                or getattr(cfg, "n_inner", None) or 4 * hidden)
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    native = {"bfloat16": 2, "float16": 2, "float32": 4}.get(str(dtype).removeprefix("torch."), 4)
    return ModelShape(
        name=name, model_type=str(getattr(cfg, "model_type", "?")),
        params=sum(p.numel() for p in unique.values()),
        root_params=sum(p.numel() for k, p in unique.items() if k not in in_blocks),
        block_params=sum(p.numel() for p in blocks[0].parameters()), layers=len(blocks),
        target_params=sum(t.weight.numel() for t in targets), target_rows=sum(t.out_features for t in targets),
        linear_params=sum(p.numel() for p in linear.values()),
        head_params=head.weight.numel() if head is not None else 0, tied=tied,
        hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv, head_dim=head_dim,
        vocab=int(getattr(cfg, "vocab_size", 0)), max_positions=int(max_pos) if max_pos else None, source=source,
        native_bytes=native,
    )
