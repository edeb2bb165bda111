"""Configuration of training jobs: dataclasses, the single source of truth for CLI flags, YAML and presets.

:class:`RunConfig` holds what every job of the one training loop shares (run folder, budget, optimizer
schedule, logging, checkpoints, devices) — ``cast-llm train`` (:class:`TrainConfig`) and ``cast-llm
finetune`` (:class:`cast_llm.finetune.config.FinetuneConfig`) extend it. :class:`CastSettings` holds
CAST's own knobs (AdamS, weight scaling, distillation), shared by :class:`TrainConfig` and the
``transformers.Trainer`` integration (:class:`cast_llm.integrations.hf_trainer.CastArguments`).

Precedence (lowest to highest): dataclass defaults < ``--preset`` < ``--config file.yaml`` < flags typed on
the command line; with ``--resume`` the run's own ``config.yaml`` comes first. The resolved config is
written into the run folder as ``config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import (
    FSDP_PRECISIONS,
    RECOMPUTE_MODES,
    DeviceSettings,
    KernelSettings,
    OutputSettings,
    PatternSettings,
    ProgressSettings,
    SeedSettings,
    ThreadSettings,
    check_ranges,
    dtype_option,
    option,
    parse_count,
    parse_hist_steps,
    recompute_mode,
)
from cast_llm.data.config import DataSettings, EvalWindowSettings, WindowSettings
from cast_llm.errors import CastError
from cast_llm.optim.schedule import FINETUNE_WARMUP, SCHEDULES, TRAIN_WARMUP

# training methods (cast_llm.train.methods.REGISTRY): CAST and the training baselines of method.md §6
METHODS = ("cast", "naive", "srste", "ast", "maskllm")
INIT_MASKS = ("magnitude", "wanda", "sparsegpt")  # one-shot masks a training run may start from
DECAY_MODES = ("proportional", "additive")  # AdamS's decay_mode (cast_llm.optim.functional's; torch-free here)
SPARSE_UPDATES = ("adams", "adam")  # AdamS's update (cast_llm.optim.adams.UPDATES; torch-free here)
MASK_LEARNERS = ("adams", "srste")  # how CAST learns its masks (--mask-learner srste: the §6 ablation)
LR_SCHEDULES = SCHEDULES  # after the linear warm-up (the paper gives none; cast_llm.optim.schedule)
FINAL_PRUNES = ("hard", "compensated")  # how the trained weights become N:M (Algorithm 1's last line, or ours)
RESUME = ("latest", "auto")
# the last fraction of a CAST run trained as the sparse model it exports (the masked repair), by default
DEFAULT_REPAIR_FRACTION = 0.2
# Defaults of --kd / --scaling when not given: what each method is in the paper (method.md §6). Naive
# retraining, SR-STE and MaskLLM train without a teacher; AST and CAST distil; only CAST scales weights.
KD_BY_DEFAULT = ("cast", "ast")
SCALING_BY_DEFAULT = ("cast",)

RUN, BUDGET, OPTIM, CAST, BEYOND, BASELINES, EVAL, ANALYSIS, CKPT = (
    "run", "budget and batch", "optimizer and schedule", "CAST: AdamS, weight scaling, distillation",
    "beyond the paper (short budgets; off with --paper-exact)", "baselines and ablations", "evaluation",
    "mask-learning statistics", "logging and checkpoints")
MEMORY = "memory for large models (cast-llm plan says which a run needs)"
SECTIONS = (RUN, BUDGET, OPTIM, CAST, BEYOND, BASELINES, EVAL, ANALYSIS, CKPT, MEMORY)  # the order of `train --help`
TEACHER_DTYPES = ("auto", "bf16", "fp32")


def _count_ge0(v) -> int:
    n = parse_count(v)
    if n < 0:
        raise ValueError(f"must be ≥ 0, got {v!r}")
    return n


def _resume(v) -> str | None:
    """``--resume`` (latest), ``--resume auto``; YAML ``true`` / ``false`` / ``auto`` / ``latest``."""
    if v is None or v is False or (isinstance(v, str) and v.lower() in ("false", "no", "off", "none", "null")):
        return None
    if v is True or (isinstance(v, str) and v.lower() in ("true", "yes", "on", "latest")):
        return "latest"
    if isinstance(v, str) and v.lower() == "auto":
        return "auto"
    raise ValueError(f"expected nothing (the latest checkpoint) or 'auto', got {v!r}")


@dataclass
class RunConfig(DeviceSettings, PatternSettings, OutputSettings, SeedSettings, ProgressSettings, KernelSettings,
                WindowSettings, ThreadSettings):
    """What every job of the one training loop shares."""

    OPTION_SECTIONS = {"n": BUDGET, "m": BUDGET, "skip_incompatible": BUDGET, "seq_len": BUDGET, "output_dir": RUN,
                       "overwrite": RUN, "seed": RUN, "progress": RUN, "kernels": RUN, "threads": RUN}

    resume: str | None = option(None, "continue the run in --output-dir from its newest complete checkpoint, with "
                                      "its own config.yaml (flags typed with it must agree); 'auto': start "
                                      "afresh when there is none (re-run the same command after a preemption); "
                                      "a finished run: 'already finished', exit 0, nothing touched (--overwrite "
                                      "starts it afresh)",
                                choices=RESUME, parse=_resume, nargs="?", const="latest", section=RUN,
                                resume="free")
    # DeviceSettings' --device, narrowed to what a launch of the training loop takes
    device: str = option("auto", "auto (CUDA when visible), cpu or cuda; accelerate launch sets it per process",
                         choices=("auto", "cpu", "cuda"), section=RUN, resume="free")
    precision: str = option("auto", "auto (fp32 on CPU, bf16 autocast on GPU), fp32, bf16",
                            choices=("auto", "fp32", "bf16"), section=RUN, resume="free")
    max_steps: int | None = option(None, "optimizer steps", min=1, section=BUDGET, resume="must_match")
    # finetune's; train's own adds 0 = the memory plan's choice (TrainConfig)
    batch_size: int = option(8, "examples per micro-batch per process", min=1, section=BUDGET, resume="must_match")
    grad_accum: int = option(1, "micro-batches accumulated per optimizer step", min=1, section=BUDGET,
                             resume="must_match")
    weight_decay: float = option(0.0, "decoupled weight decay on matrices (not on norms, biases, scales)", min=0,
                                 section=OPTIM, resume="must_match")
    warmup_steps: int | None = option(None, f"linear warm-up steps (default: {TRAIN_WARMUP:.0%} of the steps for "
                                            f"train, {FINETUNE_WARMUP:.0%} for finetune; at least 1)", min=0,
                                      section=OPTIM, resume="must_match")
    lr_schedule: str = option("cosine", "lr after the warm-up: cosine or linear decay to lr × --min-lr-ratio, or "
                                        "constant (the paper gives none; cosine measured best for CAST on short "
                                        "budgets although constant lets the decay travel further: docs/training.md)",
                              choices=LR_SCHEDULES, section=OPTIM, resume="must_match")
    min_lr_ratio: float = option(0.0, "the cosine / linear schedules decay to lr × this", min=0, max=1, section=OPTIM,
                                 resume="must_match")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0 = off)", min=0, section=OPTIM,
                              resume="must_match")
    # train's; finetune's own defaults by its --mode (FinetuneConfig)
    lr: float = option(2e-5, "peak learning rate (paper: 1e-4 GPT-2 124M, 2e-5 LLaMA)", min=0, min_exclusive=True,
                       section=OPTIM, resume="must_match")
    log_every: int = option(10, "steps between metrics.jsonl / TensorBoard records", min=1, section=CKPT,
                            resume="free")
    eval_every: int = option(0, "steps between validation evaluations (0 = only at the start and end)", min=0,
                             section=CKPT, resume="free")
    baseline_eval: bool = option(True, "also evaluate the starting model before training", section=CKPT,
                                 resume="free")
    save_every: int | None = option(None, "steps between atomic checkpoints (default: one whenever 30 minutes of "
                                          "wall time have passed since the last, so a run longer than an hour "
                                          "always has one; 0 = none; SIGTERM/SIGINT write one in every case)",
                                    min=0, section=CKPT, resume="free")
    keep_last: int = option(2, "checkpoints kept (older ones are removed once a newer one is complete)", min=1,
                            section=CKPT, resume="free")
    keep_checkpoints_after: bool = option(False, "keep the checkpoints after the run completes (they are only "
                                                 "needed to resume; removed by default)", section=CKPT,
                                                 resume="free")
    # Read by the training loop from every job's config but not an option of every command: plain class
    # attributes (no flag, no YAML key); a command's config that offers one declares it as an option field
    # (TrainConfig: --model, --fsdp)
    model = None  # the model the run starts from (never taken as the run folder)
    fsdp = False  # FSDP2: student and teacher sharded across the processes
    fsdp_precision = "auto"  # FSDP2's mixed precision (TrainConfig: --fsdp-precision)
    tensorboard = True  # TensorBoard event files in RUN/tensorboard

    def validate(self) -> None:
        if not self.output_dir:
            raise CastError("--output-dir is required")
        check_ranges(self)
        self.check_pattern()


@dataclass
class CastSettings:
    """CAST's own knobs (method.md §2-4): shared by ``cast-llm train`` and the HF Trainer integration."""

    l1_decay: float = option(4e-7, "AdamS L1 strength λ on pruned weights (paper: 2e-6 OPT, 1e-6 GPT-2, 4e-7 "
                                   "LLaMA)", min=0, section=CAST, resume="must_match")
    mask_interval: int = option(10, "recompute masks from |θ| every this many steps (T1, paper 10; 0 = fixed)",
                                min=0, section=CAST, resume="must_match")
    scale_groups: int = option(2, "column blocks per row of the weight scale A (paper n = 2)", min=1, section=CAST,
                               resume="must_match")
    eta: float = option(0.5, "KD weight η in η·KL + (1-η)·CE. It trades the training text's perplexity (lower "
                             "with small η) against WikiText-2's (lower with large η); 1/2 improves both over "
                             "the baselines (measured: docs/results/compare-smollm2-135m-cpu-notes.md); the paper: "
                             "2/3 GPT-2/OPT (its perplexity), 1/3 LLaMA (zero-shot)", min=0, max=1, section=CAST,
                             resume="must_match")
    kd_temperature: float = option(1.0, "KD softmax temperature (ours; the paper uses 1)", min=0, min_exclusive=True,
                                section=CAST, resume="must_match")
    kd_chunk_size: int = option(1024, "tokens per chunk of the KD loss (bounds the fp32 logits memory)", min=1,
                                section=CAST, resume="free")


