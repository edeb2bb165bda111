"""``cast-llm plan`` options: the run to plan, as ``cast-llm train`` would be given it, and the assumptions.

Defaults describe the paper's LLaMA run (method.md §5: global batch 256 × 4096 tokens, 7,500 steps, lr 2e-5,
λ 4e-7) with one sequence per micro-batch, so that ``cast-llm plan --model M --gpus 8`` plans what a user
of the paper's recipe would launch.
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import (
    FSDP_PRECISIONS,
    RECOMPUTE_MODES,
    check_ranges,
    option,
    parse_count,
    recompute_mode,
)
from cast_llm.errors import CastError
from cast_llm.optim.schedule import SCHEDULES as LR_SCHEDULES

RUN, MEMORY, TIME, DECAY = ("the run", "memory options (cast-llm train flags)", "time", "decay forecast assumptions")
SECTIONS = (RUN, MEMORY, TIME, DECAY)
PAPER_GLOBAL_BATCH = 256  # sequences per optimizer step (method.md §5, LLaMA)
PAPER_STEPS = 7_500
# gradient-noise rms of a pruned entry measured on SmolLM2-135M (first backward, 512 tokens per batch:
# 3.9e-4); noise falls as 1/sqrt(tokens per step). Larger models have smaller per-entry gradients, so this
# is on the pessimistic side for them.
GRAD_RMS_AT_512 = 3.9e-4
WEIGHT_RMS = {"smollm2-135m": 0.193}  # measured rms of the target weights; others: --weight-rms (0.02)


# the run `cast-llm plan` plans when no preset, config file or flag says otherwise: the paper's LLaMA recipe
# (train's `--preset llama`) with one sequence per micro-batch on a GPU. The plan writes nothing: the output
# folder that a training configuration must name is never created.
PLAN_BASE = dict(lr=2e-5, l1_decay=4e-7, seq_len=4096, global_batch=PAPER_GLOBAL_BATCH, batch_size=1,
                 max_steps=PAPER_STEPS, eta=1 / 3, device="cuda", output_dir="(planned, not created)")


def _opt_count(v):
    return None if v is None else parse_count(v)


@dataclass
class PlanOptions:
    """What only the plan asks: the machine (GPUs, their memory and links, nodes) and the estimates' assumptions.
    ``cast-llm plan`` takes these beside every flag of ``cast-llm train`` (:meth:`PlanConfig.from_run`)."""

    gpus: int = option(1, "processes (GPUs), one per GPU", min=1, section=RUN)
    gpu_memory: str | None = option(None, "memory of one GPU: 80GB (10⁹ bytes, the card's label) or 80GiB "
                                          "(default 80GB; with --device cpu: this machine's RAM, shared by "
                                          "the processes)", section=RUN)
    gpus_per_node: int = option(8, "processes per node (host memory is planned per node)", min=1, section=RUN)
    host_memory: str | None = option(None, "RAM of one node, e.g. 1TB or 2TiB: checked against the host memory the "
                                           "run needs per node (default: not checked)", section=RUN)
    tokens_per_s: float | None = option(None, "measured throughput over all GPUs (tokens_per_s of a short run's "
                                              "metrics.jsonl); default: estimated from FLOPs", min=0,
                                        min_exclusive=True, section=TIME)
    gpu_tflops: float = option(989.0, "peak dense bf16 TFLOP/s of one GPU for the estimate (H100 SXM: 989)",
                               min=0, min_exclusive=True, section=TIME)
    mfu: float = option(0.30, "model-FLOPs utilisation assumed by the estimate (0.30: plain FSDP2 training of "
                              "Llama-3.1-8B on 8 H100s as torchtitan published it; docs/training.md)", min=0,
                        min_exclusive=True, max=1, section=TIME)
    interconnect: str = option("auto", "what the GPUs' collectives cross, for the communication term: nvlink (one "
                                       "node, 450 GB/s per GPU), ib (InfiniBand NDR, 50 GB/s per GPU), ethernet "
                                       "(100 Gb/s, 12.5 GB/s per GPU); auto: nvlink within --gpus-per-node, ib "
                                       "beyond", choices=("auto", "nvlink", "ib", "ethernet"), section=TIME)
    link_bandwidth: float | None = option(None, "GB/s per GPU and direction instead of the interconnect's nominal "
                                                "figure (e.g. what nccl-tests measured)", min=0,
                                          min_exclusive=True, section=TIME)
    weight_rms: float | None = option(None, "rms of the target weights (default: measured for smollm2-135m, "
                                            "else 0.02, typical of LLaMA-2/3 linears)", min=0, min_exclusive=True,
                                      section=DECAY)
    grad_rms: float | None = option(None, "gradient-noise rms of a pruned entry at the run's batch (default: "
                                          "SmolLM2-135M's 3.9e-4 at 512 tokens, × sqrt(512 / tokens per step))",
                                    min=0, min_exclusive=True, section=DECAY)
    json: bool = option(False, "print the plan as one JSON object", section=RUN)


@dataclass
class PlanConfig(PlanOptions):
    """The plan's whole input: :class:`PlanOptions` and the run's own settings, as ``cast-llm train`` takes them.

    The defaults describe the paper's LLaMA recipe (a global batch of 256 × 4096 tokens, 7,500 steps, lr 2e-5,
    λ 4e-7) with one sequence per micro-batch. ``cast-llm plan`` builds it from a training configuration
    (:meth:`from_run`: train's flags, ``--preset``, ``--config``), so the plan and the run read one config."""

    model: str | None = option(None, "model folder, config.json, hub id, or an embedded config (smollm2-135m, "
                                     "llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, llama-2-7b, llama-2-13b, "
                                     "llama-3-70b)",
                               section=RUN)
    device: str = option("cuda", "cuda, or cpu (processes on this machine's RAM)", choices=("cuda", "cpu"),
                         section=RUN)
    fsdp: bool = option(False, "FSDP2 (cast-llm train --fsdp); without it several GPUs run DDP", section=RUN)
    precision: str = option("auto", "auto (bf16 autocast on cuda, fp32 on cpu), bf16, fp32",
                            choices=("auto", "bf16", "fp32"), section=RUN)
    batch_size: int = option(1, "sequences per micro-batch per GPU (0: the largest that fits, dividing the global "
                                "batch, as cast-llm train --batch-size 0 chooses it)", min=0, section=RUN)
    grad_accum: int | None = option(None, "micro-batches per step (default: a global batch of 256 sequences, "
                                          "the paper's)", min=1, section=RUN)
    seq_len: int = option(4096, "tokens per sequence", min=2, section=RUN)
    kd: bool = option(True, "distil from the dense teacher (--no-kd: no teacher)", section=RUN)
    scaling: bool = option(True, "learnable weight scaling (--no-scaling)", section=RUN)
    scale_groups: int = option(2, "column blocks per row of the weight scale", min=1, section=RUN)
    activation_checkpointing: str = option("none", "recompute in backward: full (each block keeps its input), "
                                                   "selective (also its matmul and attention outputs), none; the "
                                                   "flag alone means full", choices=RECOMPUTE_MODES,
                                            parse=recompute_mode, nargs="?", const="full", section=MEMORY)
    fsdp_precision: str = option("auto", "with --fsdp in bf16: policy (FSDP2 MixedPrecisionPolicy: bf16 compute and "
                                         "all-gather, fp32 reduce-scatter, no autocast cache) or autocast (fp32 "
                                         "all-gathers, bf16 casts cached); auto: policy", choices=FSDP_PRECISIONS,
                                 section=MEMORY)
    fused_head: bool = option(False, "LM head and loss in token chunks (no full logits)", section=MEMORY)
    packed_masks: bool = option(False, "N:M masks as bits", section=MEMORY)
    teacher_dtype: str = option("auto", "teacher weights: auto (the training dtype), bf16, fp32",
                                choices=("auto", "bf16", "fp32"), section=MEMORY)
    kd_chunk_size: int = option(1024, "tokens per chunk of the loss", min=1, section=MEMORY)
    tokens: int | None = option(None, "training tokens (default: the paper's 7,500 steps of the global batch)",
                                parse=_opt_count, min=1, section=TIME)
    lr: float = option(2e-5, "peak lr (paper, LLaMA: 2e-5)", min=0, min_exclusive=True, section=DECAY)
    l1_decay: float = option(4e-7, "AdamS λ (paper, LLaMA: 4e-7)", min=0, section=DECAY)
    lr_schedule: str = option("cosine", "lr after a 2% warm-up", choices=LR_SCHEDULES, section=DECAY)
    paper_exact: bool = option(False, "dense start and final prune at the last step (default: warm start from "
                                      "the one-shot model, masked repair over the last 20%)", section=DECAY)
    repair_fraction: float | None = option(None, "masked-repair fraction (default 0.2; 0 with --paper-exact)",
                                           min=0, max=0.999, section=DECAY)
    forecast_target: float = option(0.99, "the sparse-weight ratio S_t the decay should reach", min=0,
                                    min_exclusive=True, max=1, section=DECAY)
    baseline_eval: bool = option(True, "the run evaluates the dense model first (on rank 0's GPU, whole, fp32)",
                                 section=RUN)
    calib_samples: int = option(128, "calibration sequences of the SparseGPT warm start", min=1, section=RUN)
    global_batch: int | None = option(None, "sequences per optimizer step over all processes (default: the paper's "
                                            "256 unless --grad-accum is given)", min=1, section=RUN)
    max_steps: int | None = option(None, "optimizer steps (instead of --tokens)", min=1, section=TIME)
    warmup_steps: int | None = option(None, "linear warm-up steps (default: 2% of the steps, as train)", min=0,
                                      section=DECAY)
    min_lr_ratio: float = option(0.0, "the cosine / linear schedules decay to lr × this", min=0, max=1,
                                 section=DECAY)

    def validate(self) -> None:
        if not self.model:
            raise CastError("--model is required (a folder, config.json, hub id or embedded config name)")
        check_ranges(self)
        if self.paper_exact and self.repair_fraction:
            raise CastError("--paper-exact has no masked repair; it excludes --repair-fraction")
        if self.tokens is not None and self.max_steps is not None:
            raise CastError("give at most one budget: --tokens or --max-steps")

    @classmethod
    def from_run(cls, run, options: PlanOptions | None = None) -> PlanConfig:
        """The plan of a training configuration (a :class:`~cast_llm.train.config.TrainConfig`, read by its
        attributes: the plan sits below training and does not import it) on the machine ``options`` describe.
        ``--device auto`` plans a GPU run; KD, scaling and the masked repair as the run resolves them."""
        opts = options or PlanOptions()
        repair = run.effective_repair_fraction if run.method == "cast" else 0.0
        values = dict(
            model=run.model, device="cpu" if run.device == "cpu" else "cuda", fsdp=run.fsdp,
            precision=run.precision, batch_size=run.batch_size,
            grad_accum=None if run.global_batch else run.grad_accum, global_batch=run.global_batch,
            seq_len=run.seq_len, kd=run.use_kd, scaling=run.use_scaling, scale_groups=run.scale_groups,
            activation_checkpointing=run.activation_checkpointing, fsdp_precision=run.fsdp_precision,
            fused_head=run.fused_head, packed_masks=run.packed_masks, teacher_dtype=run.teacher_dtype,
            kd_chunk_size=run.kd_chunk_size, tokens=run.tokens, max_steps=run.max_steps, lr=run.lr,
            l1_decay=run.l1_decay if run.method == "cast" else 0.0, lr_schedule=run.lr_schedule,
            warmup_steps=run.warmup_steps, min_lr_ratio=run.min_lr_ratio, paper_exact=run.paper_exact,
            repair_fraction=None if run.paper_exact else repair, forecast_target=run.forecast_target,
            baseline_eval=run.baseline_eval, calib_samples=run.calib_samples)
        return cls(**{f: getattr(opts, f) for f in PlanOptions.__dataclass_fields__}, **values)
