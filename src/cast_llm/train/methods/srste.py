"""SR-STE (Zhou et al., 2021; method.md §6): sparse forward ``W ⊙ M`` with a straight-through gradient to
all of ``W``, the decay ``λ_W (1 − M) ⊙ W`` added to the gradient of pruned entries, masks recomputed from
``|W|`` every ``--mask-interval`` steps (before the forward, so forward and decay share the mask), AdamW as
the base optimizer (:class:`cast_llm.optim.SRSTEAdamW`).

λ_W is ``--srste-decay`` (default 2e-4, the SR-STE paper's value; method.md gives none). Under Adam the decay
competes with the gradient inside the normalised update, so its effect scales with λ_W / |g|, not with the
learning rate as under SGD.

Also the mask learner of ``--method cast --mask-learner srste`` (the §6 ablation): :class:`CastSRSTEMethod`,
which is exactly this with CAST's KD and weight scaling (inside the sparse forward) and CAST's metadata.
"""

from __future__ import annotations

from cast_llm.optim import SRSTEAdamW
from cast_llm.train.methods.cast import cast_switches
from cast_llm.train.methods.sparse_forward import SparseForwardMethod


class SRSTEMethod(SparseForwardMethod):
    name = "srste"
    ste = True

    def build_optimizer(self, model, cfg, total_steps: int):
        # the live buffers, read at every step: accelerate moves the model after the optimizer is built
        masks = {w.weight: (lambda w=w: w.mask) for w in self.wrappers.values()}
        return SRSTEAdamW(self.weight_groups(model, cfg), masks, srste_decay=cfg.srste_decay, lr=cfg.lr,
                          betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)

    def export_metadata(self, cfg):
        meta = super().export_metadata(cfg)
        meta["training"]["srste_decay"] = cfg.srste_decay
        return meta


class CastSRSTEMethod(SRSTEMethod):
    """``--method cast --mask-learner srste`` (method.md §6): SR-STE learns the masks, with CAST's defaults —
    KD from the dense teacher and learnable weight scaling, which the sparse forward and the loop take from
    the config as for any method. A run of it is a CAST run (``name``), its checkpoint says which learner."""

    name = "cast"

    def export_metadata(self, cfg):
        meta = super().export_metadata(cfg)
        meta["training"].update(cast_switches(cfg))
        return meta
