"""Fine-tuning data: completion-only labels, padding, label mapping, record formats (no model needed)."""

from __future__ import annotations

import json

import pytest
import tiny

from cast_llm.errors import CastError
from cast_llm.finetune.config import FinetuneConfig
from cast_llm.finetune.data import (
    IGNORE_INDEX,
    collate,
    encode_instruction,
    label_names_of,
    load_task_data,
    read_records,
)


def test_completion_only_loss_masks_every_prompt_token():
    tok = tiny.tokenizer()
    prompt, completion = "Sparse networks keep", " two of every four weights."
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    c = tok(completion, add_special_tokens=False)["input_ids"]
    ex, cut = encode_instruction(prompt, completion, tok, seq_len=64)
    assert not cut
    assert ex.input_ids == p + c + [tok.eos_token_id]
    assert ex.labels == [IGNORE_INDEX] * len(p) + c + [tok.eos_token_id]  # loss on completion + EOS only
    # too long: the completion's tail is cut, the prompt kept; a prompt that fills seq_len is dropped
    ex, cut = encode_instruction(prompt, completion, tok, seq_len=len(p) + 2)
    assert cut and ex.labels == [IGNORE_INDEX] * len(p) + c[:2]
    assert encode_instruction(prompt, completion, tok, seq_len=len(p)) == (None, True)


def test_collate_pads_right_and_ignores_padding_in_the_loss():
    tok = tiny.tokenizer()
    a, _ = encode_instruction("The quick", " fox", tok, 32)
    b, _ = encode_instruction("The quick brown fox jumps over", " the lazy dog.", tok, 32)
    batch = collate([a, b], pad_id=tok.pad_token_id)
    n = len(b.input_ids)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, n)
    assert batch["attention_mask"][0].tolist() == [1] * len(a.input_ids) + [0] * (n - len(a.input_ids))
    assert (batch["labels"][0, len(a.input_ids):] == IGNORE_INDEX).all()
    assert batch["labels"][1].tolist() == b.labels
    cls = collate([type(a)([1, 2, 3], 1), type(a)([4], 0)], pad_id=0)
    assert cls["labels"].tolist() == [1, 0] and cls["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]


def test_label_names():
    assert label_names_of([1, 0, 2, 1]) == ["0", "1", "2"]
    assert label_names_of(["1", "0"]) == ["0", "1"]  # integers read from CSV
    assert label_names_of(["pos", "neg", "pos"]) == ["neg", "pos"]
    with pytest.raises(CastError, match="integers or strings"):
        label_names_of([True, False])


def _cfg(tmp_path, data, **kw):
    return FinetuneConfig(model="m", data=str(data), output_dir=str(tmp_path / "o"), max_steps=1, batch_size=2,
                          seq_len=32, **kw)


def test_classification_files_csv_jsonl_pairs_and_held_out_labels(tmp_path):
    tok = tiny.tokenizer()
    csv_file = tmp_path / "d.csv"
    csv_file.write_text("text,label\n" + "".join(f"doc {i},{'pos' if i % 2 else 'neg'}\n" for i in range(20)))
    data = load_task_data(_cfg(tmp_path, csv_file, task="classification", eval_fraction=0.2), tok)
    assert data.kind == "classification" and data.label_names == ["neg", "pos"]
    assert len(data.train) == 16 and len(data.val) == 4
    assert {e.labels for e in data.train} == {0, 1}
    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join(json.dumps({"text_a": f"a{i}", "text_b": f"b{i}", "label": i % 3}) + "\n"
                             for i in range(9)))
    held = tmp_path / "h.jsonl"
    held.write_text(json.dumps({"text_a": "x", "text_b": "y", "label": 7}) + "\n")
    data = load_task_data(_cfg(tmp_path, pairs, task="classification"), tok)
    assert data.label_names == ["0", "1", "2"]
    ex = [e for e in data.train + data.val if e.labels == 1][0]
    assert tok.decode(ex.input_ids) in {f"a{i}\nb{i}" for i in range(9)}
    with pytest.raises(CastError, match="label 7 is not one of the training labels"):
        load_task_data(_cfg(tmp_path, pairs, task="classification", eval_data=str(held)), tok)


def test_causal_formats(tmp_path):
    tok = tiny.tokenizer()
    instr = tmp_path / "i.jsonl"
    instr.write_text("".join(json.dumps({"prompt": f"Q{i}:", "completion": f" A{i}"}) + "\n" for i in range(10)))
    data = load_task_data(_cfg(tmp_path, instr), tok)
    assert data.kind == "instruction" and len(data.train) == 9 and len(data.val) == 1
    assert data.val[0].prompt.startswith("Q") and data.val[0].completion.startswith(" A")
    text = tiny.write_corpus(tmp_path / "c.jsonl")
    data = load_task_data(_cfg(tmp_path, text), tok)
    assert data.kind == "text" and all(len(e.input_ids) == 32 and e.labels == e.input_ids for e in data.train)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "x", "completion": 3}\n')
    with pytest.raises(CastError, match="record 1 needs string 'prompt' and 'completion'"):
        load_task_data(_cfg(tmp_path, bad), tok)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "x"\n')
    with pytest.raises(CastError, match="broken.jsonl:1: not valid JSON"):
        read_records(tmp_path / "broken.jsonl")
