"""Fine-tuning N:M sparse models without losing sparsity (method.md §7): ``cast-llm finetune``.

* :mod:`~cast_llm.finetune.lora` — LoRA through peft, merged as ``W + M ⊙ (B A)·s`` (stays exactly N:M);
* :mod:`~cast_llm.finetune.sparse` — full fine-tuning where pruned weights stay exactly 0;
* :mod:`~cast_llm.finetune.modes` — the mode interface and ``dense`` (ordinary full fine-tuning);
* :mod:`~cast_llm.finetune.data`, :mod:`~cast_llm.finetune.evaluate` — examples, losses, metrics;
* :mod:`~cast_llm.finetune.loop` — the one loop; :mod:`~cast_llm.finetune.config` — its options.
"""