@dataclass
class TrainConfig(RunConfig, CastSettings, DataSettings, EvalWindowSettings):
    """``cast-llm train``: the run (:class:`RunConfig`), CAST's knobs, the data (the token cache's key, shared with
    ``cast-llm prepare-data``: :class:`cast_llm.data.config.DataSettings`), and these."""

    OPTION_TEXT = {"eval_seq_len": "WikiText-2 window length (default: --seq-len)"}
    OPTION_SECTIONS = {"model": RUN, "data": RUN, "data_cache": RUN, "tokens": BUDGET, "max_documents": BUDGET,
                       "calib_samples": CAST, "val_fraction": EVAL, "test_fraction": EVAL, "val_sequences": EVAL,
                       "test_sequences": EVAL}

    method: str = option("cast", "training method", choices=METHODS, section=RUN, resume="must_match")
    batch_size: int = option(4, "sequences (examples) per micro-batch per process; 0 = the largest that the "
                                "memory plan fits (with --global-batch: one that divides it)", min=0,
                             section=BUDGET, resume="must_match")
    global_batch: int | None = option(None, "sequences per optimizer step over all processes (the paper's batch): "
                                            "--grad-accum becomes global / (--batch-size × processes), on any "
                                            "number of processes", min=1, section=BUDGET, resume="free")
    beta1: float = option(0.9, "Adam β1 (the paper gives none: Adam's usual value)", min=0, max=0.999999,
                          section=OPTIM, resume="must_match")
    beta2: float = option(0.999, "Adam β2 (the paper gives none: Adam's usual value)", min=0, max=0.999999,
                          section=OPTIM, resume="must_match")
    eps: float = option(1e-8, "Adam ε", min=0, min_exclusive=True, section=OPTIM, resume="must_match")
    scaling: bool | None = option(None, "learnable weight scaling (Eq. 11-12); default: on for cast only; "
                                        "--no-scaling to ablate", section=CAST, resume="must_match")
    kd: bool | None = option(None, "distil from the frozen dense model (Eq. 13); default: on for cast and ast, "
                                   "off for naive, srste, maskllm", section=CAST, resume="must_match")
    teacher_cuda_graph: bool = option(False, "CUDA: replay the frozen teacher's forward as one captured CUDA graph "
                                             "(less host time per step; checked against an eager forward once, on "
                                             "any failure it says why and runs eagerly); benchmarks/train_step.py "
                                             "times both", section=CAST, resume="free")
    fixed_mask: bool = option(False, "keep the initial mask for the whole run (= --mask-interval 0)", section=CAST,
                              resume="must_match")
    init_mask: str | None = option(None, "initial N:M mask: magnitude (Eq. 6), or wanda / sparsegpt calibrated on "
                                         "--calib-samples training sequences (naive and --warm-start also keep "
                                         "SparseGPT's reconstructed weights; otherwise only the mask is taken); "
                                         "default: sparsegpt for a warm-started run, else magnitude",
                                   choices=INIT_MASKS, section=CAST, resume="must_match")
    mask_file: str | None = option(None, "initial N:M mask from a file instead of --init-mask: a cast-llm mask "
                                         "file (.safetensors) or a sparse model folder (its zeros); only the mask "
                                         "is taken (naive: dense weights ⊙ mask) — to retrain one recipe under "
                                         "different masks", section=CAST, resume="must_match")
    fsdp: bool = option(False, "shard student and teacher with FSDP2 (rows of every weight) across the launched "
                               "processes; --method cast with AdamS; resume with the same process count",
                        section=RUN, resume="free")
    # --- beyond the paper, for short budgets (docs/training.md; all off with --paper-exact)
    paper_exact: bool = option(False, "CAST exactly as the paper: dense start, hard final prune, no repair "
                                      "(refuses the options of this section)", section=BEYOND,
                                      resume="must_match")
    warm_start: bool | None = option(None, "start from the --init-mask one-shot MODEL (pruned weights 0, "
                                           "SparseGPT's reconstructed kept weights) instead of the dense one",
                                     section=BEYOND, resume="must_match")
    repair_fraction: float | None = option(None, "for this last fraction of the steps, freeze the masks, prune, and "
                                                 "train the sparse model itself (masked repair)", min=0, max=0.999,
                                           section=BEYOND, resume="must_match")
    final_prune: str | None = option(None, "hard (W ← W⊙M) or compensated (SparseGPT's OBS update of the kept "
                                           "weights with the learned masks, on --calib-samples sequences)",
                                     choices=FINAL_PRUNES, section=BEYOND, resume="must_match")
    warm_start_mix: float | None = option(None, "with a warm start: begin from (1-f)·one-shot + f·dense weights, so "
                                                "the pruned entries start at f of their dense value (decayed by "
                                                "AdamS, free to win their place back at a mask refresh); 0 = the "
                                                "one-shot model, 1 = the dense model with the one-shot mask",
                                          min=0, max=1, section=BEYOND, resume="must_match")
    regrow_factor: float | None = option(None, "multiply the updates of the pruned entries by this during the first "
                                               "--regrow-fraction of the steps, so that a pruned weight the gradient "
                                               "wants back can overtake a kept one while α_t is small (1 = off)",
                                         min=1, section=BEYOND, resume="must_match")
    regrow_fraction: float | None = option(None, "the first fraction of the steps in which --regrow-factor applies",
                                           min=0, max=1, section=BEYOND, resume="must_match")
    forecast_target: float = option(0.99, "warn when the forecast final sparse-weight ratio S_T is below this",
                                    min=0, min_exclusive=True, max=1, section=BEYOND, resume="free")
    # --- baselines and ablations (method.md §6)
    mask_learner: str = option("adams", "cast only: adams (Algorithm 1) or srste (sparse STE forward + SR-STE "
                                        "decay instead of AdamS: the §6 ablation)", choices=MASK_LEARNERS,
                               section=BASELINES, resume="must_match")
    decay_mode: str = option("proportional", "cast with AdamS: how the pruned weights decay — proportional (Eq. 7: "
                                             "mixed with the gradient by α_t = t/T, CAST) or additive (AST's: "
                                             "α_t·λ·θ added to it; the paper's ablation)", choices=DECAY_MODES,
                             section=BASELINES, resume="must_match")
    sparse_update: str = option("adams", "cast with AdamS: the targets' update on the dense forward — adams (Eq. "
                                         "7-8, CAST) or adam (torch's AdamW step, no decay, the masks kept for "
                                         "the final prune: the ablation of AdamS itself)", choices=SPARSE_UPDATES,
                                section=BASELINES, resume="must_match")
    srste_decay: float = option(2e-4, "λ_W of the SR-STE decay λ_W(1-M)⊙W on pruned weights (SR-STE paper's "
                                      "2e-4): added to the gradient (srste, cast --mask-learner srste) or, "
                                      "ramped up linearly, to the Adam momentum signal (ast)", min=0,
                                section=BASELINES, resume="must_match")
    maskllm_tau: str = option("4,0.05", "maskllm: Gumbel-softmax temperature τ, start,end (linear; MaskLLM 4 → "
                                        "0.05)", section=BASELINES, resume="must_match")
    maskllm_kappa: str = option("100,500", "maskllm: logit scaling κ, start,end (linear; MaskLLM 1e2 → 5e2)",
                                section=BASELINES, resume="must_match")
    maskllm_lr: float | None = option(None, "maskllm: lr of the mask logits (default: 10 × --lr; logits need far "
                                            "larger steps than weights)", min=0, min_exclusive=True,
                                      section=BASELINES, resume="must_match")
    maskllm_prior: float = option(3.0, "maskllm: initial scaled-logit bonus of the --init-mask pattern of each "
                                       "group", section=BASELINES, resume="must_match")
    # --- evaluation
    wikitext_windows: int | None = option(None, "WikiText-2 windows scored at the end (0 = all, the full protocol; "
                                                "default: scaled to the run, so that scoring takes less time than "
                                                "training — at least 4)", min=0, section=EVAL, resume="free")
    wikitext_file: str | None = option(None, "WikiText-2 raw test text (default: $CAST_WIKITEXT2, else the copy "
                                             "packaged with cast-llm)", section=EVAL, resume="free")
    report: bool = option(True, "write the run's HTML report (plots of loss, S_t, flip rates, perplexities) into "
                                "RUN/report at the end", section=EVAL, resume="free")
    speed_check: bool = option(False, "at the end, on a CPU, measure the exported 2:4 model's decode tokens/s and "
                                      "resident memory against the same model run dense (two fresh processes, "
                                      "~15 s; the smollm2-cpu preset turns it on)", section=EVAL,
                                      resume="free")
    # --- mask-learning dynamics (method.md §7; what each quantity means: docs/analysis.md)
    layer_stats: bool = option(True, "per-layer flip rate, initial flip rate and sparse-weight ratio on every "
                                     "log step, written to layers.jsonl", section=ANALYSIS, resume="free")
    track_weights: int = option(10_000, "target weights sampled (seeded) to track |w| and the last mask flip "
                                        "(the paper's Table 2) into dynamics.json; 0 = off", parse=_count_ge0,
                                section=ANALYSIS, resume="free")
    track_every: int = option(0, "steps between weight-tracking checks (0 = at every mask update, i.e. every "
                                 "--mask-interval steps, and every log step)", parse=_count_ge0, section=ANALYSIS,
                                 resume="free")
    ratio_hist_steps: str = option("0.1,0.5,1.0", "when to histogram |pruned|/|kept| inside N:M groups (Fig. 3) "
                                                  "into ratio_hist.npz: fractions of the run (0.5) and/or steps "
                                                  "(500), comma-separated; '' = never", parse=parse_hist_steps,
                                   section=ANALYSIS, resume="free")
    # --- memory for large models (docs/training.md, "Large models"; none changes what is computed except
    # --teacher-dtype, and --fused-head up to float summation order)
    activation_checkpointing: str = option("none", "recompute the student's decoder blocks in backward instead of "
                                                   "keeping their activations: full (each block keeps its input; "
                                                   "~+25% step time), selective (also the outputs of its matmuls "
                                                   "and attention: the cheap operators are recomputed), none; the "
                                                   "flag alone means full. The teacher keeps none anyway (its "
                                                   "forward runs without a graph)", choices=RECOMPUTE_MODES,
                                            parse=recompute_mode, nargs="?", const="full", section=MEMORY,
                                            resume="free")
    fsdp_precision: str = option("auto", "with --fsdp in bf16: policy (FSDP2's MixedPrecisionPolicy: bf16 weights "
                                         "for compute and all-gather, fp32 reduce-scatter, fp32 sharded master "
                                         "weights, no autocast; the weight scales stay fp32) or autocast (fp32 "
                                         "all-gathers, bf16 autocast as without --fsdp); auto: policy. results.json "
                                         "records which ran", choices=FSDP_PRECISIONS, section=MEMORY,
                                         resume="free")
    teacher_dtype: str = dtype_option("auto", "the frozen teacher's weights: auto (bf16 when training in bf16, "
                                              "else fp32), bf16 or fp32", choices=TEACHER_DTYPES, section=MEMORY,
                                      resume="free")
    fused_head: bool = option(False, "LM head and loss (KD or CE) together, --kd-chunk-size tokens at a time: the "
                                     "full tokens × vocabulary logits of student and teacher never exist (128k "
                                     "vocabularies; same FLOPs)", section=MEMORY, resume="free")
    packed_masks: bool = option(False, "AdamS keeps its N:M masks as bits (1/8 of the bool masks)", section=MEMORY,
                                resume="free")
    memory_check: bool = option(True, "stop before loading anything when the memory plan says the run does not fit, "
                                      "with the options that would make it fit (--no-memory-check starts anyway)",
                                section=MEMORY, resume="free")

    def validate(self) -> None:
        super().validate()
        if self.packed_masks and (self.method != "cast" or self.mask_learner != "adams"):
            raise CastError("--packed-masks is AdamS's mask storage: it needs --method cast with --mask-learner adams")
        self.check_split()
        if (self.max_steps is None) == (self.tokens is None):
            raise CastError("give exactly one budget: --max-steps N or --tokens N (e.g. 20M)")
        if self.mask_learner != "adams" and self.method != "cast":
            raise CastError(f"--mask-learner is a CAST ablation; --method {self.method} has its own mask learner")
        if self.decay_mode != "proportional" and (self.method != "cast" or self.mask_learner != "adams"):
            raise CastError(f"--decay-mode is AdamS's, in --method cast with --mask-learner adams (got --method "
                            f"{self.method}{', --mask-learner ' + self.mask_learner if self.method == 'cast' else ''}"
                            "; ast decays additively already)")
        if self.sparse_update != "adams" and (self.method != "cast" or self.mask_learner != "adams"):
            raise CastError(f"--sparse-update is AdamS's, in --method cast with --mask-learner adams (got --method "
                            f"{self.method}{', --mask-learner ' + self.mask_learner if self.method == 'cast' else ''})")
        if self.sparse_update == "adam" and self.decay_mode != "proportional":
            raise CastError("--sparse-update adam takes no decay: leave --decay-mode out")
        beyond = {"--warm-start": self.warm_start, "--repair-fraction": self.repair_fraction,
                  "--final-prune": self.final_prune, "--warm-start-mix": self.warm_start_mix,
                  "--regrow-factor": None if self.regrow_factor == 1 else self.regrow_factor,
                  "--regrow-fraction": self.regrow_fraction}
        if self.mask_file and (self.init_mask is not None or self.paper_exact or self.method == "maskllm"):
            which = "--init-mask" if self.init_mask is not None else ("--paper-exact" if self.paper_exact else
                                                                     "--method maskllm")
            raise CastError(f"--mask-file gives the initial mask: it excludes {which}")
        if self.paper_exact and self.init_mask not in (None, "magnitude"):
            raise CastError(f"--paper-exact starts from Eq. 6's magnitude mask; it excludes --init-mask {self.init_mask}")
        given = [flag for flag, v in beyond.items() if v not in (None, False, 0, 0.0, "hard")]
        if self.paper_exact and given:
            raise CastError(f"--paper-exact runs CAST as the paper does; it excludes {', '.join(given)}")
        if given and (self.method != "cast" or self.mask_learner != "adams"):
            raise CastError(f"{', '.join(given)} apply to --method cast with AdamS only (got --method {self.method}"
                            f"{', --mask-learner ' + self.mask_learner if self.method == 'cast' else ''})")
        if self.warm_start_mix is not None and not self.use_warm_start:
            raise CastError("--warm-start-mix mixes the one-shot model of a warm start with the dense one; it needs "
                            "--warm-start (the default of --method cast)")
        if (self.regrow_factor not in (None, 1)) != bool(self.regrow_fraction):
            raise CastError("--regrow-factor and --regrow-fraction go together: the factor (> 1) applies during the "
                            "first fraction (> 0) of the steps")
        if self.fsdp and self.effective_final_prune != "hard":
            raise CastError("--final-prune compensated is not supported with --fsdp yet (its calibration walks "
                            "whole blocks); use --final-prune hard")
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

    # The beyond-the-paper options: None = the default, which for CAST with AdamS is the best configuration the
    # CPU-tier comparison measured (docs/results/compare-smollm2-135m-cpu-notes.md), and with --paper-exact the
    # paper's algorithm (dense start, no repair, hard prune).
    @property
    def beyond_paper(self) -> bool:
        """Whether the short-budget defaults apply (CAST with AdamS, not --paper-exact)."""
        return self.method == "cast" and self.mask_learner == "adams" and not self.paper_exact

    @property
    def use_warm_start(self) -> bool:
        return bool(self.warm_start) if self.warm_start is not None else self.beyond_paper

    @property
    def effective_init_mask(self) -> str:
        if self.mask_file:
            return "file"
        if self.init_mask is not None:
            return self.init_mask
        return "sparsegpt" if self.use_warm_start else "magnitude"

    @property
    def effective_repair_fraction(self) -> float:
        if self.repair_fraction is not None:
            return float(self.repair_fraction)
        return DEFAULT_REPAIR_FRACTION if self.beyond_paper else 0.0

    @property
    def effective_final_prune(self) -> str:
        return self.final_prune if self.final_prune is not None else "hard"

    @property
    def effective_warm_start_mix(self) -> float:
        return float(self.warm_start_mix or 0.0)

    @property
    def regrow_steps_fraction(self) -> float:
        """The fraction of the steps whose pruned-entry updates are scaled by ``regrow_factor`` (0 = none)."""
        return float(self.regrow_fraction or 0.0) if (self.regrow_factor or 1) > 1 else 0.0

    @property
    def effective_mask_interval(self) -> int:
        """T1 as the mask learners use it: 0 (never recompute) with --fixed-mask."""
        return 0 if self.fixed_mask else self.mask_interval


