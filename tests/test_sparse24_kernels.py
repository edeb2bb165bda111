"""2:4 kernels (cast_llm.deploy.sparse24.kernels): shape and padding rules, the emulated compressed form
against a float64 reference, and the exact call layout used with torch's cuSPARSELt op (through a fake op
that computes what the C++ op documents: ``D = A·op(B)``, written ``(n, m)`` row-major when
``transpose_result``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24 import kernels as K
from cast_llm.deploy.sparse24.kernels import GPU_KERNELS, KERNELS, padded_rows, sparse_linear
from cast_llm.deploy.sparse24.linear import check_sparse24_weight
from cast_llm.sparsity.mask import nm_mask

SMOLLM2 = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # q/o, k/v (3 kv heads x 64), gate/up, down
LLAMA7B = [(4096, 4096), (11008, 4096), (4096, 11008)]
LLAMA3_8B = [(1024, 4096), (14336, 4096), (4096, 14336)]


def w24(out_f, in_f, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g, dtype=torch.float64)
    return w.masked_fill(~nm_mask(w, 2, 4), 0).to(dtype)


@pytest.mark.parametrize("n,multiple,expected", [(1, 8, 8), (8, 8, 8), (9, 8, 16), (0, 16, 16), (2048, 16, 2048),
                                                  (17, 16, 32)])
def test_padded_rows(n, multiple, expected):
    assert padded_rows(n, multiple) == expected


def test_shape_rules_follow_torch_tables_and_accept_every_llama_and_smollm2_shape():
    for name in ("cusparselt", "cusparselt-direct"):
        k = KERNELS[name]
        for dtype in (torch.bfloat16, torch.float16):
            for out_f, in_f in SMOLLM2 + LLAMA7B + LLAMA3_8B:
                assert k.shape_error(out_f, in_f, dtype) is None, (name, out_f, in_f)
            assert "multiple of (16, 16)" in k.shape_error(200, 576, dtype)
            assert "multiple of (16, 16)" in k.shape_error(192, 8, dtype)
            assert k.row_multiple(dtype) >= 8
    cutlass = KERNELS["cutlass"]
    assert cutlass.shape_error(192, 576, torch.bfloat16) is None
    assert "(32, 64)" in cutlass.shape_error(48, 576, torch.bfloat16)
    assert "(32, 64)" in cutlass.shape_error(64, 96, torch.bfloat16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reasons given without a GPU")
def test_gpu_kernels_say_why_they_cannot_run_on_cpu():
    ok, why = K.available_kernels("cpu", torch.bfloat16)
    assert ok == [] and set(why) == {"cusparselt-direct", "cusparselt", "cutlass"}
    assert all("CUDA" in r for r in why.values())
    ok, _ = K.available_kernels("cpu", torch.float32, names=("emulated",))
    assert ok == ["emulated"]
    with pytest.raises(ValueError, match="unknown 2:4 kernel"):
        K.available_kernels("cpu", torch.float32, names=("cuspraselt",))


def test_emulated_compression_keeps_exactly_the_nonzeros_and_decompresses_exactly():
    w = w24(192, 576)
    k = KERNELS["emulated"]
    state = k.compress(w)
    assert state["values"].shape == (192, 288) and state["positions"].dtype == torch.uint8
    pos = state["positions"].reshape(192, 144, 2)
    assert int(pos.max()) <= 3 and bool((pos[..., 0] < pos[..., 1]).all())  # two distinct slots, in order
    assert torch.equal(k.decompress(state, 192, 576), w)
    # a group with fewer than 2 non-zeros (a kept weight that is exactly 0) still gets two valid slots
    w[0, :4] = torch.tensor([0.0, 0.0, 0.0, 3.0])
    assert torch.equal(k.decompress(k.compress(w), 192, 576), w)


@pytest.mark.parametrize("shape", [(192, 576), (64, 32)])
@pytest.mark.parametrize("tokens", [1, 3, 8, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_sparse_linear_pads_slices_and_adds_bias_like_f_linear(shape, tokens, with_bias):
    out_f, in_f = shape
    w = w24(out_f, in_f, torch.float64)
    bias = torch.randn(out_f, dtype=torch.float64) if with_bias else None
    x = torch.randn(2, tokens, in_f, dtype=torch.float64)
    k = KERNELS["emulated"]
    y = sparse_linear(k, x, k.compress(w), bias, out_f)
    assert y.shape == (2, tokens, out_f) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-12, atol=1e-12)


def test_sparse_linear_takes_non_contiguous_inputs_and_empty_batches():
    w = w24(64, 32, torch.float64)
    k = KERNELS["emulated"]
    state = k.compress(w)
    x = torch.randn(32, 5, dtype=torch.float64).t()  # (5, 32) with strides (1, 5)
    torch.testing.assert_close(sparse_linear(k, x, state, None, 64), F.linear(x, w))
    assert sparse_linear(k, torch.randn(0, 32, dtype=torch.float64), state, None, 64).shape == (0, 64)


def test_bf16_emulation_rounds_once_after_fp32_accumulation():
    w = w24(192, 576, torch.bfloat16)
    x = torch.randn(9, 576).to(torch.bfloat16)
    k = KERNELS["emulated"]
    y = sparse_linear(k, x, k.compress(w), None, 192)
    ref = (x.double() @ w.double().t())
    # one rounding to bf16 (8 significant bits): every entry within half an ulp of the exact product
    assert float(((y.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max()) <= 2 ** -8


def test_weight_checks_give_one_line_errors_naming_the_layer():
    emu = ("emulated",)
    assert check_sparse24_weight(w24(64, 32), "l", emu) == (["emulated"], None)
    assert "3-D" in check_sparse24_weight(torch.zeros(2, 4, 4), "l", emu)[1]
    dense = torch.randn(64, 32)
    _, err = check_sparse24_weight(dense, "model.layers.0.mlp.up_proj", emu)
    assert err.startswith("model.layers.0.mlp.up_proj: weight (64, 32) is not exactly 2:4") and "\n" not in err
    assert "not a multiple of 4" in check_sparse24_weight(torch.zeros(8, 6), "l", emu)[1]
    if not torch.cuda.is_available():
        _, err = check_sparse24_weight(w24(64, 32, torch.bfloat16), "q_proj", GPU_KERNELS)
        assert err.startswith("q_proj: no 2:4 kernel can run it") and "CUDA" in err
        # by default a CPU weight gets the CPU extension's kernels (or one line saying why none runs)
        ok, err = check_sparse24_weight(w24(64, 32, torch.bfloat16), "q_proj")
        why = cpu24.extension_reason()
        assert (ok[0] == "cpu-avx512-bf16" or ok[0].startswith("cpu-")) if why is None else why in err


class _FakeCslt:
    """Stands in for torch's cuSPARSELt ops: 'packs' by remembering the dense weight, multiplies the way
    cuSPARSELtOps.cpp does — B is read through its strides, D is (n, m) when transpose_result."""

    def __init__(self):
        self.weights, self.calls, self.searches = {}, [], 0

    def compress(self, w):
        packed = torch.empty(w.numel() * 9 // 16, dtype=w.dtype)  # the op's size: kept half + metadata
        self.weights[packed.data_ptr()] = w.clone()
        return packed

    def mm(self, packed, dense_b, bias=None, transpose_result=False, **cfg):
        self.calls.append({"b_strides": dense_b.stride(), "b_shape": tuple(dense_b.shape), "bias": bias is not None,
                           "transpose_result": transpose_result, **cfg})
        d = self.weights[packed.data_ptr()].double() @ dense_b.double()  # (m, n)
        if bias is not None:
            d = d + bias.double()[:, None]
        return (d.t().contiguous() if transpose_result else d).to(dense_b.dtype)

    def mm_search(self, packed, dense_b, bias, alpha, out_dtype, transpose_result):
        self.searches += 1
        assert transpose_result is True
        return 3, 2, 1, 10  # alg_id, split_k, split_k_mode, max_alg_id


def test_cusparselt_op_kernel_call_layout_and_search_cache(monkeypatch):
    fake = _FakeCslt()
    monkeypatch.setattr(torch, "_cslt_compress", fake.compress, raising=False)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", fake.mm, raising=False)
    monkeypatch.setattr(torch._C, "_cusparselt", type("M", (), {"mm_search": staticmethod(fake.mm_search)}),
                        raising=False)
    monkeypatch.setattr(K, "capturing", lambda: False)
    k = K.CusparseltOpKernel()
    w, bias = w24(192, 576, torch.float64), torch.randn(192, dtype=torch.float64)
    state = k.compress(w)
    rows = k.row_multiple(torch.float64)
    for tokens in (1, 5, 3):  # 1, 5 and 3 rows all pad to one row block: one search
        x = torch.randn(tokens, 576, dtype=torch.float64)
        torch.testing.assert_close(sparse_linear(k, x, state, bias, 192), F.linear(x, w, bias))
    assert fake.searches == 1
    call = fake.calls[-1]
    mode_name, _ = K._cslt_mm_kwargs()
    # x.t() as a (in, rows) view with strides (1, in): the op describes it as row-major (rows, in) + TRANSPOSE
    assert call["b_shape"] == (576, rows) and call["b_strides"] == (1, 576)
    assert call["transpose_result"] and call["bias"] and call["alg_id"] == 3 and call["split_k"] == 2
    assert call[mode_name] == 1


def test_split_k_argument_name_matches_this_torchs_schema():
    names = [a.name for a in torch.ops.aten._cslt_sparse_mm.default._schema.arguments]
    name, _ = K._cslt_mm_kwargs()
    assert name is None or name in names


def test_the_cpu_extension_builds_where_an_x86_64_compiler_and_ninja_are_here():
    """The CPU 2:4 tests skip their whole module where the extension is missing (a machine without a compiler runs
    dense, by design), so a source that no longer compiles would skip them all and the suite would pass. Where an
    x86-64 Linux machine has a C++ compiler and ninja (make install's, and CI's), the build must succeed."""
    import platform
    import shutil
    import sys

    from torch.utils.cpp_extension import is_ninja_available

    from cast_llm import kernels

    if platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        pytest.skip("the CPU 2:4 extension is built for x86-64 Linux")
    if not (shutil.which("c++") or shutil.which("g++")) or not is_ninja_available():
        pytest.skip("no C++ compiler or no ninja here: the 2:4 layers run dense, as designed")
    if kernels.mode() == kernels.REFERENCE:
        pytest.skip("the checked kernels are switched off in this run (--kernels reference)")
    assert cpu24.extension_reason() is None
