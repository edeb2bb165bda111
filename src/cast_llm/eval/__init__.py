"""Evaluation as method.md §7 measures a model: perplexity (:mod:`.ppl`), zero-/few-shot accuracy (:mod:`.zeroshot`)."""
