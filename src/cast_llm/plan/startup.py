"""Around the steps: what a run needs before and after them, and how long a process may wait for another.

The memory plan (:mod:`cast_llm.plan.memory`) is the steps'. This module adds what happens around them
under ``cast-llm train --fsdp`` (:mod:`cast_llm.train.trainer`), per process unless said otherwise:

* **start-up** — rank 0 loads the model once, fp32, into host memory (the other ranks build it on the meta
  device: nothing); the baseline evaluation runs on rank 0's GPU with the whole fp32 model there; the
  teacher, then the student, are broadcast from rank 0 one tensor at a time, each rank keeping its shard;
  the SparseGPT warm start runs on rank 0, one decoder block at a time on its GPU, with the calibration
  activations of that block;
* **checkpoints** — each rank copies its shards of the weights, AdamS's moments and the masks from its GPU
  to host memory and writes (and hashes) its own files, one tensor at a time;
* **the end** — rank 0 gathers the trained model (fp32, host), folds and casts it to the model's own dtype,
  exports it and evaluates it on its GPU.

Without FSDP every process loads the whole model (DDP needs it on every GPU anyway).

**Host memory per node** is the sum over its processes at the worst of these moments (plus
:data:`HOST_FRAMEWORK` per process on a GPU node: the interpreter, torch and the CUDA libraries).

**Timeouts.** Work only rank 0 does (loading, evaluations, the warm start, the export) is waited for on a
CPU process group whose timeout covers the longest of those phases (``wait``); the NCCL / gloo process
group of the training collectives need only cover the skew between ranks doing the same work at once — the
largest being a checkpoint, each rank writing and hashing its own files (``collective``). Both are the
estimates at the rates below × :data:`TIMEOUT_MARGIN`, never below the defaults of torch. The estimates
are of the right order, not measurements: ``benchmarks/rehearsal.py`` sets them beside measured phases
(docs/results/rehearsal.md: on a loaded 2-core CPU, loading took 6-9 × its estimate — transformers' own work
is not in it — and the rest 0.3-1.6 ×); the margin and the floor are what make them safe to wait on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cast_llm.plan.memory import CUDA_CONTEXT, FRAGMENTATION, Setup
from cast_llm.plan.shapes import ModelShape

__all__ = ["StartupWork", "StartupPlan", "Timeouts", "plan_startup", "startup_fits", "HOST_FRAMEWORK", "TIMEOUT_MARGIN"]

# Assumed rates (stated; of the right order: the timeouts add a margin and a floor to what they give)
STORAGE_BYTES_PER_S = 200e6  # one process reading or writing shared storage under load (network file systems)
HASH_BYTES_PER_S = 400e6  # sha256 on one core
FLOPS = {"cuda": {"fp32": 15e12, "bf16": 100e12},  # SparseGPT in fp32 without TF32; evaluation forwards
         "cpu": {"fp32": 20e9, "bf16": 20e9}}
HOST_FRAMEWORK = 4 * 2**30  # host memory of one GPU process before any model: interpreter, torch, CUDA libraries
TIMEOUT_MARGIN = 4
MIN_COLLECTIVE_S = 600.0  # torch's NCCL default
MIN_WAIT_S = 1800.0  # torch's gloo default


@dataclass(frozen=True)
class StartupWork:
    """What a run does around its steps (the parts the step plan's :class:`Setup` does not say)."""

    baseline_eval: bool = True  # dense (and, without a warm start, one-shot magnitude) evaluation at the start
    warm_start: bool = True  # the run starts from the one-shot model (evaluated as such after the baseline)
    sparsegpt: bool = True  # SparseGPT calibrates the initial mask (a warm start's default; any --init-mask sparsegpt)
    calib_tokens: int = 128 * 2048  # calibration tokens of SparseGPT (--calib-samples × its window length)
    eval_tokens: int = 16 * 4096 + 64 * 4096  # tokens scored by one evaluation (test split + WikiText-2)
    val_tokens: int = 16 * 4096  # tokens the final evaluation scores beside them (the validation split)
    eval_window: int = 4096  # tokens per evaluation forward
    native_bytes: int = 2  # bytes per parameter of the model's own dtype (the export's)
    gpus_per_node: int = 8
    host_memory: int | None = None  # bytes of one node's RAM (None: not checked)


@dataclass(frozen=True)
class Timeouts:
    """Seconds a process may wait: in a collective (``collective``), and for rank 0's own work (``wait``)."""

    collective: float
    wait: float


@dataclass
class StartupPlan:
    """Bytes and seconds around the steps (see the module docstring)."""

    memory: dict[str, int] = field(default_factory=dict)  # per process, the start-up and end peaks
    host_per_node: dict[str, int] = field(default_factory=dict)  # per node, at each moment
    checkpoint_bytes: int = 0  # what one rank writes per checkpoint (rank 0: a few kB more)
    seconds: dict[str, float] = field(default_factory=dict)  # estimated duration of each phase
    timeouts: Timeouts = field(default_factory=lambda: Timeouts(MIN_COLLECTIVE_S, MIN_WAIT_S))
    per_node: int = 1  # processes per node
    notes: list[str] = field(default_factory=list)

    @property
    def host_peak_per_node(self) -> int:
        return max(self.host_per_node.values()) if self.host_per_node else 0

    def as_dict(self) -> dict:
        return {"memory": dict(self.memory), "host_per_node": dict(self.host_per_node),
                "host_peak_per_node": self.host_peak_per_node, "processes_per_node": self.per_node,
                "checkpoint_bytes": self.checkpoint_bytes,
                "seconds": dict(self.seconds), "timeouts": asdict(self.timeouts), "notes": list(self.notes)}


def sparsegpt_flops(shape: ModelShape, calib_tokens: int) -> float:
    """Matmul FLOPs of SparseGPT over the whole model: per block two forwards of the calibration tokens
    (inputs, then the pruned block's outputs), per target its Hessian ``2·T·in²``, a Cholesky inverse (~in³)
    and the OBS sweep (~2·out·in²), for a LLaMA block's targets."""
    per_block = 4.0 * calib_tokens * shape.block_params
    for out, inn in _targets(shape):
        per_block += 2.0 * calib_tokens * inn * inn + inn ** 3 + 2.0 * out * inn * inn
    return per_block * shape.layers


def _targets(shape: ModelShape) -> list[tuple[int, int]]:
    """(out, in) of a LLaMA block's targets: q, k, v, o, gate, up, down."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def sparsegpt_bytes(shape: ModelShape, calib_tokens: int) -> int:
    """Memory of the SparseGPT warm start where it runs (:mod:`cast_llm.prune.blockwise`): one block (fp32),
    its calibration inputs and outputs, the Hessian statistics of all its targets at once (``in²`` fp32
    each), and while its widest layer is pruned ~7 more ``in × in`` fp32 matrices (the finalised Hessian,
    its damped copy, the identity, the Cholesky factor, the inverse, its upper factor) and ~3 ``out × in``
    (the working copy, its lazy blocks, the mask). Checked against the rehearsal: docs/results/rehearsal.md."""
    targets = _targets(shape)
    out, widest = max(targets, key=lambda t: t[1])
    return (4 * shape.block_params + 2 * calib_tokens * shape.hidden * 4 + sum(4 * c * c for _, c in targets)
            + 7 * 4 * widest * widest + 3 * 4 * out * widest)


def plan_startup(shape: ModelShape, setup: Setup, work: StartupWork) -> StartupPlan:
    """The start-up, checkpoint and end figures of a run (see the module docstring)."""
    s, W = setup, setup.shards
    P = shape.params
    scales = shape.target_rows * s.scale_groups if s.scaling else 0
    trainable = P + scales
    V = shape.vocab
    c = 2 if s.autocast else 4
    gpu = s.device == "cuda"
    plan = StartupPlan()
    masks = shape.target_params // 8 if s.packed_masks else shape.target_params
    if s.strategy == "fsdp":  # each rank writes its shards and the weight scales whole (train/fsdp.py)
        plan.checkpoint_bytes = (12 * P + masks) // W + 12 * scales
    else:
        plan.checkpoint_bytes = (4 * trainable + 8 * trainable + masks) // W
    # one evaluation forward: logits in the compute dtype, their fp32 log-probabilities, a block's temporaries
    eval_act = work.eval_window * (V * (c + 4) + (3 * shape.intermediate + 4 * shape.hidden) * c)
    m = plan.memory
    sharded = s.strategy == "fsdp"
    # loading: the fp32 model, and the pages of its file while they are read (in the model's own dtype)
    m["rank 0 host: loading the model (fp32, and its file)"] = (4 + work.native_bytes) * P
    if work.baseline_eval:
        m["rank 0 device: baseline evaluation (whole fp32 model)"] = 4 * P + eval_act
    if work.sparsegpt:
        m["rank 0 device: SparseGPT warm start (one block)"] = sparsegpt_bytes(shape, work.calib_tokens)
        m["rank 0 host: SparseGPT's masks (bool)"] = shape.target_params
    # a checkpoint copies each rank's shards from the GPU to host memory, then writes them one tensor at a time
    # (on a CPU the tensors are written where they are: no copy)
    ckpt_host = plan.checkpoint_bytes if gpu else 0
    if gpu:
        m["each rank host: a checkpoint's copy of its shards"] = ckpt_host
    m["rank 0 host: the end (gathered fp32 model, its masks)"] = 4 * trainable + shape.target_params
    m["rank 0 device: final evaluation (exported dtype)"] = work.native_bytes * P + eval_act

    framework = HOST_FRAMEWORK if gpu else s.framework
    local = plan.per_node = min(work.gpus_per_node, s.world)
    node = plan.host_per_node
    if sharded:
        node["start-up (rank 0 holds the model)"] = (4 + work.native_bytes) * P + local * framework
        node["a checkpoint"] = local * (ckpt_host + framework)
        node["the end (rank 0 gathers the model)"] = 4 * trainable + shape.target_params + local * framework
    else:  # every process loads the model; a replicated checkpoint is written by rank 0 alone
        node["start-up (every process loads the model)"] = local * ((4 + work.native_bytes) * P + framework)
        node["a checkpoint (rank 0 copies the state)"] = ckpt_host + local * framework
    if work.host_memory and plan.host_peak_per_node > work.host_memory:
        plan.notes.append(f"the node's memory ({work.host_memory / 2**30:.0f} GiB) is below the host peak per node")

    rate = FLOPS["cuda" if gpu else "cpu"]
    sec = plan.seconds
    sec["load the model (rank 0)"] = P * work.native_bytes / STORAGE_BYTES_PER_S
    flop_rate = rate["bf16" if s.autocast else "fp32"]
    evals = 2.0 * P * work.eval_tokens / flop_rate
    if work.baseline_eval:
        sec["baseline evaluation (rank 0)"] = evals * (1 if work.warm_start else 2)  # + one-shot magnitude
    if work.sparsegpt:
        sec["SparseGPT warm start (rank 0)"] = sparsegpt_flops(shape, work.calib_tokens) / rate["fp32"]
    if work.warm_start and work.baseline_eval:
        sec["one-shot evaluation (rank 0)"] = evals
    sec["a checkpoint (each rank: write + hash)"] = (plan.checkpoint_bytes / STORAGE_BYTES_PER_S
                                                   + plan.checkpoint_bytes / HASH_BYTES_PER_S)
    sec["export (rank 0)"] = P * work.native_bytes / STORAGE_BYTES_PER_S
    sec["final evaluation (rank 0)"] = evals + 2.0 * P * work.val_tokens / flop_rate
    alone = [v for k, v in sec.items() if "(rank 0)" in k]
    plan.timeouts = Timeouts(
        collective=max(MIN_COLLECTIVE_S, TIMEOUT_MARGIN * sec["a checkpoint (each rank: write + hash)"]),
        wait=max(MIN_WAIT_S, TIMEOUT_MARGIN * max(alone)))
    return plan


def startup_fits(sp: StartupPlan, setup: Setup, capacity: int, host_memory: int | None) -> dict:
    """Whether the start-up and end peaks fit the device (with the same margins as the steps) and the host
    peak per node fits ``host_memory`` (None: unknown)."""
    device = max((v for k, v in sp.memory.items() if "device" in k), default=0)
    needed = int(device * (1 + FRAGMENTATION)) + CUDA_CONTEXT if setup.device == "cuda" else device
    return {"device_peak": device, "device_needed": needed, "device_fits": needed <= capacity,
            "host_fits": None if not host_memory else sp.host_peak_per_node <= host_memory}
