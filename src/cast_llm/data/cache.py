"""The token cache: a source tokenised once into binary shards, memory-mapped by every process that needs it.

Layout (``cast-llm prepare-data`` builds it ahead of a cluster job; ``train`` builds what is missing)::

    <cache>/tokens/<key>/index.json          what the shards hold; written last (atomically), so a killed
                                             build leaves the previous index or none
    <cache>/tokens/<key>/builds.jsonl        one line per build (host, pid, rank, seconds)
    <cache>/tokens/<key>/<build>/train-00000.u16   token ids, little-endian uint16 (uint32 when the
    <cache>/tokens/<key>/<build>/val-00000.u16     vocabulary needs it), each document followed by EOS
    <cache>/tokens/<key>.lock                one builder at a time; the others wait, then read

``<key>`` is the SHA-256 of what decides the tokens: the source's fingerprint
(:func:`cast_llm.data.sources.source_fingerprint`), the tokenizer's digest (:func:`tokenizer_digest`), the
split fractions, ``--max-documents`` and the cache format, so nothing stale is reused. A build reads the
source only until each split holds the tokens asked for (:class:`Need`); a later run that needs more
rebuilds it from the start — the order is fixed (:mod:`cast_llm.data.split`), so what was read before is a
prefix of what is read now, and runs with a smaller budget see exactly the same tokens.

``<cache>`` is :func:`cast_llm.io.cache_dir`: ``$CAST_LLM_CACHE``, else ``$XDG_CACHE_HOME/cast-llm``, else
``~/.cache/cast-llm``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cast_llm.data.sources import iter_documents, source_fingerprint
from cast_llm.data.split import SPLITS, shuffled, split_of
from cast_llm.data.stream import TokenStream
from cast_llm.errors import CastError
from cast_llm.io import append_jsonl, atomic_write_json, cache_dir, fsync_path, read_json

__all__ = ["CACHE_MARKER", "Need", "TokenCache", "cache_root", "tokenizer_digest"]

CACHE_MARKER = "cast-llm token cache"
CACHE_FORMAT = 1
SHARD_TOKENS = 1 << 24  # tokens per shard file (32 MiB at uint16): what a build holds in memory per split
DOC_BATCH = 256  # documents per tokenizer call


def cache_root() -> Path:
    """The folder of the token caches: ``tokens/`` in the user's cast-llm cache (:func:`cast_llm.io.cache_dir`)."""
    return cache_dir() / "tokens"


