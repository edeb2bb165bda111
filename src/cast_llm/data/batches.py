"""Deterministic, resumable batches over packed windows, and the calibration samples of one-shot pruning."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from cast_llm.errors import CastError

__all__ = ["BatchSampler", "calibration_samples", "iterate_windows", "steps_for_tokens"]


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
        self._perm_epoch, self._perm, self._perm_list = -1, None, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g), epoch
            # the order as host integers, made once per epoch: a batch's indices are then read from it with no
            # tensor access (the training step reads nothing on the host between log steps)
            self._perm_list = self._perm.tolist()
        return self._perm

    def _slice(self, k: int) -> tuple[int, int]:
        epoch, j = divmod(k, self.per_epoch)
        self._order(epoch)
        start = j * self.global_batch + self.rank * self.micro_batch
        return start, start + self.micro_batch

    def indices(self, k: int) -> torch.Tensor:
        start, stop = self._slice(k)
        return self._perm[start:stop]

    def index_list(self, k: int) -> list[int]:
        """:meth:`indices` as a list of ints."""
        start, stop = self._slice(k)
        return self._perm_list[start:stop]

    def epoch_of(self, k: int) -> float:
        return k / self.per_epoch


def calibration_samples(data, n_samples: int, *, seed: int = 0) -> torch.Tensor:
    """``n_samples`` training windows chosen with the seed from the data's calibration pool (its first
    :data:`~cast_llm.data.packing.CALIBRATION_POOL` training windows: the same whatever the budget), for
    Wanda / SparseGPT / AWQ."""
    pool = data.calibration_pool(n_samples)
    n = pool.shape[0]
    if n_samples > n:
        raise CastError(f"asked for {n_samples} calibration samples but the data has only {n} sequences")
    g = torch.Generator().manual_seed(seed)
    return pool[torch.randperm(n, generator=g)[:n_samples]]


def iterate_windows(ids: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    for i in range(0, ids.shape[0], batch_size):
        yield ids[i : i + batch_size]


def steps_for_tokens(tokens: int, tokens_per_step: int) -> int:
    return max(1, math.ceil(tokens / tokens_per_step))
