"""Where the model lives and how its processes agree: one small strategy for the training loop.

:class:`Replicated` — one process, or DDP under ``accelerate launch`` / ``torchrun``: accelerate prepares
the model and optimizer, rank 0 writes the (replicated) checkpoint. :class:`Sharded` — FSDP2
(``--fsdp``, :mod:`cast_llm.train.fsdp`): only rank 0 loads the model; student and teacher are sharded by
rows and filled from it before the optimizer is built, every rank writes (and hashes) its own shards into
one checkpoint folder, and the final model is gathered on rank 0. The loop itself
(:mod:`cast_llm.train.loop`) never branches on which one it has.

How the processes wait for each other. Work only rank 0 does (loading, evaluating, the warm start, the
export) is bracketed by :meth:`Distribution.waiting_for_main`: the other ranks wait on a CPU (gloo) process
group of their own whose timeout covers that work, not inside a training collective whose timeout (NCCL's
10 minutes) would kill the job; an error on rank 0 reaches them as the same one-line error. The training
collectives' own timeout is set from the work they must cover (:mod:`cast_llm.plan.startup`).
"""

from __future__ import annotations

import contextlib
import copy
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from cast_llm.errors import CastError
from cast_llm.models import empty_model
from cast_llm.nn import wrap_scaling_
from cast_llm.targets import find_targets
from cast_llm.train import fsdp
from cast_llm.train.checkpoint import load_checkpoint, save_checkpoint, save_sharded_checkpoint

__all__ = ["Distribution", "Replicated", "Sharded", "build_distribution", "one_line"]

# what `--fsdp-precision` ran, as the log says it (results.json records the key)
PRECISION_NOTES = {
    "policy": "policy (FSDP2 MixedPrecisionPolicy: fp32 sharded master weights, bf16 all-gather and compute, "
              "fp32 reduce-scatter; no autocast; weight scales fp32)",
    "autocast": "autocast (fp32 all-gathers, bf16 autocast with its cached weight casts)",
    "fp32": "fp32 (no mixed precision)",
    "none": "-",
}
DEFAULT_WAIT_S = 1800.0  # the control group's timeout when the job states none (torch's gloo default)


def one_line(e: BaseException) -> str:
    """An exception as one line: a CastError's own message, else its type and first line."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if isinstance(e, CastError) else f"{type(e).__name__}: {text}".rstrip(": ")


class MainWork:
    """What :meth:`Distribution.waiting_for_main` yields: ``main`` (whether this process does the work) and
    ``shared``, a dict rank 0 may fill (plain Python values) that every rank holds after the block."""

    def __init__(self, main: bool):
        self.main = main
        self.shared: dict[str, Any] = {}


class Distribution:
    """The loop's view of the processes of a job (see the module docstring)."""

    def __init__(self, accelerator, *, wait_timeout_s: float | None = None, precision_mode: str = "none"):
        self.accelerator = accelerator
        self.precision_mode = precision_mode  # train/fsdp.py precision_mode: policy | autocast | fp32 | none
        self.is_main = accelerator.is_main_process
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index
        self.device = accelerator.device
        self.wait_timeout_s = wait_timeout_s or DEFAULT_WAIT_S
        self._control = None
        if self.world > 1:
            import torch.distributed as dist

            # waiting for rank 0's own work happens here, on the CPU, with a timeout that covers that work
            self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.wait_timeout_s))

    # ---- agreement between processes
    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any rank (a MAX all-reduce; no communication alone)."""
        return self.any_of([flag])[0]

    def any_of(self, flags: list[bool]) -> list[bool]:
        """Each flag true on every rank if it is true on any rank: one MAX all-reduce for all of them."""
        if self.world == 1:
            return [bool(f) for f in flags]
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=self.device)
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v > 0) for v in t.tolist()]

    def all(self, flag: bool) -> bool:
        return not self.any(not flag)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order, on every rank (small Python values; the CPU group)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self._control)
        return out

    def first_error(self, error: str | None) -> str | None:
        """Every rank's error (None: none) of a collective phase; the first, prefixed with its rank, on every
        rank — so that an error on one rank ends every rank with the same line instead of a hang."""
        if self.world == 1:
            return error
        for rank, e in enumerate(self.gather(error)):
            if e is not None:
                return e if rank == self.rank else f"on rank {rank}: {e}"
        return None

    @contextlib.contextmanager
    def waiting_for_main(self, what: str):
        """Work that only rank 0 does (``with d.waiting_for_main("loading the model") as work: if work.main:
        ...``) while the others wait at the end of the block on the CPU group, whose timeout covers it. An
        error on rank 0 is raised on every rank (there as a one-line :class:`CastError` naming ``what``);
        the body on the other ranks must not communicate."""
        work = MainWork(self.is_main)
        if self.world == 1:
            yield work
            return
        import torch.distributed as dist

        status: list[Any] = [None]
        if self.is_main:
            try:
                yield work
            except BaseException as e:
                status[0] = ("error", one_line(e))
                dist.broadcast_object_list(status, src=0, group=self._control)
                raise
            status[0] = ("ok", work.shared)
            dist.broadcast_object_list(status, src=0, group=self._control)
            return
        yield work
        t0 = time.perf_counter()
        try:
            dist.broadcast_object_list(status, src=0, group=self._control)
        except RuntimeError as e:  # rank 0 died, or its work outlasted the wait timeout
            raise CastError(f"rank {self.rank} gave up waiting for rank 0 ({what}) after "
                            f"{time.perf_counter() - t0:.0f} s: {one_line(e)}") from None
        kind, payload = status[0]
        if kind == "error":
            raise CastError(f"rank 0 failed while {what}: {payload}")
        work.shared.update(payload)

    # ---- setting up
    def start_mode(self, resuming: bool) -> str:
        """How this process gets the method's one-shot start (``method.prepare_model(start=...)``)."""
        if resuming:
            return "skip"
        if self.world == 1:
            return "compute"
        return "send" if self.is_main else "receive"

    def loads_weights(self, resuming: bool) -> bool:
        """Whether this process loads the student's weights from ``--model`` (the others build it empty)."""
        return True

    def build_teacher(self, dense, cfg, dtype: torch.dtype, say):
        """The frozen teacher from ``dense`` (the loaded dense model, before anything changes it)."""
        teacher = copy.deepcopy(dense).eval().requires_grad_(False)
        if dtype != torch.float32:
            teacher.to(dtype)
        return teacher

    def shard(self, model, teacher, cfg, say, *, fill: bool = True) -> None:
        """Called after ``method.prepare_model`` and before the optimizer is built. ``fill``: the student's
        weights come from rank 0 (False: from the checkpoint being resumed)."""

    def wrap(self, model, optimizer, teacher):
        raise NotImplementedError

    def no_sync(self, model, sync: bool):
        raise NotImplementedError

    def autocast(self):
        """The context of a micro-batch's forward, loss and backward: accelerate's autocast (a no-op in fp32)."""
        return self.accelerator.autocast()

    def sync_gradients(self, model) -> None:
        """After the last micro-batch's backward, before clipping and the step: gradients the backward did
        not already reduce across the processes."""

    def clip(self, model, max_norm: float) -> None:
        raise NotImplementedError

    # ---- checkpoints
    def save(self, out: Path, step: int, states: dict[str, Any], meta: dict[str, Any], keep: int) -> None:
        raise NotImplementedError

    def load(self, path: Path, fp: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        raise NotImplementedError

    def model_state(self, method, raw) -> Any:
        return method.model_state(raw)

    def load_model_state(self, method, raw, state) -> None:
        method.load_model_state(raw, state)

    def optimizer_state(self, optimizer) -> Any:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer, state) -> None:
        optimizer.load_state_dict(state)

    # ---- the end
    def finish(self, raw, optimizer, method, cfg, out: Path):
        """The trained model made final (pruned, folded, merged: ``method.finalize``) on the main process;
        None on the others. Collective."""
        return method.finalize(raw, optimizer, out=out, is_main=self.is_main)


