"""``cast-llm prepare-data``: the token cache of a run built ahead of it (before a cluster job starts)."""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import check_ranges, option, parse_count
from cast_llm.errors import CastError


def _opt_count(v):
    return None if v is None else parse_count(v)


@dataclass
class PrepareDataConfig:
    """The flags a ``cast-llm train`` command shares with the data it reads (give the same values)."""

    model: str = option("smollm2-135m", "the model whose tokenizer the run uses (folder, hub id, .gguf, or "
                                        "smollm2-135m)")
    data: str = option("wiki-summaries", "wiki-summaries, a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG]")
    tokens: int | None = option(None, "the run's training-token budget (e.g. 2B): read the source until the train "
                                      "split holds it (rounded up to 1,024 windows); default: the whole source",
                                parse=_opt_count, min=1)
    seq_len: int = option(512, "tokens per training sequence (the run's --seq-len)", min=2)
    val_fraction: float = option(0.02, "fraction of the documents in the validation split", min=0, max=0.5)
    test_fraction: float = option(0.02, "fraction of the documents in the test split", min=0, max=0.5)
    val_sequences: int = option(16, "validation windows the run scores (0 = all)", min=0)
    test_sequences: int = option(16, "test windows the run scores (0 = all)", min=0)
    calib_samples: int = option(128, "calibration samples (Wanda / SparseGPT) the run draws", min=1)
    max_documents: int | None = option(None, "use only the first this many documents (the run's --max-documents)",
                                       min=1)
    data_cache: str | None = option(None, "folder of the token cache (default: $CAST_LLM_CACHE/tokens, else "
                                          "~/.cache/cast-llm/tokens)")
    rebuild: bool = option(False, "tokenise again even if the cache holds enough (a source changed in place)")
    progress: bool = option(True, "show a progress bar")

    def validate(self) -> None:
        check_ranges(self)
        if self.val_fraction + self.test_fraction >= 1:
            raise CastError("--val-fraction + --test-fraction must leave documents for training")
