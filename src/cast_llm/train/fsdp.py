"""FSDP2 for ``cast-llm train --fsdp``: sharding, sharded checkpoints, gathering the final model.

Why ``fully_shard`` is applied here and not through accelerate's ``FullyShardedDataParallelPlugin``:
accelerate 1.x switches to its FSDP code path only for GPU-like multi-process setups (``MULTI_GPU``,
``MULTI_XPU``, ...; a gloo ``MULTI_CPU`` run never becomes ``DistributedType.FSDP``), so its FSDP2 path
cannot run, or be tested, on CPU; and its ``prepare`` re-creates the optimizer's parameter references and
auto-wraps by class name. Calling ``torch.distributed.fsdp.fully_shard`` ourselves (one unit per decoder
block, then the root) is the same FSDP2 on every backend (gloo on CPU, NCCL on GPUs), is tested here on CPU,
and keeps the rest of the loop on accelerate (process setup, device, autocast, reductions).

Loading: only rank 0 reads the model; every other rank builds it on the meta device
(:func:`cast_llm.models.empty_model`), and after ``fully_shard`` each rank receives its shards from rank 0
one tensor at a time (:func:`fill_from_main`), so a node holds one host copy of the weights, not one per
process.

What is sharded: every parameter of student and teacher, dim 0 (rows of an ``(out, in)`` weight), so the
N:M groups along dim 1 stay whole on one rank and AdamS's masks, computed from each rank's local rows, are
exactly the rows of the full tensor's mask. GPT-2 ``Conv1D`` targets store ``(in, out)`` (groups along dim
0): they are sharded along dim 1 instead (``shard_placement_fn``), with the same property.

Precision (``--fsdp-precision``, :func:`precision_mode`). In bf16 the default is FSDP2's own
``MixedPrecisionPolicy`` (:func:`mixed_precision_policy`): the sharded parameters — the master weights
AdamS updates, with its moments and masks — stay fp32; each unit's all-gather casts them to bf16, so the
forward and backward compute in bf16 from bf16 copies that exist one block (plus one prefetched) at a time,
and the gradients are reduce-scattered in fp32. No autocast runs (:meth:`cast_llm.train.distributed.Sharded.
autocast`): autocast would cache a bf16 copy of every weight it casts for the whole step, on top of
FSDP2's fp32 all-gathers. ``autocast`` keeps the older way (fp32 all-gathers, bf16 autocast as without
``--fsdp``). What the policy changes besides: the residual stream is bf16 (the embedding is), where under
autocast it is fp32. The weight scales ``A`` of ``Diag(A)·W`` (a few entries per row) are not sharded:
every rank holds them whole in fp32 (``ignored_params``), so the product is formed in fp32 from the bf16
weight and the fp32 scale and rounded once, as under autocast — and formed again in backward rather than
kept (:func:`recompute_scaled_weights_`: the scaled weights live one layer at a time, not the whole
model's) — and their gradients — fp32, summed over the
micro-batches on each rank — are averaged over the ranks once per step (:func:`sync_replicated_grads`).

Checkpoints are per-rank files (local shards of the model — and the replicated weight scales — of AdamS's state with its masks, RNG and
observer state; see :func:`cast_llm.train.checkpoint.save_sharded_checkpoint`): resume needs the same
number of processes. The final model is gathered on rank 0 as a full state dict, which becomes the
parameters of a plain (unsharded) student built empty from the config, pruned with the gathered final
masks and folded there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from cast_llm.dtensor import DTensor, is_dtensor, local
from cast_llm.errors import CastError
from cast_llm.nn import ScaledLinear
from cast_llm.sparsity.mask import pack_mask, unpack_mask
from cast_llm.sparsity.stats import l1_mass
from cast_llm.targets import find_block_list
from cast_llm.train.observers import target_weight


def check_supported(cfg) -> None:
    """--fsdp covers CAST with AdamS (the paper's method and its scaling/KD/fixed-mask ablations)."""
    if cfg.method != "cast" or cfg.mask_learner != "adams":
        raise CastError(f"--fsdp supports --method cast with --mask-learner adams (got --method {cfg.method}, "
                        f"--mask-learner {cfg.mask_learner}); use DDP (no --fsdp) for the other methods")
    if cfg.eval_every:
        raise CastError("--eval-every is not supported with --fsdp yet (the final evaluation runs on rank 0)")


def precision_mode(cfg, precision: str) -> str:
    """What ran: ``policy`` (FSDP2's MixedPrecisionPolicy), ``autocast`` (fp32 all-gathers, bf16 autocast),
    ``fp32`` (no mixed precision) under ``--fsdp``; ``none`` without it (DDP and one process keep
    accelerate's autocast). ``precision``: the loop's (``bf16`` or ``no``)."""
    choice = cfg.fsdp_precision
    if not cfg.fsdp:
        if choice != "auto":
            raise CastError(f"--fsdp-precision {choice} applies to --fsdp runs only: add --fsdp, or leave the "
                            "flag out (DDP and one process use bf16 autocast)")
        return "none"
    if precision != "bf16":
        if choice != "auto":
            raise CastError(f"--fsdp-precision {choice} needs bf16 training: add --precision bf16, or leave the "
                            "flag out for an fp32 run")
        return "fp32"
    return "policy" if choice == "auto" else choice


def mixed_precision_policy():
    """bf16 parameters for compute and all-gather, fp32 gradient reduce-scatter (fp32 sharded masters)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``--fsdp`` leaves whole on every rank: the weight scales of
    :class:`~cast_llm.nn.ScaledLinear` (fp32, ``rows × groups`` entries each)."""
    return [m.scale for m in model.modules() if isinstance(m, ScaledLinear)]


def recompute_scaled_weights_(model: nn.Module) -> int:
    """Every :class:`~cast_llm.nn.ScaledLinear` of ``model`` keeps ``x, W, A`` for backward and forms
    ``Diag(A)·W`` again there (:mod:`cast_llm.nn.recomputed_linear`), so that no step holds the scaled
    weights of the whole model — the weights themselves are unsharded one block at a time. Returns how many."""
    layers = [m for m in model.modules() if isinstance(m, ScaledLinear)]
    for m in layers:
        m.recompute_weight = True
    return len(layers)


def sync_replicated_grads(params: list[nn.Parameter], world: int) -> None:
    """Average the gradients of the replicated parameters over the ranks: one all-reduce of one flat fp32
    buffer (each rank's gradients are sums over its own micro-batches, as the sharded ones are)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if world == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over sharded (DTensor) and replicated gradients together: the global
    L2 norm is that of the full sharded gradients and the replicated ones (counted once, not per rank)."""
    from torch.distributed.tensor import Replicate
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    sharded = [p for p in params if p.grad is not None and is_dtensor(p.grad)]
    plain = [p for p in params if p.grad is not None and not is_dtensor(p.grad)]
    norms = []
    if sharded:
        n = get_total_norm([p.grad for p in sharded])
        norms.append(n.full_tensor() if is_dtensor(n) else n)
    if plain:
        norms.append(get_total_norm([p.grad for p in plain]))
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    if sharded:
        g = sharded[0].grad
        clip_grads_with_norm_(sharded, max_norm, DTensor.from_local(total, g.device_mesh,
                                                                    [Replicate()] * g.device_mesh.ndim))
    if plain:
        clip_grads_with_norm_(plain, max_norm, total)
    return total


def device_mesh(device: torch.device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise CastError("--fsdp needs a distributed launch (accelerate launch / torchrun); "
                        "a single process trains unsharded, without --fsdp")
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard_model(model: nn.Module, mesh, *, transposed_weights=(), frozen: bool = False, mp_policy=None,
                replicated=()) -> nn.Module:
    """``fully_shard`` every decoder block, then the root (embeddings, final norm, head), in place.

    Parameters are moved to the mesh's device by FSDP block by block, so a model loaded on the CPU never
    sits whole on one GPU. ``transposed_weights``: Conv1D target weights, sharded along dim 1. ``frozen``
    (the teacher): the root is resharded after the forward too — FSDP2 keeps a root unsharded for the
    backward that follows, which a model without a backward never runs, so its embeddings and head would
    stay whole on every GPU. ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` for every unit (None: none).
    ``replicated``: parameters left whole on every rank (FSDP2's ``ignored_params``), moved to the mesh's
    device here.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    found = find_block_list(model)
    if found is None:
        raise CastError(f"--fsdp: no decoder block list found in {type(model).__name__}")
    ids = {id(p) for p in transposed_weights}

    def placement(p):  # None = the default Shard(0)
        return Shard(1) if id(p) in ids else None

    kw = {"mesh": mesh, "shard_placement_fn": placement, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    ignored = set(replicated)
    if ignored:
        kw["ignored_params"] = ignored
    for block in found[1]:
        fully_shard(block, **kw)
    fully_shard(model, reshard_after_forward=True if frozen else None, **kw)
    device = mesh.device_type
    for p in ignored:
        if p.device.type not in ("meta", device):
            p.data = p.data.to(device)
    return model


@contextlib.contextmanager
def unsharded_head(model: nn.Module | None):
    """The LM head weight of ``model`` as a whole tensor for the duration (None for no model): a sharded
    (FSDP2) model's root is all-gathered and resharded after; a plain model's weight is just returned."""
    if model is None:
        yield None
        return
    raw = getattr(model, "module", model)
    weight = raw.get_output_embeddings().weight
    if not is_dtensor(weight) or not hasattr(raw, "unshard"):
        yield weight
        return
    raw.unshard()  # the root's own parameters (embeddings, final norm, head); blocks are separate units
    try:
        yield raw.get_output_embeddings().weight
    finally:
        raw.reshard()


# ---------------------------------------------------------------------------- weights from rank 0
def materialize_(model: nn.Module, device: torch.device) -> None:
    """Allocate the local shards of a sharded model built on the meta device (:func:`cast_llm.models.empty_model`)
    on ``device``, uninitialised; its buffers (rotary tables: computed at construction, not in a state dict)
    keep their values."""
    if not any(p.device.type == "meta" for p in model.parameters()):
        return
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


@torch.no_grad()
def fill_from_main(model: nn.Module, full: dict[str, torch.Tensor] | None, device: torch.device) -> int:
    """Give a sharded (FSDP2) model the weights of the full state dict ``full`` that only rank 0 holds (None on
    the others): one tensor at a time is broadcast, in the model's dtype, and every rank keeps its own shard
    of it, so no rank but 0 ever holds more than one whole tensor. Ranks whose model is on the meta device
    allocate their shards first. Returns the bytes broadcast. Collective: every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    materialize_(model, device)
    main = dist.get_rank() == 0
    if main and full is None:
        raise ValueError("fill_from_main: rank 0 must give the full state dict")
    seen: set[int] = set()
    sent = 0
    for key, t in model.state_dict().items():
        dst = local(t)
        if dst.untyped_storage().data_ptr() in seen:  # a tied weight: filled under its first name
            continue
        seen.add(dst.untyped_storage().data_ptr())
        if main:
            if key not in full:
                raise CastError(f"the model has {key}, which the loaded weights lack")
            whole = full[key].to(device=device, dtype=t.dtype)
        else:
            whole = torch.empty(t.shape, dtype=t.dtype, device=device)
        dist.broadcast(whole, src=0)
        sent += whole.numel() * whole.element_size()
        if is_dtensor(t):  # this rank's rows (or columns) of the whole tensor, as FSDP2 split them
            whole = distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local()
        dst.copy_(whole)
        del whole
    return sent


# ------------------------------------------------------------------------------------- sharded state
def _to_local_cpu(obj):
    """Local shards on the CPU: a copy from a GPU, the tensor itself on a CPU (a checkpoint writes it at once)."""
    if is_dtensor(obj):
        return obj.to_local().detach().cpu()
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_local_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local_cpu(v) for v in obj)
    return obj


def local_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shards of the model's state dict, as plain CPU tensors."""
    return {k: _to_local_cpu(v) for k, v in model.state_dict().items()}


@torch.no_grad()
def load_local_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy the shards of :func:`local_model_state` back into the (identically sharded) model."""
    current = model.state_dict()
    if set(current) != set(state):
        missing, extra = set(current) - set(state), set(state) - set(current)
        raise CastError(f"sharded checkpoint does not fit the model (missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(extra)[:3]})")
    for k, t in current.items():
        dst = local(t)
        if tuple(dst.shape) != tuple(state[k].shape):
            raise CastError(f"sharded checkpoint: {k} has local shape {tuple(state[k].shape)}, the model "
                            f"{tuple(dst.shape)} (resume with the same number of processes)")
        dst.copy_(state[k])


def local_optimizer_state(optimizer) -> dict[str, Any]:
    """AdamS's state dict with DTensor moments replaced by this rank's shards (masks are local already)."""
    return _to_local_cpu(optimizer.state_dict())


def load_local_optimizer_state(optimizer, state: dict[str, Any]) -> None:
    """Load :func:`local_optimizer_state`; moments become DTensors again, sharded like their parameter."""
    optimizer.load_state_dict(state)
    for p, st in optimizer.state.items():
        if not is_dtensor(p):
            continue
        for key, v in list(st.items()):
            if torch.is_tensor(v) and not is_dtensor(v) and key in ("exp_avg", "exp_avg_sq"):
                st[key] = DTensor.from_local(v.to(local(p).device), p.device_mesh, p.placements,
                                             shape=p.shape, stride=p.stride(), run_check=False)


# ------------------------------------------------------------------------------------------- finish
def gather_masks(optimizer, names: dict[int, str], is_main: bool) -> dict[str, torch.Tensor]:
    """Full bool masks of every sparse parameter on rank 0 (``{fqn: mask}``; empty elsewhere).

    Collective: every rank must call it. One parameter at a time (uint8: gloo has no bool all-gather).
    """
    out = {}
    for p, mask in optimizer.masks().items():
        if is_dtensor(p):
            m8 = DTensor.from_local(mask.to(torch.uint8), p.device_mesh, p.placements, shape=p.shape,
                                    stride=p.stride(), run_check=False)
            full = m8.full_tensor()
        else:
            full = mask
        if is_main:
            out[names[id(p)]] = full.bool().cpu()
    return out


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on rank 0, on the CPU; an empty dict on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---------------------------------------------------------------------------------- mask statistics
class ShardedMaskStats:
    """:class:`~cast_llm.train.observers.MaskStats` for sharded masks: counts summed over ranks.

    Each rank keeps packed snapshots of its own mask rows (saved in its own checkpoint file); the flip
    rates and the sparse-weight ratio are ratios of sums all-reduced in float64, i.e. the same quantities as
    on the full tensors.
    """

    name = "mask_stats"

    def __init__(self, device: torch.device):
        self.device = device
        self.initial = None
        self.prev = None
        self.shapes: dict[str, tuple[int, ...]] = {}

    def on_step(self, ctx):
        import torch.distributed as dist

        if self.initial is None:
            self.shapes = {k: tuple(v.shape) for k, v in ctx.masks.items()}
            self.initial = {k: pack_mask(v) for k, v in ctx.masks.items()}
            self.prev = dict(self.initial)
        if not ctx.is_log_step:
            return None
        params = dict(ctx.model.named_parameters())
        sums = torch.zeros(5, dtype=torch.float64)  # flips, initial flips, entries, kept mass, total mass
        with torch.no_grad():
            for k, cur in ctx.masks.items():
                prev = unpack_mask(self.prev[k], self.shapes[k]).to(cur.device)
                init = unpack_mask(self.initial[k], self.shapes[k]).to(cur.device)
                sums[0] += float((prev != cur).sum())
                sums[1] += float((init != cur).sum())
                sums[2] += cur.numel()
                sums[3:] += torch.tensor(l1_mass(local(target_weight(params, k)), cur), dtype=torch.float64)
        self.prev = {k: pack_mask(v) for k, v in ctx.masks.items()}
        sums = sums.to(self.device)
        dist.all_reduce(sums)
        flips, init_flips, entries, kept, total = sums.tolist()
        return {"flip_rate": flips / max(entries, 1), "initial_flip_rate": init_flips / max(entries, 1),
                "sparse_weight_ratio": 1.0 if total == 0 else kept / total}

    def on_end(self, ctx) -> None:
        pass

    def state_dict(self):
        return {"initial": self.initial, "prev": self.prev, "shapes": self.shapes}

    def load_state_dict(self, state):
        if state:
            self.initial, self.prev, self.shapes = state["initial"], state["prev"], state["shapes"]
