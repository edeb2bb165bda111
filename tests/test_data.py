"""The data path: seed-independent splits, the token cache (built once, reused, extended, never stale), packed
windows over shards, the sequence split of tiny corpora, and reading only what a budget needs."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import random

import numpy as np
import pytest
import torch
from tiny import tokenizer, write_corpus

from cast_llm.data import (
    CALIBRATION_POOL,
    Need,
    Sequences,
    TokenCache,
    TokenStream,
    calibration_samples,
    prepare,
    sequence_split,
    shuffled,
    split_of,
)
from cast_llm.data import cache as cache_mod
from cast_llm.errors import CastError


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "sparse dense weights mask two four tensor cores train distil scale prune kept".split()
    return [f"doc {i} " + " ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for i in range(n)]


def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


class CountingTokenizer:
    """The tiny tokenizer, counting the documents it encodes (did a call read the source?)."""

    def __init__(self):
        self.inner = tokenizer()
        self.docs = 0
        self.eos_token_id = self.inner.eos_token_id
        self.backend_tokenizer = self.inner.backend_tokenizer

    def __len__(self):
        return len(self.inner)

    def __call__(self, texts, **kw):
        self.docs += len(texts)
        return self.inner(texts, **kw)


# ------------------------------------------------------------------------------------------------ the split
def test_split_of_is_a_function_of_the_text_alone_with_the_asked_fractions():
    docs = _docs(4000)
    a = [split_of(d, 0.05, 0.1) for d in docs]
    assert a == [split_of(d, 0.05, 0.1) for d in docs]  # no seed, no state
    counts = {s: a.count(s) / len(a) for s in ("train", "val", "test")}
    assert counts["val"] == pytest.approx(0.05, abs=0.015) and counts["test"] == pytest.approx(0.1, abs=0.02)
    # a larger validation fraction only moves train documents into it: test keeps its documents... and the
    # validation documents of the smaller fraction stay validation
    b = [split_of(d, 0.1, 0.1) for d in docs]
    assert all(y == "val" for x, y in zip(a, b) if x == "val")


def test_shuffled_prefix_does_not_depend_on_how_much_is_read():
    docs = _docs(300)
    full = list(shuffled(iter(docs), buffer=64))
    assert sorted(full) == sorted(docs) and full != docs
    # a reader that stops after k outputs saw the same k documents as one that read everything
    for k in (1, 50, 200):
        assert list(itertools.islice(shuffled(iter(docs), buffer=64), k)) == full[:k]
    # and a source that ends early shares the prefix that was emitted before its end
    short = list(shuffled(iter(docs[:200]), buffer=64))
    assert short[: 200 - 64] == full[: 200 - 64]


def test_sequence_split_holds_out_the_last_windows_capped_at_a_tenth():
    assert sequence_split(100, 4, 4) == sequence_split(100, 4, 4)
    s = sequence_split(100, 4, 6)
    assert (s.train, s.val, s.test) == (90, 4, 6)
    s = sequence_split(30, 64, 64)
    assert (s.train, s.val, s.test) == (24, 3, 3)
    s = sequence_split(30, None, 0)
    assert (s.train, s.val, s.test) == (27, 0, 3)
    s = sequence_split(2, 4, 4)
    assert (s.train, s.val, s.test) == (2, 0, 0)


# ------------------------------------------------------------------------------------------------ streams
def test_sequences_read_windows_across_shard_boundaries():
    parts = [np.arange(0, 7, dtype=np.uint16), np.arange(7, 20, dtype=np.uint16), np.arange(20, 23, dtype=np.uint16)]
    stream = TokenStream(parts)
    assert len(stream) == 23 and stream.read(5, 9).tolist() == [5, 6, 7, 8]
    seqs = Sequences(stream, 4, 5)
    full = torch.arange(20).view(5, 4)
    assert seqs.shape == (5, 4) and len(seqs) == 5
    assert torch.equal(seqs[:], full) and seqs[:].dtype == torch.int64
    assert torch.equal(seqs[1], full[1]) and torch.equal(seqs[-1], full[-1])
    assert torch.equal(seqs[torch.tensor([4, 1, 1])], full[[4, 1, 1]])
    assert torch.equal(seqs[1:3], full[1:3]) and torch.equal(seqs[::2], full[::2])
    assert torch.equal(torch.stack(list(seqs)), full)
    assert torch.equal(Sequences(stream, 4, 2, first=3)[:], full[3:5])
    assert seqs.head(2).shape == (2, 4) and seqs.head(99).shape == (5, 4)
    with pytest.raises(IndexError):
        seqs[5]
    with pytest.raises(ValueError):
        Sequences(stream, 4, 6)


# ------------------------------------------------------------------------------------------------ the cache
def test_prepare_is_seed_free_and_its_cache_is_built_once_then_reused(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", _docs(600))
    tok = CountingTokenizer()
    a = prepare(str(src), tok, 16, train_sequences=40, val_sequences=4, test_sequences=4, cache_root=tmp_path / "k")
    read = tok.docs
    assert read > 0 and a.split == "documents" and a.train.shape == (40, 16)
    assert a.val.shape == (4, 16) and a.test.shape == (4, 16)
    b = prepare(str(src), tok, 16, train_sequences=40, val_sequences=4, test_sequences=4, cache_root=tmp_path / "k")
    assert tok.docs == read, "a second run with the same needs must not tokenise again"
    assert torch.equal(a.train[:], b.train[:]) and torch.equal(a.test, b.test) and a.split_sha256 == b.split_sha256
    # a different seq_len reuses the same cache (it stores token streams, not windows)
    c = prepare(str(src), tok, 8, train_sequences=10, val_sequences=2, test_sequences=2, cache_root=tmp_path / "k")
    assert tok.docs == read and c.split_sha256 != a.split_sha256
    # test windows never overlap training windows: no test document's text is in train
    train_rows = {tuple(r.tolist()) for r in a.pool}
    assert not any(tuple(r.tolist()) in train_rows for r in a.test)


def test_a_larger_budget_extends_the_cache_and_smaller_runs_see_the_same_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "SHARD_TOKENS", 500)  # several shards per split
    monkeypatch.setattr("cast_llm.data.packing.READ_QUANTUM", 1)
    src = _jsonl(tmp_path / "c.jsonl", _docs(3000))
    tok = CountingTokenizer()
    small = prepare(str(src), tok, 16, train_sequences=30, val_sequences=2, test_sequences=2, cache_root=tmp_path)
    first = tok.docs
    assert first < 3000, "a small budget reads only part of the source"
    big = prepare(str(src), tok, 16, train_sequences=6000, val_sequences=2, test_sequences=2, cache_root=tmp_path)
    assert tok.docs > first
    assert torch.equal(big.train[:30], small.train[:]) and torch.equal(big.test, small.test)
    cache = TokenCache(str(src), tok, val_fraction=0.02, test_fraction=0.02, root=tmp_path)
    assert len(cache.index()["splits"]["train"]["shards"]) > 1
    builds = [d for d in cache.dir.iterdir() if d.is_dir()]
    assert len(builds) == 1, "the superseded build is removed"
    again = prepare(str(src), tok, 16, train_sequences=30, val_sequences=2, test_sequences=2, cache_root=tmp_path)
    assert torch.equal(again.train[:], small.train[:])


def test_a_changed_source_or_tokenizer_is_never_served_stale(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", _docs(300))
    tok = tokenizer()
    a = prepare(str(src), tok, 16, train_sequences=20, val_sequences=2, test_sequences=2, cache_root=tmp_path / "k")
    _jsonl(src, _docs(300, seed=1))  # same path, new text
    b = prepare(str(src), tok, 16, train_sequences=20, val_sequences=2, test_sequences=2, cache_root=tmp_path / "k")
    assert not torch.equal(a.train[:], b.train[:])
    assert len([d for d in (tmp_path / "k").iterdir() if d.is_dir()]) == 2  # one key each
    # a shard cut short (a disk that lost data) is refused with what to do
    cache = TokenCache(str(src), tok, val_fraction=0.02, test_fraction=0.02, root=tmp_path / "k")
    shard = cache.dir / cache.index()["splits"]["train"]["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(CastError, match="remove .* run again"):
        prepare(str(src), tok, 16, train_sequences=20, val_sequences=2, test_sequences=2, cache_root=tmp_path / "k")
    # a file in the cache folder that the tool did not write is not read as an index
    (cache.dir / "index.json").write_text(json.dumps({"key": cache.key}))
    assert cache.index() is None


def test_token_ids_above_uint16_are_stored_as_uint32(tmp_path):
    class Wide(CountingTokenizer):
        def __len__(self):
            return 70_000

        def __call__(self, texts, **kw):
            return {"input_ids": [[69_999, len(t) % 100] for t in texts]}

    src = _jsonl(tmp_path / "c.jsonl", _docs(200))
    d = prepare(str(src), Wide(), 4, val_sequences=1, test_sequences=1, cache_root=tmp_path)
    assert int(d.train[:].max()) == 69_999
    assert next(tmp_path.rglob("train-00000.*")).suffix == ".u32"


def test_one_text_file_is_split_by_sequences_and_says_so(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(" ".join(_docs(60)))
    d = prepare(str(src), tokenizer(), 16, val_sequences=4, test_sequences=4, cache_root=tmp_path / "k")
    assert d.split == "sequences" and "sequence split" in d.split_note
    assert d.val.shape == (4, 16) and d.test.shape == (4, 16)
    stream = torch.cat([d.pool[:].reshape(-1), d.val.reshape(-1), d.test.reshape(-1)])
    assert torch.equal(d.test, stream[-64:].view(4, 16)), "test is the last windows"


def test_calibration_pool_does_not_depend_on_the_budget(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", _docs(3000))
    tok = tokenizer()
    a = prepare(str(src), tok, 8, train_sequences=10, calib_samples=8, cache_root=tmp_path)
    b = prepare(str(src), tok, 8, train_sequences=3000, calib_samples=8, cache_root=tmp_path)
    assert a.calibration_pool(8).shape[0] == CALIBRATION_POOL
    assert torch.equal(calibration_samples(a, 8, seed=3), calibration_samples(b, 8, seed=3))
    assert not torch.equal(calibration_samples(a, 8, seed=3), calibration_samples(a, 8, seed=4))


def test_hf_sources_are_streamed_and_read_only_as_far_as_the_budget(tmp_path, monkeypatch):
    import datasets

    served = []

    def endless(name, config, split, streaming):
        assert streaming and split == "train"

        def rows():
            for i in itertools.count():
                served.append(i)
                yield {"text": _docs(1, seed=i)[0]}
        return rows()

    monkeypatch.setattr(datasets, "load_dataset", endless)
    d = prepare("hf:someone/endless", tokenizer(), 16, train_sequences=50, val_sequences=2, test_sequences=2,
                cache_root=tmp_path)
    assert d.train.shape == (50, 16) and d.test.shape == (2, 16)
    assert len(served) < 40_000  # the 16k shuffle buffer, and the 1,024-window read, then it stopped


def test_a_ten_times_larger_source_with_the_same_budget_reads_the_same_documents(tmp_path):
    docs = _docs(2000)
    small, large = _jsonl(tmp_path / "x1.jsonl", docs), _jsonl(tmp_path / "x10.jsonl", docs * 10)
    reads = []
    for src in (small, large):
        tok = CountingTokenizer()
        prepare(str(src), tok, 16, train_sequences=64, val_sequences=2, test_sequences=2, cache_root=tmp_path / "k")
        reads.append(tok.docs)
    assert reads[0] == reads[1] < 2000


def _build_in_child(args):
    src, root, q = args
    tok = CountingTokenizer()
    d = prepare(src, tok, 16, train_sequences=40, val_sequences=2, test_sequences=2, cache_root=root)
    q.put((tok.docs, d.split_sha256, d.train[:].sum().item()))


def test_processes_starting_together_build_the_cache_once(tmp_path):
    src = str(_jsonl(tmp_path / "c.jsonl", _docs(2000)))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=((src, str(tmp_path / "k"), q),)) for _ in range(3)]
    for p in procs:
        p.start()
    out = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(x[0] > 0 for x in out) == [False, False, True], "exactly one process tokenised"
    assert len({x[1:] for x in out}) == 1
    builds = list((tmp_path / "k").glob("*/builds.jsonl"))
    assert len(builds) == 1 and len(builds[0].read_text().splitlines()) == 1


def test_need_is_met_by_an_exhausted_source_whatever_was_asked():
    idx = {"exhausted": False, "splits": {s: {"tokens": 10} for s in ("train", "val", "test")}}
    assert Need(10, 10, 10).met_by(idx) and not Need(11, 10, 10).met_by(idx) and not Need(None, 1, 1).met_by(idx)
    assert Need(None, None, 999).met_by({**idx, "exhausted": True})


def test_too_small_data_names_what_to_change(tmp_path):
    src = write_corpus(tmp_path / "c.jsonl", docs=3)
    with pytest.raises(CastError, match="too small.*--seq-len"):
        prepare(str(src), tokenizer(), 64, min_train_sequences=50, cache_root=tmp_path / "k")


def test_an_unwritable_cache_folder_is_a_one_line_error_naming_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    src = _jsonl(tmp_path / "c.jsonl", _docs(50))
    with pytest.raises(CastError, match="cannot create the token cache folder .*CAST_LLM_CACHE"):
        prepare(str(src), tokenizer(), 16, cache_root=blocker / "tokens")


def test_batch_sampler_index_list_is_its_indices():
    from cast_llm.data import BatchSampler

    s = BatchSampler(37, 4, seed=3, rank=1, world_size=2)
    for k in (0, 1, 3, 4, 9):  # epochs of 4 global micro-batches: 4 and 9 start new ones
        assert s.index_list(k) == s.indices(k).tolist()
