"""The interface every training method implements."""

from __future__ import annotations

import torch


class TrainingMethod:
    """Strategy for one training method. Subclasses override the hooks; the loop calls them in order:

    ``prepare_model`` → ``build_optimizer`` → (training steps) → ``current_masks`` (for statistics) →
    ``finalize`` (prune, fold: afterwards the model is plain HF modules with exact N:M targets).
    """

    name = "base"

    def uses_kd(self, cfg) -> bool:
        return cfg.use_kd

    def prepare_model(self, model: torch.nn.Module, cfg) -> None:
        """Modify the student in place before the optimizer is built (e.g. wrap weight scaling)."""

    def build_optimizer(self, model: torch.nn.Module, cfg, total_steps: int) -> torch.optim.Optimizer:
        raise NotImplementedError

    def current_masks(self, model, optimizer) -> dict[str, torch.Tensor]:
        """fqn of each target weight -> its current bool mask (True = kept), in the weight's layout."""
        raise NotImplementedError

    def finalize(self, model: torch.nn.Module, optimizer) -> None:
        """Turn the trained student into the final N:M model in place."""
        raise NotImplementedError
