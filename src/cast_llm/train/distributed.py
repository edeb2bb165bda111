"""Where the model lives and how its processes agree: one small strategy for the training loop.

:class:`Replicated` — one process, or DDP under ``accelerate launch`` / ``torchrun``: accelerate prepares
the model and optimizer, rank 0 writes the (replicated) checkpoint. :class:`Sharded` — FSDP2
(``--fsdp``, :mod:`cast_llm.train.fsdp`): student and teacher are sharded by rows before the optimizer is
built, every rank writes its own shards into one checkpoint folder, and the final model is gathered on
rank 0. The loop itself (:mod:`cast_llm.train.loop`) never branches on which one it has.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from cast_llm.targets import find_targets
from cast_llm.train import fsdp
from cast_llm.train.checkpoint import load_checkpoint, save_checkpoint, save_sharded_checkpoint

__all__ = ["Distribution", "Replicated", "Sharded", "build_distribution"]


class Distribution:
    """The loop's view of the processes of a job (see the module docstring)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index
        self.device = accelerator.device

    # ---- agreement between processes
    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any rank (a MAX all-reduce; no communication alone)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def all(self, flag: bool) -> bool:
        return not self.any(not flag)

    # ---- setting up
    def shard(self, model, teacher, cfg, say) -> None:
        """Called after ``method.prepare_model`` and before the optimizer is built."""

    def wrap(self, model, optimizer, teacher):
        raise NotImplementedError

    def no_sync(self, model, sync: bool):
        raise NotImplementedError

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

    def shard(self, model, teacher, cfg, say) -> None:
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

    def shard(self, model, teacher, cfg, say) -> None:
        mesh = fsdp.device_mesh(self.device)
        for module in (model, teacher):
            if module is not None:
                transposed = [t.weight for t in find_targets(module, n=cfg.n, m=cfg.m,
                                                              skip_incompatible=cfg.skip_incompatible)
                              if t.transposed]
                fsdp.shard_model(module, mesh, transposed_weights=transposed, frozen=module is teacher)
        say(f"FSDP2: student{' and teacher' if teacher is not None else ''} sharded over {self.world} processes "
            "(rows of every weight; N:M groups stay whole on one rank)")

    def wrap(self, model, optimizer, teacher):
        return model, optimizer, teacher  # sharded already; accelerate only set up processes, device, autocast

    def no_sync(self, model, sync: bool):
        fsdp.set_gradient_sync(model, sync)
        return contextlib.nullcontext()

    def clip(self, model, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # works on DTensor gradients: global norm

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
                                barrier=self.barrier, all_ok=self.all, keep=keep)

    def load(self, path, fp):
        return load_checkpoint(path, fp, rank=self.rank, world_size=self.world)

    def finish(self, raw, optimizer, method, cfg, out):
        """Gather the sharded student and its final masks on rank 0 into a plain model; finalize it there."""
        names = {id(t.weight): t.fqn for t in find_targets(raw, n=cfg.n, m=cfg.m,
                                                          skip_incompatible=cfg.skip_incompatible)}
        masks = fsdp.gather_masks(optimizer, names, self.is_main)
        full = fsdp.full_model_state(raw)
        # training is over: AdamS's moments and masks (12-13 bytes per parameter, sharded) make room on the
        # device for the whole student that rank 0 evaluates and exports
        optimizer.state.clear()
        if not self.is_main:
            return None
        plain = fsdp.build_plain_student(cfg)
        plain.load_state_dict(full)
        del full
        return method.finalize_gathered(plain.to(self.device), masks)


def build_distribution(accelerator, fsdp: bool) -> Distribution:
    return Sharded(accelerator) if fsdp else Replicated(accelerator)
