"""The perplexities a training run reports, each printed as it comes with what it is based on: the test split
(the held-out figure every table reports), the validation split (what choices are made on) and WikiText-2."""

from __future__ import annotations

from typing import Any

import torch

from cast_llm.errors import CastError
from cast_llm.eval.ppl import PplResult, packed_perplexity, perplexity, tokenize_text, wikitext2_source

__all__ = ["Evaluator", "wikitext_windows"]

MIN_WINDOWS = 4  # the fewest WikiText-2 windows an evaluation scaled to the run scores


def wikitext_windows(requested: int | None, total: int, train_tokens: int, window: int) -> int:
    """The WikiText-2 windows each evaluation of a run scores, of the ``total`` windows of ``window`` tokens the
    text holds: ``requested`` (``--wikitext-windows``; 0 = all, the full protocol), or by default scaled to the
    run, ``train_tokens / (3 · window)`` windows and at least :data:`MIN_WINDOWS`, so that the three evaluations
    of a run (dense, one-shot, final) score fewer tokens than the run trains on. The one rule of the
    :class:`Evaluator` and of the plan's estimate (:func:`cast_llm.plan.run.evaluation_windows`)."""
    if requested == 0:
        return total
    if requested is not None:
        return min(requested, total)
    return min(total, max(MIN_WINDOWS, train_tokens // (3 * window)))


class Evaluator:
    """Test, validation and WikiText-2 perplexities of the (possibly wrapped) student, each figure printed as
    it comes with what it is based on. ``cfg``: a training config (:class:`cast_llm.train.config.TrainConfig`;
    its ``*_sequences``, ``wikitext_*``, ``eval_window``, ``batch_size`` and ``progress``).

    *Test* (the held-out figure every table reports) and *validation* (what tuning chooses on, and the
    in-training ``--eval-every`` figure) are the fixed splits of ``--data`` (:mod:`cast_llm.data.split`).
    WikiText-2 windows: as :func:`wikitext_windows` chooses them (``--wikitext-windows``, or scaled to the run).
    """

    def __init__(self, cfg, tokenizer, test: torch.Tensor, model_max: int | None, *,
                 val: torch.Tensor | None = None, train_tokens: int | None = None, say=None):
        self.cfg = cfg
        self.say = say or (lambda *a, **k: None)
        self.test = test[: cfg.test_sequences] if cfg.test_sequences else test
        self.val = test[:0] if val is None else (val[: cfg.val_sequences] if cfg.val_sequences else val)
        self.eval_len = cfg.eval_window
        if model_max is not None and self.eval_len > model_max:
            raise CastError(f"--eval-seq-len {self.eval_len} is above the model maximum ({model_max})")
        source = wikitext2_source(cfg.wikitext_file)  # explicit file, else $CAST_WIKITEXT2, else the packaged copy
        path = source.path
        self.wiki_source = source.description  # what the WikiText-2 figures were scored on, in words
        self.wiki_path = path  # its file (None: there is none)
        self.wiki_ids: torch.Tensor | None = None  # its tokens
        self.windows: int | None = None  # the windows scored
        self.windows_total: int | None = None  # the windows the text holds
        if path is not None:
            self.wiki_ids = tokenize_text(source.read_text(), tokenizer)
            total = max(0, (self.wiki_ids.numel()) // self.eval_len)
            self.windows = wikitext_windows(cfg.wikitext_windows, total, train_tokens or 0, self.eval_len)
            self.windows_total = total

    def describe(self) -> str:
        """What the figures are based on, in one line."""
        parts = []
        if self.test.shape[0]:
            parts.append(f"test: {self.test.shape[0]} sequences × {self.test.shape[1]} tokens of the held-out test "
                         "documents")
        if self.val.shape[0]:
            parts.append(f"validation: {self.val.shape[0]} × {self.val.shape[1]} (the final model)")
        if self.wiki_ids is not None:
            scope = "all" if self.windows == self.windows_total else f"the first {self.windows} of {self.windows_total}"
            parts.append(f"WikiText-2 ({self.wiki_source}): {scope} windows of {self.eval_len} tokens "
                         f"({self.windows * self.eval_len:,} tokens)")
        return "; ".join(parts) or "no evaluation data"

    def _packed(self, model, ids: torch.Tensor, desc: str) -> float | None:
        if ids.shape[0] == 0:
            return None
        return packed_perplexity(model, ids, batch_size=self.cfg.batch_size, progress=self.cfg.progress,
                                 desc=desc).perplexity

    def heldout(self, model, label: str = "model") -> float | None:
        """Perplexity on the test split (the reported held-out figure)."""
        return self._packed(model, self.test, f"{label}: test ppl")

    def validation(self, model, label: str = "model") -> float | None:
        """Perplexity on the validation split (for choices: tuning, --eval-every)."""
        return self._packed(model, self.val, f"{label}: validation ppl")

    def wikitext(self, model, label: str = "model") -> PplResult | None:
        """WikiText-2 on the evaluation's windows: the perplexity and each window's mean NLL (``window_nll``)."""
        if self.wiki_ids is None:
            return None
        return perplexity(model, self.wiki_ids, self.eval_len, batch_size=1, max_windows=self.windows or None,
                          progress=self.cfg.progress, desc=f"{label}: WikiText-2 ppl")

    def both(self, model, label: str = "model", *, validation: bool = False) -> dict[str, Any]:
        """Test and WikiText-2 perplexities by split (and validation's, when asked: the final model's), and
        ``wikitext2_window_nll``: WikiText-2 window by window (a run records it; None without WikiText-2)."""
        h = self.heldout(model, label)
        v = self.validation(model, label) if validation else None
        wiki = self.wikitext(model, label)
        w = None if wiki is None else wiki.perplexity
        self.say(f"{label}: " + _fmt({"test ppl": h, "validation ppl": v, "WikiText-2 ppl": w}))
        out = {"heldout": h, "wikitext2": w, "wikitext2_window_nll": None if wiki is None else list(wiki.window_nll)}
        if validation:
            out["validation"] = v
        return out


def _fmt(d: dict[str, float | None]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in d.items() if v is not None)
