"""Group-wise asymmetric integer quantization (method.md §7): known answers, exact zeros, group tails."""

from __future__ import annotations

import pytest
import torch
from deploy_helpers import sparse_model

from cast_llm.quant.rtn import QuantizedWeight, fake_quantize, num_groups, quant_params, rtn_quantize_
from cast_llm.sparsity.mask import nm_mask
from cast_llm.targets import find_targets


def _w24(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    return w.masked_fill(~nm_mask(w, 2, 4), 0)


def test_known_answer_two_bits():
    w = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    qw = QuantizedWeight.from_float(w, bits=2, group_size=4, mask=torch.ones_like(w, dtype=torch.bool))
    # lo = -1, hi = 2, s = 3/3 = 1, z = round(1) = 1; q = round(w) + 1 = [0, 1, 1 (0.5 rounds to even 0), 3]
    assert qw.scale.item() == 1.0 and qw.zero.item() == 1
    assert qw.codes.tolist() == [[0, 1, 1, 3]]
    assert qw.dequantize().tolist() == [[-1.0, 0.0, 0.0, 2.0]]


@pytest.mark.parametrize("bits", [4, 3])
def test_every_zero_stays_exactly_zero_and_codes_are_the_zero_point(bits):
    w = _w24(48, 256)
    qw = QuantizedWeight.from_float(w, bits, 128)
    deq = qw.dequantize()
    zero = w == 0
    assert torch.equal(deq[zero], torch.zeros(int(zero.sum())))
    assert not torch.signbit(deq[zero]).any()  # +0.0, not -0.0
    z_per_col = qw.zero.repeat_interleave(128, dim=1)
    assert torch.equal(qw.codes[zero], z_per_col[zero])
    assert int(qw.codes.max()) < 2**bits and qw.zero.dtype == torch.uint8


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_error_is_at_most_half_a_step_and_zero_point_is_an_in_range_integer(bits):
    w = _w24(16, 256, seed=1) * 3
    scale, zero = quant_params(w, bits, 64, w != 0)
    assert scale.dtype == torch.float16 and zero.dtype == torch.uint8
    assert int(zero.max()) <= 2**bits - 1
    deq = fake_quantize(w, bits, 64)
    step = scale.float().repeat_interleave(64, dim=1)
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())


def test_tail_group_is_quantized_on_its_own():
    w = _w24(8, 576)  # SmolLM2's width: 4 groups of 128 + a tail of 64
    qw = QuantizedWeight.from_float(w, 4, 128)
    assert qw.scale.shape == (8, num_groups(576, 128)) == (8, 5)
    tail = QuantizedWeight.from_float(w[:, 512:], 4, 128)
    assert torch.equal(qw.dequantize()[:, 512:], tail.dequantize())
    assert torch.equal(qw.dequantize()[:, :512], QuantizedWeight.from_float(w[:, :512], 4, 128).dequantize())


def test_pruned_zeros_do_not_widen_the_range_of_kept_values():
    # kept values all positive: the range is [0, max] either way (0 is always on the grid),
    # and an all-pruned group quantizes to zeros
    w = torch.tensor([[0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    qw = QuantizedWeight.from_float(w, 2, 4)
    assert qw.dequantize().tolist() == [[0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0]]
    assert qw.zero.tolist() == [[0, 0]]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_rtn_over_model_targets_quantizes_along_the_input_dim(arch):
    model = sparse_model(arch)
    targets = find_targets(model)
    before = {t.fqn: t.weight.detach().clone() for t in targets}
    out = rtn_quantize_(targets, bits=4, group_size=32)
    for t in targets:
        w = before[t.fqn].t() if t.transposed else before[t.fqn]  # (out, in)
        expected = fake_quantize(w, 4, 32)
        got = t.weight.detach().t() if t.transposed else t.weight.detach()
        assert torch.equal(got, expected)
        assert out[t.fqn].shape == tuple(w.shape)
        assert torch.equal(got == 0, w == 0) or bool((got[w == 0] == 0).all())
