"""The CPU 2:4 path on this CPU (cast_llm.deploy.sparse24.cpu and its C++ extension): every instruction path that
runs here against a float64 product (every 2-of-4 pattern, odd tails, bias, 1 to 64 rows, bf16 and fp32
activations, the unpack kernel, the int8 W8 variant), the compressed form against the on-disk positions stream,
the fallback when the extension is missing, the dispatcher's choice, loading a compressed checkpoint without a
dense copy, generation and the `cast-llm generate` command, the payoff measurement and benchmarks/cpu24.py.

Bounds (max|Δ| / max|y| against float64): bf16 outputs ≤ 8e-3 (one rounding to 8 significant bits of an
fp32-accumulated result), fp32 ≤ 1e-5. Whole bf16 models: ≤ max(0.01, 3 × the noise floor), the floor being how
far the dense model moves when every target GEMM is accumulated in fp32 and rounded once (tests/test_sparse24_cuda.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import pytest
import tiny
import torch
import torch.nn.functional as F
from deploy_helpers import cli, fp32_accumulated, one_line_error, prefill_and_decode, sparse_model
from torch import nn

from cast_llm import kernels as cast_kernels
from cast_llm.deploy.nm_codec import NMSparseWeight
from cast_llm.deploy.sparse24 import Dispatcher, Sparse24Linear, sparse24_layers, timing, to_sparse24_
from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24 import dispatch as D
from cast_llm.deploy.sparse24.kernels import (
    CPU_KERNELS,
    CPU_W8_KERNELS,
    KERNELS,
    available_kernels,
    default_kernels,
    sparse_linear,
)
from cast_llm.errors import CastError

WHY = cpu24.extension_reason()
PATHS = cpu24.available_paths()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no CPU 2:4 extension here: {WHY}")

BOUND = {torch.bfloat16: 8e-3, torch.float32: 1e-5}
PATTERNS = list(itertools.combinations(range(4), 2))  # the 6 ways to keep 2 of 4
# (out, in): in % 64, % 32, % 16 != 0 and in % 8 == 4 tails, one 64-multiple, odd out counts
SHAPES = [(37, 4), (5, 12), (37, 36), (16, 64), (37, 100), (3, 136), (33, 176), (64, 1540)]
ROWS = (1, 2, 3, 4, 5, 7, 16, 33, 64, 97)  # 33: three token tiles on AMX, 97: two groups of them
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def planted(out_f: int, in_f: int, seed: int = 0, dtype=torch.float32):
    """An exactly-2:4 weight whose groups cycle through all 6 patterns (group g of row r: pattern (r + g) % 6),
    kept values of magnitude 0.5..1.5 with random signs; and the planted positions (out, in/4, 2)."""
    g = torch.Generator().manual_seed(seed)
    groups = in_f // 4
    idx = (torch.arange(out_f)[:, None] + torch.arange(groups)[None, :]) % 6
    pos = torch.tensor(PATTERNS)[idx]
    vals = (torch.rand(out_f, groups, 2, generator=g) + 0.5) * (torch.randint(0, 2, (out_f, groups, 2), generator=g) * 2 - 1)
    w = torch.zeros(out_f, groups, 4).scatter_(2, pos, vals).reshape(out_f, in_f)
    return w.to(dtype), pos


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.detach().double(), ref.detach().double()
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def ref64(x, w, b=None):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def paths_for(dtype):
    return [p for p in PATHS if dtype == torch.bfloat16 or p not in cpu24.BF16_PATHS]


def bitwise_equal(a, b):
    from deploy_helpers import bitwise_equal as eq

    return eq(a, b)


# ------------------------------------------------------------------------------------------ 1. the kernel
def test_this_cpu_runs_at_least_one_path_and_the_kernel_lists_are_consistent():
    assert PATHS and set(PATHS) <= set(cpu24.PATHS), PATHS
    assert default_kernels("cpu") == CPU_KERNELS
    ok, why = available_kernels("cpu", torch.bfloat16, CPU_KERNELS)
    assert ok == [f"cpu-{p}" for p in PATHS] + ["cpu-unpack"], (ok, why)
    ok32, why32 = available_kernels("cpu", torch.float32, CPU_KERNELS)
    for p in cpu24.BF16_PATHS:
        assert f"cpu-{p}" not in ok32 and "bf16" in why32[f"cpu-{p}"]
    w8, _ = available_kernels("cpu", torch.float32, CPU_W8_KERNELS)
    assert w8 == [f"cpu-w8-{p}" for p in PATHS if p not in cpu24.BF16_PATHS]
    assert not any(p in cpu24.NO_W8_PATHS for p in (KERNELS[n].path for n in CPU_W8_KERNELS))
    ok16, why16 = available_kernels("cpu", torch.float16, CPU_KERNELS)
    assert ok16 == [] and all("float16" in r for r in why16.values()), why16


@pytest.mark.parametrize("path,dtype", [(p, d) for d in (torch.bfloat16, torch.float32) for p in cpu24.PATHS
                                        if d == torch.bfloat16 or p not in cpu24.BF16_PATHS])
def test_every_path_matches_a_float64_product_on_every_pattern_tail_bias_and_row_count(path, dtype):
    if path not in PATHS:
        pytest.skip(f"this CPU lacks the instructions of the {path} path")
    bad = []
    for i, (out_f, in_f) in enumerate(SHAPES):
        w, pos = planted(out_f, in_f, seed=i, dtype=dtype)
        state = cpu24.compress(w)
        assert torch.equal(cpu24.unpack_positions(state["meta"], in_f // 2).reshape(out_f, in_f // 4, 2).long(), pos)
        g = torch.Generator().manual_seed(100 + i)
        bias = torch.randn(out_f, generator=g).to(dtype)
        for rows in ROWS:
            x = torch.randn(rows, in_f, generator=g).to(dtype)
            for b in (None, bias):
                y = cpu24.sparse24_mm(path, x, state, b)
                assert y.dtype == dtype and y.shape == (rows, out_f)
                err = rel(y, ref64(x, w, b))
                if not err <= BOUND[dtype]:
                    bad.append((out_f, in_f, rows, b is not None, err))
    assert not bad, f"{path} {dtype}: max|Δ|/max|y| over {BOUND[dtype]}: {bad[:5]}"


@pytest.mark.parametrize("loop", ["avx512-bf16", "avx2"])
def test_a_hwpf_path_is_its_loop_without_prefetch_the_same_sums_bit_for_bit(loop):
    """``<loop>-hwpf`` is ``<loop>`` compiled without software prefetch (a hint: no arithmetic changes), so both
    give the same bits on every value kind and token count: a twin wired to another loop or kind would not."""
    if loop not in PATHS:
        pytest.skip(f"this CPU lacks the instructions of the {loop} path")
    twin = f"{loop}-hwpf"
    assert twin in PATHS
    kinds = (torch.bfloat16,) if loop in cpu24.BF16_PATHS else (torch.bfloat16, torch.float32)
    g = torch.Generator().manual_seed(21)
    for dtype in kinds:
        w, _ = planted(37, 1540, seed=5, dtype=dtype)
        for state in (cpu24.compress(w), cpu24.quantize_values(cpu24.compress(w))):
            for rows in (1, 3, 16):
                x = torch.randn(rows, 1540, generator=g).to(dtype)
                assert torch.equal(cpu24.sparse24_mm(loop, x, state, None), cpu24.sparse24_mm(twin, x, state, None))


@pytest.mark.parametrize("loop", ["avx2", "avx2-hwpf"])
def test_the_avx2_loop_widens_bf16_activations_exactly_as_it_lays_them_out(loop):
    """The AVX2 loop lays out bf16 activations while widening them (avx2_layout_x_bf16), fp32 ones as they are
    (avx2_layout_x): widening is exact, so bf16 x gives the bits of the same values as fp32 x, rounded once to
    bf16 — whole 32-input steps and the in-order tail (1540 = 48 steps + 4), every value kind, 1-5 tokens."""
    if loop not in PATHS:
        pytest.skip(f"this CPU lacks the instructions of the {loop} path")
    g = torch.Generator().manual_seed(23)
    for dtype in (torch.bfloat16, torch.float32):
        w, _ = planted(21, 1540, seed=9, dtype=dtype)
        for state in (cpu24.compress(w), cpu24.quantize_values(cpu24.compress(w))):
            for rows in (1, 2, 5):
                x = torch.randn(rows, 1540, generator=g).bfloat16()
                got = cpu24.sparse24_mm(loop, x, state, None)
                assert got.dtype == torch.bfloat16
                assert torch.equal(got, cpu24.sparse24_mm(loop, x.float(), state, None).bfloat16())


def test_the_op_takes_the_input_as_it_comes_and_refuses_a_wrong_width():
    """``sparse24_mm`` on x of shape (..., in) gives (..., out), the 2-D result's rows (a layer calls it on its
    input with no reshape / view around it); a last dimension that is not the layer's is a one-line error, not a
    reshape into other rows."""
    if not PATHS:
        pytest.skip("no CPU 2:4 path runs here")
    path, op = PATHS[0], cpu24.load_extension().sparse24_mm
    w, _ = planted(12, 64, seed=4, dtype=torch.bfloat16)
    state = cpu24.compress(w)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    flat = cpu24.sparse24_mm(path, x.reshape(6, 64), state, None)
    for shaped in (x, x[0, 0], x[:, :0]):
        y = op(shaped, state["values"], state["meta"], None, None, cpu24.PATHS[path])
        assert y.shape == (*shaped.shape[:-1], 12)
        assert torch.equal(y.reshape(-1, 12), flat[:y.reshape(-1, 12).shape[0]])
    with pytest.raises(RuntimeError, match="values must be"):
        op(torch.zeros(1, 128).bfloat16(), state["values"], state["meta"], None, None, cpu24.PATHS[path])


@pytest.mark.parametrize("in_f", [1540, 8196], ids=["fits-L1", "past-L1"])
def test_the_gather_path_at_two_to_four_tokens_on_either_side_of_its_l1_rule(in_f):
    """avx512-bf16 takes one row a block for 2-4 tokens where their activations fit L1 (tokens × in × 2 bytes),
    four rows otherwise (sparse24_cpu.cpp, rows_per_block): both sides, bf16 and int8 values, against float64."""
    if "avx512-bf16" not in PATHS:
        pytest.skip("this CPU lacks the instructions of the avx512-bf16 path")
    w, _ = planted(9, in_f, seed=7, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(8)
    bias = torch.randn(9, generator=g).bfloat16()
    state, w8 = cpu24.compress(w), cpu24.quantize_values(cpu24.compress(w))
    w8_dense = cpu24.decompress(w8, 9, in_f)
    for rows in (2, 3, 4):
        x = torch.randn(rows, in_f, generator=g).bfloat16()
        for b in (None, bias):
            assert rel(cpu24.sparse24_mm("avx512-bf16", x, state, b), ref64(x, w, b)) <= BOUND[torch.bfloat16]
            assert rel(cpu24.sparse24_mm("avx512-bf16", x, w8, b), ref64(x, w8_dense, b)) <= BOUND[torch.bfloat16]


def test_the_k_blocked_gather_path_matches_float64_over_its_chunks_and_tail():
    """2-4 tokens whose activations take more than 3/4 of L1 go through K in chunks, one row at a time, the
    chunks' fp32 sums added (sparse24_cpu.cpp, k_chunks): many chunks, a short last chunk with the masked tail,
    bias, bf16 and int8 values, both gather paths, and rows split over two threads, against float64 (one token,
    one pass, alongside)."""
    if "avx512-bf16" not in PATHS:
        pytest.skip("this CPU lacks the instructions of the avx512-bf16 path")
    import os

    ops = cpu24.load_extension()
    l1 = os.sysconf("SC_LEVEL1_DCACHE_SIZE") if "SC_LEVEL1_DCACHE_SIZE" in os.sysconf_names else 0
    in_f = 64 * (2 * max(l1, 32 << 10) // 64 + 3) + 4  # ~2 × L1 inputs: 4 tokens are many chunks; a 4-input tail
    assert all(ops.k_chunks(m, in_f) > 2 for m in (2, 3, 4))
    assert ops.k_chunks(5, in_f) == 1  # 5 tokens and more: the four-row blocks
    assert ops.k_chunks(1, in_f) == 1  # one token: one pass (the build; -DCAST_KBLOCK1_PCT=50 cuts it, §28)
    paths = [p for p in ("avx512-bf16", "avx512-bf16-hwpf") if p in PATHS]
    w, _ = planted(40, in_f, seed=11, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(40, generator=g).bfloat16()
    state, w8 = cpu24.compress(w), cpu24.quantize_values(cpu24.compress(w))
    w8_dense = cpu24.decompress(w8, 40, in_f)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 4):
                x = torch.randn(rows, in_f, generator=g).bfloat16()
                for b, path in itertools.product((None, bias), paths):
                    got = cpu24.sparse24_mm(path, x, state, b)
                    assert got.shape == (rows, 40) and rel(got, ref64(x, w, b)) <= BOUND[torch.bfloat16]
                    got8 = cpu24.sparse24_mm(path, x, w8, b)
                    assert rel(got8, ref64(x, w8_dense, b)) <= BOUND[torch.bfloat16]
    finally:
        torch.set_num_threads(before)
    broken = {k: v.clone() for k, v in state.items()}
    broken["values"][7, -1] += 50  # the last kept value of a row: in the tail of the last chunk
    for rows, path in itertools.product((1, 4), paths):
        x = torch.randn(rows, in_f, generator=g).bfloat16()
        x[:, -4:] = 4.0  # the tail's activations large: the broken value moves its row's output by 200
        assert rel(cpu24.sparse24_mm(path, x, broken, None), ref64(x, w, None)) > BOUND[torch.bfloat16]


def test_careful_dense_gemm_matches_float64_on_tails_bias_and_row_counts():
    """The careful dense kernel (vdpbf16ps or AVX2, whichever this CPU has) is the benchmarks' honest baseline
    and the LM head's GEMV: it is checked as the 2:4 paths are, and it can fail (a changed weight breaks it)."""
    assert cpu24.dense_path() in ("avx512-bf16", "avx2")
    g = torch.Generator().manual_seed(7)
    bad = []
    for out_f, in_f in ((1, 8), (7, 100), (33, 512), (129, 520)):
        w = torch.randn(out_f, in_f, generator=g).bfloat16()
        bias = torch.randn(out_f, generator=g).bfloat16()
        for rows in ROWS:
            x = torch.randn(rows, in_f, generator=g).bfloat16()
            for b in (None, bias):
                y = cpu24.dense_mm(x, w, b)
                assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
                if not (err := rel(y, ref64(x, w, b))) <= BOUND[torch.bfloat16]:
                    bad.append((out_f, in_f, rows, b is not None, err))
    assert not bad, f"dense_mm ({cpu24.dense_path()}): max|Δ|/max|y| over the bound: {bad[:5]}"
    x = torch.randn(3, 520, generator=g).bfloat16()
    w = torch.randn(129, 520, generator=g).bfloat16()
    y = cpu24.dense_mm(x, w)
    w2 = w.clone()
    w2[5, 517] += 64  # in the scalar tail of the AVX2 path
    assert rel(y, ref64(x, w2, None)) > BOUND[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_bound_catches_a_wrong_position(dtype):
    """The tests above can fail: one group's pattern changed in the metadata breaks the bound on every path."""
    out_f, in_f = 8, 64
    w, _ = planted(out_f, in_f, dtype=dtype)
    state = cpu24.compress(w)
    meta = state["meta"].clone()
    meta[3, 2] ^= 0b0011  # row 3, kept value 8: another position
    x = torch.randn(4, in_f).to(dtype)
    for path in paths_for(dtype):
        assert rel(cpu24.sparse24_mm(path, x, {**state, "meta": meta}, None), ref64(x, w)) > BOUND[dtype], path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_unpack_kernel_rebuilds_the_weight_bit_exactly_and_matches_float64(dtype):
    bad = []
    for i, (out_f, in_f) in enumerate(SHAPES):
        w, _ = planted(out_f, in_f, seed=i, dtype=dtype)
        state = KERNELS["cpu-unpack"].compress(w)
        buf = torch.empty(out_f, in_f, dtype=dtype)
        cpu24.load_extension().unpack24_out(buf, state["values"], state["meta"])
        assert bitwise_equal(buf, w), (out_f, in_f)
        bias = torch.randn(out_f).to(dtype)
        for rows in (1, 5, 64):
            x = torch.randn(rows, in_f).to(dtype)
            for b in (None, bias):
                y = sparse_linear(KERNELS["cpu-unpack"], x, state, b, out_f)
                if not rel(y, ref64(x, w, b)) <= BOUND[dtype]:
                    bad.append((out_f, in_f, rows, b is not None, rel(y, ref64(x, w, b))))
    assert not bad, bad[:5]
    assert cpu24.scratch_bytes() >= max(o * i for o, i in SHAPES) * (2 if dtype == torch.bfloat16 else 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", CPU_W8_KERNELS)
def test_w8_kernels_match_their_dequantized_weight(name, dtype):
    if KERNELS[name].path not in PATHS:
        pytest.skip(f"{name}: this CPU lacks the instructions")
    if KERNELS[name].path in cpu24.BF16_PATHS and dtype != torch.bfloat16:
        assert KERNELS[name].unavailable_reason("cpu", dtype)  # bf16 activations only: refused, not wrong
        return
    bad = []
    for i, (out_f, in_f) in enumerate(SHAPES):
        w, _ = planted(out_f, in_f, seed=i, dtype=dtype)
        state = KERNELS[name].compress(w)
        assert state["values"].dtype == torch.int8 and state["scale"].shape == (out_f,)
        deq = KERNELS[name].decompress(state, out_f, in_f)
        # symmetric round to nearest: every weight within half a step of its row's scale, zeros stay zeros
        assert bool(((deq - w.float()).abs() <= state["scale"][:, None] * 0.5 + 1e-7).all())
        assert bool((deq[w == 0] == 0).all())
        bias = torch.randn(out_f).to(dtype)
        for rows in ROWS:
            x = torch.randn(rows, in_f).to(dtype)
            for b in (None, bias):
                y = sparse_linear(KERNELS[name], x, state, b, out_f)
                assert y.dtype == dtype
                if not rel(y, ref64(x, deq, b)) <= BOUND[dtype]:
                    bad.append((out_f, in_f, rows, b is not None, rel(y, ref64(x, deq, b))))
    assert not bad, f"{name} {dtype}: {bad[:5]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compress_decompress_round_trip_is_bit_exact_with_sparser_groups(dtype):
    for i, (out_f, in_f) in enumerate(SHAPES):
        w, pos = planted(out_f, in_f, seed=i, dtype=dtype)
        w = w.clone()
        w[0, :4] = torch.tensor([0.0, 0.0, 0.0, -2.0])  # a group with one non-zero
        w[-1, -4:] = 0  # and one with none
        state = cpu24.compress(w)
        assert state["values"].shape == (out_f, in_f // 2) and state["values"].dtype == dtype
        assert state["meta"].shape == (out_f, math.ceil(in_f / 8)) and state["meta"].dtype == torch.uint8
        p = cpu24.unpack_positions(state["meta"], in_f // 2).reshape(out_f, in_f // 4, 2)
        assert bool((p[..., 0] < p[..., 1]).all())  # two distinct slots, in order, even for sparser groups
        assert bitwise_equal(cpu24.decompress(state, out_f, in_f), w), (out_f, in_f)
        if in_f % 8 == 4:  # the unused half byte of a row's metadata is zero
            assert bool((state["meta"][:, -1] >> 4 == 0).all())


def test_pack_and_unpack_positions_are_inverse():
    g = torch.Generator().manual_seed(0)
    for kept in (2, 4, 6, 8, 18, 32, 50, 770):
        pos = torch.randint(0, 4, (7, kept), generator=g, dtype=torch.uint8)
        meta = cpu24.pack_positions(pos)
        assert meta.shape == (7, math.ceil(kept / 4)) and meta.dtype == torch.uint8
        assert torch.equal(cpu24.unpack_positions(meta, kept), pos)
        assert torch.equal(cpu24.pack_positions(cpu24.unpack_positions(meta, kept)), meta)
    # value j of a row at bits 2j..2j+1 of its little-endian bit string
    assert cpu24.pack_positions(torch.tensor([[1, 2, 3, 0, 3]], dtype=torch.uint8)).tolist() == [[0b00111001, 0b11]]


def test_meta_is_the_on_disk_positions_stream_of_the_index_encoding():
    for i, (out_f, in_f) in enumerate(SHAPES):
        w, _ = planted(out_f, in_f, seed=i)
        state = cpu24.compress(w)
        packed = NMSparseWeight.from_dense(w, 2, 4, encoding="index")
        assert torch.equal(packed.values, state["values"])
        if in_f % 8 == 0:  # row after row, whole bytes: the same bytes
            assert torch.equal(packed.positions.view(out_f, in_f // 8), state["meta"]), (out_f, in_f)
        # what load_compressed does for other rows: repack the codes
        codes = packed.positions_tensor().reshape(out_f, in_f // 2).to(torch.uint8)
        assert torch.equal(cpu24.pack_positions(codes), state["meta"]), (out_f, in_f)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_sparse24_linear_on_each_cpu_kernel_takes_3d_strided_and_empty_inputs(dtype):
    lin = nn.Linear(100, 37, dtype=dtype)
    w, _ = planted(37, 100, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.normal_()
    lin.requires_grad_(False)
    names, _ = available_kernels("cpu", dtype, CPU_KERNELS + CPU_W8_KERNELS)
    for name in names:
        layer = Sparse24Linear.from_linear(lin, kernels=(name,))
        assert layer.dense_weight is None and layer.kernel_for(3) == name
        wref = layer.dense().double() if KERNELS[name].w8 else w
        x = torch.randn(2, 3, 100).to(dtype)
        assert rel(layer(x), ref64(x, wref, lin.bias)) <= BOUND[dtype], name
        xt = torch.randn(100, 5).to(dtype).t()  # non-contiguous rows
        assert rel(layer(xt), ref64(xt, wref, lin.bias)) <= BOUND[dtype], name
        assert layer(torch.randn(0, 100).to(dtype)).shape == (0, 37)


def test_a_cpu_layers_compressed_tensors_lie_on_huge_pages_where_the_os_allows_and_the_switch_turns_it_off(
        monkeypatch, tmp_path):
    t = torch.randn(1024, 640)  # 2.5 MB: one whole 2 MB chunk and a tail
    h = cpu24.on_huge_pages(t)
    assert torch.equal(h, t) and h.shape == t.shape and h.dtype == t.dtype
    if cpu24.huge_pages_reason() is None:
        assert h.data_ptr() % cpu24.HUGE_PAGE == 0 and h.data_ptr() != t.data_ptr()
        t.add_(1)
        assert not torch.equal(h, t)  # a copy, not a view of the source
    else:
        assert h is t
    small = torch.randn(8, 8)
    assert cpu24.on_huge_pages(small) is small
    # a layer: its values (>= 2 MB) moved, its output the same as with the switch off
    in_f, out_f = 4096, 512  # bf16 values 512 x 2048 x 2 B = 2 MB
    w, _ = planted(out_f, in_f, dtype=torch.bfloat16)
    lin = nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin.requires_grad_(False)
    name = next(iter(available_kernels("cpu", torch.bfloat16, CPU_KERNELS)[0]))
    x = torch.randn(3, in_f).bfloat16()
    on = Sparse24Linear.from_linear(lin, kernels=(name,))
    values = next(iter(on.states.values()))["values"]
    assert (values.data_ptr() % cpu24.HUGE_PAGE == 0) == (cpu24.huge_pages_reason() is None)
    monkeypatch.setenv("CAST_LLM_HUGE_PAGES", "0")
    assert cpu24.huge_pages_reason() == "CAST_LLM_HUGE_PAGES=0" and cpu24.on_huge_pages(t) is t
    off = Sparse24Linear.from_linear(lin, kernels=(name,))
    assert torch.equal(on(x), off(x))
    monkeypatch.delenv("CAST_LLM_HUGE_PAGES")
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(cpu24, "THP_ENABLED", never)
    assert "never" in cpu24.huge_pages_reason() and cpu24.on_huge_pages(t) is t
    monkeypatch.setattr(cpu24, "THP_ENABLED", tmp_path / "missing")
    assert "cannot be read" in cpu24.huge_pages_reason()


# ------------------------------------------------------------------------------- 2. without the extension
@contextlib.contextmanager
def extension_missing(monkeypatch, how: str, tmp_path: Path):
    """The extension as a machine without it sees it: a fresh load state that fails (the cached state of this
    process is put back afterwards by monkeypatch)."""
    with monkeypatch.context() as mp:
        mp.setattr(cpu24, "_STATE", {})
        if how == "source":
            mp.setattr(cpu24, "SOURCE", tmp_path / "missing" / "sparse24_cpu.cpp")
        else:  # a cache folder that cannot be made (below a file)
            blocker = tmp_path / "a-file"
            blocker.write_text("")
            mp.setenv("CAST_LLM_EXTENSIONS_DIR", str(blocker / "extensions"))
        yield


@pytest.mark.parametrize("how", ["source", "cache"])
def test_without_the_extension_every_kernel_says_why_in_one_line(monkeypatch, tmp_path, how):
    with extension_missing(monkeypatch, how, tmp_path):
        why = cpu24.extension_reason()
        assert why and "\n" not in why and "could not be built or loaded" in why, why
        assert cpu24.available_paths() == []
        assert cpu24.extension_reason() == why  # cached: no second attempt
        ok, reasons = available_kernels("cpu", torch.bfloat16, CPU_KERNELS)
        assert ok == [] and set(reasons) == set(CPU_KERNELS)
        assert all(r == why for r in reasons.values()), reasons
        with pytest.raises(RuntimeError, match="could not be built"):
            cpu24.load_extension()
    assert cpu24.extension_reason() is None  # this process's state is back


@pytest.mark.parametrize("how", ["source", "cache"])
def test_without_the_extension_to_sparse24_leaves_the_layers_dense(monkeypatch, tmp_path, how):
    model = sparse_model("llama", dtype=torch.bfloat16)
    ids = torch.randint(0, tiny.VOCAB, (1, 9))
    with torch.no_grad():
        ref = model(ids).logits
    with extension_missing(monkeypatch, how, tmp_path):
        assert to_sparse24_(model, skip_incompatible=True) == []
        assert sparse24_layers(model) == [] and len(model._sparse24_skipped) == 14
        assert all("could not be built or loaded" in p for p in model._sparse24_skipped)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref)


def test_without_the_extension_load_compressed_says_one_line_and_loads_dense(monkeypatch, tmp_path, ckpts, capsys):
    from cast_llm.deploy.compressed import load_compressed

    dense = load_compressed(ckpts["bf16"])
    ids = torch.randint(0, tiny.VOCAB, (1, 9))
    capsys.readouterr()
    with extension_missing(monkeypatch, "source", tmp_path):
        model = load_compressed(ckpts["bf16"], sparse24=True)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("cast-llm: no CPU 2:4 kernel runs here") and "loads dense" in err[0], err
    assert sparse24_layers(model) == []
    with torch.no_grad():
        assert torch.equal(model(ids).logits, dense(ids).logits)


@pytest.mark.parametrize("how", ["env", "set_mode"])
def test_reference_mode_never_loads_the_extension(monkeypatch, how):
    monkeypatch.setenv(cast_kernels.MODE_ENV, "reference" if how == "env" else "auto")  # restored after the test
    if how == "set_mode":
        cast_kernels.set_mode("reference")
    why = cpu24.extension_reason()
    assert why is not None and "reference" in why
    assert cpu24.available_paths() == []
    ok, reasons = available_kernels("cpu", torch.bfloat16, CPU_KERNELS)
    assert ok == [] and all("reference" in r for r in reasons.values())
    cast_kernels.set_mode("auto")
    assert cpu24.extension_reason() is None


# ------------------------------------------------------------------------------------ 3. the dispatcher
class FakeTimes:
    """Seconds per (kernel, tokens): given as a table; counts what was measured."""

    def __init__(self, table):
        self.table, self.asked = table, []

    def __call__(self, kernel, out_f, in_f, dtype, tokens, mode):
        self.asked.append((kernel, tokens))
        return self.table(kernel, tokens), None


def bf16_linear(in_f=64, out_f=48):
    lin = nn.Linear(in_f, out_f, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(planted(out_f, in_f, dtype=torch.bfloat16)[0])
    return lin


def test_dispatch_picks_the_fastest_and_never_a_slower_kernel_than_dense():
    best = f"cpu-{PATHS[-1]}"  # the fastest here: not the first candidate, so the choice is the timer's

    def table(kernel, tokens):
        if kernel == "dense":
            return 1.0
        if tokens <= 4:
            return 0.3 if kernel == best else 0.6  # every 2:4 kernel faster than dense: the fastest wins
        if tokens <= 16:
            return 0.99  # faster, but by less than min_speedup (1.02): dense
        return 1.5  # slower: dense

    fake = FakeTimes(table)
    lin = bf16_linear()
    layer = Sparse24Linear.from_linear(lin, dispatcher=Dispatcher(measure=fake, device="cpu"))
    assert layer.dense_weight is not None and "cpu-unpack" in layer.kernels
    assert "cpu-unpack" not in layer.candidates() and layer.candidates()[0] == "dense"
    assert {k for k, _ in fake.asked} == set()
    x = {t: torch.randn(t, 64).bfloat16() for t in (1, 3, 16, 64)}
    assert layer.kernel_for(1) == best and layer.kernel_for(3) == best
    assert layer.kernel_for(16) == "dense" and layer.kernel_for(64) == "dense"
    assert "cpu-unpack" not in {k for k, _ in fake.asked}
    careful = {"dense-careful"} if cpu24.dense_path() else set()
    assert {k for k, _ in fake.asked} == {"dense", *careful, *(f"cpu-{p}" for p in PATHS)}
    ref = {t: ref64(v, lin.weight, lin.bias) for t, v in x.items()}
    with torch.no_grad():
        assert bitwise_equal(layer(x[3]), cpu24.sparse24_mm(PATHS[-1], x[3], layer.states["cpu24"], lin.bias))
        assert bitwise_equal(layer(x[64]), F.linear(x[64], lin.weight, lin.bias))
        assert all(rel(layer(v), ref[t]) <= BOUND[torch.bfloat16] for t, v in x.items())


def test_a_plan_that_slows_the_whole_model_is_put_back_on_dense_for_that_count():
    """plan_sparse24_(forward=...): a prefill count whose plan puts layers holding their dense weight on a 2:4
    kernel is timed on the whole model against the same layers dense; where the model is not faster with the plan
    in all pairs but one in five, those layers run dense at that count (the decode count is not checked), and
    release_ keeps what the corrected plan uses."""
    from cast_llm.deploy.sparse24 import plan_sparse24_

    def table(kernel, tokens):  # every layer: the fastest 2:4 path by its own timing, at 1 and at 64 tokens
        return 1.0 if kernel in ("dense", "dense-careful") else 0.3

    best = None
    for plan_faster in (False, True):
        dispatcher = Dispatcher(measure=FakeTimes(table), device="cpu")
        model = nn.Sequential(*(Sparse24Linear.from_linear(lin, dispatcher=dispatcher, name=name)
                                for name, lin in (("0", bf16_linear()), ("1", bf16_linear(48, 64)))))
        layers = list(model)
        assert len(layers) == 2
        flushes = []

        def forward(n, layers=layers, model=model, plan_faster=plan_faster):  # slower (or faster) with the plan
            on_dense = all(m.kernel_for(n) == "dense" for m in layers)
            time.sleep(0.004 if on_dense == plan_faster else 0.001)
            return model[1](torch.relu(model[0](torch.randn(n, 64).bfloat16())))

        checks = []
        plan = plan_sparse24_(model, [1, 64], release=True, forward=forward, flush=lambda f=flushes: f.append(1),
                              checks=checks)
        best = plan["0"]["eager:1"]
        assert best.startswith("cpu-") and all(p["eager:1"] == best for p in plan.values())  # decode: unchecked
        assert len(checks) == 1 and checks[0]["tokens"] == 64 and checks[0]["layers"] == 2
        assert len(checks[0]["ratios"]) == 5 and len(flushes) == 12  # two first runs, then five pairs
        assert checks[0]["reverted"] is (not plan_faster)
        at64 = best if plan_faster else "dense"
        assert all(p["eager:64"] == at64 for p in plan.values())
        assert all(m.kernel_for(64) == at64 for m in layers)
        with torch.no_grad():
            x = torch.randn(64, 64).bfloat16()
            y = model[1](torch.relu(model[0](x)))  # runs on what the check left, the forms it needs kept
            if not plan_faster:
                ref = model[1].to_linear()(torch.relu(model[0].to_linear()(x)))
                assert bitwise_equal(y, ref)
    with pytest.raises(CastError, match="not one of its kernels"):
        layers[0].set_choice_(64, "eager", "cusparselt")


def test_the_careful_dense_gemm_is_a_candidate_for_a_held_dense_weight_and_runs_where_fastest():
    """Where a layer holds its dense copy (bf16, CPU), the extension's careful dense GEMM is timed beside torch's
    F.linear and the 2:4 kernels; chosen (by the same margin over F.linear) it runs the held weight, and
    release_ keeps that weight. Not offered without a dense copy or for fp32 layers."""
    if cpu24.dense_path() is None:
        pytest.skip("this CPU runs no careful dense GEMM")

    def table(kernel, tokens):
        if kernel == "dense":
            return 1.0
        if kernel == "dense-careful":
            return 0.5 if tokens >= 8 else 0.95  # 0.95: faster than F.linear, by less than the CPU margin
        return 0.4 if tokens == 1 else 2.0

    lin = bf16_linear()
    layer = Sparse24Linear.from_linear(lin, dispatcher=Dispatcher(measure=FakeTimes(table), device="cpu"))
    assert layer.candidates()[:2] == ["dense", "dense-careful"]
    assert layer.kernel_for(1).startswith("cpu-") and layer.kernel_for(4) == "dense"
    assert layer.kernel_for(16) == "dense-careful"
    x = torch.randn(2, 8, 64).bfloat16()  # 16 tokens, 3-D as a model's hidden states
    with torch.no_grad():
        y = layer(x)
        assert y.shape == (2, 8, 48)
        assert bitwise_equal(y.reshape(16, 48), cpu24.dense_mm(x.reshape(16, 64), lin.weight, lin.bias))
        assert rel(y.reshape(16, 48), ref64(x.reshape(16, 64), lin.weight, lin.bias)) <= BOUND[torch.bfloat16]
    layer.release_({"dense-careful"})
    assert layer.dense_weight is not None and layer.kernels == []
    with torch.no_grad():
        assert bitwise_equal(layer(x), y)
    bare = Sparse24Linear.from_linear(lin, dispatcher=Dispatcher(measure=FakeTimes(table), device="cpu"),
                                      keep_dense=False)
    assert "dense-careful" not in bare.candidates()
    lin32 = nn.Linear(64, 48)
    with torch.no_grad():
        lin32.weight.copy_(planted(48, 64)[0])
    assert "dense-careful" not in Sparse24Linear.from_linear(
        lin32, dispatcher=Dispatcher(measure=FakeTimes(table), device="cpu")).candidates()


def test_without_a_dense_weight_unpack_is_a_candidate_and_wins_where_fastest():
    def table(kernel, tokens):
        assert kernel != "dense"
        return {"cpu-unpack": 0.2 if tokens >= 32 else 2.0}.get(kernel, 1.0)

    fake = FakeTimes(table)
    lin = bf16_linear()
    layer = Sparse24Linear.from_linear(lin, dispatcher=Dispatcher(measure=fake, device="cpu"), keep_dense=False)
    assert layer.dense_weight is None and "dense" not in layer.candidates() and "cpu-unpack" in layer.candidates()
    assert layer.kernel_for(64) == "cpu-unpack" and layer.kernel_for(1) == f"cpu-{PATHS[0]}"
    x = torch.randn(64, 64).bfloat16()
    with torch.no_grad():
        assert rel(layer(x), ref64(x, lin.weight, lin.bias)) <= BOUND[torch.bfloat16]
        assert rel(layer(x[:1]), ref64(x[:1], lin.weight, lin.bias)) <= BOUND[torch.bfloat16]


def test_the_cpu_dispatch_key_holds_the_cpu_model_and_thread_count():
    from cast_llm.machine import cpu_model

    threads = torch.get_num_threads()
    try:
        ident = D.default_identity(torch.device("cpu"))
        assert cpu_model() in ident[0] and f"x{threads} threads" in ident[0]
        assert cpu24.build_key() in ident[1] and torch.__version__ in ident[1]
        key = Dispatcher(measure=FakeTimes(lambda k, t: 1.0), device="cpu").key(64, 48, torch.bfloat16, 1, "eager")
        assert ident[0] in key and ident[1] in key
        torch.set_num_threads(threads + 1)
        assert D.default_identity(torch.device("cpu"))[0] != ident[0]  # another thread count measures anew
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", ["cpu-avx512-bf16", "dense"])
def test_one_real_measurement_on_this_cpu(kernel):
    if kernel != "dense" and "avx512-bf16" not in PATHS:
        pytest.skip("this CPU lacks AVX512-BF16")
    s, note = timing.measure_gemm(kernel, 256, 512, torch.bfloat16, 1, "eager", torch.device("cpu"))
    assert note is None and math.isfinite(s) and 0 < s < 0.1, (s, note)


def test_the_copies_timed_lie_where_the_layer_puts_its_tensors_huge_pages_for_2_4_torchs_allocator_for_dense():
    from cast_llm.deploy.sparse24.cycles import _clone, cycled_many

    t = torch.randn(1024, 640)  # 2.5 MB
    seen = []
    cycled_many([(lambda w: seen.append(w.data_ptr()), t, cpu24.on_huge_pages)], repeats=1, min_time=0)
    copies = set(seen) - {t.data_ptr()}
    assert copies and len(copies) >= 2  # distinct copies, each cycled
    on = cpu24.huge_pages_reason() is None
    assert all((p % cpu24.HUGE_PAGE == 0) == on for p in copies)
    small = torch.zeros(8)  # below 2 MB: on_huge_pages hands back its argument, the copy is still a copy
    assert _clone(small, cpu24.on_huge_pages).data_ptr() != small.data_ptr()
    # the dispatcher's cases: a CPU 2:4 kernel's state and its copies on huge pages, the dense weight not moved
    w, x = timing._cpu_inputs(512, 4096, torch.bfloat16, 1)
    _, held, place = timing._gemm_case("dense", w, x)
    assert held is w and place is None
    if "avx512-bf16" in PATHS:
        _, held, place = timing._gemm_case("cpu-avx512-bf16", w, x)
        assert place is cpu24.on_huge_pages
        assert (held["values"].data_ptr() % cpu24.HUGE_PAGE == 0) == on


def test_the_last_level_cache_size_can_be_given_and_a_bad_one_is_refused_in_one_line(monkeypatch):
    from cast_llm.deploy.sparse24 import cycles
    from cast_llm.errors import CastError

    for given, size in (("64M", 64 << 20), ("1g", 1 << 30), ("524288", 524288), ("512K", 512 << 10)):
        monkeypatch.setenv("CAST_LLM_L3_BYTES", given)
        assert cycles.l3_bytes() == size
    for bad in ("big", "0", "12X", "M"):
        monkeypatch.setenv("CAST_LLM_L3_BYTES", bad)
        with pytest.raises(CastError, match="CAST_LLM_L3_BYTES=.*unset it to read sysfs"):
            cycles.l3_bytes()
    monkeypatch.delenv("CAST_LLM_L3_BYTES")
    assert cycles.l3_bytes() >= 1 << 20  # sysfs (or the 32 MiB default)


def test_the_cache_a_cold_timing_overflows_is_given_reported_or_measured_where_sysfs_reports_a_large_one(monkeypatch):
    """``cold_bytes``: CAST_LLM_L3_BYTES wins; a reported cache up to 64 MiB is taken as is; a larger one is cut to
    the size from which this process reads at DRAM speed (a VM's sysfs may report the socket's 480 MiB)."""
    from cast_llm.deploy.sparse24 import cycles

    probe = cycles.measured_cache_bytes.__wrapped__  # (the once-a-process cache's function)

    def no_probe(limit):
        raise AssertionError("probed")

    monkeypatch.setenv("CAST_LLM_L3_BYTES", "24M")
    monkeypatch.setattr(cycles, "measured_cache_bytes", no_probe)
    assert cycles.cold_bytes() == 24 << 20
    monkeypatch.delenv("CAST_LLM_L3_BYTES")
    monkeypatch.setattr(cycles, "l3_bytes", lambda: 64 << 20)
    assert cycles.cold_bytes() == 64 << 20
    monkeypatch.setattr(cycles, "l3_bytes", lambda: 480 << 20)
    monkeypatch.setattr(cycles, "measured_cache_bytes", lambda limit: min(limit, 128 << 20))
    assert cycles.cold_bytes() == 128 << 20
    monkeypatch.setattr(cycles, "l3_bytes", lambda: 4 << 30)  # the probe's buffer (2x its limit) is capped
    assert cycles.cold_bytes() == 128 << 20
    monkeypatch.setattr(cycles, "measured_cache_bytes", lambda limit: limit)
    assert cycles.cold_bytes() == 1 << 30
    # the rule: the first doubling from 8 MiB that reads under 1.25x the read of 2 x the reported size
    def speed(cache):
        return lambda n: 10.0 if n > cache else 40.0

    assert cycles.smallest_uncached(480 << 20, speed(64 << 20)) == 128 << 20
    assert cycles.smallest_uncached(480 << 20, speed(480 << 20)) == 480 << 20  # the reported cache is real
    assert cycles.smallest_uncached(480 << 20, speed(1 << 20)) == 8 << 20
    margin = {128 << 20: 12.6, 256 << 20: 12.4}  # 1.26x and 1.24x DRAM's 10: the margin is 1.25x
    assert cycles.smallest_uncached(480 << 20, lambda n: margin.get(n, 40.0 if n < 128 << 20 else 10.0)) == 256 << 20
    # the probe itself, on this machine: a doubling of 8 MiB, at most the limit
    got = probe(16 << 20)
    assert got in (8 << 20, 16 << 20)


def test_a_round_walks_the_copies_as_a_ring_and_costs_min_time_not_a_pass(monkeypatch):
    """A large last-level cache means many copies: a round takes min_time of calls where the ring stopped, never a
    pass over every copy (a 480 MiB sysfs L3 made the dispatcher's timing of a slow candidate take minutes)."""
    from cast_llm.deploy.sparse24 import cycles

    monkeypatch.setattr(cycles, "cold_bytes", lambda: 64 << 10)
    monkeypatch.setattr(cycles, "MAX_COPIES", 512)  # the product's cap (the suite's is 16)
    held = torch.zeros(256)  # 1 KiB: 128 copies hold 2x the (pretend) cache
    ids: dict[int, int] = {}
    seen = []

    def slow(w):
        seen.append(ids.setdefault(w.data_ptr(), len(ids)))
        time.sleep(0.001)

    cycles.cycled_many([(slow, held)], repeats=4, min_time=0.005)
    assert 4 * 1 + 4 <= len(seen) < 60, len(seen)  # 4 rounds of ~5 calls (at least one each), not 4 passes of 128
    # one ring from the copy after the warm-up's two: every call a copy not called since (fewer calls than copies)
    assert seen[2:] == list(range(2, len(seen)))


def test_candidates_reading_one_tensor_share_one_ring_of_copies_and_each_call_meets_a_cold_copy(monkeypatch):
    """torch's dense GEMM and the careful kernel read one weight, the CPU 2:4 paths one compressed state: they walk
    one ring with one cursor (a key held 9 rings of 2 x 480 MiB, 5.3 GB, cpu24-notes.md §48), and every timed call
    still meets a copy that no candidate read since the ring's last pass."""
    from cast_llm.deploy.sparse24 import cycles

    monkeypatch.setattr(cycles, "cold_bytes", lambda: 8 << 10)
    monkeypatch.setattr(cycles, "MAX_COPIES", 512)
    shared, other = torch.zeros(256), torch.zeros(256)  # 1 KiB each: 16 copies hold 2x the (pretend) cache
    made = []
    real_clone = cycles._clone
    monkeypatch.setattr(cycles, "_clone", lambda held, *place: made.append(held) or real_clone(held, *place))
    ids: dict[str, dict[int, int]] = {"dense": {}, "2:4": {}}  # a copy's number in its ring, by first read
    calls: list[tuple[str, int]] = []

    def reader(name):
        ring = ids["2:4" if name == "2:4" else "dense"]
        return lambda w: calls.append((name, ring.setdefault(w.data_ptr(), len(ring))))

    cycles.cycled_many([(reader("torch"), shared), (reader("careful"), shared), (reader("2:4"), other)],
                       repeats=3, min_time=0)
    assert sum(h is shared for h in made) == 15 and sum(h is other for h in made) == 15  # one ring each, not per case
    # past each candidate's two warm-up calls, torch's and careful's calls walk the shared ring in one order from
    # copy 2 on, whichever of the two makes the call: no copy is read twice before the ring has been passed
    firsts = {"torch": 2, "careful": 2}
    walk = []
    for name, copy in calls:
        if name in firsts and firsts[name]:
            firsts[name] -= 1
        elif name in firsts:
            walk.append(copy)
    assert len(walk) >= 8 and walk == [(2 + i) % 16 for i in range(len(walk))], walk
    assert set(ids["dense"]).isdisjoint(ids["2:4"]) and len(ids["2:4"]) >= 2  # the 2:4 state's ring is its own


def test_the_cache_probe_reads_with_one_thread_and_gives_the_threads_back(monkeypatch):
    """A 2-thread read waits for a core another process holds (small reads then look slower than DRAM): the probe
    reads at one thread, the best of several passes, and leaves torch's thread count as it was."""
    from cast_llm.deploy.sparse24 import cycles

    seen = []
    monkeypatch.setattr(cycles, "smallest_uncached",
                        lambda limit, gbps, faster: seen.append((torch.get_num_threads(), gbps(8 << 20))) or limit)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cycles.measured_cache_bytes.__wrapped__(16 << 20) == 16 << 20
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen[0][0] == 1 and seen[0][1] > 0


def test_the_candidates_of_one_key_are_timed_interleaved_and_a_failing_one_is_inf():
    from cast_llm.deploy.sparse24.cycles import cycled_many

    order = []
    a, b = torch.zeros(4), torch.zeros(4)
    cycled_many([(lambda w: order.append("a"), a), (lambda w: order.append("b"), b)], repeats=3, min_time=0)
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert runs == ["a", "b"] * 4  # a's warm-up, b's, then one round of a and one of b in turn, three times
    nan_kernel = type(KERNELS["emulated"])()  # a kernel that returns NaN is wrong, not fast
    nan_kernel.name, nan_kernel.mm = "nan-test", lambda x2d, state, bias, out: torch.full(
        (x2d.shape[0], out), float("nan"), dtype=x2d.dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(KERNELS, "nan-test", nan_kernel)
        got = timing.measure_gemms(["dense", "nan-test"], 64, 128, torch.float32, 1, "eager", torch.device("cpu"))
    assert math.isinf(got["nan-test"][0]) and "wrong results" in got["nan-test"][1] and math.isfinite(got["dense"][0])
    kernels = ["dense", "dense-careful", *(f"cpu-{p}" for p in PATHS if p != "amx-bf16"), "cusparselt"]
    got = timing.measure_gemms(kernels, 256, 512, torch.bfloat16, 1, "eager", torch.device("cpu"))
    assert list(got) == kernels
    assert math.isinf(got["cusparselt"][0]) and got["cusparselt"][1]  # cannot run on a CPU: inf, with why
    for k in kernels[:-1]:
        if k == "dense" or (k == "dense-careful" and cpu24.dense_unavailable_reason() is None) or \
                k.removeprefix("cpu-") in PATHS:
            assert got[k][1] is None and 0 < got[k][0] < 0.1, (k, got[k])
    # the dispatcher's form: each candidate's seconds in every interleaved round, the median of them reported
    from cast_llm.deploy.sparse24 import cycles

    paired = ["dense", *(f"cpu-{p}" for p in PATHS if p != "amx-bf16"), "cusparselt"]
    got = timing.measure_gemms_rounds(paired, 256, 512, torch.bfloat16, 1, "eager", torch.device("cpu"))
    for k in paired[:-1]:
        sec, note, rounds = got[k]
        assert note is None and len(rounds) == cycles.REPEATS and sec == statistics.median(rounds), (k, got[k])
    assert math.isinf(got["cusparselt"][0]) and got["cusparselt"][2] is None


# ------------------------------------------------------------------ 4. a compressed checkpoint, no dense copy
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny 2:4 LLaMA with biases (random) and a down_proj of 132 inputs (% 8 == 4), tied embeddings, saved
    in --format compressed as fp32, bf16 and fp16."""
    from cast_llm.deploy.compressed import save_compressed

    model = sparse_model("llama", intermediate_size=132, attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    root = tmp_path_factory.mktemp("cpu24-ckpts")
    out = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out[label] = save_compressed(model.to(dtype), tiny.tokenizer(), root / label)
    return out


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, tiny.VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))


def loaded(path, **kw):
    from cast_llm.deploy.compressed import load_compressed

    return load_compressed(path, sparse24=True, dispatch=False, **kw)


@pytest.mark.parametrize("label", ["fp32", "bf16"])
def test_load_compressed_holds_only_values_and_positions(ckpts, ids, label):
    from cast_llm.deploy.compressed import load_compressed, read_index
    from cast_llm.deploy.sparse24 import sparse24_memory

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[label]
    index = read_index(ckpts[label])
    model = loaded(ckpts[label])
    dense = load_compressed(ckpts[label])
    layers = dict(sparse24_layers(model))
    assert set(layers) == set(index["targets"]) and len(layers) == 14
    params = dict(model.named_parameters())
    compressed = dense_bytes = 0
    for fqn, layer in layers.items():
        out_f, in_f = index["targets"][fqn]["shape"]
        assert layer.dense_weight is None and list(layer.states) == ["cpu24"]
        st = layer.states["cpu24"]
        assert set(st) == {"values", "meta"} and st["values"].dtype == dtype and st["meta"].dtype == torch.uint8
        assert st["meta"].shape == (out_f, math.ceil(in_f / 8))
        assert list(layer.parameters()) == [] and fqn + ".weight" not in params
        assert layer.bias is not None and layer.bias.dtype == dtype
        # the file's bytes are the kernel's form: equal to compressing the dense model's weight
        w = dense.get_submodule(fqn).weight
        ref = cpu24.compress(w)
        assert torch.equal(st["values"], ref["values"]) and torch.equal(st["meta"], ref["meta"]), fqn
        compressed += sum(t.numel() * t.element_size() for t in st.values())
        dense_bytes += out_f * in_f * w.element_size()
        if in_f % 8 == 0 and dtype == torch.bfloat16:
            assert sum(t.numel() * t.element_size() for t in st.values()) == out_f * in_f * 2 * 0.5625
    assert any(index["targets"][f]["shape"][1] % 8 == 4 for f in layers)  # the odd-tail shape is among them
    ratio = compressed / dense_bytes
    assert ratio <= (0.57 if dtype == torch.bfloat16 else 0.54), ratio  # 0.5625 / 0.53125 + the odd-tail rows
    assert sparse24_memory(model)["compressed"] == compressed and sparse24_memory(model)["dense_fallback"] == 0
    assert not [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, once
    with torch.no_grad():
        y, ref = model(ids).logits, dense(ids).logits
    bound = 1e-5 if dtype == torch.float32 else max(0.01, 3 * bf16_floor(dense, ids))
    assert rel(y, ref) <= bound, (rel(y, ref), bound)


def bf16_floor(dense, ids):
    with torch.no_grad():
        ref = dense(ids).logits
        with fp32_accumulated(dense):
            return rel(dense(ids).logits, ref)


def test_an_fp16_checkpoint_loads_as_fp32_exactly(ckpts, ids):
    from cast_llm.deploy.compressed import load_compressed

    model = loaded(ckpts["fp16"])
    layers = sparse24_layers(model)
    assert layers and all(layer.dtype == torch.float32 and layer.states["cpu24"]["values"].dtype == torch.float32
                          for _, layer in layers)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    dense = load_compressed(ckpts["fp16"], dtype=torch.float32)
    with torch.no_grad():
        assert rel(model(ids).logits, dense(ids).logits) <= 1e-5
    bf = loaded(ckpts["fp16"], dtype=torch.bfloat16)
    assert all(layer.dtype == torch.bfloat16 for _, layer in sparse24_layers(bf))


def test_load_compressed_with_a_dispatcher_chooses_per_token_count(ckpts, ids):
    from cast_llm.deploy.compressed import load_compressed

    fake = FakeTimes(lambda k, t: {"cpu-unpack": 0.1 if t >= 8 else 9.0}.get(k, 1.0))
    model = load_compressed(ckpts["bf16"], sparse24=True, dispatch=Dispatcher(measure=fake, device="cpu"))
    dense = load_compressed(ckpts["bf16"])
    with torch.no_grad():
        y = model(ids).logits  # 22 tokens: unpack
    assert "dense" not in {k for k, _ in fake.asked}
    _, layer = sparse24_layers(model)[0]
    assert layer.kernel_for(22) == "cpu-unpack" and layer.kernel_for(1).startswith("cpu-avx")
    assert rel(y, dense(ids).logits) <= max(0.01, 3 * bf16_floor(dense, ids))


# ---------------------------------------------------------------------------------------- 5. generation
PROMPT = "The quick brown fox"


def test_greedy_tokens_equal_the_dense_model_for_64_tokens_in_fp32(ckpts):
    from cast_llm.deploy.compressed import load_compressed
    from cast_llm.inference import generate

    tok = tiny.tokenizer()
    sparse, dense = loaded(ckpts["fp32"]), load_compressed(ckpts["fp32"])
    g_sparse = generate(sparse, tok, PROMPT, max_new_tokens=64)
    g_dense = generate(dense, tok, PROMPT, max_new_tokens=64)
    assert g_sparse.new_tokens == 64 and g_sparse.text == g_dense.text
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=tok.eos_token_id,
                  attention_mask=torch.ones_like(ids))
        assert torch.equal(sparse.generate(ids, **kw), dense.generate(ids, **kw))
    assert g_sparse.prefill_s > 0 and g_sparse.decode_tokens_per_s > 0


def test_bf16_kv_cache_decode_logits_within_the_noise_floor(ckpts, ids):
    from cast_llm.deploy.compressed import load_compressed

    sparse, dense = loaded(ckpts["bf16"]), load_compressed(ckpts["bf16"])
    tokens = torch.randint(0, tiny.VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    ref_pre, ref_dec = prefill_and_decode(dense, ids, tokens)
    with fp32_accumulated(dense):
        f_pre, f_dec = prefill_and_decode(dense, ids, tokens)
    floor = max(rel(f_pre, ref_pre), rel(f_dec, ref_dec))
    bound = max(0.01, 3 * floor)
    pre, dec = prefill_and_decode(sparse, ids, tokens)
    assert rel(pre, ref_pre) <= bound and rel(dec, ref_dec) <= bound, (rel(pre, ref_pre), rel(dec, ref_dec), floor)


def test_sampled_generation_is_reproducible_with_a_seed(ckpts):
    from cast_llm.inference import generate

    tok, model = tiny.tokenizer(), loaded(ckpts["bf16"])
    a = generate(model, tok, PROMPT, max_new_tokens=24, sample=True, seed=3)
    b = generate(model, tok, PROMPT, max_new_tokens=24, sample=True, seed=3)
    c = generate(model, tok, PROMPT, max_new_tokens=24, sample=True, seed=4)
    assert a.text == b.text and a.text != c.text and a.new_tokens == 24


@pytest.fixture
def generate_env(monkeypatch, tmp_path):
    """The command in this process: the dispatch cache in a fresh folder, measurements faked (the real ones
    are tested above), the thread count and kernel mode the command sets put back."""
    calls = []

    def fake_measure(kernel, out_f, in_f, dtype, tokens, mode, device):
        calls.append(kernel)
        return {"cpu-unpack": 5.0, "dense": 4.0}.get(kernel, 1.0), None

    monkeypatch.setattr(timing, "measure_gemm", fake_measure)
    monkeypatch.setattr(timing, "measure_gemms", lambda kernels, *a: {k: fake_measure(k, *a) for k in kernels})
    monkeypatch.setattr(timing, "measure_gemms_rounds",
                        lambda kernels, *a: {k: (*fake_measure(k, *a), None) for k in kernels})
    monkeypatch.setenv("CAST_LLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cast_kernels.MODE_ENV, "auto")
    threads = torch.get_num_threads()
    yield calls, tmp_path / "cache"
    torch.set_num_threads(threads)


def test_generate_command_prints_text_and_tokens_per_s(ckpts, generate_env, capsys):
    calls, cache = generate_env
    assert cli("generate", "--model", ckpts["bf16"], "--prompt", PROMPT, "--max-new-tokens", "4") == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT) and "tokens/s" in out and "2:4 layers: 14 compressed targets" in out, out
    assert calls and "dense" not in calls  # a compressed load holds no dense weight
    assert (cache / "sparse24-dispatch-cpu.json").is_file()  # the plan was kept where the tests' cache is
    n = len(calls)
    assert cli("generate", "--model", ckpts["bf16"], "--prompt", PROMPT, "--max-new-tokens", "4") == 0
    assert len(calls) == n  # the second run measures nothing: read from the cache


def test_generate_command_json_and_dense(ckpts, generate_env, capsys):
    assert cli("generate", "--model", ckpts["bf16"], "--prompt", PROMPT, "--max-new-tokens", "4", "--json") == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.out.splitlines() if ln.strip()]
    assert len(lines) == 1, captured.out
    doc = json.loads(lines[0])
    assert doc["new_tokens"] == 4 and doc["dtype"] == "bfloat16" and "2:4" in doc["how"] and "text" in doc
    assert "decode_tokens_per_s" in doc and "tokens/s" in captured.err
    assert cli("generate", "--model", ckpts["bf16"], "--prompt", PROMPT, "--max-new-tokens", "4", "--dense",
               "--json") == 0
    doc = json.loads(capsys.readouterr().out.strip())
    assert doc["how"].startswith("dense") and doc["new_tokens"] == 4
    # --kernels reference: the extension is never loaded, the compressed model runs dense
    assert cli("generate", "--model", ckpts["bf16"], "--prompt", PROMPT, "--max-new-tokens", "4", "--kernels",
               "reference", "--json") == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out.strip())
    assert doc["how"].startswith("dense: no layer could run 2:4") and "no CPU 2:4 kernel runs here" in captured.err


def test_generate_command_without_a_prompt_is_one_line_exit_2(ckpts, generate_env, capsys):
    assert cli("generate", "--model", ckpts["bf16"]) == 2
    assert "--prompt is required" in one_line_error(capsys)


# ------------------------------------------------------------------------------- 6. the measured payoff
def seed_dispatch_cache(model_dir: Path, cache_file: Path) -> None:
    """Decisions for every layer of ``model_dir`` at the payoff's token counts and every thread count the child
    may run at, from a fake timer: the children measure their decode, not the dispatch (~1 s a candidate at
    these tiny shapes: the weights are cycled through thousands of copies past the last-level cache)."""
    import os

    from cast_llm.deploy.compressed import read_index
    from cast_llm.machine import cpu_model

    shapes = {tuple(t["shape"]) for t in read_index(model_dir)["targets"].values()}
    ok, _ = available_kernels("cpu", torch.bfloat16, CPU_KERNELS)
    versions = D.default_identity(torch.device("cpu"))[1]
    for n in range(1, (os.cpu_count() or 1) + 1):
        d = Dispatcher(measure=lambda k, *a: (1.0, None), device="cpu", cache_path=cache_file,
                       gpu=f"cpu {cpu_model()} x{n} threads", versions=versions)
        for (out_f, in_f), tokens in itertools.product(shapes, (1, 2, 4, 8)):
            d.decide(out_f, in_f, torch.bfloat16, tokens, "eager", ok)
        d.save()


@pytest.mark.slow
def test_payoff_measures_both_paths_in_fresh_processes(ckpts, monkeypatch, tmp_path):
    from cast_llm.inference import payoff
    from cast_llm.train.summary import format_payoff

    monkeypatch.setenv("CAST_LLM_CACHE", str(tmp_path / "cache"))
    seed_dispatch_cache(ckpts["bf16"], tmp_path / "cache" / "sparse24-dispatch-cpu.json")
    p = payoff(ckpts["bf16"], tokens=4, prompt_tokens=8, timeout=120)
    for path in ("dense", "sparse24"):
        assert p[path]["path"] == path and p[path]["decode_tokens_per_s"] > 0 and p[path]["held_bytes"] > 0
        assert p[path]["resident_bytes"] > 0, p[path]
    assert "2:4 layers: 14" in p["sparse24"]["how"] and p["dense"]["how"].startswith("dense")
    assert p["sparse24"]["held_bytes"] < p["dense"]["held_bytes"]
    assert p["sparse24"]["plan_s"] < 10  # read from the seeded cache, nothing measured
    assert p["decode_ratio"] > 0 and p["resident_ratio"] > 0
    line = format_payoff(p)
    assert "\n" not in line and "tokens/s" in line and f"{p['decode_ratio']:.2f}x" in line


def test_measure_speed_measures_nothing_without_a_24_check(monkeypatch, capsys):
    from cast_llm import inference
    from cast_llm.cli import train
    from cast_llm.errors import CastError

    def fail(*a, **k):
        raise AssertionError("payoff must not run")

    monkeypatch.setattr(inference, "payoff", fail)
    assert train.measure_speed({}) is False
    assert train.measure_speed({"nm_check": {"pattern": "4:8"}, "output_dir": "x"}) is False

    def broken(*a, **k):
        raise CastError("the sparse24 decode measurement failed: boom")

    monkeypatch.setattr(inference, "payoff", broken)
    assert train.measure_speed({"nm_check": {"pattern": "2:4"}, "output_dir": "x"}) is False
    assert "warning: the sparse24 decode measurement failed: boom" in capsys.readouterr().out


def test_measure_speed_records_what_the_payoff_measured(monkeypatch):
    """The speeds written for the model card say the payoff's own token counts and threads (not a restated 32)."""
    from cast_llm import inference
    from cast_llm.cli import train
    from cast_llm.deploy import model_card

    side = {"threads": 2, "new_tokens": 4, "prompt_tokens": 8}
    measured = {"sparse24": {**side, "decode_tokens_per_s": 80.04}, "dense": {**side, "decode_tokens_per_s": 40.02}}
    monkeypatch.setattr(inference, "payoff", lambda *a, **k: measured)
    monkeypatch.setattr(model_card, "refresh_run_card", lambda *a, **k: None)
    results = {"nm_check": {"pattern": "2:4"}, "output_dir": "x"}
    assert train.measure_speed(results) is True
    assert results["decode_payoff"] is measured
    assert [(s["what"], s["value"]) for s in results["speeds"]] == [("decode, 2:4 layers", 80.0),
                                                                  ("decode, dense", 40.0)]
    assert {s["measured_on"] for s in results["speeds"]} == {"this CPU, bf16, 2 threads, 4 new tokens after 8"}


# ------------------------------------------------------------------------------- 7. benchmarks/cpu24.py
def test_cpu24_benchmark_tiny_writes_its_json(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("cpu24_benchmark", BENCHMARKS / "cpu24.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    out = tmp_path / "cpu24.json"
    try:
        assert bench.main(["--tiny", "--repeats", "1", "--min-time", "0.001", "--threads", "1", "--rows", "1,4",
                           "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "machine:" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "l3_bytes", "when", "results", "goals", "max_rel_err"} <= set(doc)
    assert doc["benchmark"] == "cpu24" and doc["max_rel_err"] <= BOUND[torch.bfloat16]
    assert doc["path"] == bench.best_path() and doc["dense_path"] == cpu24.dense_path() is not None
    assert doc["huge_pages"] == (cpu24.huge_pages_reason() or "on")
    assert len(doc["results"]) == len(bench.TINY) * 2 and {g["rows"] for g in doc["goals"]} == {1, 4}
    for r in doc["results"]:
        assert {"out", "in", "rows", "bytes", "ms", "gbps", "max_rel_err", "x_torch", "x_careful", "w8_x_torch",
                "careful_x_torch", "shape", "threads"} <= set(r)
        # amx, rows, hwpf, tok: where this CPU runs them beside its widest path (the AVX2 ones only where that is AVX2)
        paths = bench.extra_paths(doc["path"])
        assert all(p in PATHS for p in paths) and ("avx2-tokens" in paths) == (doc["path"] == "avx2")
        extra = {bench.EXTRA[p] for p in paths}
        extra_w8 = {bench.EXTRA[p].replace("2:4", "2:4+W8") for p in paths if p not in cpu24.NO_W8_PATHS}
        assert set(r["ms"]) == {"torch", "torch hp", "careful", "2:4", "2:4+W8", *extra, *extra_w8}
        assert r["best_x_torch_hp"] == pytest.approx(r["ms"]["torch hp"] / r["ms"][r["best"]])
        assert all(v > 0 for v in r["ms"].values())
        assert r["ms"][r["best"]] == min(r["ms"][k] for k in ("2:4", *extra))
        assert r["bytes"]["2:4"] == r["bytes"]["dense_bf16"] * 0.5625
        assert r["bytes"]["2:4+W8"] == r["bytes"]["dense_bf16"] * 0.3125 + 4 * r["out"]  # + the fp32 row scales
        assert max(r["max_rel_err"].values()) <= BOUND[torch.bfloat16]


@pytest.mark.slow
def test_embedded_smollm2_greedy_64_tokens_identical_to_dense_with_zeros(tmp_path):
    """The real embedded model, magnitude-pruned to 2:4 and exported compressed: loaded straight into the CPU 2:4
    layers, its greedy 64 tokens in fp32 are the dense-with-zeros model's, token for token. (In bf16 they are
    not, on this magnitude-pruned model: it amplifies bf16 rounding, see docs/deployment.md, "Exactness"; the
    bf16 logits bound is checked on the tiny models above.)"""
    from cast_llm.deploy.compressed import load_compressed, save_compressed
    from cast_llm.models import load_model, load_tokenizer
    from cast_llm.prune.magnitude import magnitude_prune_
    from cast_llm.targets import find_targets

    if cpu24.extension_reason() is not None:
        pytest.skip(cpu24.extension_reason())
    model = load_model("smollm2-135m", dtype=torch.float32)
    with torch.no_grad():
        for t in find_targets(model, n=2, m=4):
            magnitude_prune_(t.module.weight.data, 2, 4)
    save_compressed(model, load_tokenizer("smollm2-135m"), tmp_path / "c")
    sparse = load_compressed(tmp_path / "c", sparse24=True, dispatch=False)  # always the 2:4 kernel
    assert len(sparse24_layers(sparse)) == 210
    ids = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model.generate(ids, max_new_tokens=64, do_sample=False, min_new_tokens=64)
        got = sparse.generate(ids, max_new_tokens=64, do_sample=False, min_new_tokens=64)
    assert torch.equal(got, want)


# ------------------------------------------------------------------ the careful LM head: decided, checked, undone
@pytest.mark.parametrize("decide", ["swap", "keep", "reference"])
def test_the_careful_head_is_swapped_only_when_it_measures_faster_and_is_undone(monkeypatch, decide):
    """``use_careful_head_`` swaps the head for the careful GEMV only past its speed margin (forced both ways
    here), keeps the same Parameter (a tied head stays tied), gives the same logits, and ``restore_head_``
    gives back a plain ``nn.Linear``; in reference mode it never swaps."""
    from cast_llm.deploy.sparse24.dense_cpu import CarefulDenseLinear, restore_head_, use_careful_head_

    model = tiny.model("llama", 0).to(torch.bfloat16).eval()
    head = model.get_output_embeddings()
    weight = head.weight
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        before = model(ids[:, :1]).logits
    if decide == "reference":
        monkeypatch.setenv("CAST_LLM_KERNELS", "reference")
        cast_kernels.reset()
    note = use_careful_head_(model, min_speedup={"swap": 0.0, "keep": 1e9, "reference": 0.0}[decide])
    now = model.get_output_embeddings()
    if decide == "swap":
        assert isinstance(now, CarefulDenseLinear) and now.weight is weight and "careful GEMV (" in note
        with torch.no_grad():
            after = model(ids[:, :1]).logits  # one token: the careful GEMV runs
        assert rel(after, before.double()) <= BOUND[torch.bfloat16]
        assert restore_head_(model) and type(model.get_output_embeddings()) is nn.Linear
        assert model.get_output_embeddings().weight is weight and not restore_head_(model)
    else:
        assert now is head and "torch's F.linear" in note, note
        assert ("cannot run here" in note) == (decide == "reference")


def test_the_careful_head_is_timed_from_copies_of_its_weight_both_candidates_interleaved(monkeypatch):
    """The head check times torch's F.linear and the careful GEMV as the dispatcher times layers (``cycled_many``
    over copies of the head's weight, one case each, in one paired call; no flush buffer whose time is subtracted:
    a 57 MB head timed that way flipped its verdict between runs, cpu24-notes.md §46), and decides on those times."""
    from cast_llm.deploy.sparse24 import dense_cpu

    if cpu24.dense_unavailable_reason():
        pytest.skip(cpu24.dense_unavailable_reason())
    seen = []
    for times, swapped in (([2e-3, 1e-3], True), ([1e-3, 1e-3], False)):
        model = tiny.model("llama", 0).to(torch.bfloat16).eval()
        head = model.get_output_embeddings()

        def fake(cases, times=times, head=head):
            seen.append([held is head.weight for _, held in cases])
            ys = [fn(held) for fn, held in cases]  # each case runs its candidate on the weight it is handed
            assert ys[0].shape == ys[1].shape == (1, head.out_features)
            return times

        monkeypatch.setattr(dense_cpu, "cycled_many", fake)
        note = dense_cpu.use_careful_head_(model)
        assert isinstance(model.get_output_embeddings(), dense_cpu.CarefulDenseLinear) == swapped, note
        assert ("2.00" in note) == swapped and "1.00 ms" in note
    assert seen == [[True, True]] * 2


def test_rows_path_across_row_sets_token_tiles_and_pack_chunks():
    """avx512-bf16-rows packs 48 rows a set (three lane blocks of 16), 16 groups of kept pairs and 128 groups of
    positions a transpose, and runs six tokens a tile: a layer of 1030 rows (a partial lane block and set), 1028
    inputs (257 groups: a one-group tail past both transposes) and 130 tokens crosses every one of those edges."""
    path = "avx512-bf16-rows"
    if path not in PATHS:
        pytest.skip("this CPU lacks AVX512-BF16")
    w, _ = planted(1030, 1028, seed=3, dtype=torch.bfloat16)
    state = cpu24.compress(w)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(130, 1028, generator=g).to(torch.bfloat16)
    bias = torch.randn(1030, generator=g).to(torch.bfloat16)
    y = cpu24.sparse24_mm(path, x, state, bias)
    assert rel(y, ref64(x, w, bias)) <= BOUND[torch.bfloat16]
    # every output is its own row's and token's (a transposed store writes the wrong cell, not a small error)
    y1 = cpu24.sparse24_mm(path, x[77:78], state, bias)
    assert rel(y1, ref64(x[77:78], w, bias)) <= BOUND[torch.bfloat16]


def test_rows_path_reads_any_positions():
    """avx512-bf16-rows takes each kept value's activation by its own 2-bit position (vpermw indices), so a group
    whose two positions repeat or descend is the sum it names, not a wrong pattern's product."""
    if "avx512-bf16-rows" not in PATHS:
        pytest.skip("this CPU lacks AVX512-BF16")
    g = torch.Generator().manual_seed(2)
    n, k = 53, 44
    meta = torch.randint(0, 256, (n, (k + 7) // 8), generator=g, dtype=torch.uint8)  # every nibble, 2:4 or not
    values = torch.randn(n, k // 2, generator=g).to(torch.bfloat16)
    w = torch.zeros(n, k, dtype=torch.float64)
    for r in range(n):
        for j in range(k // 2):
            p = (int(meta[r, j // 4]) >> (2 * (j % 4))) & 3
            w[r, 4 * (j // 2) + p] += float(values[r, j])
    x = torch.randn(13, k, generator=g).to(torch.bfloat16)
    y = cpu24.load_extension().sparse24_mm(x, values, meta, None, None, cpu24.PATHS["avx512-bf16-rows"])
    assert rel(y, x.double() @ w.t()) <= BOUND[torch.bfloat16]


def test_positions_that_are_not_a_2to4_rows_are_found():
    """The rebuild's dense mask (vpexpandw) reads two distinct, ascending positions per group:
    cpu24.bad_position_rows finds every other byte, padding nibbles excepted."""
    w, _ = planted(6, 12, seed=1)
    meta = cpu24.compress(w)["meta"].clone()
    assert cpu24.bad_position_rows(meta, 12).tolist() == []  # 12 inputs: the last byte's high nibble is padding
    meta[2, 0] = (meta[2, 0] & 0xF0) | 0b0101  # positions (1, 1)
    meta[4, 1] = (meta[4, 1] & 0xF0) | 0b0001  # positions (1, 0)
    assert cpu24.bad_position_rows(meta, 12).tolist() == [2, 4]
    with pytest.raises(cpu24.BadPositionsError,
                       match=r"^layer\.x: 2 row\(s\) \(first 2\).*not a 2:4 compressed weight \(export the model "
                             r"again: cast-llm export --format compressed\)$"):
        cpu24.check_positions(meta, 12, "layer.x")


def test_a_planted_compressed_file_with_non_2to4_positions_is_refused_at_load(ckpts, generate_env, tmp_path, capsys):
    """A compressed folder whose positions stream names a group's position twice is not a 2:4 weight: the loader
    refuses it in one line naming the file and tensor (library and `cast-llm generate`), never a silently wrong
    model."""
    import shutil

    from safetensors.torch import load_file, save_file

    from cast_llm.deploy.compressed import WEIGHTS_FILE, load_compressed

    planted_dir = tmp_path / "planted"
    shutil.copytree(ckpts["bf16"], planted_dir)
    tensors = load_file(str(planted_dir / WEIGHTS_FILE))
    key = next(k for k in sorted(tensors) if k.endswith("q_proj.weight.positions"))
    pos = tensors[key].clone()
    flat = pos.view(-1)
    flat[0] = (flat[0] & 0xF0) | 0b0101  # group 0 of row 0 keeps position 1 twice
    tensors[key] = pos
    save_file(tensors, str(planted_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{key}.*not a 2:4 compressed weight"):
        load_compressed(planted_dir, sparse24=True, dispatch=False)
    assert cli("generate", "--model", planted_dir, "--prompt", PROMPT, "--max-new-tokens", "2") != 0
    line = one_line_error(capsys)
    assert key in line and "not a 2:4 compressed weight" in line, line
