"""The settings of the deployment jobs, torch-free (``cast-llm --help`` builds the commands' flags from them).

* :class:`ExportConfig` — ``cast-llm export`` (:func:`cast_llm.jobs.export.export_job`);
* :class:`BenchConfig` — one dense vs 2:4 measurement (:func:`cast_llm.deploy.bench.run_bench`), and
  :class:`BenchInferenceConfig`, the same plus what ``cast-llm bench-inference`` adds around it: the model, its
  dtype and device, several batch sizes, the output (:func:`cast_llm.jobs.bench.bench_job`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import (
    DeviceSettings,
    JsonSettings,
    KernelSettings,
    ModelSettings,
    NMSettings,
    OutputSettings,
    PlotSettings,
    SeedSettings,
    dtype_option,
    option,
)
from cast_llm.errors import CastError

FORMATS = ("hf", "compressed", "compressed-tensors")


@dataclass
class ExportConfig(OutputSettings, NMSettings, ModelSettings):
    """A sparse model written as ``hf``, ``compressed`` or ``compressed-tensors`` (method.md §7)."""

    format: str = option("hf", "hf (safetensors with exact zeros), compressed (kept values + 2-bit positions), "
                         "compressed-tensors (vLLM's legacy sparse-24-bitmask)", choices=FORMATS)
    dtype: str = dtype_option("auto", "dtype of the written weights: auto (as stored in MODEL), fp32, fp16, bf16",
                              choices=("auto", "fp32", "fp16", "bf16"))
    encoding: str = option("auto", "compressed: how kept positions are stored: index (ceil(log2 m) bits per kept "
                           "value), bitmask (1 bit per weight), auto (the smaller)",
                           choices=("auto", "index", "bitmask"))
    verify: bool = option(True, "read the written checkpoint back and check it equals the model bit for bit")

    OPTION_TEXT = {
        "model": "the sparse model: a local HF folder, a hub id or an alias",
        "output_dir": "folder to write (required)",
        "overwrite": "replace the cast-llm output at --output-dir (only the files its marker lists, once the new "
                     "one is complete)",
        "n": "N of the N:M pattern the model must have (compressed-tensors: 2:4 only)",
        "m": "M of the N:M pattern",
    }

    def validate(self) -> None:
        if not self.model:
            raise CastError("MODEL is required")
        if self.output_dir is None:
            raise CastError("--output-dir is required")
        self.check_pattern()
        if self.format == "compressed-tensors" and (self.n, self.m) != (2, 4):
            raise CastError("--format compressed-tensors stores 2:4 only (sparse-24-bitmask)")


MODEL, WORKLOAD, TIMING, OUTPUT = "model and kernels", "workload", "timing", "output"
BENCH_SECTIONS = (WORKLOAD, MODEL, TIMING, OUTPUT)  # the order of `bench-inference --help`
BACKENDS = ("auto", "cusparselt", "cutlass")  # = the keys of cast_llm.deploy.bench.BACKENDS (a test keeps them equal)


@dataclass
class BenchConfig:
    """One dense vs 2:4 measurement of a model: the workload, the 2:4 layers' options, the timing."""

    batch_size: int = option(1, "sequences per batch", min=1, section=WORKLOAD)
    prompt_len: int = option(128, "prompt tokens per sequence (prefill)", min=1, section=WORKLOAD)
    gen_len: int = option(64, "tokens generated per sequence (decode, greedy, KV cache)", min=0, section=WORKLOAD)
    warmup: int = option(1, "untimed runs before measuring", min=0, section=TIMING)
    repeats: int = option(3, "timed generation runs; the median is reported", min=1, section=TIMING)
    backend: str = option("auto", "2:4 kernels: auto (every one that runs here; the dispatch picks per shape), "
                          "cusparselt, cutlass (Ampere only)", choices=BACKENDS, section=MODEL)
    linear_repeats: int = option(20, "timed runs of each per-linear F.linear measurement (median)", min=1,
                                 section=TIMING)
    dispatch_cache: str | None = option(None, "JSON file of measured dense/2:4 choices to reuse and extend "
                                        "(created if missing; a file it did not write is refused)", section=MODEL)
    dense_copy: bool = option(True, "let a 2:4 layer keep its dense weight for the token counts where dense "
                                    "measures faster (--no-dense-copy: compressed weights only, the least memory; "
                                    "on the CPU large token counts then rebuild the dense weight into a scratch "
                                    "buffer)", section=MODEL)
    dense_fp32: str = option("auto", "also time the dense model upcast to fp32: on a CPU that does not multiply "
                             "bf16 / fp16 natively (no AVX512-BF16 or AMX) torch's half-precision GEMM is emulated and "
                             "fp32 is often the faster dense path a user would run. auto (there, for a bf16 or fp16 "
                             "model), on, off", choices=("auto", "on", "off"), section=MODEL)


@dataclass
class BenchInferenceConfig(DeviceSettings, JsonSettings, PlotSettings, SeedSettings, KernelSettings, BenchConfig,
                           ModelSettings):
    """``cast-llm bench-inference``: :class:`BenchConfig` on a model loaded (or built at random) here, at one or
    several batch sizes, reported as tables, JSON and a plot."""

    batch_sizes: str = option("", "several batch sizes, one run each on the same model (e.g. 1,4,16; overrides "
                                  "--batch-size): the tables one after another, --json a list", section=WORKLOAD)
    dtype: str = dtype_option("fp16", "weights and activations dtype (semi-structured kernels: fp16 or bf16)",
                              choices=("fp16", "bf16", "fp32"), section=MODEL)
    json_out: str | None = option(None, "also write the report as JSON to this file", section=OUTPUT)

    OPTION_TEXT = {
        "model": "model folder, hub id, alias (smollm2-135m) or random:llama-2-7b / random:llama-2-13b",
        "seed": "seed of the random prompt (and of random: models)",
        "json": "print the report as one JSON object instead of a table",
        "plot": "also draw the report (tokens/s dense vs 2:4, per-linear speed-ups) into this PNG file",
    }
    OPTION_SECTIONS = {"seed": TIMING, "kernels": MODEL, "device": MODEL, "json": OUTPUT, "plot": OUTPUT}

    def validate(self) -> None:
        if not self.model:
            raise CastError("MODEL is required")

    def batch_size_list(self) -> list[int]:
        """``--batch-sizes`` as whole numbers, else ``[--batch-size]``."""
        try:
            sizes = [int(b) for b in self.batch_sizes.split(",")] if self.batch_sizes else [self.batch_size]
        except ValueError:
            raise CastError(f"--batch-sizes {self.batch_sizes!r}: give whole numbers separated by commas, e.g. "
                            "1,4,16") from None
        if min(sizes) < 1:
            raise CastError("--batch-sizes: every batch size must be at least 1")
        return sizes
