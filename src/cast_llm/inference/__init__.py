"""Running a cast-llm model for text, dense or 2:4, on the CPU: load, plan, generate, and the measured payoff.

(A package above ``models`` and ``deploy``, beside ``train``: it loads any model folder and uses the free-core
thread choice of :mod:`cast_llm.train.threads`.)

* :func:`load_for_inference` — a model folder (``--format compressed``: loaded straight into 2:4 layers,
  no dense copy of a target; a dense Hugging Face folder or alias: loaded, and its exactly-2:4 targets
  compressed into 2:4 layers that keep no dense copy), with its tokenizer;
* :func:`plan` — the dispatcher's measured choice per layer for the token counts a generation will see
  (prefill ``batch × prompt``, decode ``batch``), before anything is timed; decisions are kept in the user's
  dispatch cache (``~/.cache/cast-llm/sparse24-dispatch-cpu.json``), so a second run measures nothing;
* :func:`generate` — ``transformers``' ``generate`` (KV cache; greedy or sampled) timed as prefill + decode;
* :func:`payoff` — what ``make run``'s last screen reports: decode tokens/s of the same exported model dense
  and 2:4 on this CPU, and the resident memory each path added (each measured in a fresh process by
  ``python -m cast_llm.inference``, so that nothing the caller allocated before is reused).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cast_llm.deploy.compressed import DTYPES, is_compressed_checkpoint, load_compressed, read_index
from cast_llm.deploy.sparse24 import (
    Dispatcher,
    plan_sparse24_,
    sparse24_layers,
    sparse24_memory,
    to_sparse24_,
)
from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24.cycles import cold_bytes
from cast_llm.deploy.sparse24.dense_cpu import use_careful_head_
from cast_llm.errors import CastError
from cast_llm.io import cache_dir
from cast_llm.machine import process_rss, release_freed_memory
from cast_llm.models import load_model, load_tokenizer
from cast_llm.targets import find_targets
from cast_llm.train.threads import setup_threads

__all__ = ["Generation", "dispatch_cache_path", "generate", "load_for_inference", "payoff", "plan"]


def dispatch_cache_path() -> Path:
    root = os.environ.get("CAST_LLM_CACHE_DIR")  # else cast-llm's cache folder ($CAST_LLM_CACHE, as the tests set)
    return (Path(root) if root else cache_dir()) / "sparse24-dispatch-cpu.json"


def _dispatcher(cache: bool):
    return Dispatcher(device="cpu", cache_path=dispatch_cache_path() if cache else None)


def load_for_inference(model: str, *, sparse24: bool = True, dtype: torch.dtype | None = None, cache: bool = True):
    """(model, tokenizer, how) — ``how`` says in words what runs (e.g. "2:4 layers: 210 of 210 targets")."""
    path = Path(model)
    if sparse24:
        # the CPU timings' cache probe holds a 2 x L3 buffer for a second: before the weights, not beside them
        cold_bytes()
    if is_compressed_checkpoint(path):
        stored = DTYPES.get(read_index(path)["dtype"], torch.float32)
        dtype = dtype or (torch.float32 if stored == torch.float16 else stored)
        m = load_compressed(path, dtype=dtype, sparse24=sparse24, dispatch=_dispatcher(cache))
    else:
        m = load_model(model, dtype=dtype or torch.bfloat16, device="cpu")
        if sparse24:
            targets = find_targets(m, n=2, m=4, skip_incompatible=True)
            to_sparse24_(m, targets=targets, dispatch=_dispatcher(cache), keep_dense=False, skip_incompatible=True)
    release_freed_memory()  # the load's transient copies (what glibc would otherwise keep resident)
    tokenizer = load_tokenizer(model)
    head = None
    if sparse24:
        head = use_careful_head_(m)
    layers = len(sparse24_layers(m))
    if not sparse24:
        how = "dense (every layer torch's F.linear)"
    elif layers:
        how = f"2:4 layers: {layers} compressed targets (CPU kernels; the rest dense)"
    else:
        why = "; ".join(getattr(m, "_sparse24_skipped", [])[:1]) or "no exactly-2:4 target, or no CPU 2:4 kernel here"
        how = f"dense: no layer could run 2:4 ({why})"
    if head:
        how += f"; {head}"
    return m.eval(), tokenizer, how


def plan(model, prompt_tokens: int, batch: int = 1) -> dict[str, dict[str, str]]:
    """Measure (or read from the cache) each 2:4 layer's kernel for this generation's token counts."""
    if not sparse24_layers(model):
        return {}
    return plan_sparse24_(model, sorted({batch, batch * prompt_tokens}), modes=("eager",))


@dataclass
class Generation:
    text: str
    new_tokens: int
    prompt_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "decode_tokens_per_s": self.decode_tokens_per_s}


@torch.inference_mode()
def generate(model, tokenizer, prompt: str | torch.Tensor, *, max_new_tokens: int = 64, sample: bool = False,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> Generation:
    """``model.generate`` with the KV cache, timed: the first new token is the prefill (the whole prompt
    through the model), the others the decode steps. Stops at ``max_new_tokens`` (no early stop at the
    end-of-sequence token, so that speeds compare equal lengths)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    ids = tokenizer(prompt, return_tensors="pt").input_ids if isinstance(prompt, str) else prompt
    if ids.shape[-1] == 0:
        raise CastError("the prompt is empty; pass some text with --prompt")
    stamps: list[float] = []

    class _Clock(LogitsProcessor):  # called once per new token, after its forward: the token's time stamp
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    kwargs = {"do_sample": sample}
    if sample:
        torch.manual_seed(seed)
        kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, pad_token_id=pad,
                         logits_processor=LogitsProcessorList([_Clock()]), **kwargs)
    new = out[0, ids.shape[-1]:]
    prefill = stamps[0] - t0 if stamps else 0.0
    decode = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return Generation(tokenizer.decode(new, skip_special_tokens=True), int(new.numel()), int(ids.shape[-1]),
                      prefill, decode)


