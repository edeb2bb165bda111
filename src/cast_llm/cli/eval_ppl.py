"""``cast-llm eval ppl``: WikiText-2 (or any text) perplexity exactly as method.md §7."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    import torch

    from cast_llm.errors import CastError
    from cast_llm.eval.ppl import perplexity, tokenize_text, wikitext2_text
    from cast_llm.models import load_model, load_tokenizer

    if args.text_file:
        path = Path(args.text_file)
        if not path.is_file():
            raise CastError(f"--text-file {path} does not exist")
        text, source = path.read_text(encoding="utf-8"), str(path)
    else:
        text, source = wikitext2_text(), "wikitext2"
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=torch.float32 if device == "cpu" else torch.bfloat16, device=device)
    ids = tokenize_text(text, tokenizer)
    seq_len = args.seq_len
    res = perplexity(model, ids, seq_len, batch_size=args.batch_size, max_windows=args.max_windows,
                     progress=not args.json)
    out = {"model": args.model, "text": source, **res.to_dict()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.model} on {source}: {res}")
    return 0


def register(eval_sub) -> None:
    p = eval_sub.add_parser("ppl", help="perplexity on WikiText-2 or a text file (non-overlapping windows)")
    p.add_argument("--model", required=True, help="model folder, hub id, .gguf or alias (smollm2-135m)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text-file", default=None, help="evaluate this UTF-8 text file (rows already joined)")
    src.add_argument("--dataset", default="wikitext2", choices=["wikitext2"],
                     help="WikiText-2 raw test: the shared file if present, else through `datasets`")
    p.add_argument("--seq-len", type=int, default=2048, help="window length L (report it with the result)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
    p.add_argument("--max-windows", type=int, default=None, help="score only the first this many windows")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    p.set_defaults(func=run)
