"""Training configuration: one dataclass, the single source of truth for CLI flags, YAML and presets.

Precedence (lowest to highest): dataclass defaults < ``--preset`` < ``--config file.yaml`` < flags typed on
the command line. The resolved config is written into the run folder as ``config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import option, parse_count
from cast_llm.errors import CastError

# training methods (cast_llm.train.methods.REGISTRY): CAST and the training baselines of method.md §6
METHODS = ("cast", "naive", "srste", "ast", "maskllm")
INIT_MASKS = ("magnitude", "wanda", "sparsegpt")  # one-shot masks a training run may start from
MASK_LEARNERS = ("adams", "srste")  # how CAST learns its masks (--mask-learner srste: the §6 ablation)
LR_SCHEDULES = ("cosine", "constant", "linear")  # after the linear warm-up (the paper gives none)
FINAL_PRUNES = ("hard", "compensated")  # how the trained weights become N:M (Algorithm 1's last line, or ours)
# Defaults of --kd / --scaling when not given: what each method is in the paper (method.md §6). Naive
# retraining, SR-STE and MaskLLM train without a teacher; AST and CAST distil; only CAST scales weights.
KD_BY_DEFAULT = ("cast", "ast")
SCALING_BY_DEFAULT = ("cast",)


def _opt_count(v):
    return None if v is None else parse_count(v)


def _count_ge0(v) -> int:
    n = parse_count(v)
    if n < 0:
        raise ValueError(f"must be ≥ 0, got {v!r}")
    return n


def _hist_steps(v) -> str:
    from cast_llm.analysis.ratios import parse_hist_steps  # lazy: keeps `cast-llm --help` free of torch

    return parse_hist_steps(v)


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
    lr_schedule: str = option("cosine", "lr after the warm-up: cosine or linear decay to lr × --min-lr-ratio, or "
                                        "constant (the paper gives none)", choices=LR_SCHEDULES)
    min_lr_ratio: float = option(0.0, "cosine/linear schedules decay to lr × this")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0 = off)")
    mask_interval: int = option(10, "recompute masks from |θ| every this many steps (T1, paper 10; 0 = fixed)")
    fixed_mask: bool = option(False, "keep the initial mask for the whole run (= --mask-interval 0; the "
                                     "CAST ablation 'fixed mask')")
    init_mask: str = option("magnitude", "initial N:M mask: magnitude (Eq. 6), or wanda / sparsegpt calibrated on "
                                         "--calib-samples training sequences (naive also keeps SparseGPT's "
                                         "reconstructed weights; the other methods take the mask only)",
                            choices=INIT_MASKS)
    calib_samples: int = option(128, "training sequences used to calibrate --init-mask wanda/sparsegpt (paper 128)")
    n: int = option(2, "N of the N:M pattern (kept per group)")
    m: int = option(4, "M of the N:M pattern (group size)")
    # --- weight scaling (§3) and distillation (§4)
    scaling: bool | None = option(None, "learnable weight scaling (Eq. 11-12); default: on for cast only; "
                                        "--no-scaling to ablate")
    scale_groups: int = option(2, "column blocks per row of the scale A (paper n = 2)")
    kd: bool | None = option(None, "distil from the frozen dense model (Eq. 13); default: on for cast and ast, "
                                   "off for naive, srste, maskllm; --kd / --no-kd to change it")
    eta: float = option(1 / 3, "KD weight η in η·KL + (1-η)·CE (paper 2/3 GPT-2/OPT, 1/3 LLaMA)")
    temperature: float = option(1.0, "KD softmax temperature (ours; paper uses 1)")
    kd_chunk_size: int = option(1024, "tokens per chunk when computing the KD loss (bounds logits memory)")
    # --- beyond the paper, for short budgets (docs/training.md; all off with --paper-exact)
    paper_exact: bool = option(False, "CAST exactly as the paper: dense start, hard final prune, no repair "
                                      "(refuses the options below)")
    warm_start: bool | None = option(None, "cast: start from the --init-mask one-shot MODEL (pruned weights 0, "
                                           "SparseGPT's reconstructed kept weights) instead of the dense one")
    repair_fraction: float | None = option(None, "cast: for this last fraction of the steps, freeze the masks, "
                                                 "prune, and train the sparse model itself (masked repair)")
    final_prune: str | None = option(None, "cast: hard (W ← W⊙M) or compensated (SparseGPT's OBS update of the "
                                           "kept weights with the learned masks, on --calib-samples sequences)",
                                     choices=FINAL_PRUNES)
    forecast_target: float = option(0.99, "cast: warn when the forecast final sparse-weight ratio S_T is below this")
    # --- baselines and ablations (method.md §6)
    mask_learner: str = option("adams", "cast only: adams (Algorithm 1) or srste (sparse STE forward + SR-STE "
                                        "decay instead of AdamS: the §6 ablation)", choices=MASK_LEARNERS)
    srste_decay: float = option(2e-4, "λ_W of the SR-STE decay λ_W(1-M)⊙W on pruned weights (SR-STE paper's "
                                      "2e-4): added to the gradient (srste, cast --mask-learner srste) or, "
                                      "ramped up linearly, to the Adam momentum signal (ast)")
    maskllm_tau: str = option("4,0.05", "maskllm: Gumbel-softmax temperature τ, start,end (linear; MaskLLM 4 → 0.05)")
    maskllm_kappa: str = option("100,500", "maskllm: logit scaling κ, start,end (linear; MaskLLM 1e2 → 5e2)")
    maskllm_lr: float | None = option(None, "maskllm: lr of the mask logits (default: 10 × --lr, as MaskLLM's "
                                            "logits learn far faster than weights)")
    maskllm_prior: float = option(3.0, "maskllm: initial scaled-logit bonus of the --init-mask pattern of each group")
    skip_incompatible: bool = option(False, "leave layers whose width is not a multiple of m dense instead of failing")
    # --- logging, evaluation, checkpoints
    log_every: int = option(10, "steps between JSONL/TensorBoard records (flip rates refer to this interval)")
    eval_every: int = option(0, "steps between validation perplexities (0 = only at the start and end)")
    # --- mask-learning dynamics (method.md §7; what each quantity means: docs/analysis.md)
    layer_stats: bool = option(True, "per-layer flip rate, initial flip rate and sparse-weight ratio on every "
                                     "log step, written to layers.jsonl")
    track_weights: int = option(10_000, "target weights sampled (seeded) to track |w| and the last mask flip "
                                        "(the paper's Table 2) into dynamics.json; 0 = off", parse=_count_ge0)
    track_every: int = option(0, "steps between weight-tracking checks (0 = at every mask update, i.e. every "
                                 "--mask-interval steps, and every log step)", parse=_count_ge0)
    ratio_hist_steps: str = option("0.1,0.5,1.0", "when to histogram |pruned|/|kept| inside N:M groups (Fig. 3) "
                                                  "into ratio_hist.npz: fractions of the run (0.5) and/or steps "
                                                  "(500), comma-separated; '' = never", parse=_hist_steps)
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
    fsdp: bool = option(False, "shard student and teacher with FSDP2 (rows of every weight) across the launched "
                               "processes; --method cast with AdamS; resume with the same process count")
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
        if self.mask_learner != "adams" and self.method != "cast":
            raise CastError(f"--mask-learner is a CAST ablation; --method {self.method} has its own mask learner")
        if self.srste_decay < 0:
            raise CastError(f"--srste-decay must be ≥ 0, got {self.srste_decay}")
        if self.calib_samples < 1:
            raise CastError(f"--calib-samples must be ≥ 1, got {self.calib_samples}")
        if not 0 < self.forecast_target <= 1:
            raise CastError(f"--forecast-target must be in (0, 1], got {self.forecast_target}")
        if self.repair_fraction is not None and not 0 <= self.repair_fraction < 1:
            raise CastError(f"--repair-fraction must be in [0, 1) (a fraction of the steps), got {self.repair_fraction}")
        if self.maskllm_lr is not None and self.maskllm_lr <= 0:
            raise CastError(f"--maskllm-lr must be > 0, got {self.maskllm_lr}")
        beyond = {"--warm-start": self.warm_start, "--repair-fraction": self.repair_fraction,
                  "--final-prune": self.final_prune}
        given = [flag for flag, v in beyond.items() if v not in (None, False, 0, 0.0, "hard")]
        if self.paper_exact and given:
            raise CastError(f"--paper-exact runs CAST as the paper does; it excludes {', '.join(given)}")
        if given and (self.method != "cast" or self.mask_learner != "adams"):
            raise CastError(f"{', '.join(given)} apply to --method cast with AdamS only (got --method {self.method}"
                            f"{', --mask-learner ' + self.mask_learner if self.method == 'cast' else ''})")
        if self.method == "maskllm":
            if self.use_scaling:
                raise CastError("--method maskllm learns masks only (weights frozen): --scaling does not apply")
            if self.fixed_mask:
                raise CastError("--method maskllm learns the mask itself: --fixed-mask does not apply")
            for name in ("maskllm_tau", "maskllm_kappa"):
                start, end = self.schedule(name)
                if start <= 0 or end <= 0:
                    raise CastError(f"--{name.replace('_', '-')} values must be > 0, got {getattr(self, name)}")

    def schedule(self, name: str) -> tuple[float, float]:
        """A ``start,end`` option (``maskllm_tau``, ``maskllm_kappa``) as two floats."""
        raw = getattr(self, name)
        try:
            start, end = (float(x) for x in str(raw).split(","))
        except ValueError:
            raise CastError(f"--{name.replace('_', '-')} must be two numbers 'start,end', got {raw!r}") from None
        return start, end

    @property
    def use_kd(self) -> bool:
        kd = self.kd if self.kd is not None else self.method in KD_BY_DEFAULT
        return kd and self.eta > 0

    @property
    def use_scaling(self) -> bool:
        return self.scaling if self.scaling is not None else self.method in SCALING_BY_DEFAULT

    # the beyond-the-paper options: None = the default of the method (none of them with --paper-exact)
    @property
    def use_warm_start(self) -> bool:
        return bool(self.warm_start) if self.warm_start is not None else False

    @property
    def effective_repair_fraction(self) -> float:
        return float(self.repair_fraction) if self.repair_fraction is not None else 0.0

    @property
    def effective_final_prune(self) -> str:
        return self.final_prune if self.final_prune is not None else "hard"

    @property
    def effective_mask_interval(self) -> int:
        """T1 as the mask learners use it: 0 (never recompute) with --fixed-mask."""
        return 0 if self.fixed_mask else self.mask_interval


# Paper hyperparameters (method.md §5, Table 11). Batch = global sequences per step; with batch_size 8 the
# accumulation is set so one process reaches it (accelerate launch divides it across processes).
PRESETS: dict[str, dict] = {
    "gpt2": dict(lr=1e-4, l1_decay=1e-6, seq_len=1024, batch_size=8, grad_accum=16, max_steps=60_000, eta=2 / 3),
    "opt": dict(lr=1e-4, l1_decay=2e-6, seq_len=2048, batch_size=8, grad_accum=16, max_steps=30_000, eta=2 / 3),
    "llama": dict(lr=2e-5, l1_decay=4e-7, seq_len=4096, batch_size=8, grad_accum=32, max_steps=7_500, eta=1 / 3),
    # CPU-sized: the embedded SmolLM2-135M on the embedded corpus in ~10 minutes on 2 idle cores (measured:
    # 567 s, docs/results/training-smollm2.md). AdamS would need lr·T/2 above the typical |pruned w| (~0.06)
    # to finish the decay, but its momentum-based second moment makes a large lr wreck the model on small
    # batches (lr 2e-3: CE 2.9 → 18.7 in 10 steps), so lr 5e-4 is the largest stable choice and the run ends
    # with ~half of each pruned magnitude left (S_t 0.87): a pipeline demonstration, not CAST's quality.
    # λ ≈ 2× the per-batch gradient magnitude. Not tuned by sweeps.
    "smollm2-cpu": dict(
        model="smollm2-135m", data="wiki-summaries", seq_len=256, batch_size=2, grad_accum=1, max_steps=110,
        lr=5e-4, l1_decay=2e-4, eta=1 / 3, warmup_steps=5, log_every=10, val_sequences=16,
        wikitext_windows=8, eval_seq_len=512, save_every=50,
    ),
}
