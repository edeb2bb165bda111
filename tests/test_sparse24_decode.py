"""StaticDecoder (cast_llm.deploy.sparse24.decode) on CPU: the static buffers, the static KV cache and the
4-D masks give the same logits as plain decoding with a dynamic cache; the graph runner is asked to capture
once and replay every later step. (The CUDA capture itself is in tests/test_sparse24_cuda.py.)"""

from __future__ import annotations

import pytest
import tiny
import torch

from cast_llm.deploy.sparse24 import Dispatcher, to_sparse24_
from cast_llm.deploy.sparse24.decode import EagerRunner, StaticDecoder


def reference(model, ids, tokens):
    """Logits of the prompt's last position, then of each of ``tokens`` fed one by one (dynamic cache)."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        got, cache = [out.logits[:, -1]], out.past_key_values
        for i in range(tokens.shape[1]):
            out = model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True)
            got.append(out.logits[:, -1])
            cache = out.past_key_values
    return got


class CountingRunner(EagerRunner):
    def __init__(self):
        self.captures = self.replays = self.warmups = 0

    def warmup(self, fn):
        self.warmups += 1
        return super().warmup(fn)

    def capture(self, fn):
        self.captures += 1
        super().capture(fn)

    def replay(self):
        self.replays += 1
        return super().replay()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_decoder_matches_dynamic_cache_decoding(attn):
    model = tiny.model("llama", attn_implementation=attn)
    ids = torch.randint(0, tiny.VOCAB, (2, 7))
    tokens = torch.randint(0, tiny.VOCAB, (2, 5))
    ref = reference(model, ids, tokens)
    runner = CountingRunner()
    dec = StaticDecoder(model, batch_size=2, max_len=16, runner=runner)
    got = [dec.prefill(ids)] + [dec.step(tokens[:, i]).clone() for i in range(5)]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (runner.warmups, runner.captures, runner.replays) == (1, 1, 4)


def test_greedy_generate_matches_hf_generate_with_a_24_model():
    from deploy_helpers import sparse_model

    model = sparse_model("llama")
    ids = torch.randint(0, tiny.VOCAB, (1, 5))
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                  do_sample=False)[:, 5:]
    to_sparse24_(model, kernels=("emulated",), dispatch=Dispatcher(measure=lambda *a: (1.0, None), gpu="g",
                                                                     versions="v"))
    got = StaticDecoder(model, batch_size=1, max_len=12, runner="eager").generate(ids, 6)
    assert torch.equal(got, expected)


def test_misuse_is_refused():
    model = tiny.model("llama")
    dec = StaticDecoder(model, batch_size=1, max_len=10, runner="eager")
    assert dec.max_len == 16  # rounded up to a multiple of 16
    with pytest.raises(RuntimeError, match="prefill"):
        dec.step(torch.tensor([1]))
    with pytest.raises(ValueError, match="does not fit"):
        dec.prefill(torch.ones(1, 16, dtype=torch.long))
    dec.prefill(torch.ones(1, 14, dtype=torch.long))
    with pytest.raises(RuntimeError, match="one prompt"):
        dec.prefill(torch.ones(1, 2, dtype=torch.long))
    dec.step(torch.tensor([1]))
    dec.step(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="16 positions"):
        dec.step(torch.tensor([1]))
    with pytest.raises(ValueError, match="runner"):
        StaticDecoder(model, batch_size=1, max_len=8, runner="cudagraph")
