"""``cast-llm prepare-data``: tokenise a run's ``--data`` once into the token cache, before the run.

Every process of a training job memory-maps the same cache; building it here first (on a login node, or as
a job of its own) keeps the tokenisation out of the GPUs' time. Give the flags of the ``train`` command the
cache is for (``--model``, ``--data``, ``--tokens``, ``--seq-len``): a run that needs no more than the cache
holds starts without reading its source.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from cast_llm.cli.options import add_config_command, resolve_options, summary


def run(args: argparse.Namespace) -> int:
    from cast_llm.data import prepare
    from cast_llm.data.config import PrepareDataConfig
    from cast_llm.models import load_tokenizer

    cfg = resolve_options(PrepareDataConfig, args)
    cfg.validate()
    refuse_cache_in_inputs(cfg.data_cache, {"--data": cfg.data, "--model": cfg.model})
    tokenizer = load_tokenizer(cfg.model)
    windows = None if cfg.tokens is None else math.ceil(cfg.tokens / cfg.seq_len)  # prepare() rounds the read up
    data = prepare(cfg.data, tokenizer, cfg.seq_len, train_sequences=windows, val_sequences=cfg.val_sequences,
                   test_sequences=cfg.test_sequences, val_fraction=cfg.val_fraction, test_fraction=cfg.test_fraction,
                   calib_samples=cfg.calib_samples, max_documents=cfg.max_documents, cache_root=cfg.data_cache,
                   rebuild=cfg.rebuild, progress=cfg.progress, say=print)
    print(f"{cfg.data}: {data.train.shape[0]:,} training windows of {cfg.seq_len} tokens "
          f"({data.train.shape[0] * cfg.seq_len:,} tokens) ready; validation {data.val.shape[0]}, test "
          f"{data.test.shape[0]} windows; {data.split_note}")
    print(f"cache: {data.cache_dir} (split {data.split_sha256[:12]})")
    return 0


def refuse_cache_in_inputs(cache: str | None, inputs: dict[str, str | None]) -> None:
    """The token cache is written, its inputs only read: a ``--data-cache`` that is, lies inside or contains
    the data or the model is refused (a cache inside a data folder would be read back as data)."""
    from cast_llm.errors import CastError
    from cast_llm.io import overlap

    if not cache:
        return
    for flag, given in inputs.items():
        how = overlap(cache, given) if given and Path(given).expanduser().exists() else None
        if how is not None:
            raise CastError(f"--data-cache {cache} {how} {flag} {given}: the cache would be written into what it "
                            "is read from; choose another --data-cache")


def register(sub) -> None:
    from cast_llm.data.config import PrepareDataConfig

    add_config_command(sub, "prepare-data", PrepareDataConfig, func=run,
                       help="tokenise --data once into the token cache, ahead of a run", description=summary(__doc__))
