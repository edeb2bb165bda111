"""Perplexity exactly as method.md §7: one text, tokenised once, cut into non-overlapping windows.

ppl = exp(mean token NLL) over every predicted token of every full window (the first token of a window has
no context and is not scored; the remainder shorter than one window is dropped). The window length is part
of the result and is always reported.

WikiText-2 (the raw v1 test split) travels with the package (``resources/wikitext2/``, CC BY-SA 3.0). Where
it is read from is resolved by :func:`wikitext2_source`: an explicit file, else ``$CAST_WIKITEXT2``, else
the packaged copy; nothing else is looked at (no parent folder of the install, no dataset hub).
"""

from __future__ import annotations

import gzip
import hashlib
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from cast_llm.errors import CastError
from cast_llm.io import atomic_write_bytes, cache_dir
from cast_llm.models import check_seq_len

# WikiText-2 raw v1 test rows joined with "\n\n", shipped as package data (resources/wikitext2/README.md
# has its provenance and licence). The sha256 is of the uncompressed UTF-8 text.
WIKITEXT2_ENV = "CAST_WIKITEXT2"
WIKITEXT2_SHA256 = "696cca6b65a171b0a358a4be6732cdfdf2dd6164a32e20fd70e3c13fc4dfae83"
WIKITEXT2_RESOURCE = "resources/wikitext2/test.txt.gz"  # relative to the cast_llm package
WIKITEXT2_ORDER = (f"an explicit file, else ${WIKITEXT2_ENV}, else the copy packaged with cast-llm "
                   "(WikiText-2 raw v1 test split, CC BY-SA 3.0)")


@dataclass(frozen=True)
class TextSource:
    """Where an evaluation text is read from, and how to say so to a person."""

    path: Path  # a readable UTF-8 file
    origin: str  # "file" (given explicitly) | "env" ($CAST_WIKITEXT2) | "packaged"
    description: str  # "PATH", "$CAST_WIKITEXT2=PATH" or "packaged copy (sha256 696cca6b65a1…)"

    def read_text(self) -> str:
        return self.path.read_text(encoding="utf-8")

    def __str__(self) -> str:
        return self.description


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _packaged_wikitext2_bytes() -> bytes:
    """The uncompressed packaged text, checked against WIKITEXT2_SHA256."""
    res = resources.files("cast_llm").joinpath(WIKITEXT2_RESOURCE)
    try:
        data = gzip.decompress(res.read_bytes())
    except (OSError, EOFError) as e:
        raise CastError(f"the WikiText-2 copy packaged with cast-llm ({WIKITEXT2_RESOURCE}) is missing or "
                        f"unreadable ({type(e).__name__}): reinstall cast-llm, or set {WIKITEXT2_ENV} to the "
                        "WikiText-2 raw test file") from None
    if _sha256(data) != WIKITEXT2_SHA256:
        raise CastError(f"the WikiText-2 copy packaged with cast-llm ({WIKITEXT2_RESOURCE}) has sha256 "
                        f"{_sha256(data)[:12]}…, not {WIKITEXT2_SHA256[:12]}…: reinstall cast-llm, or set "
                        f"{WIKITEXT2_ENV} to the WikiText-2 raw test file")
    return data


def packaged_wikitext2_file() -> Path:
    """The packaged WikiText-2 text as a plain file: decompressed once into the cast-llm cache folder
    (:func:`cast_llm.io.cache_dir`, i.e. ``$CAST_LLM_CACHE``, ``$XDG_CACHE_HOME/cast-llm`` or
    ``~/.cache/cast-llm``), written atomically, and re-checked against WIKITEXT2_SHA256 on every call (a
    damaged cache file is rewritten). A cache that cannot be written falls back to the temporary folder."""
    name = f"wikitext2-test-{WIKITEXT2_SHA256[:16]}.txt"
    folders = [cache_dir() / "data", Path(tempfile.gettempdir()) / f"cast-llm-{os.getuid() if hasattr(os, 'getuid') else 0}"]
    for folder in folders:
        cached = folder / name
        try:
            if cached.is_file() and _sha256(cached.read_bytes()) == WIKITEXT2_SHA256:
                return cached
        except OSError:
            pass
    data = _packaged_wikitext2_bytes()
    errors = []
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return atomic_write_bytes(folder / name, data)
        except OSError as e:
            errors.append(f"{folder}: {e.strerror or e}")
    raise CastError(f"cannot write the decompressed WikiText-2 copy ({'; '.join(errors)}): set CAST_LLM_CACHE "
                    f"to a writable folder, or set {WIKITEXT2_ENV} to the WikiText-2 raw test file")


def wikitext2_source(file: str | Path | None = None) -> TextSource:
    """Where the WikiText-2 raw test text comes from: ``file`` if given, else ``$CAST_WIKITEXT2``, else the
    packaged copy. An explicit file or ``$CAST_WIKITEXT2`` that does not exist is an error, never skipped."""
    if file is not None and str(file) != "":
        path = Path(file).expanduser()
        if not path.is_file():
            raise CastError(f"WikiText-2 file {path} does not exist: pass an existing UTF-8 text file, or leave "
                            f"it out to use ${WIKITEXT2_ENV} or the packaged copy")
        return TextSource(path, "file", str(path))
    env = os.environ.get(WIKITEXT2_ENV, "").strip()
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise CastError(f"${WIKITEXT2_ENV}={env} is not a file: point it at the WikiText-2 raw test text, or "
                            "unset it to use the copy packaged with cast-llm")
        return TextSource(path, "env", f"${WIKITEXT2_ENV}={path}")
    return TextSource(packaged_wikitext2_file(), "packaged", f"packaged copy (sha256 {WIKITEXT2_SHA256[:12]}…)")


