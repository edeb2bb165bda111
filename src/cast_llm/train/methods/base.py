"""The interface every training method implements."""

from __future__ import annotations

from typing import Any

import torch


class TrainingMethod:
    """Strategy for one training method. Subclasses override the hooks; the loop calls them in order:

    ``prepare_model`` → ``build_optimizer`` → per step: ``begin_step`` → forward/backward → optimizer step
    → ``end_step`` → (``current_masks`` for statistics) → ``finalize`` (prune, fold: afterwards the model is plain HF
    modules with exact N:M targets) → ``export_metadata`` (recorded in the checkpoint's ``sparsity``).

    Method state must live in the model's or the optimizer's ``state_dict`` (parameters, buffers, optimizer
    state), so that a checkpoint resumes it exactly; hooks must be deterministic functions of that state and
    the step (``begin_step`` runs again for the first step after a resume).
    """

    name = "base"

    def uses_kd(self, cfg) -> bool:
        return cfg.use_kd

    def prepare_model(self, model: torch.nn.Module, cfg, *, data=None, device=None) -> None:
        """Modify the student in place before the optimizer is built (e.g. wrap weight scaling).

        ``data`` is the run's :class:`cast_llm.data.TokenData` (for one-shot masks that need calibration,
        ``--init-mask wanda|sparsegpt``), ``device`` the device the loop trains on.
        """

    def build_optimizer(self, model: torch.nn.Module, cfg, total_steps: int) -> torch.optim.Optimizer:
        raise NotImplementedError

    def begin_step(self, model: torch.nn.Module, optimizer, step: int) -> None:
        """Called before the forward of every optimizer step; ``step`` = steps already done (0-based).

        For schedules and mask refreshes that the forward must see (SR-STE masks, MaskLLM's temperature).
        """

    def end_step(self, model: torch.nn.Module, optimizer, step: int) -> None:
        """Called after every optimizer step; ``step`` = steps done before it (0-based, as in begin_step)."""

    def current_masks(self, model, optimizer) -> dict[str, torch.Tensor]:
        """fqn of each target weight -> its current bool mask (True = kept), in the weight's layout."""
        raise NotImplementedError

    def finalize(self, model: torch.nn.Module, optimizer) -> None:
        """Turn the trained student into the final N:M model in place."""
        raise NotImplementedError

    def export_metadata(self, cfg) -> dict[str, Any]:
        """What this run was, for the exported checkpoint's ``sparsity`` metadata (method + switches)."""
        return {"training": {"kd": cfg.use_kd, "scaling": cfg.use_scaling, "init_mask": cfg.init_mask,
                             "mask_interval": cfg.effective_mask_interval}}
