"""Fine-tuning data: instruction (prompt/completion), plain text, and classification examples.

``--task causal-lm``

* a ``.jsonl``/``.json``/``.csv``/``.tsv`` file whose records have ``prompt`` and ``completion``: every
  example is ``prompt tokens + completion tokens + EOS``; the labels are ``-100`` (no loss) on the prompt,
  so the model learns to *answer*, not to repeat the question (:func:`encode_instruction`). Prompt and
  completion are tokenised separately, exactly as greedy generation will see them at evaluation;
* anything else ``cast-llm train --data`` accepts (``.txt``, ``.jsonl`` with ``text``, folders,
  ``wiki-summaries``, ``hf:NAME``): packed into ``seq_len`` windows by :func:`cast_llm.data.packing`,
  loss on every token.

``--task classification``: ``.csv``/``.tsv``/``.jsonl`` records with ``text`` (or ``text_a`` and ``text_b``,
joined by a newline) and ``label``; labels are integers ``0..K-1`` or strings (mapped to ids in sorted
order, the names kept for ``config.id2label``). ``hf:NAME[:CONFIG]`` (e.g. ``hf:glue:sst2``) reads a hub
dataset through ``datasets``: its ``train`` split, and its ``validation`` split as the held-out set.

Records are split into train / held-out with the seed unless ``--eval-data`` is given. Batches come from
:class:`cast_llm.data.BatchSampler` over the example list, so resuming at step s replays the same batches.
"""

from __future__ import annotations

import csv
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cast_llm.data import EMBEDDED_CORPORA, prepare
from cast_llm.data.sources import source_files
from cast_llm.errors import CastError

IGNORE_INDEX = -100  # label of tokens without loss (torch cross_entropy's default ignore_index)
RECORD_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")
# text columns of GLUE-style hub datasets, tried in order
PAIR_FIELDS = (("text_a", "text_b"), ("sentence1", "sentence2"), ("question1", "question2"),
               ("question", "sentence"), ("premise", "hypothesis"), ("text",), ("sentence",))


@dataclass
class Example:
    """One tokenised example. ``labels``: per-token labels (causal-lm) or the class id (classification)."""

    input_ids: list[int]
    labels: list[int] | int
    prompt: str | None = None  # instruction data keeps the strings for greedy exact match
    completion: str | None = None


@dataclass
class TaskData:
    kind: str  # "instruction", "text" or "classification"
    train: list[Example]
    val: list[Example]
    label_names: list[str] | None = None
    truncated: int = 0
    dropped: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def num_labels(self) -> int:
        return len(self.label_names or [])


