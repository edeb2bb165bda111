"""The settings that decide which tokens a command reads, declared once for every command that reads them.

:class:`DataSettings` is the token cache's key: ``cast-llm train`` (:class:`cast_llm.train.config.TrainConfig`)
and ``cast-llm prepare-data`` (:class:`PrepareDataConfig`) both derive from it, so the cache that prepare-data
fills is the one a run with the same flags reads. :class:`CalibrationSettings` is the calibration text of the
one-shot commands (``prune``, ``quantize``) and of a training run's warm start.
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import DeviceSettings, ModelSettings, ProgressSettings, check_ranges, option, parse_count
from cast_llm.errors import CastError


def _opt_count(v):
    return None if v is None else parse_count(v)


@dataclass
class WindowSettings:
    seq_len: int = option(512, "tokens per training sequence", min=2, resume="must_match")


@dataclass
class EvalWindowSettings(WindowSettings):
    """The window a command's perplexity is scored in (train's WikiText-2 figures, prune's and quantize's before /
    after check): the training or calibration window unless given."""

    eval_seq_len: int | None = option(None, "perplexity window length (default: --seq-len)", min=2,
                                      section="evaluation", resume="free")

    @property
    def eval_window(self) -> int:
        """The window length scored: ``--eval-seq-len``, else ``--seq-len``."""
        return self.eval_seq_len or self.seq_len


@dataclass
class CalibrationSettings(WindowSettings):
    """The text a command reads and how many calibration windows it draws from it."""

    data: str = option("wiki-summaries", "wiki-summaries (embedded), a .txt/.jsonl/.parquet file or folder, or "
                                         "hf:NAME[:CONFIG]", resume="must_match")
    calib_samples: int = option(128, "training sequences that calibrate Wanda / SparseGPT / the compensated prune "
                                     "(paper 128)", min=1, resume="must_match")


@dataclass
class BlockCalibrationSettings(DeviceSettings, CalibrationSettings):
    """A calibration that runs through the decoder block by block (one-shot pruning, AWQ), on ``--device``."""

    OPTION_TEXT = {"device": "where the blocks run: auto (cuda if available), cpu, cuda, cuda:N"}

    calib_batch_size: int = option(1, "calibration sequences per forward through a block", min=1)


@dataclass
class DataSettings(CalibrationSettings, ModelSettings):
    """What decides the tokens of a training run: its tokenizer, source, budget, split and windows."""

    tokens: int | None = option(None, "training-token budget, e.g. 20M; sets the steps (give this or "
                                      "--max-steps)", parse=_opt_count, min=1, resume="must_match")
    max_documents: int | None = option(None, "use only the first this many documents of --data (quick runs)",
                                       min=1, resume="must_match")
    val_fraction: float = option(0.02, "fraction of the documents in the validation split (chosen by a hash of "
                                       "each text, never by --seed): what tuning and defaults are chosen on",
                                 min=0, max=0.5, resume="must_match")
    test_fraction: float = option(0.02, "fraction of the documents in the test split (by the same hash): the "
                                        "reported held-out figure", min=0, max=0.5, resume="must_match")
    val_sequences: int = option(16, "validation windows scored at the end (0 = all the split holds)", min=0,
                                resume="free")
    test_sequences: int = option(16, "test windows scored for the held-out perplexity (0 = all the split holds)",
                                 min=0, resume="free")
    data_cache: str | None = option(None, "folder of the token cache (default: $CAST_LLM_CACHE/tokens, else "
                                          "~/.cache/cast-llm/tokens; `cast-llm prepare-data` fills it ahead)",
                                    resume="free")

    def check_split(self) -> None:
        if self.val_fraction + self.test_fraction >= 1:
            raise CastError("--val-fraction + --test-fraction must leave documents for training (their sum is "
                            f"{self.val_fraction + self.test_fraction:g})")


@dataclass
class PrepareDataConfig(ProgressSettings, DataSettings):
    """``cast-llm prepare-data``: the data settings of the ``cast-llm train`` run it is for (give the same values)."""

    rebuild: bool = option(False, "tokenise again even if the cache holds enough (a source changed in place)")

    OPTION_TEXT = {
        "model": "the model whose tokenizer the run uses (folder, hub id, .gguf, or smollm2-135m)",
        "data": "wiki-summaries, a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG]",
        "tokens": "the run's training-token budget (e.g. 2B): read the source until the train split holds it "
                  "(rounded up to 1,024 windows); default: the whole source",
        "seq_len": "tokens per training sequence (the run's --seq-len)",
        "val_fraction": "fraction of the documents in the validation split",
        "test_fraction": "fraction of the documents in the test split",
        "val_sequences": "validation windows the run scores (0 = all)",
        "test_sequences": "test windows the run scores (0 = all)",
        "calib_samples": "calibration samples (Wanda / SparseGPT) the run draws",
        "max_documents": "use only the first this many documents (the run's --max-documents)",
        "data_cache": "folder of the token cache (default: $CAST_LLM_CACHE/tokens, else ~/.cache/cast-llm/tokens)",
    }

    def validate(self) -> None:
        check_ranges(self)
        self.check_split()