def tokenizer_digest(tokenizer) -> str:
    """SHA-256 of everything that decides a tokenizer's ids: its serialised model (fast tokenizers) or its
    vocabulary, its class and its EOS id."""
    h = hashlib.sha256(f"{type(tokenizer).__name__}|eos={tokenizer.eos_token_id}|".encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Need:
    """Tokens a run needs in each split; ``None``: all the source holds (the source is read to its end)."""

    train: int | None
    val: int | None
    test: int | None

    def met_by(self, index: dict) -> bool:
        if index.get("exhausted"):
            return True
        have = {s: index["splits"][s]["tokens"] for s in SPLITS}
        return all(want is not None and have[s] >= want for s, want in zip(SPLITS, (self.train, self.val, self.test)))


class TokenCache:
    """One source tokenised by one tokenizer under one split rule; :meth:`streams` gives its token streams."""

    def __init__(self, spec: str, tokenizer, *, val_fraction: float, test_fraction: float,
                 max_documents: int | None = None, root: str | Path | None = None):
        self.spec, self.tokenizer = spec, tokenizer
        self.val_fraction, self.test_fraction, self.max_documents = val_fraction, test_fraction, max_documents
        eos = tokenizer.eos_token_id
        if eos is None:
            raise CastError("the tokenizer has no EOS token; cannot separate documents")
        self.eos = int(eos)
        vocab = max(len(tokenizer), self.eos + 1)
        self.dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
        self.key_fields = {"format": CACHE_FORMAT, "source": source_fingerprint(spec),
                           "tokenizer_sha256": tokenizer_digest(tokenizer), "val_fraction": val_fraction,
                           "test_fraction": test_fraction, "max_documents": max_documents}
        self.key = hashlib.sha256(json.dumps(self.key_fields, sort_keys=True).encode()).hexdigest()[:24]
        self.root = Path(root) if root is not None else cache_root()
        self.dir = self.root / self.key

    # ------------------------------------------------------------------------------------------ reading
    def index(self) -> dict | None:
        """The index of a complete build for this key, or None (absent, another tool's file, another format)."""
        idx = read_json(self.dir / "index.json")
        if not isinstance(idx, dict) or idx.get("written_by") != CACHE_MARKER or idx.get("key") != self.key:
            return None
        return idx

    def _open(self, index: dict) -> dict[str, TokenStream]:
        dtype = np.dtype(index["dtype"])
        out = {}
        for s in SPLITS:
            parts = []
            for shard in index["splits"][s]["shards"]:
                path = self.dir / shard["file"]
                if path.stat().st_size != shard["tokens"] * dtype.itemsize:
                    raise CastError(f"token cache {path} is {path.stat().st_size} bytes, its index says "
                                    f"{shard['tokens']} tokens; remove {self.dir} (or `cast-llm prepare-data "
                                    "--rebuild`) and run again")
                parts.append(np.memmap(path, dtype=dtype, mode="r"))
            out[s] = TokenStream(parts)
        return out

    def streams(self, need: Need, *, progress: bool = False, rebuild: bool = False,
                say: Callable[[str], None] = lambda s: None) -> tuple[dict[str, TokenStream], dict]:
        """The train / val / test token streams holding at least ``need`` (built or extended first when the
        cache holds less), and the cache's index. Processes that call this together build it once."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CastError(f"cannot create the token cache folder {self.root} ({e.strerror}); point "
                            "$CAST_LLM_CACHE or --data-cache at a writable folder") from None
        with _lock(self.root / f"{self.key}.lock", say) as locked:
            index = None if rebuild else self.index()
            if index is not None and need.met_by(index):
                say(f"token cache: {self.dir} holds what this needs (train {index['splits']['train']['tokens']:,} / "
                    f"validation {index['splits']['val']['tokens']:,} / test {index['splits']['test']['tokens']:,} "
                    "tokens): not reading the source")
                return self._open(index), index
            index = self._build(need, progress=progress, say=say, previous=index, locked=locked)
            return self._open(index), index  # opened (memory-mapped) before the lock is released

    # ------------------------------------------------------------------------------------------ building
    def _build(self, need: Need, *, progress: bool, say, previous: dict | None, locked: bool) -> dict:
        t0 = time.perf_counter()
        build = f"build-{uuid.uuid4().hex[:12]}"
        out = self.dir / build
        out.mkdir(parents=True)
        writers = {s: _ShardWriter(out, s, self.dtype) for s in SPLITS}
        # what the read is expected to take: the split that fills last, at its fraction of the documents
        fractions = (1 - self.val_fraction - self.test_fraction, self.val_fraction, self.test_fraction)
        wants = [w / f for w, f in zip((need.train, need.val, need.test), fractions) if w is not None and f > 0]
        total_need = None if None in (need.train, need.val, need.test) else int(max(wants, default=0))
        why = "" if previous is None else f" (it held {previous['splits']['train']['tokens']:,} training tokens)"
        say(f"token cache: tokenising {self.spec}{why} into {self.dir}")
        bar = _progress(progress, total_need, f"tokenising {self.spec}")
        docs = {s: 0 for s in SPLITS}
        exhausted = True
        batch: list[str] = []
        try:
            for doc in shuffled(iter_documents(self.spec, max_documents=self.max_documents)):
                batch.append(doc)
                if len(batch) < DOC_BATCH:
                    continue
                bar.update(self._write_batch(batch, writers, docs))
                batch = []
                if self._enough(writers, need):
                    exhausted = False
                    break
            if batch:
                bar.update(self._write_batch(batch, writers, docs))
        finally:
            bar.close()
        for w in writers.values():
            w.close()
        index = {"written_by": CACHE_MARKER, "format": CACHE_FORMAT, "key": self.key, **self.key_fields,
                 "dtype": self.dtype.str, "eos": self.eos, "exhausted": exhausted, "build": build,
                 "documents": docs, "build_s": round(time.perf_counter() - t0, 1),
                 "splits": {s: {"tokens": writers[s].total,
                                "shards": [{"file": f"{build}/{name}", "tokens": n} for name, n in writers[s].shards]}
                            for s in SPLITS}}
        fsync_path(out)
        atomic_write_json(self.dir / "index.json", index)
        # one line per build: who tokenised the source and when (a job's ranks share one build)
        append_jsonl(self.dir / "builds.jsonl", {"build": build, "host": socket.gethostname(), "pid": os.getpid(),
                                                 "rank": os.environ.get("RANK"), "time": time.time(),
                                                 "seconds": index["build_s"], "documents": docs})
        if locked:  # earlier builds (and killed ones) of this key: ours, no longer referenced
            for d in self.dir.glob("build-*"):
                if d.is_dir() and d.name != build:
                    shutil.rmtree(d, ignore_errors=True)
        say(f"token cache: {sum(docs.values()):,} documents{' (all of them)' if exhausted else ''} → train "
            f"{writers['train'].total:,} / validation {writers['val'].total:,} / test {writers['test'].total:,} "
            f"tokens in {index['build_s']:.1f} s")
        return index

    def _write_batch(self, batch: list[str], writers: dict, docs: dict) -> int:
        enc = self.tokenizer(batch, add_special_tokens=False)["input_ids"]
        n = 0
        for text, ids in zip(batch, enc):
            s = split_of(text, self.val_fraction, self.test_fraction)
            writers[s].add(ids, self.eos)
            docs[s] += 1
            n += len(ids) + 1
        return n

    @staticmethod
    def _enough(writers: dict, need: Need) -> bool:
        return all(want is not None and writers[s].total >= want
                   for s, want in zip(SPLITS, (need.train, need.val, need.test)))


class _ShardWriter:
    """Appends documents' ids (+ EOS) of one split; writes a shard file every :data:`SHARD_TOKENS` tokens."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype):
        self.folder, self.split, self.dtype = folder, split, dtype
        self.buf: list[np.ndarray] = []
        self.buffered = 0
        self.total = 0
        self.shards: list[tuple[str, int]] = []

    def add(self, ids: list[int], eos: int) -> None:
        a = np.empty(len(ids) + 1, dtype=self.dtype)
        a[:-1] = ids
        a[-1] = eos
        self.buf.append(a)
        self.buffered += a.size
        self.total += a.size
        if self.buffered >= SHARD_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self.buffered:
            return
        name = f"{self.split}-{len(self.shards):05d}.{'u16' if self.dtype.itemsize == 2 else 'u32'}"
        path = self.folder / name
        with path.open("wb") as f:
            np.concatenate(self.buf).tofile(f)
            f.flush()
            os.fsync(f.fileno())
        self.shards.append((name, self.buffered))
        self.buf, self.buffered = [], 0

    def close(self) -> None:
        self._flush()


@contextlib.contextmanager
def _lock(path: Path, say) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (waiting, and saying so, while another process holds it). Yields
    False where the file system has no locks: the build then goes on unlocked — builds of one key write into
    folders of their own and publish with an atomic rename, so two at once both produce a complete cache."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"token cache: another process is building {path.with_suffix('')}; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            say(f"token cache: {path.parent} does not support file locks ({e.strerror}); building without one")
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(enabled: bool, total: int | None, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tok", unit_scale=True, desc=desc, leave=False)
