"""--fused-head (cast_llm/distill/head.py): Eq. 13 through the LM head chunk by chunk equals the loss on full
logits (float64 reference), for KD and plain CE, tied or not, and gives the same gradients."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from cast_llm.distill import causal_kd_loss
from cast_llm.distill.head import check_fusable, fused_head_loss, head_inputs
from cast_llm.errors import CastError


def _data(dtype=torch.float64, B=3, T=7, h=16, V=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(B, T, h, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, h, generator=g, dtype=dtype) * 0.3).requires_grad_()
    t_hid = torch.randn(B, T, h, generator=g, dtype=dtype)
    t_w = torch.randn(V, h, generator=g, dtype=dtype) * 0.3
    ids = torch.randint(0, V, (B, T), generator=g)
    return hid, w, t_hid, t_w, ids


@pytest.mark.parametrize("kd", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 5, 1000])
def test_fused_head_equals_the_loss_on_full_logits_float64(kd, chunk):
    hid, w, t_hid, t_w, ids = _data()
    eta = 0.4 if kd else 0.0
    ref = causal_kd_loss(hid @ w.t(), (t_hid @ t_w.t()) if kd else None, ids, eta=eta, temperature=1.5,
                         chunk_size=None)
    ref.loss.backward()
    g_ref = hid.grad.clone(), w.grad.clone()
    hid.grad = w.grad = None
    out = fused_head_loss(hid, w, t_hid if kd else None, t_w if kd else None, ids, eta=eta, temperature=1.5,
                          chunk_size=chunk)
    (out.loss * 2.0).backward()  # the incoming gradient scales both
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.kd, ref.kd, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.ce, ref.ce, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(hid.grad, 2 * g_ref[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, 2 * g_ref[1], rtol=1e-10, atol=1e-12)


def test_fused_head_in_fp32_and_under_bf16_autocast_is_close_to_the_reference():
    hid, w, t_hid, t_w, ids = _data(B=2, T=33, h=32, V=101, seed=1)
    ref = causal_kd_loss(hid @ w.t(), t_hid @ t_w.t(), ids, eta=0.5)
    ref.loss.backward()
    g64 = hid.grad.clone(), w.grad.clone()
    h32 = hid.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    out = fused_head_loss(h32, w32, t_hid.float(), t_w.float(), ids, eta=0.5, chunk_size=16)
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h32.grad.double(), g64[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w32.grad.double(), g64[1], rtol=1e-4, atol=1e-6)
    assert w32.grad.dtype == torch.float32  # the fp32 master weight gets an fp32 gradient
    h32.grad = w32.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # logits in bf16, as the ordinary head under autocast
        out = fused_head_loss(h32, w32, t_hid.bfloat16(), t_w.bfloat16(), ids, eta=0.5, chunk_size=16)
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=3e-2, atol=0)
    assert h32.grad.dtype == torch.float32 and w32.grad.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(w32.grad.double().flatten(), g64[1].flatten(), dim=0)
    assert cos > 0.99


def test_head_inputs_makes_the_model_return_hidden_states_and_restores_the_head():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    ids = torch.randint(0, 64, (2, 5))
    full = m(input_ids=ids).logits
    with head_inputs(m):
        hidden = m(input_ids=ids).logits
    assert hidden.shape == (2, 5, 32)
    torch.testing.assert_close(hidden @ m.lm_head.weight.t(), full)
    assert torch.equal(m(input_ids=ids).logits, full)  # the head is back
    assert "forward" not in m.lm_head.__dict__ and set(m.state_dict()) == set(m.state_dict())


def test_fused_head_refuses_heads_it_cannot_reproduce():
    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {})()
            self.head = nn.Linear(4, 8, bias=True)

        def get_output_embeddings(self):
            return self.head

    with pytest.raises(CastError, match="bias-free nn.Linear"):
        check_fusable(Biased())
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    m.config.final_logit_softcapping = 30.0
    with pytest.raises(CastError, match="final_logit_softcapping"):
        check_fusable(m)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_autocast_fused_head_matches_float64():
    hid, w, t_hid, t_w, ids = _data(B=2, T=65, h=64, V=1000, seed=2)
    ref = causal_kd_loss(hid @ w.t(), t_hid @ t_w.t(), ids, eta=0.5)
    ref.loss.backward()
    h = hid.detach().float().cuda().requires_grad_()
    wc = w.detach().float().cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fused_head_loss(h, wc, t_hid.cuda().bfloat16(), t_w.cuda().bfloat16(), ids.cuda(), eta=0.5,
                              chunk_size=48)
    out.loss.backward()
    torch.testing.assert_close(out.loss.cpu().double(), ref.loss.detach(), rtol=3e-2, atol=0)
    assert h.grad.dtype == torch.float32 and wc.grad.dtype == torch.float32
    for got, want in ((h.grad, hid.grad), (wc.grad, w.grad)):
        cos = torch.nn.functional.cosine_similarity(got.double().cpu().flatten(), want.flatten(), dim=0)
        assert cos > 0.99


_PEAK = """
import resource, sys, torch
from cast_llm.distill.head import fused_head_loss
torch.set_num_threads(1)
V, h, chunk, n = 32768, 64, 1024, int(sys.argv[1])
w = (torch.randn(V, h) * 0.02).requires_grad_(True)
x = torch.randn(1, n, h, requires_grad=True)
ids = torch.randint(0, V, (1, n))
fused_head_loss(x[:, :8], w, None, None, ids[:, :8], eta=0.0, chunk_size=chunk)  # allocator paths warmed
now = int(open('/proc/self/statm').read().split()[1]) * 4096
fused_head_loss(x, w, None, None, ids, eta=0.0, chunk_size=chunk)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - now)
"""


def test_the_fused_head_holds_one_chunk_whatever_the_number_of_chunks():
    """The loss's chunk-sized tensors (logits, their gradient, work space: what the memory plan counts) are let
    go before the next chunk forms its logits: the peak above what was resident before the loss is the same for
    one chunk and for six (measured as resident memory, every block of 128 KiB or more given back on free).
    Before the fix, the previous chunk's gradient and loss outputs lived on: two more chunk × V tensors."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    peak = {n: int(subprocess.run([sys.executable, "-c", _PEAK, str(n)], capture_output=True, text=True, env=env,
                                  check=True, timeout=300).stdout.split()[-1]) for n in (1024, 6 * 1024)}
    unit = 1024 * 32768 * 4  # one chunk × V in fp32 (128 MiB)
    assert peak[1024] > 2 * unit  # the measurement sees the chunk's tensors (logits, gradient, work space)
    assert peak[6 * 1024] - peak[1024] < unit / 2, {n: p / unit for n, p in peak.items()}


def test_the_fused_heads_chunk_holds_the_rows_the_memory_plan_counts():
    """The plan (``plan/memory.py``) counts the fused head's chunk as its logits (the teacher's too with KD), their
    gradient and the loss's fp32 work space of 1 row with CE and 2 with KD (the eager path, which the suite runs:
    ``CAST_LLM_COMPILE=0``): 3 chunk × V rows, and 5 (measured at a 128k vocabulary by
    benchmarks/dev/fused_head_rows.py; the plan had counted 6 with KD and the 16k runs measured 0.83-0.87 of it).
    Measured here as resident memory after a first call, every block of 128 KiB or more given back on free."""
    import os
    import subprocess
    import sys

    from cast_llm.kernels.switch import COMPILE_ENV

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "dev" / "fused_head_rows.py"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", COMPILE_ENV: "0"}
    rows = {m: float(re.search(r"\+ ([\d.]+) rows", subprocess.run(
        [sys.executable, str(script), m, "--vocab", "32768", "--hidden", "64"], capture_output=True, text=True,
        env=env, check=True, timeout=300).stdout).group(1)) for m in ("ce", "kd")}
    assert abs(rows["ce"] - 3) < 0.3 and abs(rows["kd"] - 5) < 0.3, rows
