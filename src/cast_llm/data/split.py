"""How a corpus is divided into train / validation / test — a property of the data, never of a run's seed.

* **Order.** Documents pass through a shuffle buffer (:func:`shuffled`) with a fixed seed, so that a source
  sorted by title or topic is mixed before a run takes a prefix of it, and a run that reads more of a source
  sees the same first documents as one that read less.
* **Document split** (the default): each document goes to one split by a hash of its text
  (:func:`split_of`): ``val_fraction`` of the documents to validation (tuning, choices of defaults), as many
  by ``test_fraction`` to test (reported only), the rest to train. The same text always lands in the same
  split, whatever the seed, the budget or the other documents; a duplicate cannot straddle train and test.
* **Sequence split** (:func:`sequence_split`): a corpus whose validation or test documents do not fill one
  window (a single ``.txt`` file is one document) is split by packed windows instead, as nanoGPT splits its
  one input file: the last windows are test, the ones before them validation, the rest train. The run says
  which split it made.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["SPLITS", "SHUFFLE_BUFFER", "ORDER_SEED", "shuffled", "split_of", "SequenceSplit", "sequence_split"]

SPLITS = ("train", "val", "test")
SHUFFLE_BUFFER = 16_384  # documents: the embedded corpus (10k) is shuffled whole; C4-sized text ~30 MB of buffer
ORDER_SEED = 0x5EED  # fixed: which documents a run sees must not change with --seed
_HASH_SCALE = float(1 << 64)
# a sequence split holds out at most this fraction of the windows (each of validation and test)
SEQUENCE_SPLIT_MAX = 0.1


def shuffled(docs: Iterable[str], buffer: int = SHUFFLE_BUFFER, seed: int = ORDER_SEED) -> Iterator[str]:
    """The documents in a seeded, buffer-local random order: each output is drawn from the next ``buffer``
    inputs, so a prefix of the output depends only on a prefix of the input (reading can stop at any point)."""
    rng = random.Random(seed)
    pool: list[str] = []
    for d in docs:
        if len(pool) < buffer:
            pool.append(d)
            continue
        i = rng.randrange(buffer)
        pool[i], d = d, pool[i]
        yield d
    rng.shuffle(pool)
    yield from pool


def split_of(text: str, val_fraction: float, test_fraction: float) -> str:
    """``train`` / ``val`` / ``test`` for one document, from the SHA-256 of its UTF-8 text."""
    u = int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big") / _HASH_SCALE
    if u < val_fraction:
        return "val"
    if u < val_fraction + test_fraction:
        return "test"
    return "train"


@dataclass(frozen=True)
class SequenceSplit:
    """Window counts of a sequence split of ``total`` windows: train ``[0, train)``, validation next, test last."""

    total: int
    train: int
    val: int
    test: int


def sequence_split(total: int, val_wanted: int | None, test_wanted: int | None) -> SequenceSplit:
    """Hold out the last windows: ``test_wanted`` for test and ``val_wanted`` before them for validation, each
    at most :data:`SEQUENCE_SPLIT_MAX` of the windows (0 wanted: that fraction; None: no such split), at least
    one each when the corpus has three windows or more; fewer than three: all of it is train."""
    if total < 3:
        return SequenceSplit(total, total, 0, 0)
    cap = max(1, int(total * SEQUENCE_SPLIT_MAX))

    def held(wanted):
        return 0 if wanted is None else (min(wanted, cap) if wanted else cap)

    val, test = held(val_wanted), held(test_wanted)
    return SequenceSplit(total, total - val - test, val, test)