# Paper hyperparameters (method.md §5, Table 11). The batch is the paper's global batch (sequences per
# optimizer step over all processes) on any number of processes; the per-process micro-batch is the largest
# the memory plan fits (batch_size 0), the accumulation makes up the rest.
PRESETS: dict[str, dict] = {
    "gpt2": dict(lr=1e-4, l1_decay=1e-6, seq_len=1024, global_batch=128, batch_size=0, max_steps=60_000, eta=2 / 3),
    "opt": dict(lr=1e-4, l1_decay=2e-6, seq_len=2048, global_batch=128, batch_size=0, max_steps=30_000, eta=2 / 3),
    # η 1/3 is the paper's LLaMA choice for zero-shot accuracy (its perplexity is lower at 2/3)
    "llama": dict(lr=2e-5, l1_decay=4e-7, seq_len=4096, global_batch=256, batch_size=0, max_steps=7_500, eta=1 / 3),
    # CPU-sized (`make run`): the embedded SmolLM2-135M on the embedded corpus in ~10 minutes on 2 idle cores,
    # with CAST's short-budget defaults (warm start from SparseGPT, masked repair) at the settings the CPU-tier
    # comparison measured best (lr 1e-4, η 1/2: docs/results/compare-smollm2-135m-cpu-notes.md).
    "smollm2-cpu": dict(
        model="smollm2-135m", data="wiki-summaries", seq_len=128, batch_size=4, grad_accum=1, tokens=36_000,
        lr=1e-4, l1_decay=1e-4, eta=0.5, warmup_steps=2, log_every=10, val_sequences=32, test_sequences=32,
        eval_seq_len=512, save_every=20, calib_samples=128, speed_check=True,
    ),
}
