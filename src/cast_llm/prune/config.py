"""``PruneConfig``: the settings of a one-shot pruning job (:func:`cast_llm.jobs.prune.prune_job`,
``cast-llm prune``).

Torch-free, so that ``cast-llm --help`` builds the command's flags from it without loading the library.
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import ModelSettings, OutputSettings, PatternSettings, SeedSettings, option
from cast_llm.data.config import BlockCalibrationSettings, EvalWindowSettings
from cast_llm.errors import CastError

METHODS = ("magnitude", "wanda", "sparsegpt")  # = cast_llm.prune.oneshot.METHODS (a test keeps them equal)

RUN, CALIB, PATTERN, SPARSEGPT, EVAL = "model and output", "calibration", "N:M pattern", "SparseGPT", "evaluation"
SECTIONS = (RUN, CALIB, PATTERN, SPARSEGPT, EVAL)  # the order of `prune --help`


@dataclass
class PruneConfig(OutputSettings, SeedSettings, PatternSettings, BlockCalibrationSettings, EvalWindowSettings,
                  ModelSettings):
    """One-shot N:M pruning of a dense model (method.md §6) into a verified sparse checkpoint."""

    method: str | None = option(
        None, "one-shot method (required): magnitude (Eq. 6), wanda (|W|·‖X‖), sparsegpt (OBS reconstruction)",
        choices=METHODS, section=RUN)
    damp: float = option(0.01, "diagonal damping as a fraction of mean(diag H); ×10 retries if Cholesky fails",
                         section=SPARSEGPT)
    blocksize: int = option(128, "columns per lazy-update block (a multiple of m)", section=SPARSEGPT)
    eval_text_file: str | None = option(None, "also report perplexity before and after pruning on this text file",
                                        section=EVAL)
    eval_max_windows: int | None = option(None, "score only the first this many windows (default: all)",
                                          section=EVAL)

    OPTION_TEXT = {
        "model": "dense model: a local HF folder, a .gguf file, a hub id or the alias smollm2-135m",
        "data": "calibration text: wiki-summaries, a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG]",
        "calib_samples": "calibration sequences (wanda, sparsegpt); the paper uses 128",
        # 512 rather than the paper's 2048: a CPU calibrates 128 × 512 tokens in minutes, and the statistics
        # (column norms, X Xᵀ) are averages over tokens that change little with the window length
        "seq_len": "tokens per calibration sequence (at most the model's maximum)",
        "n": "N of the N:M pattern: weights kept in every group",
        "m": "M of the N:M pattern: group size along the input dimension",
        "seed": "seed for the split of the data and the choice of calibration sequences",
        "output_dir": "folder for the pruned checkpoint (required)",
        "overwrite": "replace the cast-llm output in --output-dir (only the files it lists), or write beside the "
                     "files of another non-empty folder (none of them is replaced)",
        "skip_incompatible": "leave layers whose input width is not a multiple of m dense",
    }
    OPTION_SECTIONS = {"model": RUN, "device": RUN, "output_dir": RUN, "overwrite": RUN, "data": CALIB,
                       "calib_samples": CALIB, "seq_len": CALIB, "calib_batch_size": CALIB, "seed": CALIB,
                       "n": PATTERN, "m": PATTERN, "skip_incompatible": PATTERN}

    def validate(self) -> None:
        if self.method is None:
            raise CastError(f"--method is required ({'|'.join(METHODS)})")
        if self.output_dir is None:
            raise CastError("--output-dir is required (where the pruned checkpoint is written)")
        self.check_pattern()
        if self.damp < 0:
            raise CastError(f"--damp must be ≥ 0, got {self.damp}")
        if self.blocksize <= 0 or self.blocksize % self.m:
            raise CastError(f"--blocksize must be a positive multiple of --m {self.m}, got {self.blocksize}")
        if self.eval_max_windows is not None and self.eval_max_windows < 1:
            raise CastError("--eval-max-windows must be at least 1")
