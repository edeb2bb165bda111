"""``cast-llm plan``'s own options: the machine the run is planned on and the estimates' assumptions.

Everything else the plan reads is the run's own configuration, as ``cast-llm train`` resolves it (a
:class:`cast_llm.train.config.TrainConfig`: :mod:`cast_llm.plan.run`); ``cast-llm plan`` without a preset or a
config file plans train's ``--preset llama`` (the paper's LLaMA recipe: :mod:`cast_llm.cli.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import JsonSettings, option

RUN, TIME, DECAY = ("the machine", "time", "decay forecast assumptions")
SECTIONS = (RUN, TIME, DECAY)
# gradient-noise rms of a pruned entry measured on SmolLM2-135M (first backward, 512 tokens per batch:
# 3.9e-4); noise falls as 1/sqrt(tokens per step). Larger models have smaller per-entry gradients, so this
# is on the pessimistic side for them.
GRAD_RMS_AT_512 = 3.9e-4
WEIGHT_RMS = {"smollm2-135m": 0.193}  # measured rms of the target weights; others: --weight-rms (0.02)


@dataclass
class PlanOptions(JsonSettings):
    """What only the plan asks: the machine (GPUs, their memory and links, nodes) and the estimates' assumptions.
    ``cast-llm plan`` takes these beside the flags of ``cast-llm train`` (:func:`cast_llm.plan.run.plan_run`)."""

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

    OPTION_TEXT = {"json": "print the plan as one JSON object"}
    OPTION_SECTIONS = {"json": RUN}