# ------------------------------------------------------------------------------ the payoff (make run's line)
def _rss() -> int:
    """Resident bytes now, after handing freed heap pages back to the system: a load's transient copies are not
    what it keeps."""
    release_freed_memory()
    return process_rss()


def _measure(model_dir: str, path: str, tokens: int, prompt_tokens: int) -> dict:
    """In this (fresh) process: load ``model_dir`` as ``path`` (``dense`` or ``sparse24``), plan, warm up,
    generate; the resident memory it added (read after the generation, so every weight page has been touched:
    safetensors maps files lazily), the plan's time and the decode speed."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM

    setup_threads(SimpleNamespace(threads=0))  # the free cores (OMP_NUM_THREADS wins): as `cast-llm generate`

    # what both paths share comes first (the model's code, its tokenizer, the CPU extension), then the base line
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)
    tokenizer = load_tokenizer(model_dir)
    cpu24.extension_reason()
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    base = _rss()
    model, tokenizer, how = load_for_inference(model_dir, sparse24=path == "sparse24")
    t = time.perf_counter()
    plan(model, prompt_tokens)
    plan_s = time.perf_counter() - t
    generate(model, tokenizer, ids[:, :8], max_new_tokens=4)  # warm-up: first-call allocations, thread start
    g = generate(model, tokenizer, ids, max_new_tokens=tokens)
    return {"path": path, "how": how, "threads": torch.get_num_threads(), "decode_tokens_per_s": g.decode_tokens_per_s,
            "prefill_s": g.prefill_s, "resident_bytes": _rss() - base, "held_bytes": sparse24_memory(model)["total"],
            "plan_s": plan_s, "new_tokens": tokens, "prompt_tokens": prompt_tokens}


def _run_measure(model_dir, path, tokens, prompt_tokens, env, timeout) -> dict:
    cmd = [sys.executable, "-m", "cast_llm.inference", str(model_dir), path, str(tokens), str(prompt_tokens)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise CastError(f"the {path} decode measurement took over {timeout:.0f} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CastError(f"the {path} decode measurement failed: {err[:200]}")
    return json.loads(lines[-1])


def payoff(model_dir: str | Path, *, tokens: int = 32, prompt_tokens: int = 32, threads: int | None = None,
           timeout: float = 300) -> dict:
    """Dense and 2:4 decode speed and resident memory of ``model_dir``, each path measured by
    :func:`_measure` in a fresh Python process, one after the other; raises CastError on failure."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    sparse = _run_measure(model_dir, "sparse24", tokens, prompt_tokens, env, timeout)
    dense = _run_measure(model_dir, "dense", tokens, prompt_tokens, env, timeout)
    return {"model": str(model_dir), "dense": dense, "sparse24": sparse,
            "decode_ratio": sparse["decode_tokens_per_s"] / max(dense["decode_tokens_per_s"], 1e-9),
            "resident_ratio": sparse["resident_bytes"] / max(dense["resident_bytes"], 1)}
