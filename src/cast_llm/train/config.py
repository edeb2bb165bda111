"""Training configuration: one dataclass, the single source of truth for CLI flags, YAML and presets.

Precedence (lowest to highest): dataclass defaults < ``--preset`` < ``--config file.yaml`` < flags typed on
the command line. The resolved config is written into the run folder as ``config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import option, parse_count
from cast_llm.errors import CastError

METHODS = ("cast",)  # training methods; baselines register more in cast_llm.train.methods


def _opt_count(v):
    return None if v is None else parse_count(v)


@dataclass
class TrainConfig:
    # --- what to train, on what, where
    model: str = option("smollm2-135m", "Hugging Face model folder / hub id / .gguf file, or the alias smollm2-135m")
    data: str = option("wiki-summaries", "wiki-summaries (embedded), a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG]")
    output_dir: str | None = option(None, "run folder: checkpoints, logs, and the final sparse model")
    method: str = option("cast", "training method", choices=METHODS)
    # --- budget and batch
    max_steps: int | None = option(None, "optimizer steps (give this or --tokens)")
    tokens: int | None = option(None, "training-token budget, e.g. 20M; sets the steps", parse=_opt_count)
    batch_size: int = option(4, "sequences per micro-batch per process")
    grad_accum: int = option(1, "micro-batches accumulated per optimizer step")
    seq_len: int = option(512, "tokens per training sequence")
    # --- optimizer (AdamS, method.md §2) and schedule
    lr: float = option(2e-5, "peak learning rate (paper: 1e-4 GPT-2 124M, 2e-5 LLaMA)")
    l1_decay: float = option(4e-7, "AdamS L1 strength λ on pruned weights (paper: 1e-6 GPT-2, 4e-7 LLaMA)")
    beta1: float = option(0.9, "Adam β1 (paper does not give it; Adam default)")
    beta2: float = option(0.999, "Adam β2 (paper does not give it; Adam default)")
    eps: float = option(1e-8, "Adam ε")
    weight_decay: float = option(0.0, "decoupled weight decay on dense weights (not on norms, biases, scales)")
    warmup_steps: int | None = option(None, "linear warm-up steps (default: 2% of the steps, ours)")
    min_lr_ratio: float = option(0.0, "cosine decays to lr × this")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0 = off)")
    mask_interval: int = option(10, "recompute masks from |θ| every this many steps (T1, paper 10)")
    n: int = option(2, "N of the N:M pattern (kept per group)")
    m: int = option(4, "M of the N:M pattern (group size)")
    # --- weight scaling (§3) and distillation (§4)
    scaling: bool = option(True, "learnable weight scaling (Eq. 11-12); --no-scaling to ablate")
    scale_groups: int = option(2, "column blocks per row of the scale A (paper n = 2)")
    kd: bool = option(True, "distil from the frozen dense model (Eq. 13); --no-kd to ablate")
    eta: float = option(1 / 3, "KD weight η in η·KL + (1-η)·CE (paper 2/3 GPT-2/OPT, 1/3 LLaMA)")
    temperature: float = option(1.0, "KD softmax temperature (ours; paper uses 1)")
    kd_chunk_size: int = option(4096, "tokens per chunk when computing the KD loss (bounds logits memory)")
    skip_incompatible: bool = option(False, "leave layers whose width is not a multiple of m dense instead of failing")
    # --- logging, evaluation, checkpoints
    log_every: int = option(10, "steps between JSONL/TensorBoard records (flip rates refer to this interval)")
    eval_every: int = option(0, "steps between validation perplexities (0 = only at the start and end)")
    val_fraction: float = option(0.02, "fraction of documents held out for validation")
    val_sequences: int = option(16, "held-out sequences used for validation perplexity (0 = all)")
    wikitext_windows: int = option(0, "WikiText-2 windows evaluated at the end (0 = all; skipped if absent)")
    eval_seq_len: int | None = option(None, "window length for WikiText-2 perplexity (default: --seq-len)")
    wikitext_file: str | None = option(None, "WikiText-2 raw test file (default: ../shared/data/wikitext-2-raw/test.txt)")
    baseline_eval: bool = option(True, "also measure the dense model and one-shot magnitude N:M at the start")
    save_every: int = option(0, "steps between atomic checkpoints (0 = none until the end)")
    keep_checkpoints: int = option(2, "how many recent checkpoints to keep")
    resume: bool = option(False, "continue from the latest checkpoint in --output-dir")
    overwrite: bool = option(False, "replace an existing run in --output-dir")
    seed: int = option(0, "seed for data order, sampling and initialisation")
    device: str = option("auto", "auto, cpu or cuda (accelerate launch sets the device per process)")
    precision: str = option("auto", "auto (fp32 on CPU, bf16 autocast on GPU), fp32, bf16", choices=("auto", "fp32", "bf16"))
    max_documents: int | None = option(None, "use only the first this many documents of --data (quick runs)")
    progress: bool = option(True, "show a progress bar")

    def validate(self) -> None:
        if not self.output_dir:
            raise CastError("--output-dir is required")
        if (self.max_steps is None) == (self.tokens is None):
            raise CastError("give exactly one budget: --max-steps N or --tokens N (e.g. 20M)")
        for name in ("batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                raise CastError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise CastError(f"--max-steps must be ≥ 1, got {self.max_steps}")
        if self.lr <= 0 or self.l1_decay < 0:
            raise CastError(f"--lr must be > 0 and --l1-decay ≥ 0 (got {self.lr}, {self.l1_decay})")
        if not 0 <= self.eta <= 1:
            raise CastError(f"--eta must be in [0, 1], got {self.eta}")
        if not 1 <= self.n < self.m:
            raise CastError(f"need 1 ≤ n < m for an N:M pattern, got {self.n}:{self.m}")
        if self.mask_interval < 0:
            raise CastError(f"--mask-interval must be ≥ 0 (0 = fixed mask), got {self.mask_interval}")

    @property
    def use_kd(self) -> bool:
        return self.kd and self.eta > 0


# Paper hyperparameters (method.md §5, Table 11). Batch = global sequences per step; with batch_size 8 the
# accumulation is set so one process reaches it (accelerate launch divides it across processes).
PRESETS: dict[str, dict] = {
    "gpt2": dict(lr=1e-4, l1_decay=1e-6, seq_len=1024, batch_size=8, grad_accum=16, max_steps=60_000, eta=2 / 3),
    "opt": dict(lr=1e-4, l1_decay=2e-6, seq_len=2048, batch_size=8, grad_accum=16, max_steps=30_000, eta=2 / 3),
    "llama": dict(lr=2e-5, l1_decay=4e-7, seq_len=4096, batch_size=8, grad_accum=32, max_steps=7_500, eta=1 / 3),
    # CPU-sized: the embedded SmolLM2-135M on the embedded corpus in ~10 minutes on 2 cores. Short runs need
    # a larger lr: AdamS moves a pruned weight by at most ~lr per step, so lr·T/2 must exceed the typical
    # |pruned weight| for the proportional decay to reach ~0 by the end (method.md §2).
    "smollm2-cpu": dict(
        model="smollm2-135m", data="wiki-summaries", seq_len=256, batch_size=4, grad_accum=1, max_steps=120,
        lr=5e-4, l1_decay=1e-5, eta=1 / 3, warmup_steps=6, log_every=10, val_sequences=16,
        wikitext_windows=8, eval_seq_len=512, save_every=40,
    ),
}
