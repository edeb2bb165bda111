"""The interface every training method and every fine-tuning mode implements for the one loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class TrainingMethod:
    """Strategy for one way of training. Subclasses override the hooks; :func:`cast_llm.train.loop.run`
    calls them in this order::

        prepare_model → build_optimizer → [resume: load_model_state, load_extra_state]
        per step: begin_step → forward/backward (the job's loss) → before_optimizer_step → clipping
                  → before_update → optimizer step → end_step → (log steps: current_masks, log_metrics)
        checkpoints: verify, model_state, extra_state
        end: finalize (or, under FSDP2, finalize_gathered on the gathered model) → results

    State must live in the model's or the optimizer's ``state_dict``, or in :meth:`extra_state`, so that a
    checkpoint resumes it exactly; hooks must be deterministic functions of that state and the step
    (``begin_step`` runs again for the first step after a resume).
    """

    name = "base"

    def uses_kd(self, cfg) -> bool:
        return cfg.use_kd

    def prepare_model(self, model: torch.nn.Module, cfg, *, data=None, device=None,
                      start: str = "compute") -> torch.nn.Module | None:
        """Modify the model before the optimizer is built (wrap weight scaling, adapters, …); return the
        model to train if it is a new object (None: the same one, modified in place).

        ``data`` is the job's data (one-shot masks calibrate on it), ``device`` the training device.
        ``start`` says who computes the method's one-shot start (a warm start, an initial mask):
        ``"compute"`` this process for itself; ``"send"`` this process (rank 0), which then gives it to the
        others; ``"receive"`` another process (this model may be empty, on the meta device: change only its
        structure); ``"skip"`` nobody (a resumed run: the checkpoint holds it). Methods that compute their
        start identically on every process may ignore it.
        """

    def build_optimizer(self, model: torch.nn.Module, cfg, total_steps: int) -> torch.optim.Optimizer:
        raise NotImplementedError

    def begin_step(self, model: torch.nn.Module, optimizer, step: int) -> None:
        """Before the forward of every optimizer step; ``step`` = steps already done (0-based).

        For schedules and mask refreshes that the forward must see (SR-STE masks, MaskLLM's temperature).
        """

    def before_optimizer_step(self, model: torch.nn.Module, optimizer, step: int) -> None:
        """After the backward, before clipping and the step (e.g. zero the gradients of pruned weights)."""

    def before_update(self, model: torch.nn.Module, optimizer, step: int, ctx) -> None:
        """Right before the optimizer step, after clipping (the gradients are final; e.g. CAST's decay
        forecast before the first update)."""

    def end_step(self, model: torch.nn.Module, optimizer, step: int) -> None:
        """After every optimizer step; ``step`` = steps done before it (0-based, as in begin_step)."""

    def current_masks(self, model, optimizer) -> dict[str, torch.Tensor]:
        """fqn of each target weight -> its current bool mask (True = kept), in the weight's layout."""
        return {}

    def log_metrics(self, model, optimizer, step: int) -> dict[str, Any]:
        """Extra entries of a log record (``step`` 0-based, as in end_step)."""
        return {}

    def verify(self, model) -> None:
        """Raise if the model breaks the method's invariants (checked before every checkpoint)."""

    def model_state(self, model) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def load_model_state(self, model, state: dict[str, torch.Tensor]) -> None:
        model.load_state_dict(state)

    def extra_state(self) -> Any:
        """Method state that lives outside model and optimizer (None: nothing)."""
        return None

    def load_extra_state(self, state: Any) -> None:
        pass

    def finalize(self, model: torch.nn.Module, optimizer, *, out: Path, is_main: bool) -> torch.nn.Module:
        """Turn the trained model into the final one (plain HF modules; N:M targets exact where the method
        promises it) and return it. Called on every process."""
        raise NotImplementedError

    def finalize_gathered(self, model: torch.nn.Module, masks: dict[str, torch.Tensor]) -> torch.nn.Module:
        """FSDP2: :meth:`finalize` for a plain copy of the model gathered on rank 0, with the gathered masks."""
        raise NotImplementedError(f"{self.name} does not support FSDP2")

    def results(self) -> dict[str, Any]:
        """Entries for ``results.json`` (e.g. what the final prune removed)."""
        return {}

    def export_metadata(self, cfg) -> dict[str, Any]:
        """What this run was, for the exported checkpoint's ``sparsity`` metadata (method + switches)."""
        training = {"kd": cfg.use_kd, "scaling": cfg.use_scaling, "init_mask": cfg.effective_init_mask,
                    "mask_interval": cfg.effective_mask_interval}
        if cfg.mask_file:
            training["mask_file"] = str(cfg.mask_file)
        return {"training": training}
