"""Fine-tuning metrics: batched greedy exact match, held-out loss; hub-style datasets read offline."""

from __future__ import annotations

import json

import tiny
import torch

from cast_llm.finetune.config import FinetuneConfig
from cast_llm.finetune.data import Example, encode_instruction, load_task_data
from cast_llm.finetune.evaluate import evaluate, exact_match


def test_batched_exact_match_equals_one_by_one_greedy_generation():
    """Left padding must not change what greedy generation produces from each prompt."""
    tok, model = tiny.tokenizer(), tiny.model("llama")
    prompts = ["The quick", "Sparse networks keep two of every", "Training with distillation recovers", "A"]
    items = []
    for p in prompts:
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        new = out[0, ids.shape[1]:].tolist()
        new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        items.append(Example([], [], p, tok.decode(new, skip_special_tokens=True)))
    res = exact_match(model, tok, items, max_new_tokens=5, batch_size=4, device="cpu")
    assert res["exact_match"] == 1.0 and res["examples"] == 4
    items[0].completion += " nope"
    assert exact_match(model, tok, items, max_new_tokens=5, batch_size=3, device="cpu")["exact_match"] == 0.75


def test_held_out_loss_counts_completion_tokens_only():
    tok, model = tiny.tokenizer(), tiny.model("llama")
    ex, _ = encode_instruction("The quick brown fox", " jumps", tok, 32)
    res = evaluate(model, [ex, ex], task="causal-lm", batch_size=1, pad_id=tok.pad_token_id, device="cpu")
    assert res["tokens"] == 2 * sum(label != -100 for label in ex.labels)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ex.input_ids])).logits[0]
    n_prompt = ex.labels.count(-100)
    ref = torch.nn.functional.cross_entropy(logits[n_prompt - 1 : -1], torch.tensor(ex.input_ids[n_prompt:]))
    assert abs(res["loss"] - float(ref)) < 1e-5


def test_hub_style_dataset_with_glue_columns_and_validation_split(tmp_path):
    """`hf:NAME` goes through datasets.load_dataset; a local folder exercises it without a hub."""
    d = tmp_path / "pairs"
    d.mkdir()
    for split, n in (("train", 12), ("validation", 4)):
        (d / f"{split}.jsonl").write_text("".join(
            json.dumps({"sentence1": f"s{i}", "sentence2": f"t{i}", "label": i % 2}) + "\n" for i in range(n)))
    cfg = FinetuneConfig(model="m", data=f"hf:{d}", output_dir="o", max_steps=1, batch_size=2, seq_len=16,
                         task="classification")
    data = load_task_data(cfg, tiny.tokenizer())
    assert len(data.train) == 12 and len(data.val) == 4 and data.label_names == ["0", "1"]
    assert tiny.tokenizer().decode(data.val[1].input_ids) == "s1\nt1"
