"""Helpers shared by the deployment / quantization tests: tiny 2:4 models and CLI calls."""

from __future__ import annotations

import contextlib
from pathlib import Path

import tiny
import torch
import torch.nn.functional as F


def prune24_(model):
    """Magnitude 2:4 on every target (exact +0.0 zeros); returns the model."""
    from cast_llm.prune.magnitude import magnitude_prune_
    from cast_llm.targets import find_targets

    with torch.no_grad():
        for t in find_targets(model):
            magnitude_prune_(t.weight.t() if t.transposed else t.weight, 2, 4)
    return model


def sparse_model(arch: str, dtype=torch.float32, seed: int = 0, **overrides):
    return prune24_(tiny.model(arch, seed, **overrides)).to(dtype)


def save_hf(model, path: Path) -> Path:
    model.save_pretrained(path)
    tiny.tokenizer().save_pretrained(path)
    return path


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (so -0.0 != +0.0, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def state_dicts_bitwise_equal(m1, m2) -> list[str]:
    """Names of tensors that differ bitwise between two models (empty = identical)."""
    s1, s2 = m1.state_dict(), m2.state_dict()
    diff = [k for k in s1 if k not in s2 or not bitwise_equal(s1[k], s2[k])]
    return diff + [k for k in s2 if k not in s1]


def cli(*argv: str) -> int:
    from cast_llm.cli import main

    return main([str(a) for a in argv])


def one_line_error(capsys) -> str:
    """The CLI's error line (progress bars of transformers on stderr are ignored); exactly one."""
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("cast-llm")]
    assert len(err) == 1, err
    return err[0]


@contextlib.contextmanager
def fp32_accumulated(model):
    """Every target GEMM accumulated in fp32 and rounded once: the noise-floor variant of the dense model."""
    from cast_llm.targets import find_targets

    def forward_of(m):
        return lambda x: F.linear(x.float(), m.weight.float(), None if m.bias is None else m.bias.float()).to(x.dtype)

    targets = find_targets(model)
    for t in targets:
        t.module.forward = forward_of(t.module)
    try:
        yield
    finally:
        for t in targets:
            del t.module.forward


@torch.inference_mode()
def prefill_and_decode(model, ids, tokens):
    out = model(ids, use_cache=True)
    pre, cache, dec = out.logits.float(), out.past_key_values, []
    for i in range(tokens.shape[1]):
        out = model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        dec.append(out.logits[:, -1].float())
    return pre, torch.stack(dec, 1)
