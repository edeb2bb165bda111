"""Fine-tuning configuration (method.md §7 "Fine-tuning"): one dataclass, the source of CLI flags and YAML.

Precedence (lowest to highest): dataclass defaults < ``--config file.yaml`` < flags typed on the command
line. The resolved config is written into the run folder as ``config.yaml``. Flag names follow
``cast-llm train`` wherever the meaning is the same (``--data --output-dir --max-steps --batch-size
--seq-len --lr --seed --resume --overwrite --save-every --eval-every``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cast_llm.config import option
from cast_llm.errors import CastError

MODES = ("lora", "sparse", "dense")
TASKS = ("causal-lm", "classification")

# A LoRA update trains ~1% of the weights from a zero start and tolerates a 10x larger step than a full
# fine-tune, whose every weight already sits at a pretrained optimum (common practice; the paper gives none).
DEFAULT_LR = {"lora": 2e-4, "sparse": 2e-5, "dense": 2e-5}

# config keys that must match for --resume to continue the same run (logging and evaluation may change)
FINGERPRINT_KEYS = (
    "model", "mode", "task", "data", "eval_data", "val_fraction", "max_examples", "max_steps", "batch_size",
    "grad_accum", "seq_len", "lr", "weight_decay", "warmup_steps", "min_lr_ratio", "grad_clip", "n", "m",
    "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_masked_forward", "seed",
)


@dataclass
class FinetuneConfig:
    # --- what, how, on what
    model: str | None = option(None, "the model to fine-tune (positional MODEL): an HF folder (e.g. the output of "
                                     "cast-llm train / prune), a hub id, a .gguf file or the alias smollm2-135m")
    mode: str = option("lora", "lora: adapters merged as W + M⊙(BA) (stays N:M); sparse: full fine-tuning with "
                               "pruned weights held at 0; dense: ordinary full fine-tuning (the model becomes dense)",
                       choices=MODES)
    task: str = option("causal-lm", "causal-lm (prompt/completion JSONL, loss on the completion only, or plain "
                                    "text) or classification (CSV/JSONL with text or text_a/text_b and label)",
                       choices=TASKS)
    data: str | None = option(None, "training data: a .jsonl/.json/.csv/.tsv file; for causal-lm also any "
                                    "cast-llm train --data source; for classification also hf:glue:sst2 style")
    eval_data: str | None = option(None, "held-out data in the same format (default: --val-fraction of --data)")
    output_dir: str | None = option(None, "run folder: checkpoints, logs, the fine-tuned model and the adapter")
    # --- budget and batch
    max_steps: int | None = option(None, "optimizer steps (required)")
    batch_size: int = option(8, "examples per micro-batch per process")
    grad_accum: int = option(1, "micro-batches accumulated per optimizer step")
    seq_len: int = option(256, "longest example in tokens (longer ones are truncated; plain text is packed to it)")
    max_examples: int | None = option(None, "use only the first this many training records (quick runs)")
    # --- optimizer (AdamW) and schedule
    lr: float | None = option(None, f"peak learning rate (default by mode: {DEFAULT_LR})")
    weight_decay: float = option(0.0, "AdamW decoupled weight decay on matrices (not on norms, biases)")
    warmup_steps: int | None = option(None, "linear warm-up steps (default: 3% of the steps, at least 1)")
    min_lr_ratio: float = option(0.0, "cosine decays to lr × this")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0 = off)")
    n: int = option(2, "N of the N:M pattern the model must have (lora, sparse) and keeps")
    m: int = option(4, "M of the N:M pattern")
    skip_incompatible: bool = option(False, "ignore layers whose width is not a multiple of m (they are dense)")
    # --- LoRA (paper: r = 64 for parity)
    lora_r: int = option(64, "LoRA rank r (paper: 64)")
    lora_alpha: float = option(64.0, "LoRA alpha; the update is scaled by alpha / r (ours: scaling 1)")
    lora_dropout: float = option(0.05, "dropout on the LoRA input path")
    lora_target_modules: str | None = option(None, "comma-separated module names (suffixes) to adapt "
                                                   "(default: every N:M target layer)")
    lora_masked_forward: bool = option(True, "train with the masked update W + M⊙(BA) in the forward, so the "
                                             "merged model is exactly the trained one (costs about a full "
                                             "fine-tune's compute); --no-lora-masked-forward trains plain LoRA "
                                             "and masks only at the merge")
    save_adapter: bool = option(True, "also save the un-merged LoRA adapter in OUTPUT_DIR/adapter")
    # --- evaluation, logging, checkpoints
    val_fraction: float = option(0.1, "fraction of --data records held out when --eval-data is not given")
    val_examples: int = option(256, "held-out examples (or packed sequences) scored for loss/accuracy (0 = all)")
    exact_match_examples: int = option(64, "held-out prompt/completion items scored by greedy exact match (0 = off)")
    max_new_tokens: int = option(32, "greedy generation length cap for exact match")
    eval_batch_size: int | None = option(None, "examples per evaluation batch (default: --batch-size)")
    baseline_eval: bool = option(True, "also evaluate the model before fine-tuning (the 'before' column)")
    eval_every: int = option(0, "steps between validation evaluations (0 = only before and after)")
    log_every: int = option(10, "steps between JSONL records")
    save_every: int = option(0, "steps between atomic checkpoints (0 = none until the end)")
    keep_checkpoints: int = option(2, "how many recent checkpoints to keep")
    per_layer_report: bool = option(True, "print the sparsity of every target layer at the end (the total always)")
    resume: bool = option(False, "continue from the latest checkpoint in --output-dir")
    overwrite: bool = option(False, "replace an existing run in --output-dir")
    seed: int = option(0, "seed for the data split and order, dropout and new weights (LoRA, heads)")
    device: str = option("auto", "auto, cpu or cuda (accelerate launch sets the device per process)")
    precision: str = option("auto", "auto (fp32 on CPU, bf16 autocast on GPU), fp32, bf16",
                            choices=("auto", "fp32", "bf16"))
    progress: bool = option(True, "show a progress bar")

    def validate(self) -> None:
        if not self.model:
            raise CastError("MODEL is required: cast-llm finetune MODEL --mode lora|sparse|dense ...")
        if not self.data:
            raise CastError("--data is required (a prompt/completion or text .jsonl, or a classification .csv)")
        if not self.output_dir:
            raise CastError("--output-dir is required")
        if self.max_steps is None or self.max_steps < 1:
            raise CastError(f"--max-steps must be given and ≥ 1, got {self.max_steps}")
        for name in ("batch_size", "grad_accum", "seq_len", "lora_r", "log_every", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise CastError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(self, name)}")
        for name in ("val_examples", "exact_match_examples", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise CastError(f"--{name.replace('_', '-')} must be ≥ 0, got {getattr(self, name)}")
        if self.lr is not None and self.lr <= 0:
            raise CastError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.lora_dropout < 1:
            raise CastError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if not 0 <= self.val_fraction < 1:
            raise CastError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if not 1 <= self.n < self.m:
            raise CastError(f"need 1 ≤ n < m for an N:M pattern, got {self.n}:{self.m}")

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.mode]

    @property
    def target_module_list(self) -> list[str] | None:
        if not self.lora_target_modules:
            return None
        return [s.strip() for s in self.lora_target_modules.split(",") if s.strip()]
