"""``--data`` to the windows a run trains and evaluates on: the fixed train / validation / test split
(:mod:`cast_llm.data.split`) of the cached token streams (:mod:`cast_llm.data.cache`), packed into
``seq_len`` windows.

* **train**: the first ``train_sequences`` windows of the train split (the budget; all of it, in epochs,
  when the source holds fewer), visited in a seeded order (:class:`cast_llm.data.batches.BatchSampler`);
* **val**: the first ``val_sequences`` windows of the validation split: tuning and every choice;
* **test**: the first ``test_sequences`` windows of the test split: the reported figure.

Nothing here depends on ``--seed``: every run on the same data, tokenizer and ``seq_len`` is scored on the
same text, and :attr:`TokenData.split_sha256` says so.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cast_llm.data.cache import Need, TokenCache
from cast_llm.data.split import sequence_split
from cast_llm.data.stream import Sequences, TokenStream
from cast_llm.errors import CastError

__all__ = ["TokenData", "prepare", "CALIBRATION_POOL", "READ_QUANTUM"]

# Calibration (Wanda / SparseGPT / AWQ / the compensated prune) draws its samples from the first this many
# training windows, whatever the run's budget: a one-shot prune and a warm-started run of the same seed then
# calibrate on the same text.
CALIBRATION_POOL = 1024
# The source is read for a whole number of this many training windows: `cast-llm prepare-data --tokens T` and
# a run of T tokens then ask for the same read whatever the run's global batch (any that divides it)
READ_QUANTUM = 1024


@dataclass
class TokenData:
    """Packed training, validation and test windows of one ``--data`` source."""

    train: Sequences  # (N_train, seq_len): the run's training windows
    val: torch.Tensor  # (N_val, seq_len) int64
    test: torch.Tensor  # (N_test, seq_len) int64
    source: str
    split: str  # "documents" or "sequences"
    split_note: str  # what was held out, in words
    split_sha256: str  # digest of the validation and test windows
    documents: int  # documents read from the source
    pool: Sequences  # every training window read (calibration draws from its head)
    cache_dir: str | None = None

    @property
    def seq_len(self) -> int:
        return self.train.shape[1]

    def calibration_pool(self, n_samples: int) -> Sequences:
        return self.pool.head(max(n_samples, CALIBRATION_POOL))


def prepare(
    spec: str,
    tokenizer,
    seq_len: int,
    *,
    train_sequences: int | None = None,
    val_sequences: int = 16,
    test_sequences: int = 16,
    val_fraction: float = 0.02,
    test_fraction: float = 0.02,
    calib_samples: int = 0,
    min_train_sequences: int = 1,
    max_documents: int | None = None,
    cache_root=None,
    rebuild: bool = False,
    progress: bool = False,
    say: Callable[[str], None] | None = None,
    too_small: str = "for one batch; add text or lower --seq-len / --batch-size",
) -> TokenData:
    """Tokenise (once, cached), split and pack a ``--data`` source.

    ``train_sequences`` / ``val_sequences`` / ``test_sequences``: windows wanted (``None`` / 0: all the
    source holds — it is then read to its end); ``calib_samples``: the source is read far enough for
    :func:`calibration_samples` to draw them from a pool that does not depend on the budget. ``too_small``
    ends the error of a source with fewer than ``min_train_sequences`` windows: what they are for and the
    calling command's own flags that fix it."""
    say = say or (lambda s: None)
    cache = TokenCache(spec, tokenizer, val_fraction=val_fraction, test_fraction=test_fraction,
                       max_documents=max_documents, root=cache_root)
    train_windows = None if train_sequences is None else max(train_sequences, min_train_sequences,
                                                              CALIBRATION_POOL if calib_samples else 0, calib_samples)
    need = Need(train=None if train_windows is None else -(-train_windows // READ_QUANTUM) * READ_QUANTUM * seq_len,
                val=0 if not val_fraction else (val_sequences * seq_len if val_sequences else None),
                test=0 if not test_fraction else (test_sequences * seq_len if test_sequences else None))
    streams, index = cache.streams(need, progress=progress, rebuild=rebuild, say=say)
    wants = {"val": val_sequences, "test": test_sequences}
    fractions = {"val": val_fraction, "test": test_fraction}
    windows = {s: len(streams[s]) // seq_len for s in ("train", "val", "test")}
    held_out_missing = [s for s in ("val", "test") if fractions[s] > 0 and windows[s] == 0]
    if held_out_missing and index["exhausted"]:
        # too few documents for a document split (one .txt file is one document): split the windows instead
        stream = TokenStream.concat(streams["train"], streams["val"], streams["test"])
        ss = sequence_split(len(stream) // seq_len, val_sequences if fractions["val"] else None,
                            test_sequences if fractions["test"] else None)
        pool = Sequences(stream, seq_len, ss.train)
        val = Sequences(stream, seq_len, ss.val, ss.train).to_tensor()
        test = Sequences(stream, seq_len, ss.test, ss.train + ss.val).to_tensor()
        kind = "sequences"
        counted = sum(index["documents"].values())
        note = (f"sequence split: the {counted} document(s) give no full window of {seq_len} tokens to "
                f"{' and '.join('validation' if s == 'val' else 'test' for s in held_out_missing)}, so the last "
                f"{test.shape[0]} of the {ss.total} windows are test and the {val.shape[0]} before them validation"
                if ss.total >= 3 else
                f"no held-out split: the data packs into only {ss.total} window(s) of {seq_len} tokens")
    else:
        pool = Sequences(streams["train"], seq_len, windows["train"])
        split = {}
        for s in ("val", "test"):
            n = windows[s] if not wants[s] else min(wants[s], windows[s])
            split[s] = Sequences(streams[s], seq_len, n).to_tensor()
        val, test = split["val"], split["test"]
        kind = "documents"
        short = [f"{'validation' if s == 'val' else 'test'} {split[s].shape[0]} of the {wants[s]} windows asked for"
                 for s in ("val", "test") if wants[s] and split[s].shape[0] < wants[s] and fractions[s]]
        note = (f"document split (by a hash of each text, independent of --seed): validation {val_fraction:g} / "
                f"test {test_fraction:g} of the documents" + (f"; {', '.join(short)} (their documents hold no more)"
                                                               if short else ""))
    n_train = pool.count if train_sequences is None else min(max(train_sequences, 1), pool.count)
    train = pool.head(n_train)
    if train.count < min_train_sequences:
        raise CastError(
            f"data '{spec}' is too small: {train.count} training sequences of {seq_len} tokens "
            f"(from {index['documents']['train']} documents), need at least {min_train_sequences} "
            f"{too_small}")
    return TokenData(train=train, val=val, test=test, source=spec, split=kind, split_note=note,
                     split_sha256=split_digest(kind, val, test), documents=sum(index["documents"].values()),
                     pool=pool, cache_dir=str(cache.dir))


def split_digest(kind: str, val: torch.Tensor, test: torch.Tensor) -> str:
    """SHA-256 of the validation and test windows (and the kind of split): equal digests, equal evaluation text."""
    h = hashlib.sha256(f"cast-llm split 1|{kind}|{tuple(val.shape)}|{tuple(test.shape)}|".encode())
    for t in (val, test):
        h.update(np.ascontiguousarray(t.numpy().astype("<i8")).tobytes())
    return h.hexdigest()