class Replicated(Distribution):
    """One process, or DDP: every rank holds the whole model."""

    def shard(self, model, teacher, cfg, say, *, fill: bool = True) -> None:
        # on the device BEFORE the optimizer is built: a move replaces every buffer, and an optimizer built on
        # the CPU model would keep the old ones (SR-STE's masks, masks copied into AdamS's state)
        model.to(self.device)

    def wrap(self, model, optimizer, teacher):
        model, optimizer = self.accelerator.prepare(model, optimizer)
        if teacher is not None:
            teacher = self.accelerator.prepare_model(teacher, evaluation_mode=True)
        return model, optimizer, teacher

    def no_sync(self, model, sync: bool):
        return self.accelerator.no_sync(model) if (not sync and self.world > 1) else contextlib.nullcontext()

    def clip(self, model, max_norm: float) -> None:
        self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def save(self, out, step, states, meta, keep) -> None:
        if self.is_main:
            save_checkpoint(out, step, states, meta, keep=keep)

    def load(self, path, fp):
        return load_checkpoint(path, fp)


class Sharded(Distribution):
    """FSDP2: every parameter sharded by rows across the processes (:mod:`cast_llm.train.fsdp`)."""

    mesh = None  # the processes' device mesh, made on first use
    replicated: tuple = ()  # the parameters kept whole on every rank (weight scales), set by shard()

    def loads_weights(self, resuming: bool) -> bool:
        # rank 0 alone holds the model in host memory; a resumed student's weights come from the checkpoint
        return self.is_main and not resuming

    def _mesh(self):
        if self.mesh is None:
            self.mesh = fsdp.device_mesh(self.device)
        return self.mesh

    def _shard(self, module, cfg, *, frozen: bool) -> None:
        transposed = [t.weight for t in find_targets(module, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
                      if t.transposed]
        policy = fsdp.mixed_precision_policy() if self.precision_mode == "policy" else None
        replicated = [] if frozen else fsdp.replicated_params(module)
        if self.precision_mode == "policy" and not frozen:
            fsdp.recompute_scaled_weights_(module)
        fsdp.shard_model(module, self._mesh(), transposed_weights=transposed, frozen=frozen, mp_policy=policy,
                         replicated=replicated)

    def build_teacher(self, dense, cfg, dtype: torch.dtype, say):
        """Every rank builds the teacher empty, shards it and receives its shards from rank 0's ``dense``
        (None elsewhere), cast tensor by tensor: no rank holds a second whole copy."""
        teacher = empty_model(cfg.model, dtype=dtype).requires_grad_(False)
        self._shard(teacher, cfg, frozen=True)
        fsdp.fill_from_main(teacher, dict(dense.state_dict()) if self.is_main else None, self.device)
        return teacher

    def shard(self, model, teacher, cfg, say, *, fill: bool = True) -> None:
        full = dict(model.state_dict()) if (fill and self.is_main) else None  # rank 0's whole tensors
        self._shard(model, cfg, frozen=False)
        if fill:
            fsdp.fill_from_main(model, full, self.device)
        else:
            fsdp.materialize_(model, self.device)
        del full  # rank 0's whole copy goes now
        # the scales' Parameter objects as they are now (materializing a meta model replaces them)
        self.replicated = fsdp.replicated_params(model)
        say(f"FSDP2: student{' and teacher' if teacher is not None else ''} sharded over {self.world} processes "
            "(rows of every weight; N:M groups stay whole on one rank; weight scales whole on every rank), "
            + ("filled from rank 0's copy" if fill else "filled from the checkpoint"))
        say("FSDP2 precision: " + PRECISION_NOTES[self.precision_mode])

    def wrap(self, model, optimizer, teacher):
        return model, optimizer, teacher  # sharded already; accelerate only set up processes, device, autocast

    def autocast(self):
        # the policy casts the weights itself; autocast would add a cached bf16 copy of every weight it casts
        return contextlib.nullcontext() if self.precision_mode == "policy" else self.accelerator.autocast()

    def sync_gradients(self, model) -> None:
        fsdp.sync_replicated_grads(self.replicated, self.world)

    def no_sync(self, model, sync: bool):
        # every micro-batch's gradients are reduce-scattered into the sharded ones (FSDP2's default): between
        # micro-batches no rank holds more than its shard (a no-sync micro-batch would keep whole fp32
        # gradients on every GPU: +4 bytes per parameter, however many GPUs there are)
        return contextlib.nullcontext()

    def clip(self, model, max_norm: float) -> None:
        fsdp.clip_grad_norm_(list(model.parameters()), max_norm)  # global norm: shards and replicated scales

    def model_state(self, method, raw):
        return fsdp.local_model_state(raw)

    def load_model_state(self, method, raw, state) -> None:
        fsdp.load_local_model_state(raw, state)

    def optimizer_state(self, optimizer):
        return fsdp.local_optimizer_state(optimizer)

    def load_optimizer_state(self, optimizer, state) -> None:
        fsdp.load_local_optimizer_state(optimizer, state)

    def save(self, out, step, states, meta, keep) -> None:
        per_rank = {k: states[k] for k in ("model", "optimizer", "rng", "observers") if k in states}
        shared = {k: v for k, v in states.items() if k not in per_rank}
        save_sharded_checkpoint(out, step, shared, per_rank, meta, rank=self.rank, world_size=self.world,
                                first_error=self.first_error, gather=self.gather,
                                keep=keep)

    def load(self, path, fp):
        return load_checkpoint(path, fp, rank=self.rank, world_size=self.world)

    def finish(self, raw, optimizer, method, cfg, out):
        """Gather the sharded student and its final masks on rank 0 into a plain model; finalize it there.

        The plain model is built empty from the config and takes the gathered tensors themselves (no second
        copy, and ``--model`` is not read again)."""
        names = {id(t.weight): t.fqn for t in find_targets(raw, n=cfg.n, m=cfg.m,
                                                          skip_incompatible=cfg.skip_incompatible)}
        masks = fsdp.gather_masks(optimizer, names, self.is_main)
        full = fsdp.full_model_state(raw)
        # training is over: AdamS's moments and masks (12-13 bytes per parameter, sharded) make room on the
        # device for the whole student that rank 0 evaluates and exports
        optimizer.state.clear()
        if not self.is_main:
            return None
        plain = empty_model(cfg.model)
        if cfg.use_scaling:  # the structure of the trained student (CastMethod.prepare_model)
            fqns = {t.fqn for t in find_targets(plain, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)}
            wrap_scaling_(plain, filter_fn=lambda mod, fqn: fqn in fqns, n_groups=cfg.scale_groups, m=cfg.m)
        plain.load_state_dict(full, assign=True)
        plain.tie_weights()  # assign replaces parameters one by one: tie the head to the embedding again
        del full
        return method.finalize_gathered(plain.to(self.device), masks)


def build_distribution(accelerator, fsdp: bool, *, wait_timeout_s: float | None = None,
                       precision_mode: str = "none") -> Distribution:
    """``precision_mode``: :func:`cast_llm.train.fsdp.precision_mode` of the run (FSDP2 only)."""
    cls = Sharded if fsdp else Replicated
    return cls(accelerator, wait_timeout_s=wait_timeout_s, precision_mode=precision_mode if fsdp else "none")
