"""Fine-tuning losses and held-out metrics: loss / perplexity, accuracy, greedy exact match.

The same :func:`batch_loss` drives training and evaluation, so "validation loss" means exactly the
training objective on held-out examples: token-mean cross-entropy over the labelled tokens (completion
tokens only for instruction data) for ``causal-lm``, example-mean cross-entropy for ``classification``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cast_llm.finetune.data import IGNORE_INDEX, Example, collate


def batch_loss(model, batch: dict[str, torch.Tensor], task: str) -> tuple[torch.Tensor, int, int]:
    """``(mean loss, count, correct)``: count = labelled tokens (causal-lm) or examples; correct = argmax hits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    labels = batch["labels"]
    if task == "classification":
        loss = F.cross_entropy(logits.float(), labels)
        return loss, labels.numel(), int((logits.argmax(-1) == labels).sum())
    # next-token prediction: position t predicts token t+1; only labelled targets count
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    if not keep.any():  # nothing to learn in this batch: a zero that still has a graph
        return logits.sum() * 0.0, 0, 0
    loss = F.cross_entropy(logits[:, :-1][keep].float(), targets[keep])
    return loss, int(keep.sum()), 0


@torch.no_grad()
def evaluate(model, examples: list[Example], *, task: str, batch_size: int, pad_id: int, device) -> dict:
    """Held-out loss (and accuracy or perplexity) of ``model`` over ``examples``; restores train/eval mode."""
    if not examples:
        return {}
    was_training = model.training
    model.eval()
    total, count, correct = 0.0, 0, 0
    try:
        for i in range(0, len(examples), batch_size):
            batch = {k: v.to(device) for k, v in collate(examples[i : i + batch_size], pad_id).items()}
            loss, n, hits = batch_loss(model, batch, task)
            if n:
                total += float(loss) * n
                count, correct = count + n, correct + hits
    finally:
        model.train(was_training)
    mean = total / max(count, 1)
    if task == "classification":
        return {"loss": mean, "accuracy": correct / max(count, 1), "examples": count}
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "tokens": count}


@torch.no_grad()
def exact_match(model, tokenizer, examples: list[Example], *, max_new_tokens: int, batch_size: int,
                device) -> dict:
    """Greedy generation from each prompt; a hit when the text up to EOS equals the completion (stripped).

    Prompts are left-padded so that every row's generation starts right after its prompt. Generation stops
    at EOS or after ``max_new_tokens`` (capped at the longest reference + 4 tokens per batch: a longer
    output cannot match).
    """
    from transformers import GenerationConfig

    items = [e for e in examples if e.prompt is not None]
    if not items:
        return {}
    was_training = model.training
    model.eval()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    hits, samples = 0, []
    try:
        for i in range(0, len(items), batch_size):
            chunk = items[i : i + batch_size]
            prompts = [tokenizer(e.prompt, add_special_tokens=False)["input_ids"] for e in chunk]
            refs = [tokenizer(e.completion, add_special_tokens=False)["input_ids"] for e in chunk]
            width = max(len(p) for p in prompts)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for j, p in enumerate(prompts):
                ids[j, width - len(p):] = torch.tensor(p)
                attn[j, width - len(p):] = 1
            gen = GenerationConfig(do_sample=False, max_new_tokens=min(max_new_tokens, max(map(len, refs)) + 4),
                                   pad_token_id=pad, eos_token_id=eos)
            out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), generation_config=gen)
            for j, e in enumerate(chunk):
                new = out[j, width:].tolist()
                new = new[: new.index(eos)] if eos in new else new
                pred = tokenizer.decode(new, skip_special_tokens=True)
                hit = pred.strip() == e.completion.strip()
                hits += hit
                if len(samples) < 3:
                    samples.append({"prompt": e.prompt, "prediction": pred, "reference": e.completion, "hit": hit})
    finally:
        model.train(was_training)
    return {"exact_match": hits / len(items), "examples": len(items), "samples": samples}
