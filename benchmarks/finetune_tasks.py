"""Write the two small synthetic fine-tuning tasks of docs/results/finetune-smollm2.md (seeded, reproducible).

* ``sentiment-{train,val}.csv`` — binary classification of templated product reviews (``text``, ``label``
  = positive / negative). The held-out reviews use item/template combinations never seen in training.
* ``facts-{train,val}.jsonl`` — instruction data (``prompt``, ``completion``): a sentence names an animal,
  a colour and a place; the question asks for one of them and the answer is that single word. Solving it
  needs the answer format and copying the right word from the prompt; exact match is well defined.

Usage: ``python benchmarks/finetune_tasks.py [OUT_DIR]`` (default ``benchmarks/data/finetune``).
"""

from __future__ import annotations

import csv
import json
import random
import sys
from pathlib import Path

ITEMS = ["phone", "laptop", "blender", "jacket", "novel", "camera", "lamp", "backpack", "kettle", "printer",
         "chair", "headset", "watch", "tent", "bicycle", "keyboard"]
POSITIVE = ["excellent", "wonderful", "reliable", "delightful", "superb", "comfortable", "sturdy", "great"]
NEGATIVE = ["terrible", "awful", "flimsy", "useless", "disappointing", "broken", "horrible", "poor"]
TEMPLATES = ["The {item} I bought is {adj}.", "My new {item} turned out {adj}.", "Honestly, this {item} is {adj}.",
             "I found the {item} {adj} after a week.", "What a {adj} {item}!", "Overall the {item} felt {adj}."]
HELD_OUT_ITEMS = {"tent", "bicycle", "keyboard", "watch"}  # never in training sentences

ANIMALS = ["fox", "owl", "cat", "dog", "horse", "rabbit", "bear", "goat", "duck", "mouse", "wolf", "deer"]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "brown", "grey"]
PLACES = ["garden", "forest", "kitchen", "river", "barn", "meadow", "station", "library"]
QUESTIONS = {"animal": "Which animal is mentioned?", "colour": "Which colour is mentioned?",
             "place": "Which place is mentioned?"}


def sentiment(rng: random.Random) -> tuple[list[dict], list[dict]]:
    train, val = [], []
    for item in ITEMS:
        rows = val if item in HELD_OUT_ITEMS else train
        for template in TEMPLATES:
            for label, words in (("positive", POSITIVE), ("negative", NEGATIVE)):
                rows += [{"text": template.format(item=item, adj=adj), "label": label} for adj in rng.sample(words, 3)]
    rng.shuffle(train)
    rng.shuffle(val)
    return train, val[:96]


def facts(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        a, c, p = rng.choice(ANIMALS), rng.choice(COLOURS), rng.choice(PLACES)
        sentence = rng.choice([f"A {c} {a} was sleeping in the {p}.", f"In the {p}, a {a} found a {c} ball.",
                               f"The {a} walked past the {c} door of the {p}."])
        kind = rng.choice(sorted(QUESTIONS))
        answer = {"animal": a, "colour": c, "place": p}[kind]
        rows.append({"prompt": f"Sentence: {sentence}\nQuestion: {QUESTIONS[kind]}\nAnswer:",
                     "completion": f" {answer}"})
    return rows


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    train, val = sentiment(rng)
    for name, rows in (("sentiment-train.csv", train), ("sentiment-val.csv", val)):
        with (out / name).open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["text", "label"])
            w.writeheader()
            w.writerows(rows)
    rows = facts(rng, 464)
    seen = {r["prompt"] for r in rows[:400]}
    val_rows = [r for r in rows[400:] if r["prompt"] not in seen]  # held-out prompts never seen in training
    for name, part in (("facts-train.jsonl", rows[:400]), ("facts-val.jsonl", val_rows)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    print(f"wrote {out}: sentiment {len(train)} train / {len(val)} val; facts 400 train / {len(val_rows)} val")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "data" / "finetune")
