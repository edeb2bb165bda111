"""``cast-llm eval ppl``: WikiText-2 (or any text) perplexity exactly as method.md §7."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cast_llm.config import KERNEL_MODES, KERNELS_HELP

DEFAULT_SEQ_LEN = 2048  # the paper's evaluation window; shorter where the model's positions end earlier


def default_seq_len(model) -> tuple[int, str]:
    """The window used when ``--seq-len`` is not given, and a few words saying why."""
    from cast_llm.models import max_positions

    limit = max_positions(model)
    if limit is None:
        return DEFAULT_SEQ_LEN, f"the default {DEFAULT_SEQ_LEN}; the model states no maximum"
    return min(DEFAULT_SEQ_LEN, limit), f"the default: min({DEFAULT_SEQ_LEN}, the model's {limit} positions)"


def _text_source(args: argparse.Namespace):
    from cast_llm.errors import CastError
    from cast_llm.eval.ppl import TextSource, wikitext2_source

    if args.text_file:
        path = Path(args.text_file).expanduser()
        if not path.is_file():
            raise CastError(f"--text-file {path} does not exist: pass an existing UTF-8 text file, or leave it "
                            "out to evaluate WikiText-2")
        return TextSource(path, "file", str(path)), str(path)
    source = wikitext2_source()
    return source, f"WikiText-2 raw test split, {source.description}"


def run(args: argparse.Namespace) -> int:
    import torch

    from cast_llm import kernels
    from cast_llm.errors import CastError
    from cast_llm.eval.ppl import perplexity, tokenize_text
    from cast_llm.models import check_seq_len, load_model, load_tokenizer

    kernels.apply_flag(args.kernels)

    if args.batch_size < 1:
        raise CastError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_windows is not None and args.max_windows < 1:
        raise CastError(f"--max-windows must be at least 1, got {args.max_windows}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CastError("--device cuda: no CUDA GPU is available here; use --device cpu (or auto)")
    source, label = _text_source(args)  # before loading anything: a bad path fails at once
    info = sys.stderr if args.json else sys.stdout  # --json keeps stdout to the one JSON line
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=torch.float32 if device == "cpu" else torch.bfloat16, device=device)
    ids = tokenize_text(source.read_text(), tokenizer)
    if args.seq_len is None:
        seq_len, why = default_seq_len(model)
    else:
        seq_len, why = args.seq_len, "--seq-len"
    check_seq_len(model, seq_len, name=args.model)
    print(f"text: {label}: {ids.numel():,} tokens", file=info)
    windows = ids.numel() // seq_len
    scoring = f"the first {min(windows, args.max_windows)} of" if args.max_windows is not None else "all"
    print(f"window: {seq_len} tokens ({why}); scoring {scoring} {windows:,} windows", file=info, flush=True)
    res = perplexity(model, ids, seq_len, batch_size=args.batch_size, max_windows=args.max_windows,
                     progress=not args.json)
    name = "wikitext2" if source.origin != "file" else str(source.path)
    out = {"model": args.model, "text": name, "text_source": source.description,
           "seq_len_default": args.seq_len is None, **res.to_dict()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.model} on {name}: {res}")
    return 0


def register(eval_sub) -> None:
    p = eval_sub.add_parser(
        "ppl",
        help="perplexity on WikiText-2 or a text file (non-overlapping windows)",
        description="Perplexity exactly as method.md §7: the text is tokenised once and cut into "
        "non-overlapping windows; the first token of each window is not scored. The text: --text-file if "
        "given, else WikiText-2 (raw v1 test split) from $CAST_WIKITEXT2 if set, else from the copy packaged "
        "with cast-llm (CC BY-SA 3.0); nothing is downloaded.",
    )
    p.add_argument("--model", required=True,
                   help="the model: a local folder (Hugging Face, or a cast-llm export: compressed, "
                   "compressed-tensors, quantized), a .gguf file, a hub id ORG/NAME or an alias (smollm2-135m) (required)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text-file", default=None,
                     help="evaluate this UTF-8 text file (rows already joined) instead of --dataset; it comes "
                     "first in the order: --text-file, $CAST_WIKITEXT2, the packaged copy (default: none)")
    src.add_argument("--dataset", default="wikitext2", choices=["wikitext2"],
                     help="wikitext2 = the WikiText-2 raw v1 test split, read from $CAST_WIKITEXT2 if set, else "
                     "from the copy packaged with cast-llm (default: wikitext2)")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"window length L in tokens, reported with the result (default: min({DEFAULT_SEQ_LEN}, "
                   "the model's maximum positions))")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default: 1)")
    p.add_argument("--max-windows", type=int, default=None,
                   help="score only the first this many windows (default: every full window of the text)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto = cuda if a GPU is available, else cpu (default: auto)")
    p.add_argument("--kernels", default="auto", choices=list(KERNEL_MODES), help=f"{KERNELS_HELP} (default: auto)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object as the last line of stdout (the text and window lines go to "
                   "stderr)")
    p.set_defaults(func=run)
