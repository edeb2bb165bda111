"""Distillation memory in the training loop (method.md §4-5): under bf16 mixed precision the student and
teacher logits reach the loss in bf16 — no fp32 copies of the full-vocabulary logits — and training works."""

from __future__ import annotations

import pytest
import tiny
import torch

import cast_llm.train.trainer as trainer
from cast_llm.cli import main


@pytest.fixture
def fresh_accelerate_state():
    # accelerate keeps one process-wide state whose mixed precision cannot change once set (other tests
    # train in fp32 in this process): start from a clean one, and leave a clean one behind
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_training_keeps_logits_in_bf16(tmp_path, monkeypatch, fresh_accelerate_state):
    tiny.save_model(tmp_path / "llama", "llama")
    tiny.write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "eval.txt").write_text(tiny.CORPUS)
    seen = []
    real = trainer.lm_loss

    def spy(student_logits, teacher_logits, input_ids, cfg):
        seen.append((student_logits.dtype, teacher_logits.dtype if teacher_logits is not None else None))
        return real(student_logits, teacher_logits, input_ids, cfg)

    monkeypatch.setattr(trainer, "lm_loss", spy)
    argv = ["train", "--model", str(tmp_path / "llama"), "--data", str(tmp_path / "corpus.jsonl"),
            "--output-dir", str(tmp_path / "run"), "--batch-size", "2", "--seq-len", "32", "--max-steps", "2",
            "--no-progress", "--no-report", "--precision", "bf16", "--kd", "--no-baseline-eval", "--val-sequences", "2",
            "--device", "cpu", "--wikitext-file", str(tmp_path / "eval.txt")]
    assert main(argv) == 0
    assert seen and all(s == (torch.bfloat16, torch.bfloat16) for s in seen)


def test_scoring_builds_no_kv_cache():
    """Perplexity windows go through the model without a KV cache (it would keep every layer's K and V until
    the forward returns)."""
    from cast_llm.eval.ppl import window_nll

    model = tiny.model("llama").eval()
    seen = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs.get("use_cache")), with_kwargs=True)
    window_nll(model, torch.randint(0, model.config.vocab_size, (2, 16)))
    assert seen == [False]
