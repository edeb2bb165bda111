"""The three fine-tuning modes as strategies for the one fine-tuning loop (:mod:`cast_llm.finetune.loop`).

The loop calls, in order: ``check_input`` (is the model N:M where the mode needs it?) → ``prepare``
(wrap adapters, record masks) → per step ``before_step`` (after backward, before clipping and the
optimizer step) and ``after_step`` (after the step) → ``verify`` at every checkpoint → ``finalize`` (a
plain Hugging Face model to export). ``model_state`` / ``extra_state`` are what a checkpoint stores.

* ``lora`` (:class:`cast_llm.finetune.lora.LoraMode`): adapters merged as ``W + M ⊙ (B A)``;
* ``sparse`` (:class:`cast_llm.finetune.sparse.SparseMode`): all weights train, pruned ones stay exactly 0;
* ``dense`` (:class:`DenseMode`): ordinary full fine-tuning; the model becomes dense and is exported as such.
"""

from __future__ import annotations

from pathlib import Path

from cast_llm.errors import CastError


class FinetuneMode:
    name = "base"
    keeps_nm = True  # the exported model must be N:M (and so must the input model)

    @property
    def method_name(self) -> str:
        return f"{self.name}-finetune"

    def check_input(self, rows, cfg) -> None:
        """Refuse, in one line that shows its sparsity, a model that is not N:M when the mode keeps N:M."""
        from cast_llm.export import format_sparsity_report

        bad = [r for r in rows if not r.is_nm]
        if self.keeps_nm and bad:
            worst = ", ".join(f"{r.name} {r.sparsity:.1%} zero" for r in bad[:2])
            raise CastError(
                f"--mode {self.name} keeps an N:M model N:M, but {cfg.model} is not {cfg.n}:{cfg.m}: "
                f"{format_sparsity_report(rows, n=cfg.n, m=cfg.m)} (e.g. {worst}); make it {cfg.n}:{cfg.m} "
                "first (cast-llm train, or cast-llm prune --method magnitude) or use --mode dense")

    def prepare(self, model, targets, cfg):
        self.cfg = cfg
        return model

    def before_step(self, model) -> None:
        pass

    def after_step(self, model, optimizer) -> None:
        pass

    def verify(self, model) -> None:
        pass

    def model_state(self, model) -> dict:
        return model.state_dict()

    def load_model_state(self, model, state: dict) -> None:
        model.load_state_dict(state)

    def extra_state(self) -> dict | None:
        return None

    def load_extra_state(self, state: dict | None) -> None:
        pass

    def finalize(self, model, out: Path, is_main: bool):
        return model

    def metadata(self) -> dict:
        return {}


class DenseMode(FinetuneMode):
    """Ordinary full fine-tuning with AdamW: every weight moves, so pruned zeros fill in."""

    name = "dense"
    keeps_nm = False


def get_mode(name: str) -> FinetuneMode:
    if name == "lora":
        from cast_llm.finetune.lora import LoraMode

        return LoraMode()
    if name == "sparse":
        from cast_llm.finetune.sparse import SparseMode

        return SparseMode()
    if name == "dense":
        return DenseMode()
    raise CastError(f"unknown --mode {name!r} (use lora, sparse or dense)")
