"""Sparsity-aware full fine-tuning (method.md §7): every weight trains, pruned weights stay exactly 0.

The masks are the supports ``M = (W ≠ 0)`` of the N:M targets of the input model (the paper's "only kept
weights update"; same choice and reasons as :mod:`cast_llm.finetune.lora`). With AdamW three things
keep a pruned weight at exactly 0, and all three are applied every step:

1. its gradient is zeroed before clipping and the step (so clipping sees only the gradients that act);
2. with a zero gradient its moments stay 0 and the AdamW update ``lr · m̂ / (√v̂ + ε)`` is exactly 0,
   and decoupled weight decay multiplies 0 by ``1 − lr·wd``; the moments ``exp_avg`` / ``exp_avg_sq``
   (``max_exp_avg_sq`` with amsgrad) are still re-masked after the step, so a state loaded from elsewhere
   or a future optimizer cannot leak;
3. the weight itself is re-masked after the step (a no-op when 1–2 hold; the guarantee when they do not).

At every checkpoint :meth:`SparseMasks.violations` re-verifies that no pruned weight became non-zero.
"""

from __future__ import annotations

import torch

from cast_llm.errors import CastError
from cast_llm.finetune.modes import FinetuneMode
from cast_llm.sparsity.mask import pack_mask, unpack_mask

STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class SparseMasks:
    """The support masks of the N:M targets and the in-place operations that keep them."""

    def __init__(self, targets):
        self.params = {t.fqn: t.weight for t in targets}
        self.masks = {t.fqn: t.weight.detach() != 0 for t in targets}

    def _mask(self, fqn: str, like: torch.Tensor) -> torch.Tensor:
        mask = self.masks[fqn]
        if mask.device != like.device:
            mask = self.masks[fqn] = mask.to(like.device)
        return mask

    @torch.no_grad()
    def mask_grads_(self) -> None:
        for fqn, p in self.params.items():
            if p.grad is not None:
                p.grad.masked_fill_(~self._mask(fqn, p.grad), 0)

    @torch.no_grad()
    def enforce_(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        for fqn, p in self.params.items():
            keep = self._mask(fqn, p)
            p.masked_fill_(~keep, 0)
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            for key in STATE_KEYS:
                t = state.get(key)
                if isinstance(t, torch.Tensor) and t.shape == p.shape:
                    t.masked_fill_(~keep, 0)

    @torch.no_grad()
    def violations(self) -> dict[str, int]:
        """fqn -> number of pruned entries that are non-zero (empty when the masks hold)."""
        out = {}
        for fqn, p in self.params.items():
            bad = int(((p != 0) & ~self._mask(fqn, p)).sum())
            if bad:
                out[fqn] = bad
        return out

    def state_dict(self) -> dict:
        return {fqn: (tuple(m.shape), pack_mask(m.cpu())) for fqn, m in self.masks.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.masks):
            raise CastError("checkpoint masks name other layers than this model's N:M targets")
        for fqn, (shape, packed) in state.items():
            self.masks[fqn] = unpack_mask(packed, shape).to(self.params[fqn].device)


class SparseMode(FinetuneMode):
    """Full fine-tuning under fixed N:M masks: AdamW + gradient, moment and weight masking."""

    name = "sparse"

    def prepare(self, model, targets, cfg):
        self.masks = SparseMasks(targets)
        return model

    def before_optimizer_step(self, model, optimizer, step: int) -> None:
        self.masks.mask_grads_()

    def end_step(self, model, optimizer, step: int) -> None:
        self.masks.enforce_(optimizer)

    def check_invariants(self, model) -> None:
        bad = self.masks.violations()
        if bad:
            names = ", ".join(f"{k} ({v})" for k, v in list(bad.items())[:3])
            raise CastError(f"internal error: pruned weights became non-zero in {len(bad)} layer(s): {names}")

    def extra_state(self) -> dict:
        return self.masks.state_dict()

    def load_extra_state(self, state: dict | None) -> None:
        if state:
            self.masks.load_state_dict(state)