# ------------------------------------------------------------------------------------------------- records
def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``.jsonl``/``.json`` (one object per line, or one JSON array) or ``.csv``/``.tsv`` file."""
    suffix = path.suffix.lower()
    if suffix not in RECORD_SUFFIXES:
        raise CastError(f"{path}: unsupported file type '{suffix}' (use {', '.join(RECORD_SUFFIXES)})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CastError(f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); save it as "
                        "UTF-8") from None
    if suffix in (".csv", ".tsv"):
        # the csv module's field limit (128 KiB) raised to what a record may hold: one field is at most the file
        csv.field_size_limit(max(csv.field_size_limit(), min(len(text) + 1, 2**31 - 1)))
        reader = csv.DictReader(text.splitlines(), delimiter="\t" if suffix == ".tsv" else ",")
        try:
            rows = list(reader)
        except csv.Error as e:
            raise CastError(f"{path}:{reader.line_num}: not valid {suffix[1:].upper()} ({e})") from None
        if reader.fieldnames is None:
            raise CastError(f"{path}: empty file (expected a header row and records)")
        return rows
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise CastError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    else:
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise CastError(f"{path}:{i}: not valid JSON ({e.msg}); expected one object per line") from None
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise CastError(f"{path}: record {i} is a {type(row).__name__}, expected an object")
    return rows


def check_data_source(spec: str, flag: str = "--data") -> None:
    """A one-line error for a data source that is not there (before anything is loaded or written): a local
    file or folder must exist, the embedded corpus must be installed; ``hf:`` names are checked when read."""
    if spec.startswith("hf:") or Path(spec).expanduser().exists():
        return
    if spec in EMBEDDED_CORPORA:
        source_files(spec)
        return
    raise CastError(f"{flag} {spec}: data source not found (a {'/'.join(RECORD_SUFFIXES)} file, a .txt/.parquet "
                    "file or folder of text, wiki-summaries, or hf:NAME[:CONFIG])")


def _local_records(spec: str) -> list[dict[str, Any]] | None:
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix.lower() in RECORD_SUFFIXES:
        return read_records(p)
    return None


def split_records(records: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """Seeded shuffle, then the first ``val_fraction`` (at least one record) is held out."""
    records = list(records)
    random.Random(seed).shuffle(records)
    if val_fraction <= 0 or len(records) < 2:
        return records, []
    n_val = max(1, round(len(records) * val_fraction))
    return records[n_val:], records[:n_val]


# -------------------------------------------------------------------------------------------- instructions
def encode_instruction(prompt: str, completion: str, tokenizer, seq_len: int) -> tuple[Example | None, bool]:
    """``prompt + completion + EOS`` with labels ``-100`` on the prompt; returns (example, truncated).

    Too long: the completion's tail is cut (the flag says so); a prompt that leaves no room for one
    completion token gives ``None``.
    """
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if len(p) >= seq_len:
        return None, True
    ids, labels = (p + c)[:seq_len], ([IGNORE_INDEX] * len(p) + c)[:seq_len]
    return Example(ids, labels, prompt, completion), len(p) + len(c) > seq_len


def instruction_examples(records, tokenizer, seq_len, where: str) -> tuple[list[Example], int, int]:
    """Prompt/completion records as examples, with how many were truncated and dropped (``where`` names the
    source in errors)."""
    out, truncated, dropped = [], 0, 0
    for i, r in enumerate(records, 1):
        if not isinstance(r.get("prompt"), str) or not isinstance(r.get("completion"), str):
            raise CastError(f"{where}: record {i} needs string 'prompt' and 'completion' fields (has {sorted(r)})")
        ex, cut = encode_instruction(r["prompt"], r["completion"], tokenizer, seq_len)
        truncated += cut and ex is not None
        dropped += ex is None
        if ex is not None:
            out.append(ex)
    return out, truncated, dropped


def load_causal(cfg, tokenizer) -> TaskData:
    """Instruction data when the records have prompt/completion, else packed plain text."""
    records = _local_records(cfg.data)
    if records and "prompt" in records[0] and "completion" in records[0]:
        records = records[: cfg.max_examples] if cfg.max_examples else records
        if cfg.eval_data:
            train_r, val_r = records, _local_records(cfg.eval_data)
            if val_r is None:
                raise CastError(f"--eval-data {cfg.eval_data}: not a {'/'.join(RECORD_SUFFIXES)} file")
        else:
            train_r, val_r = split_records(records, cfg.eval_fraction, cfg.seed)
        train, t1, d1 = instruction_examples(train_r, tokenizer, cfg.seq_len, cfg.data)
        val, t2, d2 = instruction_examples(val_r, tokenizer, cfg.seq_len, cfg.eval_data or cfg.data)
        if not train:
            raise CastError(f"--data {cfg.data}: no prompt fits in --seq-len {cfg.seq_len}; raise --seq-len")
        return TaskData("instruction", train, val, truncated=t1 + t2, dropped=d1 + d2)
    if records is not None and Path(cfg.data).suffix.lower() in (".csv", ".tsv"):
        raise CastError(f"--data {cfg.data}: causal-lm CSV data needs 'prompt' and 'completion' columns "
                        "(plain text goes in .txt or .jsonl with a 'text' field)")
    def packed(spec, val_fraction):
        # the fixed document split of cast_llm.data (by a hash of each text: the same whatever --seed), with all
        # of the validation documents held out and no test split (fine-tuning reports its validation figures)
        d = prepare(spec, tokenizer, cfg.seq_len, val_sequences=0, test_sequences=0, val_fraction=val_fraction,
                    test_fraction=0.0, min_train_sequences=cfg.batch_size, max_documents=cfg.max_examples)
        return [Example(r.tolist(), r.tolist()) for r in d.train], [Example(r.tolist(), r.tolist()) for r in d.val]

    train, val = packed(cfg.data, 0.0 if cfg.eval_data else cfg.eval_fraction)
    if cfg.eval_data:
        val = packed(cfg.eval_data, 0.0)[0]
    return TaskData("text", train, val)


# ------------------------------------------------------------------------------------------ classification
def label_names_of(values: list) -> list[str]:
    """Class names in id order: ``0..max`` for integer labels (also ``"0"``, ``"1"`` from CSV), else sorted."""
    if not values:
        return []
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, str))]
    if bad:
        raise CastError(f"labels must be integers or strings, got {bad[0]!r}")
    if all(isinstance(v, int) or re.fullmatch(r"\s*\d+\s*", v) for v in values):
        return [str(i) for i in range(max(int(v) for v in values) + 1)]
    return sorted({str(v).strip() for v in values})


def _label_id(value, names: list[str], where: str) -> int:
    key = str(int(value)) if isinstance(value, int) or re.fullmatch(r"\s*\d+\s*", str(value)) else str(value).strip()
    if key not in names:
        raise CastError(f"{where}: label {value!r} is not one of the training labels {names}")
    return names.index(key)


def _text_of(r: dict, where: str) -> str:
    for fields in PAIR_FIELDS:
        if all(isinstance(r.get(f), str) for f in fields):
            return "\n".join(r[f] for f in fields)
    raise CastError(f"{where}: needs a string 'text' (or 'text_a' and 'text_b') field; has {sorted(r)}")


def _classification_examples(records, names, tokenizer, seq_len, where) -> tuple[list[Example], int]:
    out, truncated = [], 0
    for i, r in enumerate(records, 1):
        if "label" not in r or r["label"] in (None, ""):
            raise CastError(f"{where}: record {i} has no 'label'")
        ids = tokenizer(_text_of(r, f"{where}: record {i}"), add_special_tokens=False)["input_ids"]
        if not ids:
            raise CastError(f"{where}: record {i} has an empty text")
        truncated += len(ids) > seq_len
        out.append(Example(ids[:seq_len], _label_id(r["label"], names, f"{where}: record {i}")))
    return out, truncated


def _hf_classification(name: str) -> tuple[list[dict], list[dict], list[str] | None]:
    import datasets

    ds_name, _, config = name.partition(":")
    try:
        dd = datasets.load_dataset(ds_name, config or None)
    except Exception as e:  # the hub raises many types; the user needs one line
        first = (str(e).splitlines() or [""])[0][:200]
        raise CastError(f"could not load dataset hf:{name} ({type(e).__name__}: {first}); is the hub reachable?") from None
    val_split = next((s for s in ("validation", "validation_matched", "test") if s in dd), None)
    feature = dd["train"].features.get("label")
    names = list(feature.names) if hasattr(feature, "names") else None
    return list(dd["train"]), list(dd[val_split]) if val_split else [], names


def load_classification(cfg, tokenizer) -> TaskData:
    if cfg.data.startswith("hf:"):
        train_r, val_r, names = _hf_classification(cfg.data[3:])
        val_r = [r for r in val_r if r.get("label", -1) != -1]  # GLUE test splits hide labels as -1
    else:
        train_r = _local_records(cfg.data)
        if train_r is None:
            raise CastError(f"--data {cfg.data}: classification data must be a {'/'.join(RECORD_SUFFIXES)} file "
                            "with 'text' (or 'text_a'/'text_b') and 'label', or hf:NAME[:CONFIG]")
        names, val_r = None, []
    train_r = train_r[: cfg.max_examples] if cfg.max_examples else train_r
    if cfg.eval_data:
        val_r = _local_records(cfg.eval_data)
        if val_r is None:
            raise CastError(f"--eval-data {cfg.eval_data}: not a {'/'.join(RECORD_SUFFIXES)} file")
    elif not cfg.data.startswith("hf:"):
        train_r, val_r = split_records(train_r, cfg.eval_fraction, cfg.seed)
    if not train_r:
        raise CastError(f"--data {cfg.data} holds no records")
    missing = next((i for i, r in enumerate(train_r, 1) if r.get("label") in (None, "")), None)
    if missing is not None:
        raise CastError(f"--data {cfg.data}: record {missing} has no 'label' (classification records need "
                        f"'text' or 'text_a'/'text_b', and 'label'; it has {sorted(train_r[missing - 1])})")
    names = names or label_names_of([r["label"] for r in train_r])
    if len(names) < 2:
        raise CastError(f"--data {cfg.data}: classification needs at least 2 labels, found {names}")
    train, t1 = _classification_examples(train_r, names, tokenizer, cfg.seq_len, cfg.data)
    val, t2 = _classification_examples(val_r, names, tokenizer, cfg.seq_len, cfg.eval_data or cfg.data)
    return TaskData("classification", train, val, label_names=names, truncated=t1 + t2)


def load_task_data(cfg, tokenizer) -> TaskData:
    data = load_classification(cfg, tokenizer) if cfg.task == "classification" else load_causal(cfg, tokenizer)
    if len(data.train) < cfg.batch_size:
        raise CastError(f"--data {cfg.data}: {len(data.train)} training examples, fewer than one batch "
                        f"(--batch-size {cfg.batch_size}); add data or lower --batch-size")
    if cfg.val_examples:
        data.val = data.val[: cfg.val_examples]
    return data


# ------------------------------------------------------------------------------------------------- batches
def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask`` (B, L) and ``labels`` (B, L) with -100 or (B,) class ids."""
    length = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), length), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        attn[i, : len(e.input_ids)] = 1
    if isinstance(examples[0].labels, int):
        labels = torch.tensor([e.labels for e in examples], dtype=torch.long)
    else:
        labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
        for i, e in enumerate(examples):
            labels[i, : len(e.labels)] = torch.tensor(e.labels)
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}
