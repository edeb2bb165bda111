"""``QuantizeConfig``: the settings of a quantization job (:func:`cast_llm.jobs.quantize.quantize_job`,
``cast-llm quantize``). Torch-free, so that ``cast-llm --help`` builds the command's flags from it."""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import ModelSettings, NMSettings, OutputSettings, SeedSettings, dtype_option, option
from cast_llm.data.config import BlockCalibrationSettings, EvalWindowSettings
from cast_llm.errors import CastError

METHODS = ("awq", "rtn")  # = cast_llm.quant.quantize.METHODS in --help's order (a test keeps the sets equal)
QUANT, CALIB, OUTPUT, EVAL = "quantization", "AWQ calibration", "output", "evaluation"
SECTIONS = (QUANT, CALIB, OUTPUT, EVAL)  # the order of `quantize --help`


@dataclass
class QuantizeConfig(OutputSettings, SeedSettings, NMSettings, BlockCalibrationSettings, EvalWindowSettings,
                     ModelSettings):
    """Sparsity-preserving AWQ / RTN weight quantization of a (dense or N:M) model (method.md §7)."""

    method: str = option("awq", "awq (activation-aware scale search, then group-wise quantization) or rtn "
                         "(round-to-nearest)", choices=METHODS, section=QUANT)
    bits: int = option(4, "bits per weight (the paper: 4 and 3)", choices=(2, 3, 4, 8), section=QUANT)
    group_size: int | None = option(None, "weights per quantization group along the input dim "
                                    "(default: 128; 64 for GPT-2, method.md §7)", section=QUANT)
    grid: int = option(20, "AWQ: alpha grid points on [0, 1] beyond 0 (alpha = i / grid)", section=CALIB)
    search_tokens: int = option(4096, "AWQ: calibration tokens (a seeded random subset) on which the output "
                                "error of each alpha is measured; mean |x| uses all tokens", section=CALIB)
    dtype: str = dtype_option("fp16", "dtype of the non-quantized tensors and of fake-quant/ (the search runs in "
                              "fp32)", choices=("fp16", "bf16", "fp32"), section=OUTPUT)
    eval_windows: int = option(0, "if > 0: WikiText-2 perplexity before and after, on the first this many windows",
                               section=EVAL)

    OPTION_TEXT = {
        "eval_seq_len": "perplexity window length for --eval-windows (default: --seq-len)",
        "model": "the model to quantize (dense or N:M sparse): HF folder, hub id or alias",
        "data": "AWQ calibration text: wiki-summaries, a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG]",
        "calib_samples": "AWQ calibration sequences (the AWQ paper: 128)",
        "seq_len": "tokens per calibration sequence (the AWQ paper: 512)",
        "n": "N of the N:M pattern (selects targets; a sparse model's packed codes use it)",
        "m": "M of the N:M pattern",
        "device": "where calibration runs: auto (cuda if available), cpu, cuda, cuda:N",
        "seed": "seed of the data split, the calibration samples and the search subset",
        "output_dir": "folder to write (required): packed weights + fake-quant/",
        "overwrite": "replace the cast-llm output at --output-dir (only the files its marker lists, once the new "
                     "one is complete)",
    }
    OPTION_SECTIONS = {"n": QUANT, "m": QUANT, "data": CALIB, "calib_samples": CALIB, "seq_len": CALIB,
                       "calib_batch_size": CALIB, "device": CALIB, "seed": CALIB, "output_dir": OUTPUT,
                       "overwrite": OUTPUT}

    def validate(self) -> None:
        if not self.model:
            raise CastError("MODEL is required")
        if self.output_dir is None:
            raise CastError("--output-dir is required")
        if self.group_size is not None and self.group_size < 1:
            raise CastError(f"--group-size must be positive, got {self.group_size}")
        if self.grid < 1 or self.search_tokens < 1:
            raise CastError("--grid and --search-tokens must be ≥ 1")
        self.check_pattern()
