"""Semi-structured 2:4 weights (torch.sparse, CUDA ≥ sm80): checks on CPU, equivalence on a GPU."""

from __future__ import annotations

import pytest
import tiny
import torch
from deploy_helpers import sparse_model

from cast_llm.deploy.semi_structured import (
    _linear_from_conv1d,
    check_semi_structured_weight,
    semi_structured_unavailable_reason,
    to_semi_structured_,
)
from cast_llm.errors import CastError
from cast_llm.sparsity.mask import nm_mask

HAS_SM80 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
needs_sm80 = pytest.mark.skipif(not HAS_SM80, reason="needs a CUDA GPU with compute capability >= 8.0")


def _w24(rows, cols, dtype=torch.float16):
    w = torch.randn(rows, cols).to(dtype)
    return w.masked_fill(~nm_mask(w, 2, 4), 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when there is no CUDA")
def test_without_cuda_the_reason_is_clear_and_swapping_refuses():
    reason = semi_structured_unavailable_reason()
    assert "CUDA" in reason and "8.0" in reason
    with pytest.raises(CastError, match="compute capability >= 8.0"):
        to_semi_structured_(sparse_model("llama", torch.float16))


def test_cpu_device_is_refused_even_with_cuda_present():
    assert "CUDA" in semi_structured_unavailable_reason("cpu")


def test_weight_checks_name_the_layer():
    assert check_semi_structured_weight(_w24(32, 64), "cutlass", "l") is None
    assert check_semi_structured_weight(_w24(16, 16), "cusparselt", "l") is None
    assert "multiple of (32, 64)" in check_semi_structured_weight(_w24(32, 32), "cutlass", "l")
    assert "not exactly 2:4" in check_semi_structured_weight(torch.randn(32, 64).half(), "cutlass", "q_proj")
    assert "float64" in check_semi_structured_weight(_w24(32, 64, torch.float64), "cusparselt", "l")


def test_conv1d_becomes_an_equivalent_linear():
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(24, 16)  # nf=24 outputs, nx=16 inputs: weight (16, 24)
    torch.nn.init.normal_(conv.bias)
    lin = _linear_from_conv1d(conv)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(lin(x), conv(x))


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits.float()


@needs_sm80
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_semi_structured_model_matches_dense_on_gpu(arch, dtype):
    shape = dict(hidden_size=128, intermediate_size=256) if arch == "llama" else dict(n_embd=128)
    model = sparse_model(arch, dtype, **shape).cuda()
    ids = torch.randint(0, tiny.VOCAB, (2, 32), device="cuda")
    dense = _logits(model, ids)
    swapped = to_semi_structured_(model)
    assert len(swapped) == (14 if arch == "llama" else 8)
    sparse = _logits(model, ids)
    # bf16 has 8 bits of mantissa: kernels may accumulate in another order than the dense GEMM
    torch.testing.assert_close(sparse, dense, atol=5e-2, rtol=5e-2)


@needs_sm80
@pytest.mark.cuda
def test_compressed_checkpoint_loads_to_24_layers_on_gpu(tmp_path):
    from cast_llm.deploy.compressed import load_compressed, save_compressed
    from cast_llm.deploy.sparse24 import Sparse24Linear

    model = sparse_model("llama", torch.bfloat16, hidden_size=128, intermediate_size=256)
    save_compressed(model, tiny.tokenizer(), tmp_path / "c")
    dense = load_compressed(tmp_path / "c", device="cuda")
    sparse = load_compressed(tmp_path / "c", device="cuda", semi_structured=True)
    assert isinstance(sparse.model.layers[0].mlp.down_proj, Sparse24Linear)
    ids = torch.randint(0, tiny.VOCAB, (1, 16), device="cuda")
    torch.testing.assert_close(_logits(sparse, ids), _logits(dense, ids), atol=5e-2, rtol=5e-2)
