"""The models cast-llm reads and where they come from (:mod:`~cast_llm.models.loading`): a Hugging Face folder
or hub id, a ``.gguf`` file, the embedded SmolLM2-135M alias, and cast-llm's own exports (compressed,
compressed-tensors, quantized), decoded on load; their tokenizers; the checks a run makes of them."""

from cast_llm.io import cache_dir
from cast_llm.models.loading import (
    ALIASES,
    EXPORT_FORMATS,
    EmbeddedModel,
    ModelSource,
    canonical_alias,
    check_seq_len,
    embedded_gguf,
    empty_model,
    export_format,
    hub_offline_reason,
    load_export,
    load_model,
    load_tokenizer,
    max_positions,
    model_config,
    native_dtype,
    near_alias,
    resolve_device,
    resolve_model,
    resolve_model_path,
)

__all__ = ["ALIASES", "EXPORT_FORMATS", "EmbeddedModel", "ModelSource", "cache_dir", "canonical_alias",
           "check_seq_len", "embedded_gguf", "empty_model", "export_format", "hub_offline_reason", "load_export",
           "load_model", "load_tokenizer", "max_positions", "model_config", "native_dtype", "near_alias",
           "resolve_device", "resolve_model", "resolve_model_path"]
