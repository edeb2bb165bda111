"""Fine-tuning configuration (method.md §7 "Fine-tuning"): one dataclass, the source of CLI flags and YAML.

The settings every job of the one training loop shares come from
:class:`~cast_llm.train.config.RunConfig`. Precedence (lowest to highest): dataclass defaults <
``--config file.yaml`` < flags typed on the command line (with ``--resume``, the run's own config.yaml first). The resolved config is written into the run folder as ``config.yaml``. Flag names follow
``cast-llm train`` wherever the meaning is the same (``--data --output-dir --max-steps --batch-size
--seq-len --lr --seed --resume --overwrite --save-every --eval-every``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import ModelSettings, option
from cast_llm.errors import CastError
from cast_llm.train.config import BUDGET, CKPT, EVAL, OPTIM, RUN, RunConfig

LORA = "LoRA"
SECTIONS = (RUN, BUDGET, OPTIM, LORA, EVAL, CKPT)  # the order of `finetune --help`

MODES = ("lora", "sparse", "dense")
TASKS = ("causal-lm", "classification")

# A LoRA update trains ~1% of the weights from a zero start and tolerates a 10x larger step than a full
# fine-tune, whose every weight already sits at a pretrained optimum (common practice; the paper gives none).
DEFAULT_LR = {"lora": 2e-4, "sparse": 2e-5, "dense": 2e-5}


@dataclass
class FinetuneConfig(RunConfig, ModelSettings):
    """``cast-llm finetune``: the shared run settings (:class:`~cast_llm.train.config.RunConfig`) plus these."""

    # ModelSettings' --model without a default: the positional MODEL (or a --config file) must name one
    model: str | None = option(None, "the model to fine-tune (positional MODEL): an HF folder (e.g. the output of "
                                     "cast-llm train / prune), a hub id, a .gguf file or the alias smollm2-135m",
                               section=RUN, resume="must_match")
    mode: str = option("lora", "lora: adapters merged as W + M⊙(BA) (stays N:M); sparse: full fine-tuning with "
                               "pruned weights held at 0; dense: ordinary full fine-tuning (the model becomes dense)",
                       choices=MODES, section=RUN, resume="must_match")
    task: str = option("causal-lm", "causal-lm (prompt/completion JSONL, loss on the completion only, or plain "
                                    "text) or classification (CSV/JSONL with text or text_a/text_b and label)",
                       choices=TASKS, section=RUN, resume="must_match")
    data: str | None = option(None, "training data: a .jsonl/.json/.csv/.tsv file; for causal-lm also any "
                                    "cast-llm train --data source; for classification also hf:glue:sst2 style",
                              section=RUN, resume="must_match")
    eval_data: str | None = option(None, "held-out data in the same format (default: --eval-fraction of --data)",
                                   section=RUN, resume="must_match")
    seq_len: int = option(256, "longest example in tokens (longer ones are truncated; plain text is packed to it)",
                          min=2, section=BUDGET, resume="must_match")
    max_examples: int | None = option(None, "use only the first this many training records (quick runs)", min=1,
                                      section=BUDGET, resume="must_match")
    # RunConfig's --lr, its default by --mode
    lr: float | None = option(None, "peak learning rate (default by --mode: "
                                    + ", ".join(f"{mode} {lr:g}" for mode, lr in DEFAULT_LR.items()) + ")",
                              min=0, min_exclusive=True, section=OPTIM, resume="must_match")
    # --- LoRA (paper: r = 64 for parity)
    lora_r: int = option(64, "LoRA rank r (paper: 64)", min=1, section=LORA, resume="must_match")
    lora_alpha: float = option(64.0, "LoRA alpha; the update is scaled by alpha / r (ours: scaling 1)", min=0,
                               min_exclusive=True, section=LORA, resume="must_match")
    lora_dropout: float = option(0.05, "dropout on the LoRA input path", min=0, max=0.999, section=LORA,
                                 resume="must_match")
    lora_target_modules: str | None = option(None, "comma-separated module names (suffixes) to adapt "
                                                   "(default: every N:M target layer)", section=LORA,
                                                   resume="must_match")
    lora_masked_forward: bool = option(True, "train with the masked update W + M⊙(BA) in the forward, so the "
                                             "merged model is exactly the trained one (costs about a full "
                                             "fine-tune's compute); --no-lora-masked-forward trains plain LoRA "
                                             "and masks only at the merge", section=LORA, resume="must_match")
    save_adapter: bool = option(True, "also save the un-merged LoRA adapter in OUTPUT_DIR/adapter", section=LORA,
                                resume="free")
    # --- evaluation
    eval_fraction: float = option(0.1, "fraction of --data records held out when --eval-data is not given",
                                  min=0, max=0.9, section=EVAL, resume="must_match")
    val_examples: int = option(256, "held-out examples (or packed sequences) scored for loss/accuracy (0 = all)",
                               min=0, section=EVAL, resume="free")
    exact_match_examples: int = option(64, "held-out prompt/completion items scored by greedy exact match (0 = off)",
                                       min=0, section=EVAL, resume="free")
    exact_match_max_tokens: int = option(32, "greedy generation length cap for exact match", min=1,
                                         section=EVAL, resume="free")
    eval_batch_size: int | None = option(None, "examples per evaluation batch (default: --batch-size)", min=1,
                                         section=EVAL, resume="free")
    per_layer_report: bool = option(True, "print the sparsity of every target layer at the end (the total always)",
                                    section=EVAL, resume="free")

    def validate(self) -> None:
        if not self.model:
            raise CastError("MODEL is required: cast-llm finetune MODEL --mode lora|sparse|dense ...")
        if not self.data:
            raise CastError("--data is required (a prompt/completion or text .jsonl, or a classification .csv)")
        super().validate()
        if self.max_steps is None:
            raise CastError("--max-steps is required")

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.mode]

    @property
    def target_module_list(self) -> list[str] | None:
        if not self.lora_target_modules:
            return None
        return [s.strip() for s in self.lora_target_modules.split(",") if s.strip()]
