"""Perplexity exactly as method.md §7: one text, tokenised once, cut into non-overlapping windows.

ppl = exp(mean token NLL) over every predicted token of every full window (the first token of a window has
no context and is not scored; the remainder shorter than one window is dropped). The window length is part
of the result and is always reported.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cast_llm.errors import CastError

SHARED_WIKITEXT = Path("..") / "shared" / "data" / "wikitext-2-raw" / "test.txt"


@dataclass
class PplResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    seq_len: int  # window length
    windows: int
    tokens_scored: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"ppl {self.perplexity:.3f} (window {self.seq_len}, {self.windows} windows, {self.tokens_scored} tokens)"


def wikitext2_file() -> Path | None:
    """The shared WikiText-2 raw test file if present ($CAST_WIKITEXT2 overrides), else None."""
    env = os.environ.get("CAST_WIKITEXT2")
    candidates = [Path(env)] if env else []
    candidates += [SHARED_WIKITEXT, Path(__file__).resolve().parents[4] / "shared/data/wikitext-2-raw/test.txt"]
    for c in candidates:
        if c.is_file():
            return c
    return None


def wikitext2_text() -> str:
    """WikiText-2 raw test rows joined with "\\n\\n": the shared file, else through ``datasets``."""
    f = wikitext2_file()
    if f is not None:
        return f.read_text(encoding="utf-8")
    try:
        import datasets

        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    except Exception as e:
        raise CastError(
            "WikiText-2 is not available: the shared file ../shared/data/wikitext-2-raw/test.txt is absent "
            f"(set CAST_WIKITEXT2 or pass --text-file) and the hub failed ({type(e).__name__})"
        ) from None
    return "\n\n".join(rows)


def tokenize_text(text: str, tokenizer) -> torch.Tensor:
    if not text.strip():
        raise CastError("the evaluation text is empty")
    # tokenised once, as one stream; the tokenizer may warn about length > model max, which is harmless here
    verbose = getattr(tokenizer, "verbose", None)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False, verbose=False)["input_ids"][0]
    if verbose is not None:
        tokenizer.verbose = verbose
    return ids


@torch.no_grad()
def window_nll(model, windows: torch.Tensor) -> torch.Tensor:
    """Sum of token NLLs (float64) of a batch of windows (B, L): predicts tokens 1..L-1 of each."""
    logits = model(input_ids=windows).logits  # (B, L, V)
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, windows[:, 1:, None]).squeeze(-1)
    return nll.double().sum()


def perplexity(
    model,
    ids: torch.Tensor,
    seq_len: int,
    *,
    batch_size: int = 1,
    max_windows: int | None = None,
    progress: bool = False,
    desc: str = "ppl",
) -> PplResult:
    """Perplexity of ``model`` on a 1-D token stream, non-overlapping windows of ``seq_len``."""
    from cast_llm.models import check_seq_len

    check_seq_len(model, seq_len)
    n = ids.numel() // seq_len
    if n == 0:
        raise CastError(f"the evaluation text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    if max_windows is not None:
        n = min(n, max_windows)
    windows = ids[: n * seq_len].view(n, seq_len)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = 0.0
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n * seq_len, desc=desc, unit="tok", unit_scale=True, leave=False)
    for i in range(0, n, batch_size):
        w = windows[i : i + batch_size].to(device)
        total += float(window_nll(model, w))
        if bar is not None:
            bar.update(w.numel())
    if bar is not None:
        bar.close()
    model.train(was_training)
    scored = n * (seq_len - 1)
    nll = total / scored
    return PplResult(
        perplexity=math.exp(nll) if nll < 700 else float("inf"),
        nll=nll,
        seq_len=seq_len,
        windows=n,
        tokens_scored=scored,
        seconds=time.perf_counter() - t0,
    )


def packed_perplexity(model, sequences: torch.Tensor, *, batch_size: int = 1, progress=False, desc="val") -> PplResult:
    """Perplexity over already-packed (N, L) sequences (the held-out slice of the training data)."""
    return perplexity(model, sequences.reshape(-1), sequences.shape[1], batch_size=batch_size, progress=progress,
                      desc=desc)