def wikitext2_file(file: str | Path | None = None) -> Path:
    """A readable WikiText-2 raw test file, resolved as :func:`wikitext2_source` does (never None)."""
    return wikitext2_source(file).path


def wikitext2_text(file: str | Path | None = None) -> str:
    """The WikiText-2 raw test rows joined with "\\n\\n", resolved as :func:`wikitext2_source` does."""
    return wikitext2_source(file).read_text()


def describe_wikitext2(file: str | Path | None = None) -> str:
    """Where the WikiText-2 text comes from, for a person: ``PATH``, ``$CAST_WIKITEXT2=PATH`` or
    ``packaged copy (sha256 696cca6b65a1…)``."""
    return wikitext2_source(file).description


@dataclass
class PplResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    seq_len: int  # window length
    windows: int
    tokens_scored: int
    seconds: float
    text_tokens: int = 0  # tokens in the whole text (the windows scored may be the first few only)
    text_windows: int = 0  # full windows the whole text holds
    # each window's mean NLL per scored token, in the text's order: the figure on any first n windows
    # (:meth:`first`) without the model — kept out of to_dict (a run's metadata stays small)
    window_nll: tuple[float, ...] = field(default=(), repr=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "window_nll"}

    def first(self, n: int) -> float:
        """Perplexity on the first ``n`` windows scored (every window has the same number of scored tokens)."""
        return perplexity_of_windows(self.window_nll, n)

    def __str__(self) -> str:
        of = f" of {self.text_windows:,}" if self.text_windows > self.windows else ""
        return (f"ppl {self.perplexity:.3f} (window {self.seq_len}, {self.windows}{of} windows, "
                f"{self.tokens_scored:,} tokens scored)")


def tokenize_text(text: str, tokenizer) -> torch.Tensor:
    if not text.strip():
        raise CastError("the evaluation text is empty")
    # tokenised once, as one stream; the tokenizer may warn about length > model max, which is harmless here
    verbose = getattr(tokenizer, "verbose", None)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False, verbose=False)["input_ids"][0]
    if verbose is not None:
        tokenizer.verbose = verbose
    return ids


def perplexity_of_windows(window_nll, n: int) -> float:
    """Perplexity on the first ``n`` windows from their mean NLLs per scored token (a run's
    ``wikitext2_window_nll``): windows of one length score the same number of tokens, so the mean of the means
    is the mean over their tokens."""
    if not 1 <= n <= len(window_nll):
        raise ValueError(f"the first {n} windows: {len(window_nll)} were scored")
    return _exp(math.fsum(window_nll[:n]) / n)


def _exp(nll: float) -> float:
    """Perplexity from a mean NLL: inf where exp overflows a float (a diverged model), not an OverflowError."""
    return math.exp(nll) if nll < 700 else float("inf")


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, *, per_window: bool = False) -> torch.Tensor:
    """Sum of token NLLs (float64) of a batch of windows (B, L): predicts tokens 1..L-1 of each (``per_window``:
    one sum per window, shape (B,))."""
    # no KV cache: it would keep every layer's keys and values until the forward returns
    logits = model(input_ids=windows, use_cache=False).logits  # (B, L, V)
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, windows[:, 1:, None]).squeeze(-1)
    return nll.double().sum(dim=1) if per_window else nll.double().sum()


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
    check_seq_len(model, seq_len)
    available = n = ids.numel() // seq_len
    if n == 0:
        raise CastError(f"the evaluation text has {ids.numel()} tokens, fewer than one window of {seq_len}: "
                        "use a longer text or a smaller --seq-len")
    if max_windows is not None:
        if max_windows < 1:
            raise CastError(f"--max-windows must be at least 1, got {max_windows}")
        n = min(n, max_windows)
    windows = ids[: n * seq_len].view(n, seq_len)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums: list[float] = []
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n * seq_len, desc=desc, unit="tok", unit_scale=True, leave=False)
    for i in range(0, n, batch_size):
        w = windows[i : i + batch_size].to(device)
        sums.extend(window_nll(model, w, per_window=True).tolist())
        if bar is not None:
            bar.update(w.numel())
    if bar is not None:
        bar.close()
    model.train(was_training)
    scored = n * (seq_len - 1)
    nll = math.fsum(sums) / scored
    return PplResult(
        perplexity=_exp(nll),
        nll=nll,
        seq_len=seq_len,
        windows=n,
        tokens_scored=scored,
        seconds=time.perf_counter() - t0,
        text_tokens=ids.numel(),
        text_windows=available,
        window_nll=tuple(x / (seq_len - 1) for x in sums),
    )


def packed_perplexity(model, sequences: torch.Tensor, *, batch_size: int = 1, progress=False, desc="val") -> PplResult:
    """Perplexity over already-packed (N, L) sequences (the held-out slice of the training data)."""
    return perplexity(model, sequences.reshape(-1), sequences.shape[1], batch_size=batch_size, progress=progress,
                      desc=desc)
